-- The vault key each period charges with, one per currency. Only the worker reads this table:
-- the secret is shown once by the vault and must never reach workflow history or logs.

CREATE TABLE period_vault_keys (
    billing_period text NOT NULL CHECK (billing_period ~ '^[0-9]{4}-(0[1-9]|1[0-2])$'),
    currency       text NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    vault_key_id   text NOT NULL UNIQUE,
    secret         text NOT NULL CHECK (secret LIKE 'vk\_%'),
    cap_cents      bigint NOT NULL CHECK (cap_cents > 0),
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (billing_period, currency)
);

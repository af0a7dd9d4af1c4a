-- Every vault key this ledger's workers issued for a period, written as soon as the vault
-- answers and outside the opening's transaction: a key whose period_vault_keys row that
-- transaction then rolled back (a later currency refused, the worker lost) is still known
-- here, and the next opening of the period revokes it if nothing went through it
-- (billing/period_keys.py revoke_unstored). A vault may serve other deployments, whose keys
-- are theirs to keep: only those listed here are revoked.
CREATE TABLE issued_vault_keys (
    vault_key_id   text PRIMARY KEY,
    billing_period text NOT NULL,
    currency       text NOT NULL,
    issued_at      timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX issued_vault_keys_period ON issued_vault_keys (billing_period);

-- The vault proxy: spend-capped keys, the reservations counted against their caps, the audit log.

CREATE TABLE vault_keys (
    id                text PRIMARY KEY CHECK (id ~ '^vkey_[0-9a-f]{16}$'),
    -- sha256 of the secret; the secret itself is shown once, at issue, and never stored.
    secret_sha256     bytea NOT NULL UNIQUE CHECK (octet_length(secret_sha256) = 32),
    vendor            text NOT NULL CHECK (vendor = 'stripe'),
    label             text NOT NULL CHECK (length(label) BETWEEN 1 AND 100),
    period            text NOT NULL CHECK (period ~ '^[0-9]{4}-(0[1-9]|1[0-2])$'),
    currency          text NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    cap_cents         bigint NOT NULL CHECK (cap_cents > 0),
    daily_cap_cents   bigint CHECK (daily_cap_cents > 0 AND daily_cap_cents <= cap_cents),
    -- Pending and unknown reservations; committed ones. Both equal the sums over
    -- vault_reservations, kept up to date in the same transactions.
    reserved_cents    bigint NOT NULL DEFAULT 0 CHECK (reserved_cents >= 0),
    spent_cents       bigint NOT NULL DEFAULT 0 CHECK (spent_cents >= 0),
    allowed_endpoints text[] NOT NULL CHECK (cardinality(allowed_endpoints) > 0),
    expires_at        timestamptz NOT NULL,
    revoked_at        timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now(),
    -- The hard cap, held by the database as well as by the reservation's conditional update.
    CHECK (spent_cents + reserved_cents <= cap_cents)
);

CREATE INDEX vault_keys_period_label ON vault_keys (period, label);

-- Per UTC day counters, kept only for keys with a daily cap.
CREATE TABLE vault_key_days (
    vault_key_id   text NOT NULL REFERENCES vault_keys (id),
    day            date NOT NULL,
    reserved_cents bigint NOT NULL DEFAULT 0 CHECK (reserved_cents >= 0),
    spent_cents    bigint NOT NULL DEFAULT 0 CHECK (spent_cents >= 0),
    PRIMARY KEY (vault_key_id, day)
);

CREATE TABLE vault_reservations (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    vault_key_id    text NOT NULL REFERENCES vault_keys (id),
    idempotency_key text NOT NULL CHECK (idempotency_key ~ '^[A-Za-z0-9_.:-]{1,255}$'),
    -- A replay must be the same request: same endpoint, amount, currency and customer.
    endpoint        text NOT NULL,
    amount_cents    bigint NOT NULL CHECK (amount_cents > 0),
    currency        text NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    customer        text,
    -- UTC day the amount was (last) counted on, for the daily cap.
    day             date NOT NULL,
    state           text NOT NULL CHECK (state IN ('pending', 'unknown', 'committed', 'released')),
    committed_cents bigint CHECK (committed_cents BETWEEN 1 AND amount_cents),
    -- Bumped each time a request takes the reservation over, so only that request settles it.
    attempt         integer NOT NULL DEFAULT 1 CHECK (attempt >= 1),
    upstream_status integer,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (vault_key_id, idempotency_key),
    CHECK ((state = 'committed') = (committed_cents IS NOT NULL))
);

CREATE INDEX vault_reservations_key_state ON vault_reservations (vault_key_id, state);

-- One row per request to the proxy, refused or forwarded. Never a secret.
CREATE TABLE vault_audit (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at                timestamptz NOT NULL DEFAULT now(),
    vault_key_id      text REFERENCES vault_keys (id),
    method            text NOT NULL,
    path              text NOT NULL,
    idempotency_key   text,
    amount_cents      bigint,
    currency          text,
    customer          text,
    upstream_status   integer,
    decision          text NOT NULL CHECK (decision IN (
                          'forwarded', 'replayed', 'refused_auth', 'refused_endpoint',
                          'refused_request', 'refused_cap', 'refused_daily_cap',
                          'refused_in_flight')),
    refusal_code      text,
    reservation_state text CHECK (reservation_state IN ('pending', 'unknown', 'committed', 'released')),
    latency_ms        double precision NOT NULL CHECK (latency_ms >= 0)
);

CREATE INDEX vault_audit_key ON vault_audit (vault_key_id, id);

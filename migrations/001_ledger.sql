-- The billing ledger: who is due, and one row per (customer, period) claimed before Stripe is called.

CREATE TABLE customers (
    customer_id        text PRIMARY KEY
                       CHECK (customer_id ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$'),
    stripe_customer_id text NOT NULL CHECK (stripe_customer_id ~ '^cus_[A-Za-z0-9]{1,250}$'),
    payment_method     text CHECK (payment_method ~ '^pm_[A-Za-z0-9_]{1,250}$'),
    amount_cents       bigint NOT NULL CHECK (amount_cents BETWEEN 1 AND 99999999),
    currency           text NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    active             boolean NOT NULL DEFAULT true,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE billing_runs (
    id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer_id        text NOT NULL REFERENCES customers (customer_id),
    billing_period     text NOT NULL CHECK (billing_period ~ '^[0-9]{4}-(0[1-9]|1[0-2])$'),
    idempotency_key    text NOT NULL UNIQUE CHECK (idempotency_key ~ '^[0-9a-f]{32}$'),
    amount_cents       bigint NOT NULL CHECK (amount_cents BETWEEN 1 AND 99999999),
    currency           text NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    -- Fixed at claim time too: every attempt must send Stripe the same parameters.
    stripe_customer_id text NOT NULL,
    payment_method     text,
    status             text NOT NULL DEFAULT 'claimed'
                       CHECK (status IN ('claimed', 'charged', 'failed', 'skipped', 'cancelled')),
    payment_intent_id  text,
    charge_id          text UNIQUE,
    failure_code       text,
    decline_code       text,
    failure_message    text,
    reason             text,
    attempts           integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    claimed_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    completed_at       timestamptz,
    UNIQUE (customer_id, billing_period),
    CHECK (status <> 'charged' OR charge_id IS NOT NULL),
    CHECK (status <> 'failed' OR failure_code IS NOT NULL),
    CHECK ((status = 'claimed') = (completed_at IS NULL))
);

CREATE INDEX billing_runs_period_status ON billing_runs (billing_period, status);

CREATE TABLE billing_periods (
    billing_period     text PRIMARY KEY CHECK (billing_period ~ '^[0-9]{4}-(0[1-9]|1[0-2])$'),
    workflow_id        text NOT NULL,
    state              text NOT NULL CHECK (state IN ('running', 'completed')),
    due                integer NOT NULL DEFAULT 0,
    expected_total_cents bigint NOT NULL DEFAULT 0,
    summary            jsonb,
    started_at         timestamptz NOT NULL DEFAULT now(),
    finished_at        timestamptz
);

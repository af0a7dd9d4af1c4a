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
    daily_cap_cents   bigint CHECK (daily_cap_cents > 0),
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

-- Reserve a metered request's amount against its key's caps, keyed by (key, idempotency key).
-- One statement, so the key row stays locked only while Postgres runs it, never across a
-- round trip to the vault: otherwise every request of a key would queue behind that lock.
-- Locks are taken reservation row, key row, day row, like every statement on these tables.
-- decision: reserved (counted now, this request owns it), taken_over (already counted,
-- outcome unknown; this request owns it), replay (committed), in_flight, mismatch, revoked,
-- expired, cap, daily_cap (nothing changed).
CREATE FUNCTION vault_reserve(
    p_key text, p_idempotency_key text, p_endpoint text, p_amount bigint, p_currency text,
    p_customer text, p_stale_after interval,
    OUT decision text, OUT reservation_id bigint, OUT attempt integer, OUT detail text
) LANGUAGE plpgsql AS $$
DECLARE
    today constant date := (now() AT TIME ZONE 'UTC')::date;
    existing vault_reservations%ROWTYPE;
    vkey vault_keys%ROWTYPE;
    day_used bigint := 0;
BEGIN
    INSERT INTO vault_reservations AS r (vault_key_id, idempotency_key, endpoint, amount_cents,
                                         currency, customer, day, state)
    VALUES (p_key, p_idempotency_key, p_endpoint, p_amount, p_currency, p_customer, today,
            'pending')
    ON CONFLICT (vault_key_id, idempotency_key) DO NOTHING
    RETURNING r.id, r.attempt INTO reservation_id, attempt;

    IF reservation_id IS NULL THEN
        -- A replay. The first insert has committed (ON CONFLICT waited for it).
        SELECT * INTO existing FROM vault_reservations
        WHERE vault_key_id = p_key AND idempotency_key = p_idempotency_key FOR UPDATE;
        reservation_id := existing.id;
        attempt := existing.attempt;
        IF (existing.endpoint, existing.amount_cents, existing.currency, existing.customer)
           IS DISTINCT FROM (p_endpoint, p_amount, p_currency, p_customer) THEN
            decision := 'mismatch';
            detail := format('%s, %s %s, customer %s', existing.endpoint, existing.amount_cents,
                             existing.currency, coalesce(existing.customer, 'none'));
            RETURN;
        ELSIF existing.state = 'committed' THEN
            decision := 'replay';
            RETURN;
        ELSIF existing.state = 'pending' AND existing.updated_at > now() - p_stale_after THEN
            decision := 'in_flight';
            RETURN;
        ELSIF existing.state <> 'released' THEN
            -- Unknown, or pending but left by a vault that stopped: still counted.
            attempt := existing.attempt + 1;
            UPDATE vault_reservations SET state = 'pending', attempt = existing.attempt + 1,
                                          updated_at = now()
            WHERE id = existing.id;
            decision := 'taken_over';
            RETURN;
        END IF;
        -- Released: Stripe refused it, so a retry may execute; it is counted again.
    END IF;

    -- NO KEY UPDATE: it serialises reservations, and unlike FOR UPDATE it does not conflict
    -- with the KEY SHARE locks that the foreign keys of concurrent inserts hold on this row.
    SELECT * INTO vkey FROM vault_keys WHERE id = p_key FOR NO KEY UPDATE;
    IF vkey.daily_cap_cents IS NOT NULL THEN
        -- Day rows change only under the key row's lock, which this transaction now holds.
        SELECT d.reserved_cents + d.spent_cents INTO day_used
        FROM vault_key_days d WHERE d.vault_key_id = p_key AND d.day = today;
        day_used := coalesce(day_used, 0);
    END IF;
    decision := CASE
        WHEN vkey.revoked_at IS NOT NULL THEN 'revoked'
        WHEN vkey.expires_at <= now() THEN 'expired'
        WHEN vkey.spent_cents + vkey.reserved_cents + p_amount > vkey.cap_cents THEN 'cap'
        WHEN day_used + p_amount > vkey.daily_cap_cents THEN 'daily_cap'
        ELSE 'reserved'
    END;
    IF decision <> 'reserved' THEN
        detail := CASE decision
            WHEN 'cap' THEN format('%s of %s', vkey.cap_cents - vkey.spent_cents - vkey.reserved_cents,
                                   vkey.cap_cents)
            WHEN 'daily_cap' THEN format('%s of %s', vkey.daily_cap_cents - day_used,
                                         vkey.daily_cap_cents)
        END;
        IF existing.id IS NULL THEN
            DELETE FROM vault_reservations WHERE id = reservation_id;
        END IF;
        reservation_id := NULL;
        RETURN;
    END IF;

    UPDATE vault_keys SET reserved_cents = reserved_cents + p_amount WHERE id = p_key;
    IF vkey.daily_cap_cents IS NOT NULL THEN
        INSERT INTO vault_key_days AS d (vault_key_id, day, reserved_cents)
        VALUES (p_key, today, p_amount)
        ON CONFLICT (vault_key_id, day)
        DO UPDATE SET reserved_cents = d.reserved_cents + EXCLUDED.reserved_cents;
    END IF;
    IF existing.id IS NOT NULL THEN
        attempt := existing.attempt + 1;
        UPDATE vault_reservations
        SET state = 'pending', attempt = existing.attempt + 1, day = today, updated_at = now(),
            upstream_status = NULL
        WHERE id = existing.id;
    END IF;
END
$$;

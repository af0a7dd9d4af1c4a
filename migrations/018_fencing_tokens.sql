-- Fencing tokens, so that a cap refusal's "proven" reopen (billing/ledger.py
-- reopen_refused_charge) holds against an attempt still on its way. Two attempts of one claim
-- may be past the gate at once (a terminated run's child still running, a local activity
-- timed out while its request was out). If the later one is refused on the cap and reopens the
-- claim, the earlier one could reach the vault after room was freed and charge, while a cancel
-- or skip meanwhile recorded that nothing was. Now every attempt that passes the gate gets a
-- number one above the claim's last (gate_passes, never reset) and sends it to the vault
-- (Vault-Fencing-Token). A cap refusal of token N fences the (key, idempotency key): the vault
-- refuses any later request with them below N, or without a token, and its refusal says the
-- fence it left. The ledger reopens a claim only on the refusal of its latest attempt, and only
-- when the vault says it fenced that attempt's token.
ALTER TABLE billing_runs ADD COLUMN gate_passes integer NOT NULL DEFAULT 0;

-- Kept apart from vault_reservations: a refusal reserves nothing and forwards nothing.
CREATE TABLE vault_fences (
    vault_key_id    text NOT NULL REFERENCES vault_keys (id),
    idempotency_key text NOT NULL,
    fenced_below    integer NOT NULL CHECK (fenced_below >= 1),
    PRIMARY KEY (vault_key_id, idempotency_key)
);

-- billing_begin_charge as in 016_sent_through.sql, except that an attempt that passes is
-- numbered: its fencing token (for one stopped at the gate, the claim's last).
DROP FUNCTION billing_begin_charge(text, text, text);
CREATE FUNCTION billing_begin_charge(
    p_key text, p_period text, p_vault_key text, OUT gate text, OUT status text,
    OUT fencing_token integer
) LANGUAGE plpgsql AS $$
DECLARE
    period_control text;
    claim billing_runs%ROWTYPE;
BEGIN
    SELECT control INTO period_control FROM billing_periods
    WHERE billing_period = p_period FOR SHARE;
    SELECT * INTO claim FROM billing_runs WHERE idempotency_key = p_key FOR UPDATE;
    status := coalesce(claim.status, 'missing');
    fencing_token := claim.gate_passes;
    IF status <> 'claimed' THEN
        gate := 'closed';
        RETURN;
    END IF;
    -- Once an attempt has passed, every retry passes: that charge may be at Stripe already.
    IF claim.charge_started_at IS NULL THEN
        IF claim.skip_reason IS NOT NULL THEN
            gate := 'skipped';
            RETURN;
        END IF;
        IF period_control IN ('paused', 'cancelled') THEN
            gate := period_control;
            RETURN;
        END IF;
    END IF;
    UPDATE billing_runs
    SET charge_started_at = coalesce(charge_started_at, now()),
        attempts = attempts + 1, gate_passes = gate_passes + 1, updated_at = now(),
        sent_through = CASE
            WHEN p_vault_key IS NULL OR p_vault_key = ANY(coalesce(sent_through, '{}'))
            THEN sent_through
            ELSE array_append(sent_through, p_vault_key) END
    WHERE idempotency_key = p_key
    RETURNING gate_passes INTO fencing_token;
    gate := 'go';
END $$;

-- vault_reserve as in 015_takeover_daily_cap.sql, except that it takes the request's fencing
-- token (none counts as 0): a request below its key's fence is refused ('superseded'), and a
-- cap refusal of a token raises the fence to it. Both answer the fence standing
-- (fenced_below).
DROP FUNCTION vault_reserve(text, text, text, bigint, text, text, interval);
CREATE FUNCTION vault_reserve(
    p_key text, p_idempotency_key text, p_endpoint text, p_amount bigint, p_currency text,
    p_customer text, p_stale_after interval, p_fencing_token integer DEFAULT NULL,
    OUT decision text, OUT reservation_id bigint, OUT attempt integer, OUT detail text,
    OUT fenced_below integer
) LANGUAGE plpgsql AS $$
DECLARE
    today constant date := (now() AT TIME ZONE 'UTC')::date;
    existing vault_reservations%ROWTYPE;
    vkey vault_keys%ROWTYPE;
    day_used bigint := 0;
    fence integer;
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
    END IF;
    -- Read only now: a refusal that fenced this key committed before this request's insert
    -- went in, or before it locked the row it found (either waited for that refusal).
    SELECT f.fenced_below INTO fence FROM vault_fences f
    WHERE f.vault_key_id = p_key AND f.idempotency_key = p_idempotency_key;
    IF coalesce(p_fencing_token, 0) < fence THEN
        IF existing.id IS NULL THEN
            DELETE FROM vault_reservations WHERE id = reservation_id;
        END IF;
        decision := 'superseded';
        fenced_below := fence;
        reservation_id := NULL;
        attempt := NULL;
        RETURN;
    END IF;

    IF existing.id IS NOT NULL THEN
        IF (existing.endpoint, existing.amount_cents, existing.currency, existing.customer)
           IS DISTINCT FROM (p_endpoint, p_amount, p_currency, p_customer) THEN
            decision := 'mismatch';
            detail := format('%s, %s %s, customer %s', existing.endpoint, existing.amount_cents,
                             existing.currency, coalesce(existing.customer, 'none'));
            RETURN;
        ELSIF existing.state = 'pending' AND existing.updated_at > now() - p_stale_after THEN
            decision := 'in_flight';
            RETURN;
        ELSIF existing.state <> 'released'
              AND existing.created_at <= now() - interval '23 hours' THEN
            decision := 'replay_expired';
            detail := existing.state;
            reservation_id := NULL;
            RETURN;
        ELSIF existing.state = 'committed' THEN
            decision := 'replay';
            RETURN;
        ELSIF existing.state <> 'released' THEN
            -- Unknown, or pending but left by a vault that stopped: still counted, so no cap
            -- is checked, but the key is, under its lock: a revoke committed since the
            -- vault's own key check must stop this retry too.
            SELECT * INTO vkey FROM vault_keys WHERE id = p_key FOR NO KEY UPDATE;
            IF vkey.revoked_at IS NOT NULL OR vkey.expires_at <= now() THEN
                decision := CASE WHEN vkey.revoked_at IS NOT NULL THEN 'revoked'
                                 ELSE 'expired' END;
                reservation_id := NULL;
                RETURN;
            END IF;
            IF vkey.daily_cap_cents IS NOT NULL AND existing.day <> today THEN
                -- Counted on the day it was first sent, but this attempt may move the money
                -- today: it must fit today's cap, and moves to today's counter.
                SELECT d.reserved_cents + d.spent_cents INTO day_used
                FROM vault_key_days d WHERE d.vault_key_id = p_key AND d.day = today;
                day_used := coalesce(day_used, 0);
                IF day_used + existing.amount_cents > vkey.daily_cap_cents THEN
                    decision := 'daily_cap';
                    detail := format('%s of %s', vkey.daily_cap_cents - day_used,
                                     vkey.daily_cap_cents);
                    reservation_id := NULL;
                    RETURN;
                END IF;
                UPDATE vault_key_days SET reserved_cents = reserved_cents - existing.amount_cents
                WHERE vault_key_id = p_key AND day = existing.day;
                INSERT INTO vault_key_days AS d (vault_key_id, day, reserved_cents)
                VALUES (p_key, today, existing.amount_cents)
                ON CONFLICT (vault_key_id, day)
                DO UPDATE SET reserved_cents = d.reserved_cents + EXCLUDED.reserved_cents;
                existing.day := today;
            END IF;
            attempt := existing.attempt + 1;
            UPDATE vault_reservations SET state = 'pending', attempt = existing.attempt + 1,
                                          day = existing.day, updated_at = now()
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
        IF decision IN ('cap', 'daily_cap') AND p_fencing_token IS NOT NULL THEN
            INSERT INTO vault_fences AS f (vault_key_id, idempotency_key, fenced_below)
            VALUES (p_key, p_idempotency_key, p_fencing_token)
            ON CONFLICT (vault_key_id, idempotency_key)
            DO UPDATE SET fenced_below = greatest(f.fenced_below, EXCLUDED.fenced_below)
            RETURNING f.fenced_below INTO fenced_below;
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

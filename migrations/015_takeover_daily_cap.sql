-- vault_reserve as in 011_replay_window.sql, except that a takeover of a reservation in doubt
-- first made on an earlier UTC day is checked against today's daily cap, and moves to today's
-- counter: the retry may execute today, and without this any number of such retries could
-- pile onto one day past the cap. Over the cap it is refused as a new reservation would be
-- (402 spend_cap_exceeded, daily), and the reservation stays in doubt on its first day.
-- Period keys have no daily cap, so the billing workers never meet this refusal, whose
-- "proven" reading (billing.ledger.reopen_refused_charge) would not hold: here an earlier
-- attempt is in doubt.
CREATE OR REPLACE FUNCTION vault_reserve(
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

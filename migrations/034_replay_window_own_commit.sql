-- vault_reserve as in 030_replay_checks_key.sql, but a retry through a key that committed
-- the charge itself is refused as charged when another key holds the same idempotency key
-- in doubt and 23 hours old: the other-key window, checked first, answered with that key's
-- state alone ("outcome unknown, retry once released"), and after the release the retry was
-- refused as charged all the same. The commit is what the caller needs to know: it looks the
-- charge up rather than waiting on a release.

CREATE OR REPLACE FUNCTION vault_reserve(
    p_key text, p_idempotency_key text, p_endpoint text, p_amount bigint, p_currency text,
    p_customer text, p_stale_after interval, p_fencing_token integer DEFAULT NULL,
    OUT decision text, OUT reservation_id bigint, OUT attempt integer, OUT detail text,
    OUT fenced_below integer, OUT first_sent_through text
) LANGUAGE plpgsql AS $$
DECLARE
    today constant date := (now() AT TIME ZONE 'UTC')::date;
    existing vault_reservations%ROWTYPE;
    vkey vault_keys%ROWTYPE;
    day_used bigint := 0;
    fence integer;
    elder vault_reservations%ROWTYPE;
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

    -- The same idempotency key sent through another key (the period's key before a renewal
    -- or a rerun replaced it) 23 hours ago or more: Stripe may have forgotten it, whichever
    -- vault key carries the retry. Committed ones first, which no release ends.
    SELECT o.* INTO elder FROM vault_reservations o
    WHERE o.idempotency_key = p_idempotency_key AND o.vault_key_id <> p_key
      AND o.state <> 'released' AND o.created_at <= now() - interval '23 hours'
    ORDER BY o.state = 'committed' DESC, o.created_at
    LIMIT 1;
    IF elder.id IS NOT NULL THEN
        IF existing.id IS NULL THEN
            DELETE FROM vault_reservations WHERE id = reservation_id;
        END IF;
        decision := 'replay_expired';
        -- This key's own commit says the charge was made, whatever the other key's row knows.
        detail := CASE WHEN existing.state = 'committed' THEN 'committed' ELSE elder.state END;
        first_sent_through := elder.vault_key_id;
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
            first_sent_through := p_key;
            reservation_id := NULL;
            RETURN;
        ELSIF existing.state <> 'released' THEN
            -- Committed (a replay), or unknown, or pending but left by a vault that stopped
            -- (a takeover): still counted, so no cap is checked, but both are forwarded, so
            -- the key is, under its lock: a revoke committed since the vault's own key check
            -- must stop them too.
            SELECT * INTO vkey FROM vault_keys WHERE id = p_key FOR NO KEY UPDATE;
            IF vkey.revoked_at IS NOT NULL OR vkey.expires_at <= clock_timestamp() THEN
                decision := CASE WHEN vkey.revoked_at IS NOT NULL THEN 'revoked'
                                 ELSE 'expired' END;
                reservation_id := NULL;
                RETURN;
            END IF;
            IF existing.state = 'committed' THEN
                decision := 'replay';
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
        WHEN vkey.expires_at <= clock_timestamp() THEN 'expired'
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

-- vault_reserve as in 010_takeover_checks_key.sql, except that a request whose reservation
-- was first made 23 hours ago or more is neither replayed nor taken over. Stripe forgets an
-- idempotency key 24 hours after its first request: past that, a retry of a committed or
-- in-doubt charge executes as a new one, and would move money that nothing counts. The
-- caller must look the charge up on Stripe (the billing worker does for claims this old;
-- reconciliation settles an unknown reservation, after which a released one is counted
-- again). 23 hours leaves an hour for clocks that disagree. A released reservation is still
-- counted again and forwarded: Stripe refused it, so no money moved.
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

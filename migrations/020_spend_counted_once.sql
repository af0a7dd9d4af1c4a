-- A charge's spend is counted under one vault key. A charge in doubt under the period's old
-- key, retried through the key `renew-keys` or a rerun issued since, was committed under the
-- new key by Stripe's replay, and again under the old one when reconciliation found the
-- charge: one charge held two caps' room, and the worker budget counted it twice for its
-- window. Stripe keeps one idempotency key per account, whichever vault key carried it, so a
-- reservation whose idempotency key another key has already committed is released instead,
-- naming that key (counted_under).

ALTER TABLE vault_reservations
    ADD COLUMN counted_under text REFERENCES vault_keys (id),
    ADD CHECK (counted_under IS NULL OR state = 'released');

-- A released reservation taken up again by a retry (vault_reserve) no longer says where its
-- charge is counted: the retry's own answer settles it afresh.
CREATE FUNCTION vault_reservation_reopened() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.counted_under := NULL;
    RETURN NEW;
END
$$;

CREATE TRIGGER vault_reservation_reopened BEFORE UPDATE OF state ON vault_reservations
    FOR EACH ROW WHEN (NEW.state <> 'released' AND NEW.counted_under IS NOT NULL)
    EXECUTE FUNCTION vault_reservation_reopened();

-- Commits of one idempotency key, whichever vault key carries them, one at a time: each then
-- sees the others'. Taken before any reservation row's lock (vault_finish, and the admin's
-- resolve before it reads the reservation), so it adds no lock cycle.
CREATE FUNCTION vault_lock_commits(p_idempotency_key text) RETURNS void LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(hashtextextended('vault-commit:' || p_idempotency_key, 0));
$$;

-- Settles a reservation's attempt: its amount leaves reserved and, committed, goes to spent,
-- under the locks of reservation, key and day rows in that order. A commit of an idempotency
-- key another vault key has committed is a release that names that key. Returns the state
-- reached, or nothing when the attempt no longer holds the reservation in one of p_from.
CREATE FUNCTION vault_finish(
    p_id bigint, p_attempt integer, p_from text[], p_to text, p_committed_cents bigint,
    p_upstream_status integer, OUT finished text, OUT elsewhere text
) LANGUAGE plpgsql AS $$
DECLARE
    r vault_reservations%ROWTYPE;
BEGIN
    IF p_to = 'committed' THEN
        PERFORM vault_lock_commits(v.idempotency_key) FROM vault_reservations v WHERE v.id = p_id;
        -- A statement of its own, so that it sees what committed before the lock was granted.
        SELECT o.vault_key_id INTO elsewhere
        FROM vault_reservations o JOIN vault_reservations s USING (idempotency_key)
        WHERE s.id = p_id AND o.id <> p_id AND o.state = 'committed'
        ORDER BY o.id LIMIT 1;
    END IF;
    UPDATE vault_reservations AS v
    SET state = CASE WHEN elsewhere IS NULL THEN p_to ELSE 'released' END,
        counted_under = elsewhere,
        updated_at = now(),
        upstream_status = coalesce(p_upstream_status, v.upstream_status),
        committed_cents = CASE WHEN p_to = 'committed' AND elsewhere IS NULL
                               THEN coalesce(p_committed_cents, v.amount_cents) END
    WHERE v.id = p_id AND v.attempt = p_attempt AND v.state = ANY(p_from)
    RETURNING v.* INTO r;
    IF r.id IS NULL THEN
        elsewhere := NULL;
        RETURN;
    END IF;
    UPDATE vault_keys
    SET reserved_cents = reserved_cents - r.amount_cents,
        spent_cents = spent_cents + coalesce(r.committed_cents, 0)
    WHERE id = r.vault_key_id;
    UPDATE vault_key_days
    SET reserved_cents = reserved_cents - r.amount_cents,
        spent_cents = spent_cents + coalesce(r.committed_cents, 0)
    WHERE vault_key_id = r.vault_key_id AND day = r.day;
    finished := r.state;
END
$$;

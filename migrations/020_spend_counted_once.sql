-- A charge's spend is counted under one vault key. A charge in doubt under the period's old
-- key, retried through the key `renew-keys` or a rerun issued since, was committed under the
-- new key by Stripe's replay, and again under the old one when reconciliation found the
-- charge: one charge held two caps' room, and the worker budget counted it twice for its
-- window. Stripe keeps one idempotency key per account, whichever vault key carried it, so a
-- reservation committing the same request that another key has already committed is
-- committed without being counted: counted_under names the key whose spend holds it. It
-- stays committed, so a retry through its key is still a replay, never counted again.

ALTER TABLE vault_reservations
    ADD COLUMN counted_under text REFERENCES vault_keys (id),
    ADD CHECK (counted_under IS NULL OR state = 'committed');

-- Commits of one idempotency key, whichever vault key carries them, one at a time: each then
-- sees the others'. Taken before any reservation row's lock (vault_finish, and the admin's
-- resolve before it reads the reservation), so it adds no lock cycle.
CREATE FUNCTION vault_lock_commits(p_idempotency_key text) RETURNS void LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(hashtextextended('vault-commit:' || p_idempotency_key, 0));
$$;

-- Settles a reservation's attempt: its amount leaves reserved and, committed, goes to spent,
-- under the locks of reservation, key and day rows in that order; unless another key has
-- committed the same request, which then holds its spend. Returns the state reached and that
-- key, or nothing when the attempt no longer holds the reservation in one of p_from.
-- The check relies on READ COMMITTED, the vault's isolation: the statement after the lock
-- takes a snapshot of its own, which holds every commit made before the lock was granted.
CREATE FUNCTION vault_finish(
    p_id bigint, p_attempt integer, p_from text[], p_to text, p_committed_cents bigint,
    p_upstream_status integer, OUT finished text, OUT elsewhere text
) LANGUAGE plpgsql AS $$
DECLARE
    r vault_reservations%ROWTYPE;
BEGIN
    IF p_to = 'committed' THEN
        PERFORM vault_lock_commits(v.idempotency_key) FROM vault_reservations v WHERE v.id = p_id;
        -- The same request: Stripe refuses a key reused with other parameters, so a success
        -- for another request under this key is no replay of this one.
        SELECT o.vault_key_id INTO elsewhere
        FROM vault_reservations o JOIN vault_reservations s USING (idempotency_key)
        WHERE s.id = p_id AND o.id <> p_id AND o.state = 'committed'
              AND o.counted_under IS NULL
              AND (o.endpoint, o.amount_cents, o.currency, o.customer)
                  IS NOT DISTINCT FROM (s.endpoint, s.amount_cents, s.currency, s.customer);
    END IF;
    UPDATE vault_reservations AS v
    SET state = p_to,
        counted_under = elsewhere,
        updated_at = now(),
        upstream_status = coalesce(p_upstream_status, v.upstream_status),
        committed_cents = CASE WHEN p_to = 'committed'
                               THEN coalesce(p_committed_cents, v.amount_cents) END
    WHERE v.id = p_id AND v.attempt = p_attempt AND v.state = ANY(p_from)
    RETURNING v.* INTO r;
    IF r.id IS NULL THEN
        elsewhere := NULL;
        RETURN;
    END IF;
    UPDATE vault_keys
    SET reserved_cents = reserved_cents - r.amount_cents,
        spent_cents = spent_cents + CASE WHEN elsewhere IS NULL
                                         THEN coalesce(r.committed_cents, 0) ELSE 0 END
    WHERE id = r.vault_key_id;
    UPDATE vault_key_days
    SET reserved_cents = reserved_cents - r.amount_cents,
        spent_cents = spent_cents + CASE WHEN elsewhere IS NULL
                                         THEN coalesce(r.committed_cents, 0) ELSE 0 END
    WHERE vault_key_id = r.vault_key_id AND day = r.day;
    finished := r.state;
END
$$;

-- The ledger's gate before a charge (billing/ledger.py begin_charge) in one round trip: the
-- same statements its transaction ran one by one, in the same order, so the same locks are
-- taken in the same order. FOR SHARE on the period: a pause or cancel committed before it is
-- seen; one committed after waits for this call, so the charge counts as already in flight.
-- gate: go, paused, cancelled, skipped, or closed (the claim is no longer open; status says
-- what it is, or 'missing').
CREATE FUNCTION billing_begin_charge(
    p_key text, p_period text, OUT gate text, OUT status text
) LANGUAGE plpgsql AS $$
DECLARE
    period_control text;
    claim billing_runs%ROWTYPE;
BEGIN
    SELECT control INTO period_control FROM billing_periods
    WHERE billing_period = p_period FOR SHARE;
    SELECT * INTO claim FROM billing_runs WHERE idempotency_key = p_key FOR UPDATE;
    status := coalesce(claim.status, 'missing');
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
        attempts = attempts + 1, updated_at = now()
    WHERE idempotency_key = p_key;
    gate := 'go';
END $$;

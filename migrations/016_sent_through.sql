-- The vault keys a claim's attempts may have reached Stripe through, in the order first used.
-- A cap refusal proves that nothing is in doubt under the refusing key only (the vault
-- checks a key's earlier reservations before its cap), so a claim is reopened on it only when
-- every attempt went through that key (billing/ledger.py reopen_refused_charge). The key's
-- age cannot say so: a worker may still hold a key a later run's preparation has replaced.
-- NULL for a claim no attempt has passed the gate for. An attempt sent without the vault
-- names 'direct' (billing/ledger.py SENT_DIRECT).
ALTER TABLE billing_runs ADD COLUMN sent_through text[];

-- Open claims sent before this column: which keys they went through is unknown, so they
-- name one no refusal can match, 'before-016', and the key the old rule credited them to (the
-- stored key, when the first attempt came after it was stored), which a run's opening then
-- counts as holding them, as it did.
UPDATE billing_runs r
SET sent_through = ARRAY['before-016'] || coalesce((
    SELECT ARRAY[k.vault_key_id] FROM period_vault_keys k
    WHERE k.billing_period = r.billing_period AND k.currency = r.currency
        AND r.charge_started_at >= k.created_at), '{}')
WHERE r.status = 'claimed' AND r.charge_started_at IS NOT NULL;

-- billing_begin_charge as in 008_begin_charge.sql, except that an attempt that passes names
-- its route, the vault key it will send through ('direct' without the vault), and the claim
-- keeps it; NULL for an attempt that will send nothing (no key for the period).
DROP FUNCTION billing_begin_charge(text, text);
CREATE FUNCTION billing_begin_charge(
    p_key text, p_period text, p_vault_key text, OUT gate text, OUT status text
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
        attempts = attempts + 1, updated_at = now(),
        sent_through = CASE
            WHEN p_vault_key IS NULL OR p_vault_key = ANY(coalesce(sent_through, '{}'))
            THEN sent_through
            ELSE array_append(sent_through, p_vault_key) END
    WHERE idempotency_key = p_key;
    gate := 'go';
END $$;

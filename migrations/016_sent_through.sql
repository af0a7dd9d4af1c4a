-- The vault keys a claim's attempts may have reached Stripe through, in the order first used.
-- A cap refusal proves that nothing is in doubt under the refusing key only (the vault
-- checks a key's earlier reservations before its cap), so a claim is reopened on it only when
-- every attempt went through that key (billing/ledger.py reopen_refused_charge). The key's
-- age cannot say so: a worker may still hold a key a later run's preparation has replaced.
-- NULL for a claim no attempt has passed the gate for, or one charged without the vault.
ALTER TABLE billing_runs ADD COLUMN sent_through text[];

-- billing_begin_charge as in 008_begin_charge.sql, except that an attempt that passes names
-- the vault key it will send through (NULL without the vault), and the claim keeps it.
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

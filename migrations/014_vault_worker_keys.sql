-- Who issued a key: an operator with the admin token, or a worker with the worker token,
-- whose keys the vault holds to a budget (VAULT_WORKER_BUDGET_CENTS, vault/budget.py). The
-- worker token may also settle its keys' reservations left unknown as failed, which frees
-- cap a charge may have taken after all: what it frees so is counted against the budget too.
ALTER TABLE vault_keys
    ADD COLUMN issued_by text NOT NULL DEFAULT 'admin' CHECK (issued_by IN ('admin', 'worker')),
    ADD COLUMN worker_released_cents bigint NOT NULL DEFAULT 0
        CHECK (worker_released_cents >= 0);

-- Period keys live now were issued by workers (with the admin token, before this), and
-- workers hold their sealed secrets: they count against the worker budget.
UPDATE vault_keys SET issued_by = 'worker'
WHERE label = 'billing' AND revoked_at IS NULL AND expires_at > now();

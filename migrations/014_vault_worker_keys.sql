-- Who issued a key: an operator with the admin token, or a worker with the worker token,
-- whose keys the vault holds to a budget (VAULT_WORKER_BUDGET_CENTS, vault/budget.py). The
-- worker token may also settle a reservation left unknown as failed, which frees cap a charge
-- may have taken after all: what it frees so is counted against the budget too.
ALTER TABLE vault_keys
    ADD COLUMN issued_by text NOT NULL DEFAULT 'admin' CHECK (issued_by IN ('admin', 'worker')),
    ADD COLUMN worker_released_cents bigint NOT NULL DEFAULT 0
        CHECK (worker_released_cents >= 0);

-- Who issued a key: an operator with the admin token, or a worker with the worker token,
-- whose keys the vault holds to a budget (VAULT_WORKER_BUDGET_CENTS, vault/budget.py).
ALTER TABLE vault_keys
    ADD COLUMN issued_by text NOT NULL DEFAULT 'admin' CHECK (issued_by IN ('admin', 'worker'));

CREATE INDEX vault_keys_worker_issued ON vault_keys (currency, created_at)
    WHERE issued_by = 'worker';

-- Each period's latest reconciliation, and what it left to look at again (open claims, bank
-- debits pending, vault reservations unknown, something for a person); NULL when nothing.
-- The daily reconciliation checks the latest period billed, and goes back to an earlier one
-- while its last report left something, or once a run of it has started since it was last
-- reconciled (a backfill, a run by hand): a debit its bank returns weeks later, or a
-- duplicate nobody has refunded, is reported every day, not only while its period is the
-- latest.
CREATE TABLE period_reconciliations (
    billing_period text PRIMARY KEY CHECK (billing_period ~ '^[0-9]{4}-(0[1-9]|1[0-2])$'),
    reconciled_at  timestamptz NOT NULL DEFAULT now(),
    open_reason    text CHECK (open_reason <> '')
);

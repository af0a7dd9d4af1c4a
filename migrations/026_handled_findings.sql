-- Findings of reconciliation a person has handled (`python starter.py handled`): a duplicate
-- refunded by hand elsewhere, a returned debit collected another way. Later reconciliations
-- count them as handled rather than report them, so the daily run exits 0 once every finding
-- has been seen to. By Stripe charge id, whatever the finding's kind.
CREATE TABLE handled_findings (
    charge_id      text PRIMARY KEY CHECK (charge_id ~ '^(ch|py)_[A-Za-z0-9]{1,250}$'),
    billing_period text NOT NULL CHECK (billing_period ~ '^[0-9]{4}-(0[1-9]|1[0-2])$'),
    reason         text NOT NULL,
    handled_by     text NOT NULL,
    handled_at     timestamptz NOT NULL DEFAULT now()
);

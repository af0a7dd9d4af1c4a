-- A cancelled run marks the customers it never started. Only those reopen when the period
-- runs again: a customer whose child already ran keeps its deterministic workflow ID, which
-- REJECT_DUPLICATE refuses to start twice within the namespace's retention.
ALTER TABLE billing_runs ADD COLUMN cancelled_before_start boolean NOT NULL DEFAULT false;

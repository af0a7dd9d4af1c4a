-- The workflow run that claimed the row. A child claims, charges and records in one workflow
-- task; when that task is retried (a signal arrived meanwhile, the worker died), the run
-- claims again and finds its own row charged: that is its charge, not an earlier one.
ALTER TABLE billing_runs ADD COLUMN claimed_by_run text;

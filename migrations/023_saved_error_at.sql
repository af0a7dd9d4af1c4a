-- When the claim's latest attempt met a 500 Stripe saved for its key and found no charge made
-- with it (billing/ledger.py stop_behind_saved_error). Stripe executes no request with the key
-- until it forgets the key, a day after its first request, so until then an operator's skip
-- may still reach such a charge, though it has passed the gate (request_skip).
ALTER TABLE billing_runs ADD COLUMN saved_error_at timestamptz;

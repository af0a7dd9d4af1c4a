-- The Stripe API a claim charges through, fixed when it is claimed: a retry after
-- BILLING_CHARGE_API changed must reach the same endpoint with the same key, or Stripe refuses
-- it as an idempotency error and a charge made by the first attempt goes unrecorded. NULL for
-- rows claimed before: the worker's setting, as before.
ALTER TABLE billing_runs ADD COLUMN charge_api text
    CHECK (charge_api IN ('payment_intents', 'charges'));

-- Inactive customers by Stripe customer: a run holds an active customer whose Stripe customer
-- the period billed under an inactive id (billing/ledger.py _HELD_AS), probed once per
-- customer it lists. Few customers are inactive, so the index stays small.
CREATE INDEX customers_inactive_by_stripe_customer ON customers (stripe_customer_id)
    WHERE NOT active;

-- Customers and a period's rows by Stripe customer: reconciliation asks which Stripe customers
-- more than one customer of ours has (billing/ledger.py shared_stripe_customers), since it
-- lists such a one's charges under each. The index of inactive customers (017) stays: its
-- probe, once per customer a run lists, mostly finds no entry and reads no row.
CREATE INDEX customers_by_stripe_customer ON customers (stripe_customer_id);
CREATE INDEX billing_runs_period_stripe_customer ON billing_runs (billing_period, stripe_customer_id);

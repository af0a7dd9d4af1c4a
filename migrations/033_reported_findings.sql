-- The findings reconciliation has reported, by Stripe charge and kind (as handled_findings):
-- `handled` marks only a finding a reconciliation reported, so that a mistyped charge id
-- is refused rather than confirmed while the real finding stays open. Written by the page
-- that finds it, every time it does (the period it was last reported under, and when).
CREATE TABLE reported_findings (
    -- Stripe's, as it listed it: no shape is checked, or an odd one would fail the page.
    charge_id        text NOT NULL,
    kind             text NOT NULL
                     CHECK (kind IN ('orphan', 'duplicate', 'unrecorded', 'failed_later')),
    billing_period   text NOT NULL CHECK (billing_period ~ '^[0-9]{4}-(0[1-9]|1[0-2])$'),
    last_reported_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (charge_id, kind)
);

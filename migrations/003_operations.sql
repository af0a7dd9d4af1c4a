-- Operator controls: a period can be paused or cancelled, and a customer skipped, before the
-- charge. The charge activity reads these in the same transaction that marks a charge started.

ALTER TABLE billing_periods
    ADD COLUMN control text NOT NULL DEFAULT 'running'
        CHECK (control IN ('running', 'paused', 'cancelled')),
    ADD COLUMN control_reason text,
    ADD COLUMN control_by text,
    ADD COLUMN control_at timestamptz;

ALTER TABLE billing_runs
    -- Set by the first charge attempt; a skip is refused once it is set.
    ADD COLUMN charge_started_at timestamptz,
    ADD COLUMN skip_reason text,
    ADD COLUMN skip_by text,
    ADD COLUMN decided_by text;

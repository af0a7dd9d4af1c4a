-- Findings of reconciliation a person has handled (`python starter.py handled`): a duplicate
-- the customer agreed to, a returned debit collected another way. Later reconciliations count
-- them as handled rather than report them, so the daily run exits 0 once every finding has
-- been seen to. By Stripe charge and kind: a charge is one charge whatever period it is
-- looked at under, and a mark for one kind hides no other (the ledger's own charge, marked
-- by mistake, still shows if it fails later).
CREATE TABLE handled_findings (
    charge_id      text NOT NULL CHECK (charge_id ~ '^(ch|py)_[A-Za-z0-9]{1,250}$'),
    kind           text NOT NULL
                   CHECK (kind IN ('orphan', 'duplicate', 'unrecorded', 'failed_later')),
    billing_period text NOT NULL CHECK (billing_period ~ '^[0-9]{4}-(0[1-9]|1[0-2])$'),
    reason         text NOT NULL,
    handled_by     text NOT NULL,
    handled_at     timestamptz NOT NULL DEFAULT now(),
    -- Taken back (`handled --undo`): reported again, and who did it and why kept here.
    undone_at      timestamptz,
    undone_by      text,
    undo_reason    text,
    PRIMARY KEY (charge_id, kind)
);

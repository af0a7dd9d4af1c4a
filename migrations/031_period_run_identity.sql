-- Which run a period's row belongs to. A run is a chain of Temporal runs under one workflow
-- ID; its first run's id (Temporal's "first execution run id") stays the same across
-- continue-as-new and a reset, and differs for a run started again after a terminate.
-- * run_id: the close of a run writes its summary only while the row is still its own: an
--   activity of a terminated run finishing after a rerun opened would otherwise mark the
--   rerun's period completed, with the old summary. NULL for rows opened before this.
-- * run_opened_in_temporal_at: when the opening was scheduled, by Temporal's clock, which
--   children's close times are read against (started_at is the database's clock).
ALTER TABLE billing_periods
    ADD COLUMN run_id text,
    ADD COLUMN run_opened_in_temporal_at timestamptz;

-- Which run a period's row belongs to. A run is a chain of Temporal runs under one workflow
-- ID; its first run's id (Temporal's "first execution run id") stays the same across
-- continue-as-new and a reset, and differs for a run started again after a terminate.
-- * run_id: the run that opened the period (which run a close finds completed). NULL for
--   rows opened before this. Who may write the row is the workers' check: only the current
--   try of the latest run of the period's workflow (activities/period.py _current_try).
-- * run_opened_in_temporal_at: when the opening's try was scheduled, by Temporal's clock,
--   which children's close times are read against (started_at is the database's clock).
ALTER TABLE billing_periods
    ADD COLUMN run_id text,
    ADD COLUMN run_opened_in_temporal_at timestamptz;

-- An opening by a release from before this one (a rolling upgrade, a rollback) writes
-- neither column: the row would keep the last run's id, and the close of the run it opened
-- would match nothing. A new opening that leaves the run id as it was clears both, which
-- matches any close, as before this migration.
CREATE FUNCTION billing_periods_opened_unnamed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.started_at IS DISTINCT FROM OLD.started_at
            AND NEW.run_id IS NOT DISTINCT FROM OLD.run_id
            AND NEW.run_opened_in_temporal_at IS NOT DISTINCT FROM OLD.run_opened_in_temporal_at
    THEN
        NEW.run_id := NULL;
        NEW.run_opened_in_temporal_at := NULL;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER billing_periods_opened_unnamed BEFORE UPDATE ON billing_periods
    FOR EACH ROW EXECUTE FUNCTION billing_periods_opened_unnamed();

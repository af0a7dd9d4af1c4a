-- Which due customers a run of a period has listed, and in which of its listings. Its close
-- writes the summary only once every due customer is marked by the run (run_id, the first run
-- id of its chain, which a reset keeps); one that is not (imported behind the listing, or
-- given a row meanwhile by an operator's skip or an earlier run's child) is listed then, and
-- counted once. A listing of the unlisted passes over the customers with a row that an
-- earlier listing of the run marked (`listing`: 0 the first, one more for each listing of
-- the unlisted; a mark keeps the lowest).
-- A mark says a listing ran, not that the run took its page: a reset's terminated run, or a
-- local activity run twice, may mark under the same run id. So a customer with no row is
-- taken for reached only if the run's workflow for it says so, as before marks. A rerun's
-- marks are its own. A close deletes the period's marks, an opening those of its own run.
CREATE TABLE period_listed (
    billing_period text NOT NULL,
    run_id text NOT NULL,
    customer_id text NOT NULL,
    listing integer NOT NULL,
    PRIMARY KEY (billing_period, run_id, customer_id)
);

-- Which due customers a run of a period has listed, and in which of its listings. Its close
-- writes the summary only once every due customer is marked by the run (run_id, the first run
-- id of its chain, which a reset keeps); one that is not (imported behind the listing, or
-- given a row meanwhile by an operator's skip or an earlier run's child) is listed then, and
-- counted once. A listing of the unlisted takes the customers no earlier listing of the run
-- marked (`listing`: 0 the first, one more for each listing of the unlisted).
-- Each run's marks are its own: a run that has ended (terminated, its listing still on a
-- worker) cannot mark for another. A close deletes the period's marks.
CREATE TABLE period_listed (
    billing_period text NOT NULL,
    run_id text NOT NULL,
    customer_id text NOT NULL,
    listing integer NOT NULL,
    PRIMARY KEY (billing_period, run_id, customer_id)
);

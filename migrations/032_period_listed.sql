-- Which due customers a run of a period took from its listings' pages (counted due), and
-- under which of its listings: written with the run's next page's request, or its close's,
-- so that a listing whose result no run took (a Temporal reset's terminated run, a local
-- activity run twice) marks nothing. The close writes the summary only once every due
-- customer is marked by the run (run_id, the first run id of its chain, which a reset
-- keeps); one that is not (imported behind the listing, or given a row meanwhile by an
-- operator's skip or an earlier run's child) is listed then, and counted once; one that is,
-- whatever its row or workflow (gone past the namespace's retention), is not listed again.
-- `listing`: 0 the first, one more for each listing of the unlisted, which passes over the
-- customers an earlier listing took; a mark keeps the lowest. A reset keeps the run id: the
-- marks of the timeline it undid stay the run's, as its rows do (a later listing's count for
-- nothing until that listing comes). A close deletes the period's marks, an opening those of
-- its own run.
CREATE TABLE period_listed (
    billing_period text NOT NULL,
    run_id text NOT NULL,
    customer_id text NOT NULL,
    listing integer NOT NULL,
    PRIMARY KEY (billing_period, run_id, customer_id)
);

-- Rate limits shared by every worker process (GCRA, "next free slot"): local activities do
-- not pass the task queue, whose rate limit the server would enforce, so a charge takes its
-- Stripe slot here (billing/rate_limit.py). One row per limit; nothing else is stored.
CREATE TABLE rate_limits (
    name      text PRIMARY KEY CHECK (name ~ '^[a-z][a-z0-9_.-]{0,62}$'),
    -- When the next request may be sent; reserving slots moves it on.
    next_free timestamptz NOT NULL
);

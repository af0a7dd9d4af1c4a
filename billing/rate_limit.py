"""A request rate shared by every worker process, held in Postgres (GCRA, "next free slot").

Local activities do not pass the task queue, whose activity rate limit the Temporal server
enforces, so calls to Stripe take their slots here instead. A limit is one row holding when
its next request may be sent; one short statement reserves the next slots and moves the row
on, so the row stays locked only while Postgres runs it. Slots are evenly spaced, with no
burst: Stripe's limiter allows a second's worth of requests at once, so requests sent at
their slots stay under it whatever the jitter. Times are the database's clock, the one clock
all workers share.

No maintained library fits: pyrate-limiter's PostgresBucket is a synchronous psycopg
sliding-window log (a row per request, a table it creates itself), rate-sync needs Python
3.12; this is one statement over asyncpg, in a migration like the rest of the schema.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

import asyncpg
from pydantic import BaseModel, ConfigDict

from billing.config import BillingSettings

# Stripe's limit is per account: every worker's calls to Stripe share this one row.
STRIPE = "stripe"
# A slot sent late goes out with the slots reserved after it: within a second's worth, which
# Stripe's limiter allows at once. One later than this (its workflow's timer fired late, a
# worker restarted) is given up for a new one, or many such would go out together.
LATE_LIMIT = timedelta(seconds=1)

# The row is created by the first reservation: a limit needs no set-up.
_RESERVE = """
INSERT INTO rate_limits AS r (name, next_free) VALUES ($1, clock_timestamp() + $2::interval)
ON CONFLICT (name) DO UPDATE
SET next_free = greatest(r.next_free, clock_timestamp()) + $2::interval
RETURNING r.next_free - $2::interval AS at,
          extract(epoch FROM r.next_free - $2::interval - clock_timestamp()) AS wait
"""
_UNTIL = "SELECT extract(epoch FROM $1::timestamptz - clock_timestamp())"


class Slot(BaseModel):
    """A reserved moment to send, on the database's clock, and how far off it was."""

    model_config = ConfigDict(frozen=True)

    at: datetime
    wait_seconds: float


class RateLimit:
    def __init__(self, pool: asyncpg.Pool, name: str, per_second: float) -> None:
        self._pool = pool
        self._name = name
        self._interval = timedelta(seconds=1 / per_second)

    async def reserve(self, requests: int = 1) -> Slot:
        """Reserve the next `requests` slots and return the first: requests sent together from
        it keep the average rate. An idle limit banks nothing: its slot is now, wait zero."""
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(_RESERVE, self._name, self._interval * requests)
        assert row is not None
        return Slot(at=row["at"], wait_seconds=max(0.0, float(row["wait"])))

    async def wait_turn(self, requests: int = 1) -> None:
        """Reserve the next slots and sleep until the first: for callers that may wait."""
        slot = await self.reserve(requests)
        await asyncio.sleep(slot.wait_seconds)

    async def seconds_until(self, at: datetime) -> float | None:
        """How long until a slot reserved earlier, on the database's clock: zero once due,
        None once more than LATE_LIMIT past (reserve a new one)."""
        async with self._pool.acquire() as conn:
            wait = float(await conn.fetchval(_UNTIL, at))
        return None if wait < -LATE_LIMIT.total_seconds() else max(0.0, wait)


def stripe_rate(pool: asyncpg.Pool, settings: BillingSettings) -> RateLimit | None:
    """The cluster's Stripe rate (BILLING_STRIPE_RPS), or None when unset: no limit."""
    rps = settings.billing_stripe_rps
    return RateLimit(pool, STRIPE, rps) if rps else None

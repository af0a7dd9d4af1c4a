"""The shared rate limit: slots evenly spaced on the database's clock, whoever reserves them."""

from __future__ import annotations

import asyncio
import itertools
import time
from datetime import datetime

import asyncpg
import pytest

from billing.rate_limit import LATE_LIMIT, RateLimit


async def db_clock(db: asyncpg.Pool) -> datetime:
    """The database's clock, the one the limit keeps its slots on."""
    now: datetime = await db.fetchval("SELECT clock_timestamp()")
    return now


async def past(db: asyncpg.Pool, at: datetime) -> None:
    """Sleep until `at` has passed on the database's clock."""
    await asyncio.sleep(max(0.0, (at - await db_clock(db)).total_seconds()) + 0.01)


async def until_judged(limit: RateLimit, db: asyncpg.Pool, at: datetime) -> float | None:
    """`limit.seconds_until(at)`, checked against the database's clock read just before and
    just after it: on a loaded machine the call may take any time, so what it should say is
    known only between the two."""
    before = await db_clock(db)
    wait = await limit.seconds_until(at)
    after = await db_clock(db)
    late = LATE_LIMIT.total_seconds()
    earliest, latest = (at - after).total_seconds(), (at - before).total_seconds()
    if latest < -late:
        assert wait is None, (wait, earliest, latest)
    elif earliest >= -late:
        assert wait is not None, (earliest, latest)
    if wait is not None:
        assert max(0.0, earliest) <= wait <= max(0.0, latest), (wait, earliest, latest)
    return wait


async def test_concurrent_reservations_get_evenly_spaced_slots(db: asyncpg.Pool) -> None:
    # Slow enough that each reservation is made before the slot ahead of it is due, however
    # loaded the machine: one made later would rightly get a later slot (at 20/s, a CI run
    # saw that).
    limit = RateLimit(db, "test", per_second=2)
    began = time.monotonic()
    slots = await asyncio.gather(*(limit.reserve() for _ in range(10)))
    took = time.monotonic() - began
    ats = sorted(s.at for s in slots)
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(ats)]
    assert all(g == pytest.approx(0.5, abs=1e-6) for g in gaps)
    # The last of ten slots at 2/s is 4.5 seconds after the first, which was now; each
    # wait is its slot's distance from the moment it was reserved, within the reservations'
    # time (however long a loaded machine took for them).
    assert min(s.wait_seconds for s in slots) == 0
    for slot in slots:
        ahead = (slot.at - ats[0]).total_seconds()
        assert ahead - took - 1e-3 <= slot.wait_seconds <= ahead + 1e-6
    assert max(s.wait_seconds for s in slots) > 4.5 - took - 1e-3


async def test_a_wait_for_a_turn_lasts_until_the_slot_after_the_ones_held(
    db: asyncpg.Pool,
) -> None:
    """What reconciliation's Stripe lookups wait with: the first turn on an idle limit is
    now, and holds two slots; the next is two intervals later, on the database's clock."""
    limit = RateLimit(db, "test", per_second=4)
    began = await db_clock(db)
    await limit.wait_turn(2)
    await limit.wait_turn()
    assert (await db_clock(db) - began).total_seconds() >= 0.5 - 0.01


async def test_limits_in_separate_pools_share_one_row(db: asyncpg.Pool, database_url: str) -> None:
    # Two worker processes each have their own pool: the row, not the object, is the limit.
    other = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    assert other is not None
    try:
        first = RateLimit(db, "stripe", per_second=10)
        second = RateLimit(other, "stripe", per_second=10)
        a = await first.reserve()
        b = await second.reserve()
        c = await first.reserve()
    finally:
        await other.close()
    assert (b.at - a.at).total_seconds() == pytest.approx(0.1, abs=1e-6)
    assert (c.at - b.at).total_seconds() == pytest.approx(0.1, abs=1e-6)


async def test_a_reservation_of_several_requests_holds_their_slots(db: asyncpg.Pool) -> None:
    limit = RateLimit(db, "test", per_second=10)
    began = time.monotonic()
    lookup_and_create = await limit.reserve(2)
    after = await limit.reserve()
    took = time.monotonic() - began
    assert (after.at - lookup_and_create.at).total_seconds() == pytest.approx(0.2, abs=1e-6)
    # Its wait counts down from 0.2 s by the time the two reservations took.
    assert lookup_and_create.wait_seconds == 0
    assert max(0.0, 0.2 - took - 1e-3) <= after.wait_seconds <= 0.2


async def test_an_idle_limit_gives_a_slot_now_and_a_held_one_counts_down(
    db: asyncpg.Pool,
) -> None:
    limit = RateLimit(db, "test", per_second=2)
    now = await limit.reserve()
    assert now.wait_seconds == 0
    held = await limit.reserve()
    assert (held.at - now.at).total_seconds() == pytest.approx(0.5, abs=1e-6)
    assert 0 < held.wait_seconds <= 0.5
    # It counts down on the database's clock, to zero once due.
    await asyncio.sleep(0.2)
    counted = await until_judged(limit, db, held.at)
    assert counted is None or counted < held.wait_seconds
    await past(db, held.at)
    assert await until_judged(limit, db, held.at) in (0.0, None)
    # A limit idle longer than its interval does not bank the slots it did not use.
    await asyncio.sleep(1.0)
    idle_until = await db_clock(db)
    first, second = await asyncio.gather(limit.reserve(), limit.reserve())
    # The one slot now, then the interval: not two slots from the idle second at once.
    earlier, later = sorted([first, second], key=lambda s: s.at)
    assert earlier.wait_seconds == 0 and earlier.at >= idle_until
    assert 0 < later.wait_seconds <= 0.5
    assert (later.at - earlier.at).total_seconds() == pytest.approx(0.5, abs=1e-6)


async def test_a_slot_long_past_is_given_up_so_late_senders_do_not_go_out_together(
    db: asyncpg.Pool,
) -> None:
    # Slots whose senders come late (timers fired late, a worker restarted) would all go out
    # at once: within a second's worth that Stripe allows, past it a sender reserves anew.
    limit = RateLimit(db, "test", per_second=4)
    slots = [await limit.reserve() for _ in range(8)]
    # Slots every 0.25 s, the last 1.75 s after the first. Once the last is due, the first
    # is past LATE_LIMIT; each is judged on the database's clock as it is asked, the latest
    # first (a slot only grows later), since a loaded machine may take any time to ask.
    await past(db, slots[-1].at)
    waits = [await until_judged(limit, db, s.at) for s in reversed(slots)][::-1]
    assert waits[0] is None
    # Given up from the oldest on: never an older slot kept after a newer one was given up.
    kept = [w is not None for w in waits]
    assert kept == sorted(kept)

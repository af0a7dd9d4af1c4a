"""The shared rate limit: slots evenly spaced on the database's clock, whoever reserves them."""

from __future__ import annotations

import asyncio
import itertools

import asyncpg
import pytest

from billing.rate_limit import LATE_LIMIT, RateLimit


async def test_concurrent_reservations_get_evenly_spaced_slots(db: asyncpg.Pool) -> None:
    # Slow enough that each reservation is made before the slot ahead of it is due, however
    # loaded the machine: one made later would rightly get a later slot (at 20/s, a CI run
    # saw that).
    limit = RateLimit(db, "test", per_second=2)
    slots = await asyncio.gather(*(limit.reserve() for _ in range(10)))
    ats = sorted(s.at for s in slots)
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(ats)]
    assert all(g == pytest.approx(0.5, abs=1e-6) for g in gaps)
    # The last of ten slots at 2/s is about 4.5 seconds away.
    assert max(s.wait_seconds for s in slots) == pytest.approx(4.5, abs=0.5)


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
    lookup_and_create = await limit.reserve(2)
    after = await limit.reserve()
    assert (after.at - lookup_and_create.at).total_seconds() == pytest.approx(0.2, abs=1e-6)
    assert 0.1 < after.wait_seconds <= 0.2


async def test_an_idle_limit_gives_a_slot_now_and_a_held_one_counts_down(
    db: asyncpg.Pool,
) -> None:
    limit = RateLimit(db, "test", per_second=2)
    now = await limit.reserve()
    assert now.wait_seconds == 0
    held = await limit.reserve()
    assert 0.4 < held.wait_seconds <= 0.5
    await asyncio.sleep(0.2)
    assert 0.2 < (await limit.seconds_until(held.at) or 0) <= 0.3
    await asyncio.sleep(0.3)
    assert await limit.seconds_until(held.at) == 0
    # A limit idle longer than its interval does not bank the slots it did not use.
    await asyncio.sleep(1.0)
    first, second = await asyncio.gather(limit.reserve(), limit.reserve())
    # The one slot now, then the interval: not two slots from the idle second at once.
    assert sorted([first.wait_seconds, second.wait_seconds])[0] == 0
    assert 0.4 < sorted([first.wait_seconds, second.wait_seconds])[1] <= 0.5
    assert abs((second.at - first.at).total_seconds()) == pytest.approx(0.5, abs=1e-6)


async def test_a_slot_long_past_is_given_up_so_late_senders_do_not_go_out_together(
    db: asyncpg.Pool,
) -> None:
    # Slots whose senders come late (timers fired late, a worker restarted) would all go out
    # at once: within a second's worth that Stripe allows, past it a sender reserves anew.
    limit = RateLimit(db, "test", per_second=4)
    slots = [await limit.reserve() for _ in range(8)]
    # Slots every 0.25 s; the last 0.375 s past, the first five more than a second past.
    await asyncio.sleep(slots[-1].wait_seconds + LATE_LIMIT.total_seconds() - 0.625)
    waits = [await limit.seconds_until(s.at) for s in slots]
    assert waits[:5] == [None] * 5
    assert waits[5:] == [0.0] * 3

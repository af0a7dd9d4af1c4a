"""The ledger marks the customers a run takes from its listings' pages (migrations/032): the
listing of the unlisted and the close take those it took from no listing, whatever their row."""

from __future__ import annotations

from datetime import UTC, datetime

from billing import ledger
from billing.keys import idempotency_key
from billing.models import Counts, Listing, PeriodSummary, RunIdentity
from billing.periods import Period
from tests.integration.harness import Harness

PERIOD = "2026-12"
RUN = RunIdentity(run_id="run-1", opened_at=datetime(2026, 12, 1, tzinfo=UTC))


async def _open(harness: Harness, run: RunIdentity = RUN) -> None:
    async with harness.pool.acquire() as conn:
        await ledger.open_period(conn, PERIOD, "wf", run=run)


async def _listing(
    harness: Harness, number: int, run_id: str = RUN.run_id, *, take: bool = True
) -> list[str]:
    """Every customer a listing lists, page by page (two a page), each page's taken (marked
    with the next request) unless not `take` (its result lost)."""
    listing = Listing(run_id=run_id, number=number)
    listed: list[str] = []
    taken: list[str] = []
    after = None
    async with harness.pool.acquire() as conn:
        while True:
            page = await ledger.listed_page(conn, PERIOD, after, 2, listing, taken)
            ids = [c.customer_id for c in page.customers]
            listed += ids
            taken = ids if take else []
            if page.next_cursor is None:
                await ledger.mark_taken(conn, PERIOD, listing, taken)
                return listed
            after = page.next_cursor


async def _unlisted(harness: Harness, number: int, run_id: str = RUN.run_id) -> bool:
    async with harness.pool.acquire() as conn:
        return await ledger.unlisted_due(conn, PERIOD, Listing(run_id=run_id, number=number))


async def test_a_listing_of_the_unlisted_takes_what_no_earlier_listing_took(
    harness: Harness,
) -> None:
    first = sorted(c.customer_id for c in await harness.seed(3))
    await _open(harness)
    assert await _unlisted(harness, 0)
    assert await _listing(harness, 0) == first
    assert not await _unlisted(harness, 0)
    # Imported behind the listing, one of them skipped meanwhile: a row, but not taken.
    late = sorted(c.customer_id for c in await harness.seed(2, prefix="a-late"))
    async with harness.pool.acquire() as conn:
        skipped = await ledger.request_skip(
            conn, late[0], PERIOD, idempotency_key("test", late[0], Period(2026, 12)), "no", "carol"
        )
    assert skipped.skipped
    assert await _unlisted(harness, 1)
    # Listed again by the same listing (a page put back at a pause, its result lost).
    assert await _listing(harness, 1, take=False) == late
    assert await _unlisted(harness, 1)
    assert await _listing(harness, 1) == late
    assert not await _unlisted(harness, 1)
    assert await _listing(harness, 2) == []


async def test_a_listing_whose_result_is_lost_marks_only_what_its_run_took(
    harness: Harness,
) -> None:
    """A listing of the run whose result no one takes (the run a Temporal reset terminated,
    still on its worker; a local activity run twice) sends only what its run took before
    it: a customer imported behind the listing stays unlisted (helper-167 F1)."""
    customers = sorted(c.customer_id for c in await harness.seed(3))
    await _open(harness)
    assert await _listing(harness, 0) == customers
    await harness.seed(1, prefix="a-late")
    async with harness.pool.acquire() as conn:
        await ledger.listed_page(conn, PERIOD, None, 10, Listing(run_id=RUN.run_id, number=0), [])
    assert await _unlisted(harness, 0)


async def test_a_later_listings_marks_are_not_this_ones(harness: Harness) -> None:
    """A run reset to a listing before its last finds the marks of the listings it undid:
    they count for neither its close nor its listings until it takes them again; a listing
    never raises a mark."""
    customers = sorted(c.customer_id for c in await harness.seed(3))
    await _open(harness)
    assert await _listing(harness, 0) == customers
    late = sorted(c.customer_id for c in await harness.seed(1, prefix="a-late"))
    assert await _listing(harness, 1) == late
    # Reset to before its listing of the unlisted: at its first listing again.
    assert await _unlisted(harness, 0)
    assert await _listing(harness, 0) == [*late, *customers]
    assert not await _unlisted(harness, 0)
    # Marks of a listing 3 (of a timeline undone) leave them at 0.
    async with harness.pool.acquire() as conn:
        await ledger.mark_taken(
            conn, PERIOD, Listing(run_id=RUN.run_id, number=3), [*late, *customers]
        )
    assert not await _unlisted(harness, 0)


async def test_an_opening_again_by_the_same_run_forgets_its_marks(harness: Harness) -> None:
    """Reset to before its opening, the run opens the period again and lists from the start:
    a customer its first timeline took, not due at the new listing and due again by the
    close, is unlisted (helper-167 F1)."""
    customers = sorted(c.customer_id for c in await harness.seed(3))
    await _open(harness)
    await _listing(harness, 0)
    await _open(harness)
    await harness.pool.execute(
        "UPDATE customers SET active = false WHERE customer_id = $1", customers[0]
    )
    assert await _listing(harness, 0) == customers[1:]
    await harness.pool.execute(
        "UPDATE customers SET active = true WHERE customer_id = $1", customers[0]
    )
    assert await _unlisted(harness, 0)


async def test_each_runs_marks_are_its_own_until_a_close(harness: Harness) -> None:
    customers = sorted(c.customer_id for c in await harness.seed(2))
    await _open(harness)
    assert await _listing(harness, 0) == customers
    rerun = RunIdentity(run_id="run-2", opened_at=RUN.opened_at)
    await _open(harness, rerun)
    assert await _unlisted(harness, 0, rerun.run_id)
    assert await _listing(harness, 0, run_id=rerun.run_id) == customers
    assert not await _unlisted(harness, 0, rerun.run_id)
    async with harness.pool.acquire() as conn:
        summary = PeriodSummary(
            period=PERIOD, workflow_id="wf", run_id=rerun.run_id, **Counts().model_dump()
        )
        await ledger.finish_period(conn, PERIOD, summary.model_dump_json())
        marks = await conn.fetchval("SELECT count(*) FROM period_listed")
    assert marks == 0

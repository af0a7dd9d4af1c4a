"""A stop recorded for a claim whose charge met a 500 Stripe saved for its key
(ledger.stop_behind_saved_error), on the real ledger: only for the claim's latest attempt,
only once the run is cancelled or the customer skipped, and only while no request with the
key can still be on its way when Stripe forgets it; and the skip that may reach such a claim
(ledger.request_skip)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg
import pytest

from billing import ledger
from billing.models import Claim, Control, PeriodPlan, SkipResult
from tests.integration.harness import Harness
from tests.integration.test_ledger_reopen import PERIOD, claimed, passed
from tests.waiting import eventually, waits_on_a_lock


async def sent_in(conn: asyncpg.Connection, harness: Harness, control: Control) -> Claim:
    """One claim whose attempt passed the gate, in a run whose control is now `control`."""
    plan = PeriodPlan(period=str(PERIOD), due=1, to_charge=1, expected_total_cents=0)
    await ledger.start_period(conn, plan, "billing-period-2026-12")
    [claim] = await claimed(harness)
    assert await passed(conn, claim, None) == 1
    if control != "running":
        await ledger.set_control(conn, str(PERIOD), control, "wrong prices", "ops")
    return claim


async def status(conn: asyncpg.Connection, claim: Claim) -> str:
    found = await ledger.claim_by_key(conn, claim.idempotency_key)
    assert found is not None
    return found.status


async def test_a_cancelled_run_records_the_claim_cancelled_with_its_reason(
    harness: Harness,
) -> None:
    async with harness.pool.acquire() as conn:
        claim = await sent_in(conn, harness, "cancelled")
        assert (
            await ledger.stop_behind_saved_error(conn, claim.idempotency_key, 1, record=True)
            == "cancelled"
        )
        [row] = await harness.ledger_rows(str(PERIOD))
        assert (row["status"], row["reason"], row["decided_by"]) == (
            "cancelled",
            "wrong prices",
            "ops",
        )
        assert row["charge_started_at"] is not None
        # Asked again (a retry), nothing changes.
        assert (
            await ledger.stop_behind_saved_error(conn, claim.idempotency_key, 1, record=True)
            is None
        )


async def test_a_stop_not_to_be_recorded_yet_is_only_noted(harness: Harness) -> None:
    # Until the vault has fenced off the attempts before (activities/charging.py): the stop
    # that applies is said, and only the saved error noted, for a skip to reach it still.
    async with harness.pool.acquire() as conn:
        claim = await sent_in(conn, harness, "cancelled")
        due = await ledger.stop_behind_saved_error(conn, claim.idempotency_key, 1, record=False)
        assert due == "cancelled"
        [row] = await harness.ledger_rows(str(PERIOD))
        assert (row["status"], row["completed_at"]) == ("claimed", None)
        # Nor the cancel's words: the claim is still open, no decision was taken on it.
        assert (row["reason"], row["decided_by"]) == (None, None)
        assert row["saved_error_at"] is not None


@pytest.mark.parametrize("control", ["running", "paused"])
async def test_a_run_not_cancelled_leaves_the_claim_open(
    harness: Harness, control: Control
) -> None:
    async with harness.pool.acquire() as conn:
        claim = await sent_in(conn, harness, control)
        assert (
            await ledger.stop_behind_saved_error(conn, claim.idempotency_key, 1, record=True)
            is None
        )
        assert await status(conn, claim) == "claimed"


async def test_an_attempt_that_is_not_the_latest_proves_nothing(harness: Harness) -> None:
    """Another attempt passed the gate since: it may have been sent after Stripe forgot the
    key (or meet what this one did not), so only its own answer decides."""
    async with harness.pool.acquire() as conn:
        claim = await sent_in(conn, harness, "running")
        assert await passed(conn, claim, None) == 2
        await ledger.set_control(conn, str(PERIOD), "cancelled", "wrong prices", "ops")
        assert (
            await ledger.stop_behind_saved_error(conn, claim.idempotency_key, 1, record=True)
            is None
        )
        assert await status(conn, claim) == "claimed"
        assert (
            await ledger.stop_behind_saved_error(conn, claim.idempotency_key, 2, record=True)
            == "cancelled"
        )


@pytest.mark.parametrize(
    ("age", "cancelled"),
    [
        (ledger.SAVED_ERROR_HOLDS_FOR - timedelta(minutes=1), True),
        (ledger.SAVED_ERROR_HOLDS_FOR + timedelta(minutes=1), False),
        # Stripe forgets the key 24 hours after its first request: a request still on its
        # way then could charge behind a recorded cancel, so the window closes well before.
        (timedelta(hours=23), False),
    ],
    ids=["just-within", "just-past", "an-hour-before-stripe-forgets"],
)
async def test_only_a_claim_young_enough_is_cancelled(
    harness: Harness, age: timedelta, cancelled: bool
) -> None:
    async with harness.pool.acquire() as conn:
        claim = await sent_in(conn, harness, "cancelled")
        await conn.execute("UPDATE billing_runs SET claimed_at = now() - $1::interval", age)
        stopped = await ledger.stop_behind_saved_error(conn, claim.idempotency_key, 1, record=True)
        assert stopped == ("cancelled" if cancelled else None)
        assert await status(conn, claim) == (stopped or "claimed")


async def skip(conn: asyncpg.Connection, claim: Claim) -> SkipResult:
    return await ledger.request_skip(
        conn, claim.customer_id, claim.period, claim.idempotency_key, "disputed", "ops"
    )


async def test_a_skip_reaches_a_charge_held_behind_a_saved_500(harness: Harness) -> None:
    """Refused once the charge is sent; accepted once it is known to be held behind a saved
    500; recorded skipped, with its reason, at the next try that meets the replay."""
    async with harness.pool.acquire() as conn:
        claim = await sent_in(conn, harness, "running")
        refused = await skip(conn, claim)
        assert (refused.skipped, refused.detail) == (
            False,
            "cannot skip: its charge has already been sent to Stripe",
        )
        assert (
            await ledger.stop_behind_saved_error(conn, claim.idempotency_key, 1, record=True)
            is None
        )
        accepted = await skip(conn, claim)
        assert accepted.skipped and "held behind a 500 Stripe saved" in accepted.detail
        assert await status(conn, claim) == "claimed"
        assert await passed(conn, claim, None) == 2
        assert (
            await ledger.stop_behind_saved_error(conn, claim.idempotency_key, 2, record=True)
            == "skipped"
        )
        [row] = await harness.ledger_rows(str(PERIOD))
        assert (row["status"], row["reason"], row["decided_by"]) == ("skipped", "disputed", "ops")


@pytest.mark.parametrize(
    "age",
    [
        ledger.SKIP_BEHIND_SAVED_ERROR_FOR + timedelta(minutes=1),
        # Still within the stop's window, but too near its end for the next try, minutes
        # away, to record the skip: accepted, it would be said skipped and then charged.
        ledger.SAVED_ERROR_HOLDS_FOR - timedelta(minutes=30),
    ],
    ids=["just-past", "near-the-stops-end"],
)
async def test_a_skip_is_refused_once_the_held_charge_is_too_old(
    harness: Harness, age: timedelta
) -> None:
    async with harness.pool.acquire() as conn:
        claim = await sent_in(conn, harness, "running")
        assert (
            await ledger.stop_behind_saved_error(conn, claim.idempotency_key, 1, record=True)
            is None
        )
        await conn.execute("UPDATE billing_runs SET claimed_at = now() - $1::interval", age)
        refused = await skip(conn, claim)
        assert not refused.skipped and "already been sent" in refused.detail


async def test_a_stop_waits_for_an_attempt_passing_the_gate_and_leaves_the_claim_to_it(
    harness: Harness,
) -> None:
    """Attempt 1 met a saved 500 in a cancelled run while attempt 2 was passing the gate
    (uncommitted). Its stop waits for that pass and, attempt 1 no longer the latest, records
    nothing: read from before the pass, it recorded the claim cancelled while attempt 2,
    sent, may charge."""
    async with harness.pool.acquire() as conn, harness.pool.acquire() as retrying:
        claim = await sent_in(conn, harness, "cancelled")
        async with retrying.transaction():
            assert await passed(retrying, claim, None) == 2
            stop = asyncio.create_task(
                ledger.stop_behind_saved_error(conn, claim.idempotency_key, 1, record=True)
            )
            await eventually(lambda: waits_on_a_lock(harness.pool, conn, stop))
        assert await stop is None
        assert await status(conn, claim) == "claimed"


async def test_a_skip_before_the_runs_cancel_ends_the_held_charge_skipped_for_its_reason(
    harness: Harness,
) -> None:
    """Skipped while held behind a saved 500, then its run cancelled: it ends skipped, for
    the skip's reason and by its operator, as the gate stops a claim skipped before a
    cancel. The ledger keeps the decision taken first, not the cancel's words."""
    async with harness.pool.acquire() as conn:
        claim = await sent_in(conn, harness, "running")
        assert (
            await ledger.stop_behind_saved_error(conn, claim.idempotency_key, 1, record=True)
            is None
        )
        assert (await skip(conn, claim)).skipped
        await ledger.set_control(conn, str(PERIOD), "cancelled", "wrong prices", "bob")
        assert await passed(conn, claim, None) == 2
        assert (
            await ledger.stop_behind_saved_error(conn, claim.idempotency_key, 2, record=True)
            == "skipped"
        )
        [row] = await harness.ledger_rows(str(PERIOD))
        assert (row["status"], row["reason"], row["decided_by"]) == ("skipped", "disputed", "ops")

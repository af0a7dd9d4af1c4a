"""Operators' words (pause, cancel, Temporal's cancel) given as a run closes: its close may
find customers its listing did not reach and go back to bill them, where the word applies;
else the run has ended, and the word is answered so. Never a run left waiting on itself, nor
a cancel undone."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

from billing import operations
from billing.models import OperatorRequest, SkipRequest
from billing.periods import Period
from billing.runs import start_period
from tests.integration.harness import (
    Harness,
    accepted_updates,
    cancel_taken,
    update_taken,
)
from tests.integration.holds import ActivityHold
from tests.integration.invariants import assert_billed_once
from tests.integration.replay import keep, replay
from tests.integration.test_unlisted_customers import ALICE, ImportAtTheClose, _counted
from tests.waiting import eventually
from workflows.billing_period import BillingPeriodWorkflow

PERIOD = Period(2026, 12)
BOB = OperatorRequest(reason="looking into it", operator="bob")


@pytest.mark.parametrize("word", ["cancel", "pause"])
async def test_a_word_given_while_the_close_waits_for_a_skip_applies(
    harness: Harness, word: Literal["cancel", "pause"]
) -> None:
    """Every outcome in, the run waits for a skip still running before its close: a cancel
    then applies at once (it waited for the close's verdict, which waited for it); a pause
    holds the close until a resume, not a run completed under a pause it took."""
    customers = await harness.seed(3)
    hold = ActivityHold("skip_customer")
    async with harness.running_worker(interceptors=[hold]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        skip = SkipRequest(customer_id=customers[0].customer_id, reason="x", operator="bob")
        skipping = asyncio.create_task(handle.execute_update(BillingPeriodWorkflow.skip, skip))
        await asyncio.wait_for(hold.reached.wait(), 60)

        async def closing() -> bool:
            return (await handle.query(BillingPeriodWorkflow.progress)).state == "closing"

        await eventually(closing)
        accepted = await accepted_updates(handle)
        speaking = asyncio.create_task(operations.control(harness.client, PERIOD, word, ALICE))
        await update_taken(handle, speaking, accepted)
        hold.go.set()
        await asyncio.wait_for(skipping, 30)
        answer = await asyncio.wait_for(speaking, 30)
        if word == "pause":
            await eventually(lambda: harness.in_state(PERIOD, "paused"), timeout=30)
            await operations.control(harness.client, PERIOD, "resume", BOB)
        summary = await asyncio.wait_for(handle.result(), 30)
        taken = await handle.fetch_history()
    # I6 for the patched path: RECORD_HISTORIES=1 keeps the run that took the word.
    await replay([taken])
    keep([taken])
    # The pause sends the run back to wait: its answer (and the Web UI's status) said
    # "closing" (helper-209).
    assert answer.state == ("cancelling" if word == "cancel" else "paused")
    assert summary.cancelled_by == ("alice" if word == "cancel" else None)
    assert (summary.due, _counted(summary)) == (3, 3)
    await assert_billed_once(harness, str(PERIOD), customers)


@pytest.mark.parametrize("by", ["operator", "temporal"])
async def test_a_pause_after_a_cancel_as_the_run_closes_does_not_undo_it(
    harness: Harness, by: str
) -> None:
    """Both taken as the run closes; the close finds a customer its listing did not reach:
    the cancel applies, and the pause after it changes nothing (it overwrote the cancel, and
    a resume billed the customer the cancel was to stop)."""
    customers = await harness.seed(3)
    importing, hold = ImportAtTheClose(harness), ActivityHold("close_period*")
    async with harness.running_worker(interceptors=[importing, hold]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await asyncio.wait_for(hold.reached.wait(), 60)
        cancelling = None
        if by == "temporal":
            await handle.cancel()
            await cancel_taken(handle)
        else:
            accepted = await accepted_updates(handle)
            cancelling = asyncio.create_task(
                operations.control(harness.client, PERIOD, "cancel", ALICE)
            )
            await update_taken(handle, cancelling, accepted)
        accepted = await accepted_updates(handle)
        pausing = asyncio.create_task(operations.control(harness.client, PERIOD, "pause", BOB))
        await update_taken(handle, pausing, accepted)
        hold.go.set()
        with pytest.raises(operations.OperatorRefusedError) as refused:
            await asyncio.wait_for(pausing, 30)
        summary = await asyncio.wait_for(handle.result(), 30)
        if cancelling is not None:
            assert (await cancelling).state == "cancelling"
    assert "as the pause arrived, so the pause changed nothing" in str(refused.value)
    assert summary.cancelled_by == ("alice" if by == "operator" else "temporal")
    charged = {c["customer"] for c in await harness.charges()}
    assert importing.late[0].stripe_customer_id not in charged
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_pause_as_the_run_closes_holds_the_customers_it_goes_back_to(
    harness: Harness,
) -> None:
    """The pause applies once the close goes back; the run waits (continuing as new with
    the listing of the unlisted), and a resume bills the customer, counted once."""
    customers = await harness.seed(3)
    importing, hold = ImportAtTheClose(harness), ActivityHold("close_period*")
    async with harness.running_worker(interceptors=[importing, hold]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await asyncio.wait_for(hold.reached.wait(), 60)
        accepted = await accepted_updates(handle)
        pausing = asyncio.create_task(operations.control(harness.client, PERIOD, "pause", BOB))
        await update_taken(handle, pausing, accepted)
        hold.go.set()
        assert (await asyncio.wait_for(pausing, 30)).state == "paused"
        assert not {c["customer"] for c in await harness.charges()} & {
            importing.late[0].stripe_customer_id
        }
        await operations.control(harness.client, PERIOD, "resume", BOB)
        summary = await asyncio.wait_for(handle.result(), 60)
    assert (summary.due, summary.charged, _counted(summary)) == (4, 4, 4), summary
    await assert_billed_once(harness, str(PERIOD), [*customers, *importing.late])


async def test_a_cancel_as_the_run_closes_for_good_says_it_changed_nothing(
    harness: Harness,
) -> None:
    """The close finds every customer reached and closes: the cancel it took is refused,
    saying why, not answered as though it had applied."""
    customers = await harness.seed(2)
    hold = ActivityHold("close_period*")
    async with harness.running_worker(interceptors=[hold]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await asyncio.wait_for(hold.reached.wait(), 60)
        accepted = await accepted_updates(handle)
        cancelling = asyncio.create_task(
            operations.control(harness.client, PERIOD, "cancel", ALICE)
        )
        await update_taken(handle, cancelling, accepted)
        hold.go.set()
        with pytest.raises(operations.OperatorRefusedError) as refused:
            await asyncio.wait_for(cancelling, 30)
        summary = await asyncio.wait_for(handle.result(), 30)
    assert "completed as the cancel arrived: every due customer has its outcome" in str(
        refused.value
    )
    assert (summary.charged, summary.cancelled_by) == (2, None)
    await assert_billed_once(harness, str(PERIOD), customers)


@pytest.mark.parametrize("by", ["pause", "cancel", "temporal"])
async def test_a_word_after_the_close_is_not_written_over_the_completed_run(
    harness: Harness, by: str
) -> None:
    """Closed, the run still waits for a skip taken as it closed: a word given then was
    applied, its control written over the completed period (a pause there holds a later
    re-drive at the gate for good; a cancel makes launches read the period as cancelled)."""
    customers = await harness.seed(2)
    close = ActivityHold("close_period*")
    skip_hold = ActivityHold("skip_customer")
    async with harness.running_worker(interceptors=[close, skip_hold]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await asyncio.wait_for(close.reached.wait(), 60)
        skip = SkipRequest(customer_id=customers[0].customer_id, reason="x", operator="bob")
        skipping = asyncio.create_task(handle.execute_update(BillingPeriodWorkflow.skip, skip))
        await asyncio.wait_for(skip_hold.reached.wait(), 60)
        close.go.set()

        async def completed() -> bool:
            return (await handle.query(BillingPeriodWorkflow.progress)).state == "completed"

        await eventually(completed)
        word = None
        accepted = await accepted_updates(handle)
        if by == "temporal":
            await handle.cancel()
            await cancel_taken(handle)
        elif by == "pause":
            word = asyncio.create_task(operations.control(harness.client, PERIOD, "pause", BOB))
        else:
            word = asyncio.create_task(operations.control(harness.client, PERIOD, "cancel", BOB))
        if word is not None:
            await update_taken(handle, word, accepted)
        skip_hold.go.set()
        await asyncio.wait_for(skipping, 30)
        summary = await asyncio.wait_for(handle.result(), 30)
        if word is not None:
            with pytest.raises(operations.OperatorRefusedError, match="a run that has ended"):
                await asyncio.wait_for(word, 30)
    row = await harness.pool.fetchrow(
        "SELECT state, control FROM billing_periods WHERE billing_period = $1", str(PERIOD)
    )
    assert (row["state"], row["control"], summary.cancelled_by) == ("completed", "running", None)

"""Operating a period: pause, resume, cancel, skip, preview, schedules, and what the Web UI
filters on, against the real dev server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta, tzinfo
from functools import partial
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from google.protobuf.duration_pb2 import Duration
from pydantic import ValidationError
from temporalio import activity, workflow
from temporalio.api.common.v1 import WorkflowExecution as ExecutionRef
from temporalio.api.enums.v1 import EventType
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.api.workflowservice.v1 import (
    RegisterNamespaceRequest,
    ResetWorkflowExecutionRequest,
)
from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionExecutionStartWorkflow,
    ScheduleActionStartWorkflow,
    ScheduleBackfill,
    ScheduleCalendarSpec,
    ScheduleHandle,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    ScheduleRange,
    ScheduleSpec,
    ScheduleState,
    ScheduleUpdate,
    ScheduleUpdateInput,
    WorkflowExecution,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowHistory,
    WorkflowQueryFailedError,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.testing import ActivityEnvironment
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    ExecuteWorkflowInput,
    HandleQueryInput,
    Interceptor,
    StartChildWorkflowInput,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
)
from temporalio.workflow import ChildWorkflowHandle

from activities.period import ControlRequest, PeriodActivities, SkipCustomerRequest
from billing import ledger, operations, run_states, schedules, search_attributes
from billing.config import TemporalSettings
from billing.customers import upsert_customers
from billing.errors import BillingError, InvalidInputError, NoWorkerError, RunEndedError
from billing.keys import (
    customer_workflow_id,
    idempotency_key,
    period_workflow_id,
    reconcile_workflow_id,
)
from billing.models import (
    BillingPeriodInput,
    ChargeFailure,
    ChargeResult,
    Claim,
    EndedRun,
    OpenRun,
    OperatorRequest,
    PeriodPlan,
    PeriodProgress,
    PeriodStatus,
    PeriodSummary,
    PeriodTotals,
    RunOptions,
    SkipRequest,
)
from billing.money import describe_amount
from billing.periods import Billing, Period, period_for
from billing.preview import preview_period
from billing.reporting import describe_preview
from billing.runs import period_status, start_period, start_reconcile
from billing.stripe_client import stripe_client
from billing.temporal_client import workflow_status
from cli import commands, runs
from tests.integration.harness import (
    IDLE_QUEUE,
    Harness,
    accepted_updates,
    at_least,
    single_batch_activations,
    update_taken,
)
from tests.integration.holds import ActivityHold, BillHold
from tests.integration.invariants import assert_billed_once
from tests.integration.replay import keep, replay
from tests.prometheus import metric_value
from tests.waiting import eventually, waits_on_a_lock
from workflows.billing_period import BillingPeriodWorkflow
from workflows.identity import WRONG_WORKFLOW_ID
from workflows.signals import PERIOD_BLOCKED

# The current month: `run` refuses a period long past, so a fixed one would expire.
PERIOD = period_for(datetime.now(UTC), "advance")
ALICE = OperatorRequest(reason="amounts look wrong", operator="alice")
SLOW = RunOptions(max_in_flight=4)


async def db_now(harness: Harness) -> datetime:
    async with harness.pool.acquire() as conn:
        now: datetime = await conn.fetchval("SELECT now()")
        return now


async def test_pause_stops_new_charges_and_resume_completes(harness: Harness) -> None:
    customers = await harness.seed(40)
    await harness.set_faults(latency_ms=150)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, SLOW)
        await eventually(lambda: at_least(harness.succeeded(), 4))
        progress = await operations.control(harness.client, PERIOD, "pause", ALICE)
        paused_at = await db_now(harness)
        assert (progress.state, progress.operator, progress.reason) == (
            "paused",
            "alice",
            "amounts look wrong",
        )
        # Charges past the gate when it paused reach Stripe; then, for a while, none.
        await eventually(partial(harness.started_charges_sent, PERIOD))
        settled = await harness.money_requests()
        await asyncio.sleep(2.0)
        assert await harness.money_requests() == settled, "Stripe was called while paused"
        assert (await period_status(harness.client, PERIOD)).state == "paused"
        assert settled < 40
        # Starting it again joins the paused run, and says so rather than "running".
        code, out, stderr = await harness.starter("run", str(PERIOD))
        assert code == 0 and out.startswith(f"period {PERIOD} paused as"), out
        assert f"the run of {PERIOD} is paused by alice (amounts look wrong)" in stderr
        resumed_at = await db_now(harness)
        await operations.control(
            harness.client, PERIOD, "resume", OperatorRequest(reason="checked", operator="bob")
        )
        summary = await handle.result()
    assert summary.charged == 40
    # Paused and resumed, not cancelled: the summary names no cancel.
    assert (summary.cancelled_by, summary.cancel_reason) == (None, None)
    # While paused, no charge passed the ledger's gate.
    for row in await harness.ledger_rows(str(PERIOD)):
        assert not paused_at < row["charge_started_at"] < resumed_at
    await assert_billed_once(harness, str(PERIOD), customers)
    # A child that waited at the paused gate until the resume's signal woke it.
    for customer in customers:
        history = await harness.client.get_workflow_handle(
            customer_workflow_id(PERIOD, customer.customer_id)
        ).fetch_history()
        if any(
            e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED for e in history.events
        ):
            await replay([history])
            keep([history])
            break
    else:
        raise AssertionError("no child waited at the paused gate")


async def test_cancel_charges_nothing_more_and_cancels_the_rest(harness: Harness) -> None:
    customers = await harness.seed(30)
    await harness.set_faults(latency_ms=150)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, SLOW)
        await eventually(lambda: at_least(harness.succeeded(), 3))
        await operations.control(harness.client, PERIOD, "cancel", ALICE)
        cancelled_at = await db_now(harness)
        summary = await handle.result()
        with pytest.raises(operations.NotRunningError):
            await operations.control(harness.client, PERIOD, "resume", ALICE)
    charged = await harness.succeeded()
    assert summary.charged == charged < 30
    assert summary.charged + summary.cancelled == 30
    assert (summary.cancelled_by, summary.cancel_reason) == ("alice", "amounts look wrong")
    rows = await harness.ledger_rows(str(PERIOD))
    assert {r["status"] for r in rows} == {"charged", "cancelled"}
    # Nothing passed the gate to Stripe after the cancel; only keys that had were sent.
    started = {r["idempotency_key"] for r in rows if r["charge_started_at"] is not None}
    assert all(r["charge_started_at"] < cancelled_at for r in rows if r["charge_started_at"])
    assert {
        r["idempotency_key"]
        for r in await harness.requests()
        if r["method"] == "POST" and r["path"] == "/v1/payment_intents"
    } == started
    for row in rows:
        if row["status"] == "cancelled":
            assert (row["reason"], row["decided_by"], row["charge_started_at"]) == (
                "amounts look wrong",
                "alice",
                None,
            )
    # A new run bills the customers the cancelled one never started, and nobody twice. Those
    # whose child the cancel stopped at the gate keep it: REJECT_DUPLICATE holds their ID.
    stopped = frozenset(
        r["customer_id"]
        for r in rows
        if r["status"] == "cancelled" and not r["cancelled_before_start"]
    )
    async with harness.running_worker():
        rerun = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert (rerun.charged, rerun.already_billed, rerun.cancelled) == (
        30 - charged - len(stopped),
        charged,
        len(stopped),
    )
    await assert_billed_once(harness, str(PERIOD), customers, cancelled=stopped)


@pytest.mark.parametrize("single_batch", [False, True], ids=["sdk-default", "sdk-flag-2"])
async def test_temporals_own_cancel_is_an_operators_cancel(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, single_batch: bool
) -> None:
    """The Web UI's Cancel (a Temporal cancellation request) cancels as `starter.py cancel`
    does: the customers not yet charged end cancelled, the ledger has the summary, and the
    schedule's next launch leaves the period alone. Also under the activation rule the SDK
    means to make its default (logic flag 2), which raises the cancel in every waiting task."""
    if single_batch:
        single_batch_activations(monkeypatch)
    customers = await harness.seed(30)
    await harness.set_faults(latency_ms=150)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, SLOW)
        await eventually(lambda: at_least(harness.succeeded(), 3))
        await handle.cancel()
        summary = await handle.result()
        completed = PeriodActivities(harness.pool, harness.settings).completed
        assert await ActivityEnvironment(client=harness.client).run(completed, str(PERIOD))
    assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED
    assert (summary.cancelled_by, summary.charged + summary.cancelled) == ("temporal", 30)
    assert summary.cancelled > 0
    rows = await harness.ledger_rows(str(PERIOD))
    assert {r["status"] for r in rows} == {"charged", "cancelled"}
    stopped = frozenset(r["customer_id"] for r in rows if r["status"] == "cancelled")
    assert all(r["decided_by"] == "temporal" for r in rows if r["status"] == "cancelled")
    await assert_billed_once(harness, str(PERIOD), customers, cancelled=stopped)
    await replays(handle)


async def test_a_run_whose_workflow_task_fails_is_said_to_be_open_not_gone(
    harness: Harness,
) -> None:
    """A run whose workflow task is failing (a worker hung, crashed or failing on it) takes
    no update: a pause is told that the run is open and that it may not land, not that no
    run is running."""
    await harness.seed(3)
    failing = FailWorkflowTasks("BillingPeriodWorkflow")
    async with harness.running_worker(interceptors=[failing]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await _reached(handle, EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED)
        with pytest.raises(NoWorkerError, match=f"the run of {PERIOD} is open, but could not"):
            await operations.control(harness.client, PERIOD, "pause", ALICE)
    await handle.terminate("checked")
    with pytest.raises(
        operations.NotRunningError,
        match=f"no run of {PERIOD} is running to pause: its last run ended terminated",
    ):
        await operations.control(harness.client, PERIOD, "pause", ALICE)
    assert await harness.money_requests() == 0


async def replays(handle: WorkflowHandle[Any, PeriodSummary]) -> None:
    """The run's history replays with the current code (RECORD_HISTORIES=1 keeps it in
    tests/histories)."""
    history = await handle.fetch_history()
    await replay([history])
    keep([history])


async def cancelled_once_charging(
    harness: Harness, max_in_flight: int
) -> WorkflowHandle[Any, PeriodSummary]:
    """A run cancelled by Alice once its first charge is at Stripe; the worker must run."""
    handle = await start_period(
        harness.client, PERIOD, harness.task_queue, RunOptions(max_in_flight=max_in_flight)
    )
    await eventually(lambda: at_least(harness.money_requests(), 1))
    await operations.control(harness.client, PERIOD, "cancel", ALICE)
    return handle


async def test_a_rerun_bills_those_the_cancel_never_started_as_they_are_now(
    harness: Harness,
) -> None:
    customers = {c.customer_id: c for c in await harness.seed(12)}
    await harness.set_faults(latency_ms=300)
    async with harness.running_worker():
        await (await cancelled_once_charging(harness, max_in_flight=2)).result()
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    gone, repriced = sorted(c for c, r in rows.items() if r["cancelled_before_start"])[-2:]
    # Between the runs one customer leaves and another's price changes.
    async with harness.pool.acquire() as conn:
        await conn.execute("UPDATE customers SET active = false WHERE customer_id = $1", gone)
        new_amount = await conn.fetchval(
            "UPDATE customers SET amount_cents = amount_cents + 5000 WHERE customer_id = $1"
            " RETURNING amount_cents",
            repriced,
        )
    await harness.set_faults(latency_ms=0)
    async with harness.running_worker():
        rerun = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert rerun.due == 11
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    assert (rows[gone]["status"], rows[gone]["cancelled_before_start"]) == ("cancelled", True)
    assert (rows[repriced]["status"], rows[repriced]["amount_cents"]) == ("charged", new_amount)
    # Each once over both runs, the repriced one at its new price; the cancelled, never.
    now = customers | {
        repriced: customers[repriced].model_copy(update={"amount_cents": new_amount})
    }
    cancelled = frozenset(c for c, r in rows.items() if r["status"] == "cancelled")
    assert gone in cancelled
    await assert_billed_once(harness, str(PERIOD), now.values(), cancelled=cancelled)


async def _claim_as_another_run(harness: Harness, customer_id: str, *, send: bool) -> Claim:
    """What a child of a terminated run, left running, did: claim, and maybe send."""
    namespace = harness.settings.billing_key_namespace
    await harness.open_period_by_hand(PERIOD)
    async with harness.pool.acquire() as conn:
        claim = await ledger.claim(
            conn,
            customer_id,
            str(PERIOD),
            idempotency_key(namespace, customer_id, PERIOD),
            "run-of-a-terminated-period",
            charge_api="payment_intents",
        )
        if send:
            assert (await ledger.begin_charge(conn, claim, None)).gate == "go"
    return claim


class HoldListingAndControl(Interceptor):
    """Holds the period's second page of due customers (a local activity), as a slow
    database would, until the run's control is being written: the operator's update has then
    reached the run while the page was listed. Each write of the control is held `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.listing = asyncio.Event()
        self.control_written = asyncio.Event()
        self.held_page: list[str] = []

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        hold = self

        class Held(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                name = activity.info().activity_type
                if name == "set_control":
                    hold.control_written.set()
                    await asyncio.sleep(hold.seconds)
                if name != "due_customers" or input.args[0].after is None or hold.listing.is_set():
                    return await super().execute_activity(input)
                hold.listing.set()
                await asyncio.wait_for(hold.control_written.wait(), 30)
                page = await super().execute_activity(input)
                hold.held_page = [c.customer_id for c in page.customers]
                return page

        return Held(next)


@asynccontextmanager
async def _listing_held(
    harness: Harness,
) -> AsyncIterator[tuple[WorkflowHandle[Any, PeriodSummary], HoldListingAndControl]]:
    """A run whose second page, held by HoldListingAndControl, outlasts a workflow task:
    the local activity's heartbeat at four fifths of it ends the task, and the next one
    delivers an operator's update while the page is still listed. Entered once it is
    listed."""
    hold = HoldListingAndControl(seconds=3.0)
    async with harness.running_worker(interceptors=[hold]):
        handle = await harness.client.start_workflow(
            BillingPeriodWorkflow.run,
            BillingPeriodInput(
                period=str(PERIOD), options=RunOptions(max_in_flight=2, page_size=4)
            ),
            id=period_workflow_id(PERIOD),
            task_queue=harness.task_queue,
            task_timeout=timedelta(seconds=2),
            search_attributes=TypedSearchAttributes(
                [SearchAttributePair(search_attributes.BILLING_PERIOD, str(PERIOD))]
            ),
        )
        await hold.listing.wait()
        yield handle, hold


async def test_a_batch_listed_while_the_run_is_cancelled_is_not_started(
    harness: Harness,
) -> None:
    # The cancel's write to the ledger is slow too: started, the page's first child would
    # pass the ledger's gate, still "running", and charge.
    customers = await harness.seed(12)
    async with _listing_held(harness) as (handle, hold):
        await operations.control(harness.client, PERIOD, "cancel", ALICE)
        summary = await asyncio.wait_for(handle.result(), 60)
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    assert len(hold.held_page) == 4
    assert [rows[c]["status"] for c in hold.held_page] == ["cancelled"] * 4
    assert all(rows[c]["cancelled_before_start"] for c in hold.held_page)
    assert (summary.due, summary.charged + summary.cancelled) == (12, 12)
    await replays(handle)
    cancelled = frozenset(c for c, r in rows.items() if r["status"] == "cancelled")
    await assert_billed_once(harness, str(PERIOD), customers, cancelled=cancelled)


async def test_a_batch_listed_while_the_run_is_paused_waits_for_the_resume(
    harness: Harness,
) -> None:
    customers = await harness.seed(12)
    async with _listing_held(harness) as (handle, hold):
        await operations.control(harness.client, PERIOD, "pause", ALICE)
        resumed_at = await db_now(harness)
        await operations.control(harness.client, PERIOD, "resume", ALICE)
        summary = await asyncio.wait_for(handle.result(), 60)
    started = [
        r["charge_started_at"]
        for r in await harness.ledger_rows(str(PERIOD))
        if r["customer_id"] in hold.held_page
    ]
    assert len(started) == 4
    assert all(at > resumed_at for at in started)
    assert (summary.due, summary.charged) == (12, 12)
    await replays(handle)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_cancel_waits_for_charges_another_runs_children_sent(harness: Harness) -> None:
    first, claimed, sent = (c.customer_id for c in await harness.seed(3))
    await _claim_as_another_run(harness, claimed, send=False)
    in_doubt = await _claim_as_another_run(harness, sent, send=True)
    await harness.set_faults(latency_ms=2000)
    async with harness.running_worker():
        handle = await cancelled_once_charging(harness, max_in_flight=1)
        # The cancel cannot stop a charge already at Stripe: the run waits for its outcome.
        await asyncio.sleep(4)
        assert (await period_status(harness.client, PERIOD)).state == "cancelling"
        async with harness.pool.acquire() as conn:
            await ledger.record_charge(
                conn,
                in_doubt.idempotency_key,
                ChargeResult(
                    charge_id="ch_late", payment_intent_id="pi_late", amount_cents=1, currency="usd"
                ),
            )
        summary = await handle.result()
    await replays(handle)
    assert await _cancel_written_before_customers_cancelled(handle)
    assert (summary.due, summary.charged, summary.cancelled) == (3, 2, 1)
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    assert (rows[first]["status"], rows[sent]["status"]) == ("charged", "charged")
    # The claimed one keeps its child's ID: it stays cancelled, not reopened by a rerun.
    assert (rows[claimed]["status"], rows[claimed]["cancelled_before_start"]) == (
        "cancelled",
        False,
    )


async def _cancel_written_before_customers_cancelled(
    handle: WorkflowHandle[Any, PeriodSummary],
) -> bool:
    """Whether the run marked customers cancelled only once the ledger had the cancel: a
    child of an earlier run claiming one meanwhile would otherwise pass the gate."""
    scheduled: dict[int, str] = {}
    written = None
    async for event in handle.fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes"):
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            scheduled[event.event_id] = name
            if name == "cancel_unstarted":
                return written is not None
        elif event.HasField("activity_task_completed_event_attributes"):
            started = event.activity_task_completed_event_attributes.scheduled_event_id
            if scheduled.get(started) == "set_control":
                written = event.event_id
    return False


async def test_a_cancel_of_a_run_ended_before_its_close_closes_it_with_the_ledgers_counts(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cancel` of a run gone from Temporal with its period open (operations.cancel_ended_run)
    marks every customer it had not started cancelled, page after page, under the customer's
    one key (I3), closes the period with what the ledger holds, and names the claims whose
    charge was sent as left to reconciliation; a second cancel finds nothing to close."""
    monkeypatch.setattr(operations, "_CANCEL_PAGE", 2)
    charged, sent, claimed, *never = (c.customer_id for c in await harness.seed(6))
    # Opened with no workflow: its run is gone from Temporal, the period never closed.
    bill = await _claim_as_another_run(harness, charged, send=True)
    await _claim_as_another_run(harness, sent, send=True)
    await _claim_as_another_run(harness, claimed, send=False)
    namespace = harness.settings.billing_key_namespace
    async with harness.pool.acquire() as conn:
        result = ChargeResult(
            charge_id="ch_1", payment_intent_id="pi_1", amount_cents=1, currency=bill.currency
        )
        assert await ledger.record_charge(conn, bill.idempotency_key, result)
        cancel = await operations.cancel_ended_run(harness.client, conn, namespace, PERIOD, ALICE)
        assert cancel is not None
        record = await ledger.period_record(conn, str(PERIOD))
        again = await operations.cancel_ended_run(harness.client, conn, namespace, PERIOD, ALICE)
    summary = cancel.summary
    assert (summary.due, summary.charged, summary.failed, summary.cancelled) == (6, 1, 0, 4)
    assert summary.charged_by_currency == {bill.currency: bill.amount_cents}
    assert summary.total_charged_cents == bill.amount_cents
    assert (summary.cancelled_by, summary.cancel_reason) == (ALICE.operator, ALICE.reason)
    assert cancel.in_doubt == 1
    assert record is not None and record.summary == summary
    assert again is None
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    assert {c: r["status"] for c, r in rows.items()} == {
        charged: "charged",
        sent: "claimed",
        **dict.fromkeys([claimed, *never], "cancelled"),
    }
    for customer_id in [claimed, *never]:
        row = rows[customer_id]
        assert (row["reason"], row["decided_by"]) == (ALICE.reason, ALICE.operator)
        assert row["idempotency_key"] == idempotency_key(namespace, customer_id, PERIOD)
    assert await harness.period_control(PERIOD) == ("cancelled", ALICE.reason, ALICE.operator)


async def test_a_runs_opening_as_an_ended_run_is_cancelled_lands_after_the_cancel(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new run opening the period just as `cancel` finds its last run ended waits for the
    cancel: it then opens the period afresh, rather than have the cancel close the new run
    and mark its customers cancelled."""
    await harness.seed(2)
    await harness.open_period_by_hand(PERIOD)
    ended_open = run_states.ended_open

    async def then_a_run_opens(*args: Any) -> Any:
        ended = await ended_open(*args)
        opening = asyncio.create_task(ledger.open_period(other, str(PERIOD), "wf-new"))
        await eventually(lambda: waits_on_a_lock(harness.pool, other, opening), timeout=30)
        openings.append(opening)
        return ended

    openings: list[asyncio.Task[Any]] = []
    monkeypatch.setattr(run_states, "ended_open", then_a_run_opens)
    namespace = harness.settings.billing_key_namespace
    async with harness.pool.acquire() as conn, harness.pool.acquire() as other:
        assert await operations.cancel_ended_run(harness.client, conn, namespace, PERIOD, ALICE)
        await openings[0]
        record = await ledger.period_record(conn, str(PERIOD))
    assert record is not None
    assert (record.workflow_id, record.state, record.summary) == ("wf-new", "running", None)


async def test_a_word_a_worker_took_up_is_awaited_past_the_time_to_take_it_up(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ACCEPT_TIMEOUT bounds only the wait for a worker to take the word up: a pause whose
    ledger write is slow is awaited to its end, not called one no worker took up."""
    monkeypatch.setattr(operations, "ACCEPT_TIMEOUT", timedelta(seconds=1))
    await harness.seed(3)
    hold = BillHold()
    slow_write = HoldListingAndControl(seconds=3)
    async with harness.running_worker(interceptors=[hold, slow_write]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await asyncio.wait_for(hold.reached.wait(), 30)
        progress = await operations.control(harness.client, PERIOD, "pause", ALICE)
        assert (progress.state, progress.operator) == ("paused", ALICE.operator)
        hold.go.set()
        await operations.control(harness.client, PERIOD, "resume", ALICE)
        assert (await handle.result()).charged == 3


async def test_a_blocked_report_with_a_long_message_pauses_the_run_with_it_cut(
    harness: Harness,
) -> None:
    """A vault's or Stripe's message past what a reason holds (or anyone's who can signal the
    run) failed the period's workflow task on every attempt (helper-118's F4)."""
    await harness.seed(3)
    await harness.set_faults(latency_ms=2000)
    async with harness.running_worker():
        handle = await start_period(
            harness.client, PERIOD, harness.task_queue, RunOptions(max_in_flight=1)
        )
        await eventually(lambda: at_least(harness.money_requests(), 1))
        await handle.signal(
            PERIOD_BLOCKED, ChargeFailure(code="permission_denied", message="m" * 600)
        )

        async def paused() -> bool:
            return (await handle.query(BillingPeriodWorkflow.progress)).state == "paused"

        await eventually(paused)
        progress = await handle.query(BillingPeriodWorkflow.progress)
        await operations.control(harness.client, PERIOD, "cancel", ALICE)
        await handle.result()
    assert progress.reason is not None and progress.reason.endswith(" (cut)")
    assert progress.reason.startswith("permission_denied: mmm") and len(progress.reason) <= 500
    history = await handle.fetch_history()
    assert not [
        e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
    ]


async def test_a_stripe_base_stripe_does_not_know_pauses_the_run_for_an_operator(
    harness: Harness,
) -> None:
    """A STRIPE_API_BASE written as Stripe's reference writes the API's (`.../v1`) sent every
    charge to /v1/v1/..., and Stripe's 404 for it was recorded as each customer's failure,
    for good: no run billed them again (helper-188). The settings refuse that base now; a
    URL Stripe does not know, however it comes about, pauses the run instead, and a worker
    set right bills everyone once the operator resumes."""
    customers = await harness.seed(5)
    base = harness.emulator_url + "/v1"
    settings = harness.settings.model_copy(update={"stripe_api_base": base})
    secret = settings.stripe_api_key.get_secret_value()
    misrouted = dataclasses.replace(
        harness, settings=settings, stripe=stripe_client(secret, base, harness.http)
    )
    async with misrouted.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await eventually(partial(harness.in_state, PERIOD, "paused"))
        progress = await period_status(harness.client, PERIOD)
    assert progress.reason is not None and progress.operator == "billing (automatic)"
    assert progress.reason.startswith("unrecognized_request_url: Stripe does not know the URL")
    assert "STRIPE_API_BASE" in progress.reason and progress.failed == 0
    assert await harness.charges() == []
    async with harness.running_worker():
        await operations.control(harness.client, PERIOD, "resume", ALICE)
        summary = await handle.result()
    assert (summary.charged, summary.failed) == (len(customers), 0)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_blocked_charge_reported_after_the_last_outcome_pauses_nothing(
    harness: Harness,
) -> None:
    await harness.seed(2)
    [idle] = await harness.seed(1, prefix="idle")
    async with harness.pool.acquire() as conn:
        await conn.execute(
            "UPDATE customers SET active = false WHERE customer_id = $1", idle.customer_id
        )
    skip = SkipRequest(customer_id=idle.customer_id, reason="left", operator="carol")
    await harness.set_faults(latency_ms=1500)
    async with harness.running_worker(), harness.pool.acquire() as conn, conn.transaction():
        # Holding the customer's row keeps the skip's insert waiting: the run, all of its
        # customers done, waits for that update before it closes.
        await conn.execute(
            "SELECT 1 FROM customers WHERE customer_id = $1 FOR UPDATE", idle.customer_id
        )
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await eventually(lambda: at_least(harness.money_requests(), 2))
        skipping = asyncio.create_task(
            operations.skip(harness.client, harness.settings, harness.database_url, PERIOD, skip)
        )
        await eventually(lambda: harness.in_state(PERIOD, "closing"))
        # A child's report of a refused key, arriving now, has nothing left to pause: not in
        # the run (a query sees the signal handled) nor in the ledger, while the run is open
        # (closing it lifts a pause anyway).
        await handle.signal(PERIOD_BLOCKED, ChargeFailure(code="spend_cap_exceeded", message="x"))
        progress = await handle.query(BillingPeriodWorkflow.progress)
        assert (progress.state, progress.reason) == ("closing", None), progress
        await asyncio.sleep(1)
        control, _, _ = await harness.period_control(PERIOD)
        assert control == "running"
        await conn.execute("ROLLBACK; BEGIN")
        await skipping
        summary = await handle.result()
    await replays(handle)
    assert summary.charged == 2


async def test_run_refuses_to_join_a_cancelled_run_still_finishing(harness: Harness) -> None:
    await harness.seed(6)
    # The sent charges are held until the CLI has answered, however long it takes to start.
    hold = BillHold()
    async with harness.running_worker(interceptors=[hold]):
        handle = await start_period(
            harness.client, PERIOD, harness.task_queue, RunOptions(max_in_flight=2)
        )
        await eventually(lambda: at_least(harness.money_requests(), 2))
        await operations.control(harness.client, PERIOD, "cancel", ALICE)
        code, out, err = await harness.starter("run", str(PERIOD), "--wait")
        assert (code, out) == (2, ""), err
        assert "was cancelled by alice and is still finishing" in err
        hold.go.set()
        await handle.result()
        # Once it has ended, a run starts afresh and bills the rest.
        code, out, err = await harness.starter("run", str(PERIOD), "--wait")
    assert code == 0, err
    assert await harness.succeeded() == 6


async def test_run_joining_a_cancelled_run_as_it_ends_says_nothing_was_started(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run` joins the cancelled run still finishing, which ends before `run` reads its
    status: it said "running" (and, waiting, printed that run's summary as its own)."""
    await harness.seed(6)
    # The sent charges are held until the join, however long it takes on a loaded machine.
    hold = BillHold()
    harness.use_cli_env(monkeypatch)
    async with harness.running_worker(interceptors=[hold]):
        handle = await start_period(
            harness.client, PERIOD, harness.task_queue, RunOptions(max_in_flight=2)
        )
        await eventually(lambda: at_least(harness.money_requests(), 2))
        await operations.control(harness.client, PERIOD, "cancel", ALICE)

        async def status_once_ended(client: Client, period: Period) -> PeriodProgress:
            hold.go.set()
            await handle.result()  # the joined run ends between the join and the status
            return await period_status(client, period)

        monkeypatch.setattr(runs, "period_status", status_once_ended)
        with pytest.raises(
            BillingError, match="cancelled by alice and ended as this command joined it"
        ):
            await runs.cmd_run(commands.parser().parse_args(["run", str(PERIOD)]))
    assert await harness.succeeded() == 2


async def test_resume_is_refused_on_a_cancelled_run(harness: Harness) -> None:
    await harness.seed(12)
    # Slow answers keep the cancelled run open (it waits for the charges already sent).
    await harness.set_faults(latency_ms=3000)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, SLOW)
        await eventually(lambda: at_least(harness.money_requests(), 1))
        await operations.control(harness.client, PERIOD, "pause", ALICE)
        await operations.control(harness.client, PERIOD, "cancel", ALICE)
        with pytest.raises(operations.OperatorRefusedError, match="cancelled by alice"):
            await operations.control(harness.client, PERIOD, "resume", ALICE)
        await handle.result()
    with pytest.raises(operations.NotRunningError, match="its last run was cancelled by alice"):
        await operations.control(harness.client, PERIOD, "resume", ALICE)


async def test_a_cancel_of_a_period_billed_in_full_names_no_cancel(harness: Harness) -> None:
    """The ledger's summary of a run that completed has no canceller: `cancel` says that
    nothing runs, not that someone cancelled a period its customers have paid."""
    await harness.seed(1)
    async with harness.running_worker():
        await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    code, out, err = await harness.starter(
        "cancel", str(PERIOD), "--reason", "wrong prices", "--operator", "alice"
    )
    assert (code, out) == (2, ""), err
    assert f"no run of {PERIOD} is running to cancel" in err and "cancelled by" not in err, err


async def test_skip_before_and_during_a_run(harness: Harness) -> None:
    customers = await harness.seed(10)
    first, second = customers[0], customers[1]
    skip = SkipRequest(customer_id=first.customer_id, reason="disputed", operator="carol")
    # No run yet: the skip is kept in the ledger for the run.
    result = await operations.skip(
        harness.client, harness.settings, harness.database_url, PERIOD, skip
    )
    assert (result.skipped, result.detail) == (True, "skip recorded")
    # One deactivated since is skipped too, and said so: it was counted due and skipped
    # without a word (helper-187).
    gone = customers[9]
    await harness.pool.execute(
        "UPDATE customers SET active = false WHERE customer_id = $1", gone.customer_id
    )
    inactive = await operations.skip(
        harness.client,
        harness.settings,
        harness.database_url,
        PERIOD,
        skip.model_copy(update={"customer_id": gone.customer_id}),
    )
    assert inactive.skipped and inactive.detail.startswith(
        "skip recorded, for a customer deactivated since: no run lists it, but the period's"
        " runs count it as due and skipped"
    )
    async with harness.running_worker():
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert (summary.due, summary.charged, summary.skipped) == (10, 8, 2)
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    assert (rows[first.customer_id]["status"], rows[first.customer_id]["reason"]) == (
        "skipped",
        "disputed",
    )
    # Recorded with no run, under the customer's one key all the same (I3).
    assert rows[first.customer_id]["idempotency_key"] == idempotency_key(
        harness.settings.billing_key_namespace, first.customer_id, PERIOD
    )
    late = SkipRequest(customer_id=second.customer_id, reason="too late", operator="carol")
    refused = await operations.skip(
        harness.client, harness.settings, harness.database_url, PERIOD, late
    )
    assert not refused.skipped and "charged" in refused.detail
    # Through the CLI, refused as other refusals are: on stderr, exit 2.
    code, out, err = await harness.starter(
        "skip", str(PERIOD), second.customer_id, "--reason", "too late", "--operator", "carol"
    )
    assert (code, out) == (2, ""), out
    assert err.startswith(f"error: {second.customer_id} in {PERIOD}: cannot skip"), err
    # One that stands is said on stdout, exit 0: not as an error, as a refusal is.
    code, out, err = await harness.starter(
        "skip", str(PERIOD), first.customer_id, "--reason", "disputed", "--operator", "carol"
    )
    assert (code, out, err) == (0, f"{first.customer_id} in {PERIOD}: already skipped\n", "")
    assert not [c for c in await harness.charges() if c["customer"] == first.stripe_customer_id]


async def test_a_skip_for_a_far_month_the_ledger_has_a_run_of_needs_no_flag(
    harness: Harness,
) -> None:
    """--ahead and --late guard a skip for a month with no run, most likely mistyped; a
    month the ledger has a run of is meant, however far back."""
    [customer] = await harness.seed(1)
    far = Period(PERIOD.year - 2, PERIOD.month)
    await harness.open_period_by_hand(far)
    skip = SkipRequest(customer_id=customer.customer_id, reason="disputed", operator="carol")
    result = await operations.skip(
        harness.client, harness.settings, harness.database_url, far, skip
    )
    assert result.skipped, result.detail


async def test_a_control_is_recorded_with_the_operators_reason_and_name(harness: Harness) -> None:
    """The ledger keeps why a run was paused or cancelled and by whom: a cancelled customer's
    row takes its reason and decider from there (ledger.claims), for an auditor to read."""
    await harness.open_period_by_hand(PERIOD)
    control = PeriodActivities(harness.pool, harness.settings).set_control
    await control(ControlRequest(period=str(PERIOD), control="paused", request=ALICE))
    assert await harness.period_control(PERIOD) == ("paused", ALICE.reason, ALICE.operator)


async def test_a_skip_during_a_run_writes_the_row_under_the_customers_stable_key(
    harness: Harness,
) -> None:
    """The row a skip writes holds the one idempotency key of the customer's period (I3):
    a charge held behind its key, and a reconciliation matching Stripe's charges to rows,
    find the row by it (another period's key would even collide with that period's row)."""
    [customer] = await harness.seed(1)
    await harness.open_period_by_hand(PERIOD)
    skip = SkipRequest(customer_id=customer.customer_id, reason="disputed", operator="carol")
    skipping = PeriodActivities(harness.pool, harness.settings).skip_customer
    assert (await skipping(SkipCustomerRequest(period=str(PERIOD), request=skip))).skipped
    [row] = await harness.ledger_rows(str(PERIOD))
    assert row["idempotency_key"] == idempotency_key(
        harness.settings.billing_key_namespace, customer.customer_id, PERIOD
    )


async def test_a_skip_after_a_cancelled_run_holds_for_the_next_run(harness: Harness) -> None:
    customers = await harness.seed(12)
    await harness.set_faults(latency_ms=300)
    last = customers[-1]
    skip = SkipRequest(customer_id=last.customer_id, reason="disputed", operator="carol")
    async with harness.running_worker():
        handle = await start_period(
            harness.client, PERIOD, harness.task_queue, RunOptions(max_in_flight=2)
        )
        await eventually(lambda: at_least(harness.succeeded(), 1))
        await operations.control(harness.client, PERIOD, "cancel", ALICE)
        assert (await handle.result()).cancelled > 0
        # The cancelled run never started the last customer; the next run would.
        result = await operations.skip(
            harness.client, harness.settings, harness.database_url, PERIOD, skip
        )
        assert result.skipped, result.detail
        await harness.set_faults(latency_ms=0)
        rerun = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert rerun.skipped == 1
    assert not [c for c in await harness.charges() if c["customer"] == last.stripe_customer_id]
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    assert (rows[last.customer_id]["status"], rows[last.customer_id]["reason"]) == (
        "skipped",
        "disputed",
    )


async def test_a_skip_of_a_customer_the_run_does_not_list_leaves_no_claim(
    harness: Harness,
) -> None:
    customers = await harness.seed(10)
    gone = customers[0]
    async with harness.pool.acquire() as conn:
        await conn.execute(
            "UPDATE customers SET active = false WHERE customer_id = $1", gone.customer_id
        )
    await harness.set_faults(latency_ms=200)
    skip = SkipRequest(customer_id=gone.customer_id, reason="disputed", operator="carol")
    async with harness.running_worker():
        handle = await start_period(
            harness.client, PERIOD, harness.task_queue, RunOptions(max_in_flight=2)
        )
        await eventually(lambda: at_least(harness.succeeded(), 2))
        result = await operations.skip(
            harness.client, harness.settings, harness.database_url, PERIOD, skip
        )
        summary = await handle.result()
    assert result.skipped and summary.charged == 9
    rows = await harness.ledger_rows(str(PERIOD))
    assert [r["customer_id"] for r in rows if r["status"] == "claimed"] == []


async def test_preview_matches_what_the_run_charges(harness: Harness) -> None:
    customers = await harness.seed(
        15, card_for=lambda i: "pm_card_chargeCustomerFail" if i == 4 else "pm_card_visa"
    )
    preview = await preview_period(harness.pool, str(PERIOD), 1.10)
    assert len(preview.to_charge) == 15 and not preview.already_billed
    assert preview.expected_total_cents == sum(c.amount_cents for c in customers)
    assert preview.cap_cents == -(-preview.expected_total_cents * 110 // 100)
    assert not await harness.money_requests(), "a preview must not call Stripe"
    async with harness.running_worker():
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert summary.charged + summary.failed == len(preview.to_charge)
    assert summary.total_charged_cents == preview.expected_total_cents - customers[3].amount_cents
    after = await preview_period(harness.pool, str(PERIOD), 1.10)
    assert (len(after.to_charge), len(after.already_billed), len(after.not_billable)) == (0, 14, 1)


async def test_preview_names_customers_a_run_would_charge_with_no_payment_method(
    harness: Harness,
) -> None:
    # Rows imported before the import required a payment method; one of them already claimed,
    # then imported again with one: its claim still names none.
    customers = await harness.seed(3)
    await harness.open_period_by_hand(PERIOD)
    async with harness.pool.acquire() as conn:
        await conn.execute(
            "UPDATE customers SET payment_method = NULL WHERE customer_id = ANY($1::text[])",
            [customers[0].customer_id, customers[1].customer_id],
        )
        await ledger.claim(
            conn,
            customers[1].customer_id,
            str(PERIOD),
            idempotency_key(
                harness.settings.billing_key_namespace, customers[1].customer_id, PERIOD
            ),
            charge_api=harness.settings.billing_charge_api,
        )
        await conn.execute(
            "UPDATE customers SET payment_method = 'pm_reimported' WHERE customer_id = $1",
            customers[1].customer_id,
        )
    preview = await preview_period(harness.pool, str(PERIOD), 1.10)
    missing = [customers[0].customer_id, customers[1].customer_id]
    assert [x.customer_id for x in preview.without_payment_method] == missing
    text = describe_preview(preview)
    assert "1 of them have no payment method" in text and customers[0].customer_id in text
    assert "1 of them were claimed with no payment method" in text


async def test_preview_warns_of_a_stripe_customer_charged_under_two_ids(harness: Harness) -> None:
    # Billed as cust-000001; a later export spells it CUST-000001: a new id, with its own key.
    first, other = await harness.seed(2)
    async with harness.running_worker():
        await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    respelt = first.customer_id.upper()
    await upsert_customers(harness.pool, [first.model_copy(update={"customer_id": respelt})])
    preview = await preview_period(harness.pool, str(PERIOD), 1.10)
    assert [x.customer_id for x in preview.to_charge] == [respelt]
    assert preview.sharing_a_stripe_customer == {
        first.stripe_customer_id: [respelt, first.customer_id]
    }
    text = describe_preview(preview)
    assert "1 Stripe customer would be charged more than once this period" in text
    assert f"{first.stripe_customer_id} ({respelt}, {first.customer_id})" in text
    assert other.stripe_customer_id not in text


async def test_a_preview_of_a_period_partly_billed_caps_what_is_left_at_the_multiplier_asked(
    harness: Harness,
) -> None:
    """A rerun's preview: its total and caps are for what the run has left to charge (an open
    claim included, a charge or a failure not), at the multiplier asked; a key with just the
    room left, or one this ledger's workers issued (a run replaces it), is no warning."""
    charged, failed, open_claim, unclaimed, euro = await harness.seed(5)
    euro = euro.model_copy(update={"currency": "eur"})
    await upsert_customers(harness.pool, [euro])
    await harness.open_period_by_hand(PERIOD)
    for row in (charged, failed, open_claim):
        await harness.claim_by_hand(PERIOD, row.customer_id)
    namespace = harness.settings.billing_key_namespace
    async with harness.pool.acquire() as conn:
        paid = ChargeResult(
            charge_id="ch_1",
            payment_intent_id="pi_1",
            amount_cents=charged.amount_cents,
            currency="usd",
        )
        await ledger.record_charge(
            conn, idempotency_key(namespace, charged.customer_id, PERIOD), paid
        )
        declined = ChargeFailure(code="card_declined", message="Your card was declined.")
        await ledger.record_unbilled(
            conn, idempotency_key(namespace, failed.customer_id, PERIOD), "failed", declined
        )
    left = {"usd": open_claim.amount_cents + unclaimed.amount_cents, "eur": euro.amount_cents}
    for currency, key_id, cap in (("usd", "vk_theirs", left["usd"]), ("eur", "vk_ours", 1)):
        await harness.pool.execute(
            "INSERT INTO period_vault_keys"
            " (billing_period, currency, vault_key_id, secret, cap_cents)"
            " VALUES ($1, $2, $3, $4, $5)",
            str(PERIOD),
            currency,
            key_id,
            f"{key_id}_secret",
            cap,
        )
    await harness.pool.execute(
        "INSERT INTO issued_vault_keys (vault_key_id, billing_period, currency)"
        " VALUES ('vk_ours', $1, 'eur')",
        str(PERIOD),
    )

    preview = await preview_period(harness.pool, str(PERIOD), 1.5)
    assert sorted(x.customer_id for x in preview.to_charge) == sorted(
        [open_claim.customer_id, unclaimed.customer_id, euro.customer_id]
    )
    assert [x.customer_id for x in preview.already_billed] == [charged.customer_id]
    assert [x.customer_id for x in preview.not_billable] == [failed.customer_id]
    assert (preview.totals_by_currency, preview.expected_total_cents) == (left, None)
    assert preview.caps_by_currency == {c: -(-total * 3 // 2) for c, total in left.items()}
    assert (preview.cap_cents, preview.cap_multiplier) == (None, 1.5)
    assert preview.issued_caps_by_currency == {"usd": left["usd"], "eur": 1}
    assert preview.short_keys == []


async def test_search_attributes_answer_what_the_web_ui_filters(harness: Harness) -> None:
    await harness.seed(
        6, card_for=lambda i: "pm_card_chargeCustomerFail" if i == 2 else "pm_card_visa"
    )
    async with harness.running_worker():
        await (await start_period(harness.client, PERIOD, harness.task_queue)).result()

    async def count_is(query: str, n: int) -> bool:
        # Visibility is eventually consistent: what the Web UI lists once it has caught up.
        return len([w async for w in harness.client.list_workflows(query)]) == n

    failed = f'BillingPeriod="{PERIOD}" AND BillingStatus="failed"'
    charged = f'BillingPeriod="{PERIOD}" AND BillingStatus="charged"'
    await eventually(lambda: count_is(failed, 1), timeout=60)
    await eventually(lambda: count_is(charged, 5), timeout=60)
    [declined] = [w async for w in harness.client.list_workflows(failed)]
    assert declined.id == f"billing-{PERIOD}-cust-000002"
    period_run = await harness.client.get_workflow_handle(period_workflow_id(PERIOD)).describe()
    assert await period_run.static_summary() == f"Billing period {PERIOD}"
    child = await harness.client.get_workflow_handle(declined.id).describe()
    assert await child.static_summary() == f"Charge customer cust-000002 for {PERIOD}"


async def test_a_run_no_worker_has_taken_up_is_listed_under_its_period(harness: Harness) -> None:
    """The Web UI's filter by period finds the run from its start: one no worker has taken up
    yet (none polls, or all are down) is the one an operator looks for."""
    handle = await start_period(harness.client, PERIOD, IDLE_QUEUE)
    query = f'BillingPeriod="{PERIOD}"'

    async def listed() -> bool:
        return [w.id async for w in harness.client.list_workflows(query)] == [handle.id]

    await eventually(listed, timeout=60)
    await handle.terminate("test over")


async def test_an_operator_starting_a_running_period_again_joins_its_run(
    harness: Harness,
) -> None:
    customers = await harness.seed(3)
    async with harness.running_worker():
        first = await start_period(harness.client, PERIOD, harness.task_queue)
        again = await start_period(harness.client, PERIOD, harness.task_queue)
        assert again.first_execution_run_id == first.first_execution_run_id
        summary = await again.result()
    assert (summary.due, summary.charged) == (3, 3)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_schedule_trigger_and_manual_run_bill_each_customer_once(harness: Harness) -> None:
    customers = await harness.seed(20)
    await harness.set_faults(latency_ms=50)
    period = period_for(datetime.now(UTC), "advance")
    config = schedules.MonthlySchedule(schedule_id="monthly-race", billing="advance", paused=True)
    async with harness.running_worker():
        await schedules.create_schedule(harness.client, config, harness.task_queue)
        schedule = harness.client.get_schedule_handle("monthly-race")
        manual, _ = await asyncio.gather(
            start_period(harness.client, period, harness.task_queue, SLOW), schedule.trigger()
        )
        await manual.result()

        async def launcher_done() -> bool:
            runs = [
                w
                async for w in harness.client.list_workflows(
                    'WorkflowType="ScheduledBillingWorkflow"'
                )
            ]
            return bool(runs) and all(r.close_time is not None for r in runs)

        await eventually(launcher_done, timeout=30)
        await schedule.delete()
    await assert_billed_once(harness, str(period), customers)


async def test_a_trigger_while_a_launch_is_open_is_not_dropped(harness: Harness) -> None:
    # A schedule's overlap policy `skip` (the default before `buffer_all`) drops a firing while
    # an earlier launch is open; an operator's trigger would be dropped too, with "triggered"
    # printed.
    customers = await harness.seed(3)
    # Fires at midnight on the 1st: the firing that bills this month is always past.
    config = schedules.MonthlySchedule(
        schedule_id="monthly-twice", billing="advance", hour=0, paused=True, overlap="skip"
    )
    await schedules.create_schedule(harness.client, config, harness.task_queue)
    query = 'WorkflowType="ScheduledBillingWorkflow" AND TemporalScheduledById="monthly-twice"'

    async def launches(count: int, status: str = "") -> bool:
        found = harness.client.list_workflows(query + status)
        return len([w async for w in found]) == count

    # No worker yet, so the first launch stays open, as one does behind a busy worker.
    for count in (1, 2):
        code, out, err = await harness.starter(
            "schedule", "trigger", "--id", "monthly-twice", "--while-paused"
        )
        billed = period_for(datetime.now(UTC), "advance")
        assert (code, out) == (0, f"triggered schedule monthly-twice: it bills {billed}\n"), err
        await eventually(partial(launches, count), timeout=30)
        # Temporal names a launch by its second: a trigger within the same one would join it.
        await asyncio.sleep(1)
    async with harness.running_worker():
        await eventually(lambda: launches(2, ' AND ExecutionStatus="Completed"'), timeout=30)
        summary = await harness.client.get_workflow_handle(
            period_workflow_id(PERIOD), result_type=PeriodSummary
        ).result()
    await harness.client.get_schedule_handle("monthly-twice").delete()
    assert summary.charged == len(customers)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_scheduled_launch_returns_once_its_period_has_started(harness: Harness) -> None:
    """A schedule skips a firing while its last launch is still open (overlap `skip`, or holds
    it back, `buffer_all`), so a launch that waited for its period would let a period paused
    for weeks drop (or hold back) the next month. I6 for ScheduledBillingWorkflow too:
    RECORD_HISTORIES=1 keeps its history."""
    customers = await harness.seed(6)
    await harness.set_faults(latency_ms=500)
    period = period_for(datetime.now(UTC), "advance")
    config = schedules.MonthlySchedule(schedule_id="monthly-launch", billing="advance", paused=True)
    async with harness.running_worker():
        await schedules.create_schedule(
            harness.client, config, harness.task_queue, RunOptions(max_in_flight=1)
        )
        schedule = harness.client.get_schedule_handle(config.schedule_id)
        await schedule.trigger()

        async def launched() -> list[WorkflowExecution]:
            query = 'WorkflowType="ScheduledBillingWorkflow" AND ExecutionStatus="Completed"'
            return [w async for w in harness.client.list_workflows(query)]

        await eventually(lambda: _nonempty(launched()), timeout=30)
        [launcher] = await launched()
        history = await harness.client.get_workflow_handle(
            launcher.id, run_id=launcher.run_id
        ).fetch_history()
        await replay([history])
        keep([history])
        run = harness.client.get_workflow_handle(
            period_workflow_id(period), result_type=PeriodSummary
        )
        summary = await run.result()
        await schedule.delete()
    # The run bills with the schedule's options (one charge at a time), not the defaults.
    opened = (await run.fetch_history()).events[0].workflow_execution_started_event_attributes
    [given] = await harness.client.data_converter.decode(
        opened.input.payloads, [BillingPeriodInput]
    )
    assert isinstance(given, BillingPeriodInput), given
    assert (given.options.max_in_flight, given.options.billing) == (1, "advance"), given
    # The launch closed once its period had started and while it still ran (six charges of
    # half a second, one at a time), by Temporal's times: the run's state, read once the test
    # got round to it, may be past its end on a loaded machine.
    described = await run.describe()
    assert launcher.close_time is not None and described.close_time is not None
    assert described.start_time < launcher.close_time < described.close_time
    assert summary.charged == len(customers)
    await assert_billed_once(harness, str(period), customers)


async def _nonempty(found: Awaitable[list[Any]]) -> bool:
    return bool(await found)


async def _completed(harness: Harness, period: Period) -> bool:
    """Whether the period's run has completed, by Temporal's status rather than the run's
    query: a query sent as the run closes is answered by replaying its whole history, which
    these tests of launches have no need of."""
    handle = harness.client.get_workflow_handle(period_workflow_id(period))
    return await workflow_status(handle) == WorkflowExecutionStatus.COMPLETED


async def backfill(
    harness: Harness, schedule_id: str, first: Period, last: Period, *, late: bool = False
) -> list[datetime]:
    """The times a backfill launched (the schedule paused, so that only the backfill bills)."""
    async with harness.pool.acquire() as conn:
        done = await schedules.backfill(
            harness.client, conn, schedule_id, first, last, late=late, while_paused=True
        )
    return done.launches


async def test_backfill_of_three_months_runs_three_periods(harness: Harness) -> None:
    customers = await harness.seed(5)
    config = schedules.MonthlySchedule(schedule_id="monthly-backfill", paused=True)
    async with harness.running_worker():
        await schedules.create_schedule(harness.client, config, harness.task_queue)
        with pytest.raises(InvalidInputError, match="2026-01 is more than 3 months before"):
            await backfill(harness, "monthly-backfill", Period(2026, 1), Period(2026, 3))
        launches = await backfill(
            harness, "monthly-backfill", Period(2026, 1), Period(2026, 3), late=True
        )
        assert [t.isoformat() for t in launches] == [
            f"2026-{month:02d}-01T02:00:00+00:00" for month in (2, 3, 4)
        ]
        for month in (1, 2, 3):
            period = Period(2026, month)

            await eventually(partial(_completed, harness, period), timeout=60)
    for month in (1, 2, 3):
        await assert_billed_once(harness, str(Period(2026, month)), customers)
    assert await period_status(harness.client, Period(2026, 4)) is not None
    assert (await period_status(harness.client, Period(2026, 4))).state == "not_started"


async def test_a_backfill_over_a_billed_period_starts_nothing_in_it(harness: Harness) -> None:
    """A completed period is not started again by a launch (a backfill, a time the clocks
    repeat): it would charge the customers added since, or undo an operator's cancel."""
    customers = await harness.seed(3)
    august, september, october = Period(2026, 8), Period(2026, 9), Period(2026, 10)
    config = schedules.MonthlySchedule(schedule_id="monthly-again", paused=True)
    # August was billed so long ago that Temporal no longer holds its run; the ledger does.
    await _billed_in_the_ledger_only(harness, august, charged=0)

    async def launched(count: int) -> bool:
        query = 'WorkflowType="ScheduledBillingWorkflow" AND ExecutionStatus="Completed"'
        return len([w async for w in harness.client.list_workflows(query)]) == count

    async with harness.running_worker():
        await schedules.create_schedule(harness.client, config, harness.task_queue)
        await backfill(harness, config.schedule_id, september, september, late=True)
        await eventually(partial(_completed, harness, september), timeout=60)
        billed = await harness.client.get_workflow_handle(period_workflow_id(september)).describe()
        # A customer signs up in November; the operator backfills September to October.
        (late,) = await harness.seed(1, prefix="late")
        async with harness.pool.acquire() as conn:
            done = await schedules.backfill(
                harness.client,
                conn,
                config.schedule_id,
                august,
                october,
                late=True,
                while_paused=True,
            )
        assert done.finished == {str(august): "completed", str(september): "completed"}
        await eventually(lambda: launched(4), timeout=60)
        await eventually(partial(_completed, harness, october), timeout=60)
        # Each launch over a billed month says why it started nothing, and what bills it.
        query = 'WorkflowType="ScheduledBillingWorkflow" AND ExecutionStatus="Completed"'
        shown = [
            (await _ended_with(harness.client.get_workflow_handle(w.id)))[0]
            async for w in harness.client.list_workflows(query)
        ]
        for kept in (august, september):
            assert (
                f"a run of {kept} has completed or was cancelled: nothing started (bill it again"
                f" by hand once it has ended: `python starter.py run {kept}`)"
            ) in shown, shown
    again = await harness.client.get_workflow_handle(period_workflow_id(september)).describe()
    assert again.run_id == billed.run_id
    await assert_billed_once(harness, str(september), customers)
    assert late.customer_id not in {r["customer_id"] for r in await harness.ledger_rows("2026-09")}
    await assert_billed_once(harness, str(october), [*customers, late])
    assert await harness.ledger_rows(str(august)) == []
    assert (await period_status(harness.client, august)).state == "not_started"  # no run


async def test_a_backfill_never_bills_a_period_before_its_launch(harness: Harness) -> None:
    config = schedules.MonthlySchedule(schedule_id="monthly-ahead", paused=True)
    await schedules.create_schedule(harness.client, config, harness.task_queue)
    with pytest.raises(InvalidInputError, match="bills 2098-12 on 2099-01-01T02:00:00"):
        await backfill(harness, "monthly-ahead", Period(2098, 12), Period(2099, 1))
    # The period is the schedule zone's: there, this launch is on 2099-01-01, billing 2098-12.
    zoned = schedules.MonthlySchedule(
        schedule_id="monthly-auckland", paused=True, time_zone="Pacific/Auckland"
    )
    await schedules.create_schedule(harness.client, zoned, harness.task_queue)
    with pytest.raises(InvalidInputError, match=r"bills 2098-12 on 2099-01-01T02:00:00\+13:00"):
        await backfill(harness, "monthly-auckland", Period(2098, 12), Period(2098, 12))
    assert [w async for w in harness.client.list_workflows()] == []


async def test_a_backfill_includes_a_launch_at_the_first_instant_of_its_window(
    harness: Harness,
) -> None:
    config = schedules.MonthlySchedule(schedule_id="midnight", hour=0, paused=True)
    await schedules.create_schedule(harness.client, config, harness.task_queue)
    launches = await backfill(harness, "midnight", Period(2026, 1), Period(2026, 1), late=True)
    assert [t.isoformat() for t in launches] == ["2026-02-01T00:00:00+00:00"]


def _fired_every(seconds: int) -> ScheduleIntervalSpec:
    """An interval whose next firing is half an interval away: aligned to the clock, an
    hourly one paused would skip a firing at the top of the hour a test crossed, a warning
    more in what `describe` says."""
    now = int(datetime.now(UTC).timestamp())
    return ScheduleIntervalSpec(
        every=timedelta(seconds=seconds), offset=timedelta(seconds=(now + seconds // 2) % seconds)
    )


async def firing_every(
    harness: Harness,
    schedule_id: str,
    seconds: int,
    *,
    paused: bool = False,
    overlap_all: bool = False,
    time_zone: str = "UTC",
    billing: Billing = "arrears",
    start_at: datetime | None = None,
) -> ScheduleHandle:
    """A billing schedule firing every few seconds instead of monthly, so that a test can
    wait through firings; with `overlap_all`, each firing launches even while others run;
    with `start_at`, none before it."""
    config = schedules.MonthlySchedule(
        schedule_id=schedule_id, paused=paused, time_zone=time_zone, billing=billing
    )
    schedule = schedules.build_schedule(config, harness.task_queue, RunOptions())
    schedule.spec = ScheduleSpec(intervals=[_fired_every(seconds)], start_at=start_at)
    if overlap_all:
        schedule.policy.overlap = ScheduleOverlapPolicy.ALLOW_ALL
    return await harness.client.create_schedule(schedule_id, schedule)


async def test_firings_due_while_a_launch_is_open_wait_for_it_instead_of_being_dropped(
    harness: Harness,
) -> None:
    """Under `skip`, Temporal drops every firing due while a launch is open, and of firings
    caught up at once after an outage it starts only the first: an outage over two monthly
    firings lost the second. The default holds them back (`buffer_all`)."""
    # No worker: the first launch stays open, as every launch does during an outage.
    handle = await firing_every(harness, "held-back", 1)
    try:

        async def held_back() -> bool:
            return (await handle.describe()).info.num_actions >= 1 and await _waiting(handle)

        await eventually(held_back, timeout=30)
        info = (await handle.describe()).info
        assert info.num_actions_skipped_overlap == 0
        assert len(info.running_actions) == 1
    finally:
        await handle.delete()


async def test_firings_waiting_for_an_open_launch_are_not_called_missed(harness: Harness) -> None:
    """`describe` said of firings Temporal holds in the schedule's buffer that it "launched
    nothing at" them, and "Temporal does not make them up", with a backfill to run
    (helper-152 F5): they start once the open launch ends."""
    # No worker: the first launch stays open. Once firings wait, no more: the buffer then
    # holds what it will.
    handle = await firing_every(harness, "held-and-named", 1)
    try:
        await eventually(partial(_waiting, handle), timeout=60)
        end = await _stop_firing(handle)
        await eventually(partial(_all_taken, harness, handle, end), timeout=60)
        missed = await schedules.missed_launches(harness.client, "held-and-named")
        code, out, err = await harness.starter("schedule", "describe", "--id", "held-and-named")
        waiting = (await handle.describe()).raw_description.info.buffer_size
    finally:
        await handle.delete()
    assert missed == []
    assert code == 0 and "launched nothing" not in err, err
    assert f"waiting: {waiting} firings, held by Temporal until the open launch ends" in out


async def test_firings_skipped_while_paused_are_named_beside_firings_held(
    harness: Harness,
) -> None:
    """Firings buffered, then skipped while paused, then buffered again: Temporal gives only
    how many it holds, and taking the first that many after the open launch hid the skipped
    ones (their month never named) and named held ones instead (helper-155 C1). Each is
    named, with a word that some may be held."""
    # No worker: the first launch stays open and later firings wait in the buffer.
    handle = await firing_every(harness, "paused-between-held", 2)
    try:

        async def launched() -> bool:
            return len((await handle.describe()).info.running_actions) >= 1

        await eventually(launched, timeout=90)
        await asyncio.sleep(4)
        # The window is read inside the pause, so a slow call widens neither end of it.
        await handle.pause(note="between held firings")
        paused_at = datetime.now(UTC)
        await asyncio.sleep(6)
        unpaused_at = datetime.now(UTC)
        await handle.unpause(note="again")
        await asyncio.sleep(4)

        await _stop_firing(handle)
        held = (await handle.describe()).raw_description.info.buffer_size
        missed = await schedules.missed_launches(harness.client, "paused-between-held")
        code, _out, err = await harness.starter(
            "schedule", "describe", "--id", "paused-between-held"
        )
        skipped = [
            t
            for t in await schedules.matching_times(
                harness.client, "paused-between-held", paused_at, unpaused_at
            )
            if paused_at + timedelta(seconds=0.7) < t < unpaused_at - timedelta(seconds=0.7)
        ]
    finally:
        await handle.delete()
    assert skipped and held >= 1
    assert set(skipped) <= {m.at for m in missed}
    assert sum(m.maybe_waiting for m in missed) >= held
    assert code == 0 and "may be firings Temporal holds for the launch still open" in err, err


async def _stop_firing(handle: ScheduleHandle) -> datetime:
    """End the schedule's firings, wait past the end, and return it.

    The end is set seconds ahead: an end of "now" reaches the scheduler after it may have
    taken the next firing, which the schedule's times then no longer list (a loaded machine
    saw one more held than listed), and a loaded machine takes a while to update."""
    end = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=5)

    def ending(update: ScheduleUpdateInput) -> ScheduleUpdate:
        schedule = update.description.schedule
        schedule.spec.end_at = end
        return ScheduleUpdate(schedule=schedule)

    await handle.update(ending)
    await asyncio.sleep((end - datetime.now(UTC)).total_seconds() + 1)
    return end


async def _all_taken(harness: Harness, handle: ScheduleHandle, end: datetime) -> bool:
    """Whether Temporal has taken each of an unpaused schedule's firings up to `end`
    (launched, held or dropped): a loaded scheduler may lag behind the clock."""
    info = (await handle.describe()).raw_description.info
    taken = (
        info.action_count
        + info.buffer_size
        + info.buffer_dropped
        + info.overlap_skipped
        + info.missed_catchup_window
    )
    created = info.create_time.ToDatetime(tzinfo=UTC)
    return taken >= len(await schedules.matching_times(harness.client, handle.id, created, end))


async def _waiting(handle: ScheduleHandle) -> bool:
    """Whether firings wait behind the open launch (the schedule's buffer)."""
    described = await handle.describe()
    return described.raw_description.info.buffer_size >= 2


async def test_unpausing_names_the_launches_the_pause_skipped(harness: Harness) -> None:
    handle = await firing_every(harness, "often", 1, paused=True)

    async def skipped_twice() -> bool:
        # Counted from the schedule's creation, which a namespace's first schedule may
        # record seconds after the call returns.
        return len(await schedules.missed_launches(harness.client, "often")) >= 2

    await eventually(skipped_twice, timeout=30)
    missed = await schedules.missed_launches(harness.client, "often")
    assert {m.period for m in missed} == {period_for(datetime.now(UTC))}
    # `describe` names them too (as it does firings missed in an outage past the catch-up).
    code, out, err = await harness.starter("schedule", "describe", "--id", "often")
    assert code == 0 and "WARNING: often launched nothing at" in err
    assert "\n  bills the month before each firing (arrears, months in UTC)\n" in out, out
    code, out, err = await harness.starter("schedule", "unpause", "--id", "often")
    await handle.delete()
    assert (code, out.strip()) == (0, "unpaused schedule often"), err
    assert "WARNING: often launched nothing at" in err and "paused schedule skips" in err
    last = period_for(datetime.now(UTC))
    assert f"schedule backfill --id often --start {last} --end {last}" in err


async def test_a_launch_ended_before_starting_its_run_is_missed(harness: Harness) -> None:
    """A firing's launcher terminated before it started the period's run (no worker took
    it; `--overlap terminate_other` does the same) billed nothing: it is named as missed."""
    handle = await firing_every(harness, "cut-short", 2)
    try:
        await eventually(partial(_launched, handle, 1), timeout=30)
        await handle.pause()
        [first, *_] = (await handle.describe()).info.recent_actions
        assert first.scheduled_at not in {
            m.at for m in await schedules.missed_launches(harness.client, "cut-short")
        }
        launcher = first.action
        assert isinstance(launcher, ScheduleActionExecutionStartWorkflow)
        await harness.client.get_workflow_handle(launcher.workflow_id).terminate("cut short")
        missed = await schedules.missed_launches(harness.client, "cut-short")
        assert first.scheduled_at in {m.at for m in missed}
        assert {m.period for m in missed} == {period_for(datetime.now(UTC))}
        # Its month run by hand since (open on a queue nobody polls here): not missed, or
        # `describe` would ask for a backfill of a month being billed.
        run = await start_period(harness.client, period_for(first.scheduled_at), "nobody-polls")
        missed = await schedules.missed_launches(harness.client, "cut-short")
        await run.terminate("the test is over")
        assert first.scheduled_at not in {m.at for m in missed}
    finally:
        await handle.delete()


async def test_the_oldest_listed_launch_ended_early_is_missed(harness: Harness) -> None:
    """With Temporal's 10 recent actions listed, only times since the oldest was taken are
    checked; that oldest one, ended before starting its run, is named all the same."""
    # No worker: each launch stays open, so each firing starts one.
    handle = await firing_every(harness, "crowded", 1, overlap_all=True)
    try:
        await eventually(partial(_launched, handle, 10), timeout=30)
        await handle.pause()
        oldest = min((await handle.describe()).info.recent_actions, key=lambda a: a.started_at)
        # Paused, its times from now on are missed too: only the oldest's is looked at.
        missed = await schedules.missed_launches(harness.client, "crowded")
        assert oldest.scheduled_at not in {m.at for m in missed}
        launcher = oldest.action
        assert isinstance(launcher, ScheduleActionExecutionStartWorkflow)
        await harness.client.get_workflow_handle(launcher.workflow_id).terminate("cut short")
        missed = await schedules.missed_launches(harness.client, "crowded")
        assert oldest.scheduled_at in {m.at for m in missed}
    finally:
        await handle.delete()


async def test_describe_lists_the_latest_launches_not_the_oldest(harness: Harness) -> None:
    """Of the ten launches Temporal lists, `describe` shows five: the latest, which an
    operator checking last night's firing looks for."""
    # No worker: each launch stays open, so each firing starts one.
    handle = await firing_every(harness, "many", 1, overlap_all=True)
    try:
        await eventually(partial(_launched, handle, 7), timeout=30)
        await handle.pause()
        description, request = await schedules.launcher_of(harness.client, "many")
    finally:
        await handle.delete()
    shown = schedules.describe(description, request)
    assert "  fires: every 0:00:01 (UTC)" in shown, shown
    launched = [
        a.action.workflow_id
        for a in description.info.recent_actions
        if isinstance(a.action, ScheduleActionExecutionStartWorkflow)
    ]
    assert [w for w in launched if w in shown] == launched[-5:], shown


class _HoldAfterStartingOutbound(WorkflowOutboundInterceptor):
    async def start_child_workflow(
        self, input: StartChildWorkflowInput
    ) -> ChildWorkflowHandle[Any, Any]:
        try:
            return await super().start_child_workflow(input)
        finally:
            # Started, or refused as running already: held either way.
            if workflow.info().workflow_type == schedules.LAUNCHER:
                await workflow.wait_condition(lambda: False)


class _HoldAfterStartingInbound(WorkflowInboundInterceptor):
    def init(self, outbound: WorkflowOutboundInterceptor) -> None:
        super().init(_HoldAfterStartingOutbound(outbound))


class HoldLaunchersOpen(Interceptor):
    """Keeps a schedule's launcher open once it has started its run, as if its worker had
    stopped right there, so that a test can end it at that step."""

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor]:
        return _HoldAfterStartingInbound


async def _reconciling_by_trigger(
    harness: Harness, schedule_id: str
) -> tuple[Period, ScheduleHandle]:
    """A paused daily reconciliation, fired only by the test, and the month it reconciles,
    billed in the ledger."""
    # Billed in the ledger: the month a launch now reconciles, or the one before it.
    billed = period_for(datetime.now(UTC), "arrears")
    await _billed_in_the_ledger_only(harness, billed, 0)
    # Its daily time half a day off: no firing of its own while the test runs.
    hour = (datetime.now(UTC).hour + 12) % 24
    config = schedules.MonthlySchedule(
        schedule_id=schedule_id, action="reconcile", paused=True, hour=hour
    )
    schedule = schedules.build_schedule(config, harness.task_queue, RunOptions())
    return billed, await harness.client.create_schedule(schedule_id, schedule)


async def _missed_at(client: Client, schedule_id: str) -> list[datetime]:
    return [m.at for m in await schedules.missed_launches(client, schedule_id)]


async def _nth_launch(
    client: Client, schedule: ScheduleHandle, count: int
) -> WorkflowHandle[Any, Any]:
    """The schedule's `count`th launch, once it is listed."""
    await eventually(partial(_launched, schedule, count), timeout=30)
    action = (await schedule.describe()).info.recent_actions[count - 1].action
    assert isinstance(action, ScheduleActionExecutionStartWorkflow)
    return client.get_workflow_handle(action.workflow_id)


async def _ended_with(launch: WorkflowHandle[Any, Any]) -> tuple[str, WorkflowHistory]:
    """Once the launch has completed: its details, as the Web UI shows them, and its history."""
    await launch.result()
    metadata = await launch.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
    return metadata.current_details, await launch.fetch_history()


async def _reached(launch: WorkflowHandle[Any, Any], kind: EventType.ValueType) -> int:
    """The id of the first event of `kind` in the launch's history, once there is one."""
    found: list[int] = []

    async def reached() -> bool:
        found[:] = [e.event_id async for e in launch.fetch_history_events() if e.event_type == kind]
        return bool(found)

    await eventually(reached)
    return found[0]


async def test_a_reconcile_launch_ended_after_starting_its_reconciliation_is_not_missed(
    harness: Harness,
) -> None:
    """A reconciliation's workflow ID is reused daily, so whether a launcher ended early had
    started one is read from the launcher's own history; one that had not is missed."""
    billed, handle = await _reconciling_by_trigger(harness, "held")
    launcher = partial(_nth_launch, harness.client, handle)
    missed = partial(_missed_at, harness.client, "held")

    async def ended_at(launch: WorkflowHandle[Any, Any], kind: EventType.ValueType) -> None:
        """End the launch once its history holds an event of `kind`."""
        await _reached(launch, kind)
        await launch.terminate("the worker stopped")

    reconcile = harness.client.get_workflow_handle(reconcile_workflow_id(billed))
    try:
        async with harness.running_worker(interceptors=[HoldLaunchersOpen()]):
            await handle.trigger()
            started = EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED
            await ended_at(await launcher(1), started)
            await reconcile.result()
            # A reconciliation running already (on a queue no worker polls), which the next
            # launch joins.
            await start_reconcile(harness.client, billed, "nobody-polls")
            await handle.trigger()
            joined = EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_FAILED
            await ended_at(await launcher(2), joined)
            await reconcile.terminate("checked")
        assert await missed() == []
        # With no worker, the next launch starts nothing before it is ended: missed.
        await handle.trigger()
        await (await launcher(3)).terminate("nobody took it")
        [at] = await missed()
        assert at == (await handle.describe()).info.recent_actions[2].scheduled_at
        code, out, _ = await harness.starter("schedule", "describe", "--id", "held")
        assert code == 0, out
        assert (
            "\n  reconciles the latest period billed (arrears, months in UTC);"
            " follows no billing schedule\n" in out
        ), out
        assert "overlap buffer_all, catch-up window 168 hours\n" in out, out
    finally:
        await handle.delete()


class FailWorkflowTasks(Interceptor):
    """Fails every workflow task of one workflow type, as a release with a bug in it would."""

    def __init__(self, workflow_type: str) -> None:
        self._failing = workflow_type

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor]:
        failing = self._failing

        class Failing(WorkflowInboundInterceptor):
            async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
                if workflow.info().workflow_type == failing:
                    raise RuntimeError(f"a bug in this release's {failing}")
                return await super().execute_workflow(input)

        return Failing


async def test_a_launch_reset_after_a_terminate_is_not_missed(harness: Harness) -> None:
    """An operator who terminated a stuck launch may reset it once its worker is fixed: the
    reset run, which started the reconciliation, is the launch, not the terminated one."""
    billed, handle = await _reconciling_by_trigger(harness, "reset")
    missed = partial(_missed_at, harness.client, "reset")

    try:
        async with harness.running_worker(interceptors=[FailWorkflowTasks(schedules.LAUNCHER)]):
            await handle.trigger()
            launch = await _nth_launch(harness.client, handle, 1)
            failed = await _reached(launch, EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED)
        await launch.terminate("stuck")
        assert await missed() == [(await handle.describe()).info.recent_actions[0].scheduled_at]
        await harness.client.workflow_service.reset_workflow_execution(
            ResetWorkflowExecutionRequest(
                namespace=harness.client.namespace,
                workflow_execution=ExecutionRef(workflow_id=launch.id),
                reason="the launcher's bug is fixed",
                workflow_task_finish_event_id=failed,
                request_id=f"reset-{launch.id}",
            )
        )
        async with harness.running_worker():
            await launch.result()
            await harness.client.get_workflow_handle(reconcile_workflow_id(billed)).result()
        assert await missed() == []
    finally:
        await handle.delete()


async def test_launches_pushed_out_of_the_recent_list_by_a_backfill_are_not_missed(
    harness: Harness,
) -> None:
    """Temporal lists a schedule's last 10 actions. Ten backfilled launches of long ago push
    its real firings out of that list: they launched all the same."""
    # Every 3 s: firings to push out, and seconds before the next pushes a backfilled one out.
    handle = await firing_every(harness, "backfilled", 3, overlap_all=True)
    try:
        await eventually(partial(_launched, handle, 2), timeout=30)
        backfilled_at = datetime.now(UTC)
        long_ago = backfilled_at - timedelta(hours=1)
        await handle.backfill(
            ScheduleBackfill(
                start_at=long_ago,
                end_at=long_ago + timedelta(seconds=30),
                overlap=ScheduleOverlapPolicy.ALLOW_ALL,
            )
        )

        async def pushed_out() -> bool:
            recent = (await handle.describe()).info.recent_actions
            return sum(a.scheduled_at < long_ago + timedelta(minutes=1) for a in recent) >= 9

        await eventually(pushed_out)
        # Only a firing due since the backfill may not be listed yet.
        missed = await schedules.missed_launches(harness.client, "backfilled")
        assert [m for m in missed if m.at < backfilled_at] == []
    finally:
        await handle.delete()


async def test_run_with_no_worker_says_the_run_is_open_and_nobody_answers(harness: Harness) -> None:
    await harness.seed(1)
    code, out, err = await harness.starter("run", str(PERIOD))
    assert (code, out.splitlines()[0]) == (
        0,
        f"period {PERIOD} open as {period_workflow_id(PERIOD)}",
    )
    assert "no worker answered its query within 10 s" in err and "Traceback" not in err
    # Asked for JSON, a script gets JSON (joining the same run), the warning on stderr.
    code, out, err = await harness.starter("run", str(PERIOD), "--json")
    assert (code, OpenRun.model_validate_json(out)) == (
        0,
        OpenRun(period=str(PERIOD), workflow_id=period_workflow_id(PERIOD)),
    )
    assert "no worker answered" in err
    # Started indeed: a worker now bills it.
    async with harness.running_worker():
        summary = await harness.client.get_workflow_handle(
            period_workflow_id(PERIOD), result_type=PeriodSummary
        ).result()
    assert summary.charged == 1


async def _billed_in_the_ledger_only(harness: Harness, period: Period, charged: int) -> None:
    """The ledger's row of a run that completed, as it stays once Temporal drops the run."""
    workflow_id = period_workflow_id(period)
    plan = PeriodPlan(period=str(period), due=charged, to_charge=charged, expected_total_cents=0)
    summary = PeriodSummary(
        period=str(period),
        workflow_id=workflow_id,
        due=charged,
        charged=charged,
        already_billed=0,
        failed=0,
        skipped=0,
        cancelled=0,
        total_charged_cents=1_000 * charged,
    )
    async with harness.pool.acquire() as conn:
        await ledger.start_period(conn, plan, workflow_id)
        await ledger.finish_period(conn, str(period), summary.model_dump_json())


async def test_status_of_a_period_temporal_no_longer_holds_comes_from_the_ledger(
    harness: Harness,
) -> None:
    # Past the namespace's retention Temporal holds no run of a period; the ledger still has
    # its row, as here, where no workflow ever ran.
    plan = PeriodPlan(period=str(PERIOD), due=3, to_charge=3, expected_total_cents=3_000)
    async with harness.pool.acquire() as conn:
        await ledger.start_period(conn, plan, period_workflow_id(PERIOD))
    code, out, err = await harness.starter("status", str(PERIOD))
    # A run that ended without its summary reads as a failed one.
    assert (code, out) == (3, ""), err
    assert f"a run of {PERIOD} ({period_workflow_id(PERIOD)}) that never finished" in err
    # For scripts, the same as JSON.
    code, out, err = await harness.starter("status", str(PERIOD), "--json")
    assert code == 3 and "never finished" in err
    assert EndedRun.model_validate_json(out) == EndedRun(
        period=str(PERIOD), workflow_id=period_workflow_id(PERIOD), state="unfinished"
    )
    await _billed_in_the_ledger_only(harness, PERIOD, charged=3)
    code, out, err = await harness.starter("status", str(PERIOD), "--json")
    status = PeriodStatus.model_validate_json(out)
    assert (code, status.state, status.charged) == (0, "completed", 3), err
    code, out, _ = await harness.starter("status", str(PERIOD.previous()), "--json")
    assert PeriodStatus.model_validate_json(out).state == "not_started"
    # Not read as an empty run that succeeded, as a mistyped month would be (helper-177 F7).
    code, out, _ = await harness.starter("status", str(PERIOD.previous()))
    assert code == 0 and f"no run of {PERIOD.previous()} has started: `python starter" in out


async def test_status_says_without_the_ledger_totals_when_the_ledger_does_not_answer(
    harness: Harness,
) -> None:
    """The totals are an extra: a database that takes connections and answers nothing (a
    hung server, a proxy before one) held `status` for asyncpg's minute (helper-171 F4)."""
    await harness.seed(2)
    silent = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    try:
        async with harness.running_worker():
            await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
        began = time.monotonic()
        process = await harness.starter_process(
            "status", str(PERIOD), DATABASE_URL=f"postgresql://billing@127.0.0.1:{port}/billing"
        )
        out, err = (s.decode() for s in await asyncio.wait_for(process.communicate(), 90))
    finally:
        silent.close()
    assert process.returncode == 0, err
    # Its note's 5 s, not asyncpg's minute: the rest is the command starting and asking
    # Temporal, many seconds on a loaded machine.
    assert time.monotonic() - began < 45
    assert "charged 2" in out and "the ledger could not be read" in err, (out, err)


async def test_status_after_a_rerun_says_what_every_run_billed(harness: Harness) -> None:
    """A rerun's summary counts what the runs before it charged as already billed: `status`
    said "charged nothing" for a period billed in full (helper-169 F3). It adds the ledger's
    totals of every run."""
    customers = await harness.seed(3)
    async with harness.running_worker():
        for _ in range(2):
            await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    code, out, err = await harness.starter("status", str(PERIOD), "--json")
    status = PeriodStatus.model_validate_json(out)
    assert (code, status.charged, status.already_billed) == (0, 0, 3), err
    total = sum(c.amount_cents for c in customers)
    assert status.ledger == PeriodTotals(charged=3, charged_by_currency={"usd": total})
    code, out, err = await harness.starter("status", str(PERIOD))
    assert code == 0, err
    assert (
        f"the period in the ledger, every run: charged 3 ({describe_amount('usd', total)})" in out
    )


async def test_status_with_no_worker_answering_says_what_the_ledger_holds(
    harness: Harness,
) -> None:
    """With no worker to answer the run's query `status` said only that, not what the
    period's runs had charged, which the ledger holds all the same (helper-171)."""
    await harness.seed(2)
    async with harness.running_worker():
        await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    rerun = await start_period(harness.client, PERIOD, harness.task_queue)
    try:
        code, out, err = await harness.starter("status", str(PERIOD))
    finally:
        await rerun.terminate(reason="test over")
    assert code != 0 and out == "", out
    assert "no worker answered its query" in err, err
    assert "; the period in the ledger, every run: charged 2 (usd " in err, err
    assert err.rstrip().endswith("claims open 0"), err


async def test_run_wait_json_says_how_a_run_that_ended_early_ended(harness: Harness) -> None:
    """A script waiting on `run --wait --json` reads how the run ended from stdout when it
    did not complete, as from `status --json`, not only from stderr's words."""
    await harness.seed(3)
    await harness.set_faults(latency_ms=2000)
    async with harness.running_worker():
        waiting = asyncio.create_task(harness.starter("run", str(PERIOD), "--wait", "--json"))
        handle = harness.client.get_workflow_handle(period_workflow_id(PERIOD))

        async def charging() -> bool:
            return (await period_status(harness.client, PERIOD)).in_flight > 0

        await eventually(charging)
        await handle.terminate(reason="by hand")
        code, out, err = await waiting
    assert code == 3 and f"the run of {PERIOD} ended terminated (by hand)" in err, err
    assert EndedRun.model_validate_json(out) == EndedRun(
        period=str(PERIOD), workflow_id=period_workflow_id(PERIOD), state="terminated"
    )


async def test_run_wait_tells_how_the_run_it_waited_on_ended_when_another_has_started(
    harness: Harness,
) -> None:
    """The period run again between the end of the run waited on and the report (a
    schedule's firing, another operator's `run`): the report is of the run waited on, not
    of the period's latest run, which is running."""
    await harness.seed(3)
    await harness.set_faults(latency_ms=1500)
    async with harness.running_worker():
        first = await start_period(harness.client, PERIOD, harness.task_queue)
        first_run = (await first.describe()).run_id
        await first.terminate(reason="by hand")
        again = await start_period(harness.client, PERIOD, harness.task_queue)
        waited = harness.client.get_workflow_handle(
            first.id, run_id=first_run, result_type=PeriodSummary
        )
        args = argparse.Namespace(period=PERIOD, json=True)
        with pytest.raises(RunEndedError) as ended:
            await runs._wait_and_report(harness.client, waited, args, TemporalSettings())
        await again.result()
    assert (ended.value.state, ended.value.workflow_id) == ("terminated", first.id)
    assert f"the run of {PERIOD} ended terminated (by hand)" in str(ended.value)


async def test_status_of_a_run_that_ended_early_says_why_and_exits_3(harness: Harness) -> None:
    await harness.seed(1)
    handle = await start_period(harness.client, PERIOD, harness.task_queue)
    await handle.terminate(reason="by hand")
    code, out, err = await harness.starter("status", str(PERIOD), "--json")
    assert code == 3 and f"the run of {PERIOD} ended terminated (by hand)" in err
    assert EndedRun.model_validate_json(out).state == "terminated"
    # A run that failed says what failed it, as `run --wait` does.
    later = PERIOD.next()
    failing = await harness.client.start_workflow(
        BillingPeriodWorkflow.run,
        BillingPeriodInput(period="2026-13"),
        id=period_workflow_id(later),
        task_queue=harness.task_queue,
    )
    async with harness.running_worker():
        with pytest.raises(WorkflowFailureError):
            await failing.result()
    code, _, err = await harness.starter("status", str(later))
    assert code == 3, err
    assert f"the run of {later} ended failed (billing period month 13 is not 01-12)" in err


async def test_status_json_of_a_rerun_ended_early_names_how_it_ended_beside_the_ledger_totals(
    harness: Harness,
) -> None:
    """The period billed, then run again and terminated: `status` adds what every run
    billed to its words, and its JSON must still say the run was terminated, as a script
    tells a run stopped by hand from one that failed."""
    await harness.seed(2)
    async with harness.running_worker():
        await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    rerun = await start_period(harness.client, PERIOD, harness.task_queue)
    await rerun.terminate(reason="by hand")
    code, out, err = await harness.starter("status", str(PERIOD), "--json")
    assert code == 3 and f"the run of {PERIOD} ended terminated (by hand)" in err, err
    assert "; the period in the ledger, every run: charged 2 (usd " in err, err
    assert EndedRun.model_validate_json(out) == EndedRun(
        period=str(PERIOD), workflow_id=period_workflow_id(PERIOD), state="terminated"
    )


async def test_a_period_run_started_under_another_id_fails_before_it_opens_anything(
    harness: Harness,
) -> None:
    """The Web UI's start form, or `temporal workflow start` with no --workflow-id, makes an
    ID up: such a run would open the period beside its real run, set the control an operator
    paused back to running, and charge the customers the pause holds (helper-118's F1)."""
    await harness.seed(2)
    async with harness.running_worker():
        by_hand = await harness.client.start_workflow(
            BillingPeriodWorkflow.run,
            BillingPeriodInput(period=str(PERIOD)),
            id="started-in-the-web-ui",
            task_queue=harness.task_queue,
        )
        with pytest.raises(WorkflowFailureError) as failed:
            await by_hand.result()
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == WRONG_WORKFLOW_ID
    assert cause.message == (
        f"a run of {PERIOD} must have the workflow ID {period_workflow_id(PERIOD)}, not"
        f" 'started-in-the-web-ui': start it with `python starter.py run {PERIOD}`"
    )
    async with harness.pool.acquire() as conn:
        opened = await conn.fetchval(
            "SELECT count(*) FROM billing_periods WHERE billing_period = $1", str(PERIOD)
        )
    assert (opened, await harness.ledger_rows(str(PERIOD)), await harness.money_requests()) == (
        0,
        [],
        0,
    )


async def test_creating_a_schedule_twice_is_a_clear_error(harness: Harness) -> None:
    assert (await harness.starter("schedule", "create", "--id", "twice", "--paused"))[0] == 0
    code, out, err = await harness.starter("schedule", "create", "--id", "twice", "--paused")
    assert (code, out) == (2, "")
    assert "a schedule 'twice' exists already" in err and "Traceback" not in err


async def test_a_trigger_or_backfill_that_would_start_nothing_is_refused(harness: Harness) -> None:
    """A launch leaves a period whose run completed as it is: "triggered" would have an
    operator believe the customers added since were billed."""
    # Fires at midnight on the 1st: the launch billing last month is always past.
    config = schedules.MonthlySchedule(schedule_id="monthly-done", hour=0, paused=True)
    await schedules.create_schedule(harness.client, config, harness.task_queue)
    billed = period_for(datetime.now(UTC))
    await _billed_in_the_ledger_only(harness, billed, charged=0)
    paused = ("--id", "monthly-done", "--while-paused")
    code, out, err = await harness.starter("schedule", "trigger", *paused)
    assert (code, out) == (2, ""), out
    assert f"bills {billed} now, and {billed}'s run completed: a launch" in err
    assert f"python starter.py run {billed}" in err and "Traceback" not in err
    # Completed: nothing to wait for before running it again.
    assert f"run it again by hand: python starter.py run {billed}" in err, err
    span = ("--start", str(billed), "--end", str(billed))
    code, out, err = await harness.starter("schedule", "backfill", *paused, *span)
    assert (code, out) == (2, "") and f"{billed}'s run completed. Nothing was backfilled" in err, (
        err
    )
    # A month long past is refused without --late, as `run` refuses it: a mistyped year.
    old = Period(*billed.later(-12))
    span = ("--start", str(old), "--end", str(old))
    code, out, err = await harness.starter("schedule", "backfill", *paused, *span)
    assert (code, out) == (2, "") and f"{old} is more than 3 months before" in err, err
    handle = harness.client.get_schedule_handle("monthly-done")
    assert (await handle.describe()).info.num_actions == 0
    # With a month still to bill in the range, the backfill goes on and names the other.
    span = ("--start", str(billed.previous()), "--end", str(billed))
    code, out, err = await harness.starter("schedule", "backfill", *paused, *span)
    await handle.delete()
    assert code == 0, err
    assert out.startswith("backfilling 2 launches")
    assert f"left as they are: {billed}'s run completed (bill one again" in out


@pytest.mark.parametrize("overlap", ["skip", "terminate_other", "buffer_all"])
async def test_an_overlap_policy_that_can_lose_a_firing_is_warned_of(
    harness: Harness, overlap: str
) -> None:
    """Still offered for a schedule of one's own making, but not silently (helper-152 N3)."""
    made = ("schedule", "create", "--id", f"policy-{overlap}", "--paused", "--leave-unbilled")
    code, out, err = await harness.starter(*made, "--overlap", overlap)
    await harness.client.get_schedule_handle(f"policy-{overlap}").delete()
    assert code == 0 and out.startswith("created schedule"), err
    assert (f"warning: --overlap {overlap}:" in err) is (overlap != "buffer_all"), err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            (
                *("--day", "5", "--hour", "7", "--minute", "30", "--time-zone", "Europe/Berlin"),
                *("--billing", "advance", "--overlap", "skip", "--catchup-hours", "12"),
                "--paused",
            ),
            schedules.MonthlySchedule(
                schedule_id="made",
                day_of_month=5,
                hour=7,
                minute=30,
                time_zone="Europe/Berlin",
                billing="advance",
                overlap="skip",
                catchup_window=timedelta(hours=12),
                paused=True,
            ),
        ),
        # As the help says: created paused, or with a policy or window that drops a late
        # firing, a month would go unbilled without a word.
        (
            (),
            schedules.MonthlySchedule(
                schedule_id="made",
                overlap="buffer_all",
                catchup_window=timedelta(days=7),
                paused=False,
            ),
        ),
    ],
    ids=["flags", "defaults"],
)
async def test_a_schedule_is_created_as_its_flags_say(
    harness: Harness, flags: tuple[str, ...], expected: schedules.MonthlySchedule
) -> None:
    """What Temporal keeps is what was asked: a flag lost on the way fires on another day,
    hour or zone, bills another month, or fires a schedule meant to be created paused."""
    code, _, err = await harness.starter(
        "schedule", "create", "--id", "made", "--leave-unbilled", *flags
    )
    assert code == 0, err
    description, request = await schedules.launcher_of(harness.client, "made")
    await harness.client.get_schedule_handle("made").delete()
    made, wanted = (
        description.schedule,
        schedules.build_schedule(expected, harness.task_queue, RunOptions()),
    )
    assert [(list(c.day_of_month), list(c.hour), list(c.minute)) for c in made.spec.calendars] == [
        (list(c.day_of_month), list(c.hour), list(c.minute)) for c in wanted.spec.calendars
    ]
    assert made.spec.time_zone_name == expected.time_zone
    assert (made.policy.overlap, made.policy.catchup_window) == (
        wanted.policy.overlap,
        expected.catchup_window,
    )
    assert (made.state.paused, made.state.note) == (expected.paused, wanted.state.note)
    assert (request.action, request.options.billing, request.time_zone) == (
        "bill",
        expected.billing,
        expected.time_zone,
    )


async def test_the_longest_schedule_id_taken_is_one_temporal_takes(harness: Harness) -> None:
    """Temporal checks the launches' workflow ID (the id, "-run", "-" and a firing's time) as
    the schedule is made: the CLI took four characters more than it does (helper-152 F3)."""
    longest = "m" * schedules.SCHEDULE_ID_MAX
    code, out, err = await harness.starter(
        "schedule", "create", "--id", longest, "--paused", "--leave-unbilled"
    )
    assert code == 0, err
    await harness.client.get_schedule_handle(longest).delete()
    code, out, err = await harness.starter(
        "schedule", "create", "--id", longest + "m", "--paused", "--leave-unbilled"
    )
    assert (code, out) == (2, "") and f"must be 1-{schedules.SCHEDULE_ID_MAX} characters" in err


async def test_a_trigger_of_a_month_whose_cancelled_run_still_finishes_is_refused(
    harness: Harness,
) -> None:
    """Cancelled, the run still finishes the charges it had sent: a launch would join it and
    start nothing. The trigger said "it bills" the month, and the launcher joined the run,
    as `run` refuses to (helper-152 F2)."""
    await harness.seed(6)
    await harness.set_faults(latency_ms=10_000)
    config = schedules.MonthlySchedule(
        schedule_id="monthly-cancelled", billing="advance", hour=0, paused=True
    )
    await schedules.create_schedule(harness.client, config, harness.task_queue)
    try:
        async with harness.running_worker():
            handle = await start_period(
                harness.client, PERIOD, harness.task_queue, RunOptions(max_in_flight=2)
            )
            await eventually(lambda: at_least(harness.money_requests(), 2))
            await operations.control(harness.client, PERIOD, "cancel", ALICE)
            code, out, err = await harness.starter(
                "schedule", "trigger", "--id", config.schedule_id, "--while-paused"
            )
            described = await harness.client.get_schedule_handle(config.schedule_id).describe()
            # A backfill of it and the month before bills the month before alone, and says
            # the cancelled run is left as it is, not joined.
            span = ("--start", str(PERIOD.previous()), "--end", str(PERIOD))
            backfill = ("schedule", "backfill", "--id", config.schedule_id, "--while-paused")
            filled = await harness.starter(*backfill, *span)
            await harness.set_faults(latency_ms=0)
            summary = await handle.result()
            earlier = harness.client.get_workflow_handle(
                period_workflow_id(PERIOD.previous()), result_type=PeriodSummary
            )

            async def started() -> bool:
                with contextlib.suppress(RPCError):
                    return bool(await earlier.describe())
                return False

            await eventually(started, timeout=30)
            assert (await earlier.result()).charged == 6
    finally:
        await harness.client.get_schedule_handle(config.schedule_id).delete()
    assert (code, out) == (2, ""), (out, err)
    # "(it may still be finishing ...)" while it is, which a loaded machine may not catch.
    assert f"bills {PERIOD} now, and {PERIOD}'s run was cancelled" in err, err
    assert described.info.num_actions == 0
    assert summary.cancelled_by == "alice"
    code, out, err = filled
    assert code == 0 and out.startswith("backfilling 2 launches"), (out, err)
    assert f"left as they are: {PERIOD}'s run was cancelled" in out, out
    assert "joining" not in out, out
    assert await harness.succeeded() == 2 + 6


@pytest.mark.parametrize("run", ["open", "running", "ended"])
async def test_a_trigger_or_backfill_says_it_joins_a_paused_run_only_while_it_runs(
    harness: Harness, run: str
) -> None:
    """The launch joins the month's open run, which bills nothing while paused: "it bills"
    would have an operator wait for charges that do not come. A run that ended paused
    (terminated), which the ledger still holds open, is not joined but started again,
    billing at once: "joins" was false then (helper-156 G2). An open run that is running
    bills on: "paused" would have an operator resume a run nobody paused."""
    config = schedules.MonthlySchedule(schedule_id="monthly-held", hour=0, paused=True)
    await schedules.create_schedule(harness.client, config, harness.task_queue)
    billed = period_for(datetime.now(UTC))
    await harness.seed(1)
    if run in ("open", "running"):
        await harness.set_faults(latency_ms=10_000)
        control = "paused" if run == "open" else "running"

        async def opened() -> bool:
            async with harness.pool.acquire() as conn:
                return await ledger.open_runs(conn, [str(billed)]) == {str(billed): control}

        async with harness.running_worker():
            await start_period(harness.client, billed, harness.task_queue, SLOW)
            if run == "open":
                await operations.control(harness.client, billed, "pause", ALICE)
            await eventually(opened)
        await harness.set_faults(latency_ms=0)
    else:
        plan = PeriodPlan(period=str(billed), due=1, to_charge=1, expected_total_cents=0)
        async with harness.pool.acquire() as conn:
            await ledger.start_period(conn, plan, period_workflow_id(billed))
            await ledger.set_control(conn, str(billed), "paused", "checking the amounts", "bob")
    code, out, err = await harness.starter(
        "schedule", "trigger", "--id", "monthly-held", "--while-paused"
    )
    span = ("--start", str(billed), "--end", str(billed))
    backfill = await harness.starter(
        "schedule", "backfill", "--id", "monthly-held", "--while-paused", *span
    )
    await harness.client.get_schedule_handle("monthly-held").delete()
    assert code == 0 and backfill[0] == 0, (err, backfill)
    joins = run == "open"
    assert (f"{billed}'s run is open and paused" in out) is joins, out
    assert (f"`python starter.py status {billed}` says how" in out) is joins, out
    assert (f"it bills {billed}" in out) is not joins, out
    # A backfill over it says so too (helper-152 N1).
    assert (f"joining the open, paused runs of {billed}" in backfill[1]) is joins, backfill
    assert (f"joining the open runs of {billed}:" in backfill[1]) is (run == "running"), backfill


async def _billing_this_month(harness: Harness, schedule_id: str) -> tuple[Period, ScheduleHandle]:
    """A paused monthly billing schedule, and the month a launch of it bills now (the test
    skipped if that month turns within two minutes)."""
    billed = period_for(datetime.now(UTC))
    if period_for(datetime.now(UTC) + timedelta(minutes=2)) != billed:
        pytest.skip("the month turns during the test")
    config = schedules.MonthlySchedule(schedule_id=schedule_id, hour=0, paused=True)
    await schedules.create_schedule(harness.client, config, harness.task_queue)
    return billed, harness.client.get_schedule_handle(schedule_id)


async def test_a_launch_that_finds_its_periods_run_open_joins_it_and_completes(
    harness: Harness,
) -> None:
    """A firing, a trigger and a run by hand share the period's one workflow: a launch that
    finds it running starts nothing more, says so, and completes. A failed launch would tell
    an operator the month went unbilled, and ask for a backfill of a month being billed."""
    billed, handle = await _billing_this_month(harness, "monthly-join")
    # Open on a queue no worker polls, as a run behind a busy worker is.
    run = await start_period(harness.client, billed, "nobody-polls")
    try:
        async with harness.running_worker():
            await handle.trigger()
            details, _ = await _ended_with(await _nth_launch(harness.client, handle, 1))
    finally:
        await handle.delete()
        await run.terminate("the test is over")
    assert details == f"{period_workflow_id(billed)} runs or has run: nothing more started"


async def test_a_run_completing_as_a_launch_checks_it_is_not_started_again(
    harness: Harness,
) -> None:
    """The ledger says no run of the period has completed, and the run completes before the
    launch starts it: the launch's reuse policy refuses a completed run's ID, so it starts
    nothing rather than bill the period again."""
    customers = await harness.seed(2)
    billed, handle = await _billing_this_month(harness, "monthly-closing")
    # A launch's answer to "has a run of the period completed?", held once read (within the
    # local activity's timeout).
    hold = ActivityHold("period_completed", after=True, timeout=8)
    try:
        async with harness.running_worker(interceptors=[hold]):
            await handle.trigger()
            await asyncio.wait_for(hold.reached.wait(), 30)
            await (await start_period(harness.client, billed, harness.task_queue)).result()
            hold.go.set()
            details, _ = await _ended_with(await _nth_launch(harness.client, handle, 1))
    finally:
        hold.go.set()
        await handle.delete()
    assert details == f"{period_workflow_id(billed)} runs or has run: nothing more started"
    await assert_billed_once(harness, str(billed), customers)


async def test_a_second_backfill_and_describe_say_what_the_launches_joined_and_billed(
    harness: Harness,
) -> None:
    """A second backfill of months whose runs are open said "backfilling 2 launches" as if
    they would bill anew; `describe` listed each month's two launches twice, naming no
    month, and after an unpause Temporal's "Unpaused via Python SDK" (helper-169 F8)."""
    config = schedules.MonthlySchedule(schedule_id="monthly-twice", hour=0, paused=True)
    await schedules.create_schedule(harness.client, config, harness.task_queue)
    handle = harness.client.get_schedule_handle("monthly-twice")
    last = period_for(datetime.now(UTC))
    months = [last.previous(), last]
    span = ("--start", str(months[0]), "--end", str(last))
    backfill = ("schedule", "backfill", "--id", "monthly-twice", "--while-paused", *span)
    await harness.seed(2)
    # Both runs stay open through four commands, however long a loaded machine takes.
    hold = BillHold()

    async def both_open() -> bool:
        async with harness.pool.acquire() as conn:
            return len(await ledger.open_runs(conn, [str(m) for m in months])) == 2

    try:
        async with harness.running_worker(interceptors=[hold]):
            code, out, err = await harness.starter(*backfill)
            assert code == 0 and "joining" not in out, (out, err)
            await eventually(both_open, timeout=30)
            code, out, err = await harness.starter(*backfill)
            assert code == 0, err
            assert f"joining the open runs of {months[0]}, {last}: each customer is billed" in out
            await eventually(lambda: _launched(handle, 4), timeout=30)
            code, out, err = await harness.starter(
                "schedule", "unpause", "--id", "monthly-twice", "--operator", "bob"
            )
            assert code == 0, err
            code, out, err = await harness.starter("schedule", "describe", "--id", "monthly-twice")
            assert code == 0, err
            assert "\n  active (unpaused by bob)\n" in out, out
            for month in months:
                assert f" (bills {month}): monthly-twice-run-" in out, out
            assert out.count(", launched 2 times") == 2, out
            for month in months:
                await operations.control(harness.client, month, "cancel", ALICE)
            hold.go.set()
            for month in months:
                await harness.client.get_workflow_handle(period_workflow_id(month)).result()
    finally:
        await handle.delete()


async def _launched(handle: ScheduleHandle, count: int) -> bool:
    """Whether Temporal lists `count` of the schedule's actions (it lists the latest 10)."""
    return len((await handle.describe()).info.recent_actions) >= count


async def test_a_trigger_or_backfill_of_a_paused_schedule_is_refused_unless_told(
    harness: Harness,
) -> None:
    """Temporal runs a trigger or a backfill whatever the pause: a second operator would bill
    through a freeze another declared, without a word of it."""
    config = schedules.MonthlySchedule(schedule_id="frozen", hour=0)
    await schedules.create_schedule(harness.client, config, harness.task_queue)
    handle = harness.client.get_schedule_handle("frozen")
    try:
        note = ("--note", "freeze for the audit")
        code, _, err = await harness.starter("schedule", "pause", "--id", "frozen", *note)
        assert code == 0, err
        billed = period_for(datetime.now(UTC))
        span = ("--start", str(billed), "--end", str(billed))
        for command in (("trigger",), ("backfill", *span)):
            code, out, err = await harness.starter("schedule", *command, "--id", "frozen")
            assert (code, out) == (2, ""), out
            assert "the schedule frozen is paused (by " in err, err
            assert ": freeze for the audit), and Temporal runs" in err, err
            assert "pass --while-paused" in err and "Nothing was started" in err, err
        assert (await handle.describe()).info.num_actions == 0
    finally:
        await handle.delete()


async def test_a_trigger_does_not_bill_a_month_before_the_schedules_firing_for_it(
    harness: Harness,
) -> None:
    """A trigger bills the month of now. In arrears on the 28th, one on the 4th would bill last
    month 24 days early, its customers as they are that day, and an operator making up the
    firing missed before it would leave that month unbilled."""
    now = datetime.now(UTC)
    if period_for(now + timedelta(minutes=80), "advance") != period_for(now, "advance"):
        pytest.skip("near a month's end no hourly firing 10 minutes ahead is left in it")
    # Hourly from 10 minutes on instead of monthly: the first firing billing last month is
    # ahead, however long the commands take.
    handle = await firing_every(
        harness, "hourly", 3600, paused=True, start_at=now + timedelta(minutes=10)
    )
    billed = period_for(now)
    trigger = ("schedule", "trigger", "--id", "hourly", "--while-paused")
    try:
        code, out, err = await harness.starter(*trigger)
        assert (code, out) == (2, ""), out
        assert f"the schedule bills {billed} on " in err, err
        assert "not yet: a trigger now would bill it early" in err
        assert "`schedule backfill` bills its month" in err and "pass --early" in err
        assert (await handle.describe()).info.num_actions == 0
        code, out, err = await harness.starter(*trigger, "--early")
        assert (code, out) == (0, f"triggered schedule hourly: it bills {billed}\n"), err
    finally:
        await handle.delete()


async def test_describe_notes_a_month_billed_by_hand_rather_than_calling_it_unbilled(
    harness: Harness,
) -> None:
    """A paused schedule skipped its firings, and the month was billed by hand since:
    `describe` named it unbilled, with a `backfill` command that is refused ("every period ...
    has a completed run"), where the daily check reads the ledger and says nothing."""
    period = period_for(datetime.now(UTC))
    if period_for(datetime.now(UTC) + timedelta(minutes=2)) != period:
        pytest.skip("its firings would bill two months")
    handle = await firing_every(harness, "billed-by-hand", 1, paused=True)
    await _billed_in_the_ledger_only(harness, period, charged=0)
    try:

        async def skipped() -> bool:
            return bool(await schedules.missed_launches(harness.client, "billed-by-hand"))

        await eventually(skipped, timeout=30)
        code, _, err = await harness.starter("schedule", "describe", "--id", "billed-by-hand")
        assert code == 0, err
        assert "WARNING" not in err and "unbilled by it" not in err, err
        assert "note: billed-by-hand launched nothing at " in err
        assert f"and their months have completed runs since (by hand?): {period}\n" in err
    finally:
        await handle.delete()


async def _paused_burst(harness: Harness, schedule_id: str, seconds: int = 3) -> None:
    """A paused billing schedule (arrears, UTC) that fires every second for `seconds` seconds,
    ten seconds from now, then not before next year, once its skipped firings are listed:
    they all bill last month, and a backfill of it has no launch ahead."""
    now = datetime.now(UTC).replace(microsecond=0)
    config = schedules.MonthlySchedule(schedule_id=schedule_id, paused=True)
    schedule = schedules.build_schedule(config, harness.task_queue, RunOptions())
    times = [now + timedelta(seconds=10 + i) for i in range(seconds)]
    schedule.spec = ScheduleSpec(
        calendars=[
            ScheduleCalendarSpec(
                second=[ScheduleRange(t.second)],
                minute=[ScheduleRange(t.minute)],
                hour=[ScheduleRange(t.hour)],
                day_of_month=[ScheduleRange(t.day)],
                month=[ScheduleRange(t.month)],
                year=[ScheduleRange(t.year)],
            )
            for t in times
        ]
        # Monthly from next year on: with no firing ahead, describing the schedule crawls.
        + [
            ScheduleCalendarSpec(
                day_of_month=[ScheduleRange(1)],
                hour=[ScheduleRange(2)],
                year=[ScheduleRange(now.year + 1, now.year + 50)],
            )
        ]
    )
    await harness.client.create_schedule(schedule_id, schedule)

    async def skipped() -> bool:
        return bool(await schedules.missed_launches(harness.client, schedule_id))

    await asyncio.sleep(10 + seconds)
    await eventually(skipped, timeout=30)


async def test_describe_of_a_paused_schedule_names_a_backfill_that_runs(
    harness: Harness,
) -> None:
    """A backfill of a paused schedule is refused without --while-paused: the command
    `describe` and the daily check give for one says so."""
    now = datetime.now(UTC)
    if period_for(now + timedelta(minutes=1)) != period_for(now):
        pytest.skip("at a month's boundary")
    await _paused_burst(harness, "paused-burst")
    handle = harness.client.get_schedule_handle("paused-burst")
    try:
        code, _, err = await harness.starter("schedule", "describe", "--id", "paused-burst")
        assert code == 0, err
        [line] = [ln for ln in err.splitlines() if "to bill them:" in ln]
        assert line.endswith("(it is paused: unpause it first, or add --while-paused)"), line
        command = line.split("to bill them: python starter.py ", 1)[1].split(" (it is")[0]
        code, _, err = await harness.starter(*command.split(), "--while-paused")
        assert code == 0, f"the command describe printed ({command}) fails: {err}"
    finally:
        await handle.delete()
    unbilled = schedules.UnbilledFiring(
        schedule_id="billing-monthly", at=now, period=period_for(now), paused=True
    )
    assert unbilled.describe().endswith("(it is paused: unpause it first, or add --while-paused)")


async def test_a_trigger_near_the_turn_of_the_month_is_refused(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temporal bills the month of its own clock's trigger time. At 23:59:59 on a month's
    last day (arrears, day 28) this host's check passed for the month before last, whose
    firing is past, and the launch, a moment later in the new month, billed last month 28
    days early."""
    real = datetime.now(UTC)
    last_second = datetime(real.year, real.month, 1, tzinfo=UTC) - timedelta(seconds=1)

    class Clock(datetime):
        @classmethod
        def now(cls, tz: tzinfo | None = None) -> Clock:
            return cls.fromtimestamp(last_second.timestamp(), tz)

    config = schedules.MonthlySchedule(schedule_id="on-the-28th", day_of_month=28, paused=True)
    await schedules.create_schedule(harness.client, config, harness.task_queue)
    handle = harness.client.get_schedule_handle("on-the-28th")
    try:
        monkeypatch.setattr(schedules, "datetime", Clock)
        async with harness.pool.acquire() as conn:
            with pytest.raises(InvalidInputError, match="the month turns within 10 minutes"):
                await schedules.trigger(harness.client, conn, "on-the-28th", while_paused=True)
        assert (await handle.describe()).info.num_actions == 0
    finally:
        monkeypatch.undo()
        await handle.delete()


async def test_describe_names_a_cancelled_month_with_the_run_that_bills_it(
    harness: Harness,
) -> None:
    """A cancelled run is a completed one to the ledger, which a launch leaves as it is: its
    month is not billed, and only a run by hand bills it."""
    period = period_for(datetime.now(UTC))
    if period_for(datetime.now(UTC) + timedelta(minutes=1)) != period:
        pytest.skip("at a month's boundary")
    await _billed_in_the_ledger_only(harness, period, charged=0)
    async with harness.pool.acquire() as conn:
        await conn.execute(
            "UPDATE billing_periods SET control = 'cancelled' WHERE billing_period = $1",
            str(period),
        )
    await _paused_burst(harness, "cancelled-month")
    handle = harness.client.get_schedule_handle("cancelled-month")
    try:
        code, _, err = await harness.starter("schedule", "describe", "--id", "cancelled-month")
        assert code == 0, err
        assert "(by hand?)" not in err, err
        assert f"WARNING: cancelled-month launched nothing for {period}, and the runs" in err
        assert "were cancelled; a launch leaves a cancelled run as it is" in err
        assert f"python starter.py run {period}" in err, err
    finally:
        await handle.delete()


async def test_a_key_in_a_pause_note_is_never_shown(harness: Harness) -> None:
    """A note set with Temporal's own tools skips `pause --note`'s redaction."""
    key = "sk_live_" + "A1b2C3d4E5f6G7h8I9j0K1l2"
    config = schedules.MonthlySchedule(schedule_id="noted")
    await schedules.create_schedule(harness.client, config, harness.task_queue)
    handle = harness.client.get_schedule_handle("noted")
    try:
        await handle.pause(note=f"frozen: rotate {key} first")
        for command in ("trigger", "describe", "pause"):
            code, out, err = await harness.starter("schedule", command, "--id", "noted")
            assert code == (2 if command == "trigger" else 0), err
            assert key not in out + err and "[redacted key]" in out + err, (command, out, err)
        # Nor kept by Temporal, whose Web UI shows a note as it is, when given to `--note`.
        given = ("--note", f"rotate {key} first", "--operator", "ann")
        code, _, err = await harness.starter("schedule", "unpause", "--id", "noted", *given)
        assert code == 0, err
        kept = (await handle.describe()).schedule.state.note
        assert kept == "unpaused by ann: rotate [redacted key] first", kept
    finally:
        await handle.delete()


@pytest.mark.parametrize("command", ["pause", "unpause"])
async def test_a_schedule_pause_or_unpause_keeps_who_did_it_and_why(
    harness: Harness, command: str
) -> None:
    """Temporal keeps the note, and `describe` shows it: without it, nobody can tell who
    stopped the monthly billing, or why, nor whether to start it again."""
    config = schedules.MonthlySchedule(schedule_id="noted-by", paused=command == "unpause")
    handle = await schedules.create_schedule(harness.client, config, harness.task_queue)
    given = ("--note", "amounts look wrong", "--operator", "alice")
    code, _, err = await harness.starter("schedule", command, "--id", "noted-by", *given)
    state = (await handle.describe()).schedule.state
    await handle.delete()
    assert code == 0, err
    assert (state.paused, state.note) == (
        command == "pause",
        f"{'unpaused ' if command == 'unpause' else ''}by alice: amounts look wrong",
    )


async def test_a_reconciliation_keeps_the_id_it_is_given(harness: Harness) -> None:
    """`--id billing-monthly` with `--reconcile` was taken for the default and renamed."""
    create = ("schedule", "create", "--reconcile", "--paused")
    # Under the billing schedule's own id, it would follow itself (and check no firing).
    code, out, err = await harness.starter(*create, "--id", schedules.DEFAULT_SCHEDULE_ID)
    assert (code, out) == (2, "") and "would follow itself" in err, err
    elsewhere = await firing_every(harness, "elsewhere", 3600, paused=True)
    for given, created in (
        (
            ("--id", schedules.DEFAULT_SCHEDULE_ID, "--billing-schedule", "elsewhere"),
            schedules.DEFAULT_SCHEDULE_ID,
        ),
        (("--billed-by-hand",), schedules.RECONCILE_SCHEDULE_ID),
    ):
        code, out, err = await harness.starter(*create, *given)
        assert code == 0 and out.startswith(f"created schedule {created}:"), err
        _, request = await schedules.launcher_of(harness.client, created)
        assert request.action == "reconcile"
        await harness.client.get_schedule_handle(created).delete()
    await elsewhere.delete()


async def test_a_schedule_not_ours_is_named_so(harness: Harness) -> None:
    await harness.client.create_schedule(
        "someone-elses",
        Schedule(
            action=ScheduleActionStartWorkflow(
                "NightlyExport", id="export", task_queue=harness.task_queue
            ),
            spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=timedelta(days=1))]),
            state=ScheduleState(paused=True),
        ),
    )
    for command in ("describe", "trigger", "unpause", "delete"):
        code, out, err = await harness.starter("schedule", command, "--id", "someone-elses")
        assert (code, out) == (2, ""), (command, out)
        assert "starts 'NightlyExport', not this project's ScheduledBillingWorkflow" in err
        assert "Traceback" not in err
    # Nor followed: "no billing schedule ... create it first" would send the operator to a
    # create that fails on the id.
    code, out, err = await harness.starter(
        *("schedule", "create", "--reconcile", "--paused", "--billing-schedule", "someone-elses")
    )
    assert (code, out) == (2, "") and "not this project's ScheduledBillingWorkflow" in err, err
    handle = harness.client.get_schedule_handle("someone-elses")
    assert (await handle.describe()).schedule.state.paused
    await handle.delete()


async def written_by_another_release(
    harness: Harness, schedule_id: str, *, paused: bool = False
) -> ScheduleHandle:
    """One of our schedules whose launch arguments this release cannot read."""
    return await harness.client.create_schedule(
        schedule_id,
        Schedule(
            action=ScheduleActionStartWorkflow(
                schedules.LAUNCHER,
                {"time_zone": "UTC", "a_field_of_a_later_release": 1},
                id=f"{schedule_id}-run",
                task_queue=harness.task_queue,
            ),
            spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=timedelta(days=1))]),
            state=ScheduleState(paused=paused),
        ),
    )


async def test_a_schedule_another_release_wrote_can_still_be_paused(harness: Harness) -> None:
    """A pause must not depend on reading the launch's arguments: arguments this release
    cannot read stop only the commands that need them, with a message that says so."""
    await written_by_another_release(harness, "from-elsewhere")
    code, out, err = await harness.starter("schedule", "pause", "--id", "from-elsewhere")
    assert (code, out.strip()) == (0, "paused schedule from-elsewhere"), err
    # Paused already: said so, and the note of who paused it is kept.
    code, out, err = await harness.starter(
        "schedule", "pause", "--id", "from-elsewhere", "--note", "again"
    )
    assert code == 0 and out.startswith("schedule from-elsewhere is paused ("), err
    assert out.rstrip().endswith("): unchanged") and "again" not in out, out
    code, out, err = await harness.starter("schedule", "describe", "--id", "from-elsewhere")
    assert (code, out) == (2, ""), out
    assert "holds arguments this release cannot read" in err and "Traceback" not in err, err
    # Unpaused all the same, and said so: exit 2 read as an unpause that failed.
    code, out, err = await harness.starter("schedule", "unpause", "--id", "from-elsewhere")
    assert (code, out.strip()) == (0, "unpaused schedule from-elsewhere"), err
    assert "note: the firings it skipped were not looked for: the schedule" in err, err
    code, _, err = await harness.starter("schedule", "delete", "--id", "from-elsewhere")
    assert code == 0, err


async def test_a_reconciliation_following_a_schedule_another_release_wrote_is_described(
    harness: Harness,
) -> None:
    """Its `describe` read the billing schedule it follows, to warn if that is gone, and
    failed on that schedule's arguments, naming it as if asked about it (helper-179 nit)."""
    billing = await firing_every(harness, "billing-monthly", 3600, paused=True)
    code, out, err = await harness.starter(
        "schedule", "create", "--reconcile", "--paused", "--id", "daily"
    )
    assert code == 0, err
    await billing.delete()
    await written_by_another_release(harness, "billing-monthly", paused=True)
    code, out, err = await harness.starter("schedule", "describe", "--id", "daily")
    assert code == 0 and "schedule daily" in out, (out, err)
    assert "note: the billing schedule billing-monthly it follows could not be read: the" in err
    assert "warning" not in err, err


async def test_a_reconciliation_is_told_what_it_cannot_follow(harness: Harness) -> None:
    reconcile = ("schedule", "create", "--reconcile", "--paused", "--id")
    # With no billing schedule to follow, it would check no month left unbilled, for good.
    code, out, err = await harness.starter(*reconcile, "alone")
    assert (code, out) == (2, ""), out
    assert "no billing schedule 'billing-monthly' for the reconciliation to follow, so" in err
    assert "--billed-by-hand" in err, err
    with pytest.raises(RPCError, match="not found"):
        await harness.client.get_schedule_handle("alone").describe()
    code, out, err = await harness.starter(*reconcile, "alone", "--billed-by-hand")
    assert code == 0 and out.rstrip().endswith("(billed by hand: following no billing schedule)")
    _, request = await schedules.launcher_of(harness.client, "alone")
    assert request.billing_schedule_id is None
    await firing_every(harness, "billing-monthly", 3600, paused=True, time_zone="Europe/Berlin")
    # Another zone says when it fires; its months are still read in the billing schedule's.
    code, out, err = await harness.starter(*reconcile, "utc", "--time-zone", "UTC")
    assert code == 0, err
    assert out.rstrip().endswith("(following billing-monthly, its months in Europe/Berlin)"), out
    description, request = await schedules.launcher_of(harness.client, "utc")
    assert (description.schedule.spec.time_zone_name, request.time_zone) == (
        "UTC",
        "Europe/Berlin",
    )
    # What each firing reads from the billing schedule itself, should that change since.
    async with harness.pool.acquire() as conn:
        firings = await schedules.billing_firings(
            harness.client, conn, "billing-monthly", datetime.now(UTC)
        )
    assert (firings.billing, firings.time_zone) == ("arrears", "Europe/Berlin")
    code, out, err = await harness.starter(*reconcile, "on-one", "--billing-schedule", "alone")
    assert (code, out) == (2, ""), out
    assert "--billing-schedule alone reconciles: name the schedule that bills" in err
    # Named but mistyped: it was created following nothing, its unbilled-month check off.
    code, out, err = await harness.starter(
        *reconcile, "on-typo", "--billing-schedule", "billing-montly"
    )
    assert (code, out) == (2, ""), out
    assert "no billing schedule 'billing-montly' (mistyped?) for the reconciliation" in err
    code, out, err = await harness.starter(
        *reconcile, "on-both", "--billing-schedule", "billing-monthly", "--billed-by-hand"
    )
    assert (code, out) == (2, ""), out
    assert "--billed-by-hand says the reconciliation follows no billing schedule" in err
    # A backfill of a reconciliation would start one launch a day, all reconciling one period.
    month = str(period_for(datetime.now(UTC), "advance").previous())
    backfill = ("schedule", "backfill", "--id", "utc", "--start", month, "--end", month)
    code, out, err = await harness.starter(*backfill)
    assert (code, out) == (2, "") and "utc reconciles, and bills nothing to backfill" in err
    # Deleted, the billing schedule leaves "utc" following nothing: said at the delete, and
    # by describe (helper-177 F2), not only in the worker's log at its next firing.
    gone = "utc follows the billing schedule billing-monthly, which is gone or does not bill"
    await eventually(lambda: _lists(harness, "utc"))
    code, out, err = await harness.starter("schedule", "delete", "--id", "billing-monthly")
    assert code == 0 and f"warning: {gone}" in err, (out, err)
    code, out, err = await harness.starter("schedule", "describe", "--id", "utc")
    assert code == 0 and f"warning: {gone}" in err, (out, err)
    # Its id taken by a reconciliation: no firing of that bills a month either.
    code, out, err = await harness.starter(*reconcile, "billing-monthly", "--billed-by-hand")
    assert code == 0, err
    code, out, err = await harness.starter("schedule", "describe", "--id", "utc")
    await harness.client.get_schedule_handle("billing-monthly").delete()
    assert code == 0 and f"warning: {gone}" in err, (out, err)
    code, out, err = await harness.starter("schedule", "describe", "--id", "alone")
    assert code == 0 and "warning" not in err, (out, err)
    for made in ("alone", "utc"):
        await harness.client.get_schedule_handle(made).delete()


async def _lists(harness: Harness, schedule_id: str) -> bool:
    """Whether Temporal's list of schedules (its visibility, which lags) has the schedule."""
    return schedule_id in [s.id async for s in await harness.client.list_schedules()]


@pytest.mark.parametrize("billing", ["arrears", "advance"])
async def test_a_billing_schedule_that_would_leave_months_unbilled_is_refused(
    harness: Harness, billing: Billing
) -> None:
    """Between the ledger's latest run and the month a new schedule first bills (billing
    stopped for a while, or switched from advance to arrears), months would go unbilled. In
    advance, the first firing bills its own month: read as arrears, the gap looked a month
    shorter, and the month before that firing went unbilled unsaid."""
    config = schedules.MonthlySchedule(billing=billing)
    first = period_for(schedules.first_firing(config, datetime.now(UTC)), config.billing)
    gap = [first.previous().previous(), first.previous()]
    await _billed_in_the_ledger_only(harness, gap[0].previous(), charged=0)
    create = ("schedule", "create", "--paused", "--billing", billing)
    code, out, err = await harness.starter(*create)
    assert (code, out) == (2, ""), out
    assert f"{gap[0]}, {gap[1]} would be billed by nothing" in err, err
    assert f"python starter.py run {gap[0]}; python starter.py run {gap[1]}" in err
    assert "--leave-unbilled" in err and "nothing was created" in err
    with pytest.raises(RPCError, match="not found"):
        await harness.client.get_schedule_handle(config.schedule_id).describe()
    code, out, err = await harness.starter(*create, "--leave-unbilled")
    assert code == 0 and out.startswith(f"created schedule {config.schedule_id}"), err
    await harness.client.get_schedule_handle(config.schedule_id).delete()
    # Once the gap is billed, nothing stands in the way.
    for period in gap:
        await _billed_in_the_ledger_only(harness, period, charged=0)
    assert (await harness.starter(*create))[0] == 0


async def test_a_month_billed_ahead_by_hand_does_not_hide_the_months_unbilled_before_it(
    harness: Harness,
) -> None:
    """The gap runs from the latest run before the schedule's first month: a run of that
    month itself (started by hand ahead of the schedule) leaves the months before unbilled."""
    config = schedules.MonthlySchedule()
    now = datetime.now(UTC)
    first = period_for(schedules.first_firing(config, now), config.billing)
    gap = [first.previous().previous(), first.previous()]
    await _billed_in_the_ledger_only(harness, gap[0].previous(), charged=0)
    await _billed_in_the_ledger_only(harness, first, charged=0)
    async with harness.pool.acquire() as conn:
        unbilled = await schedules.unbilled_before(conn, config, now)
    assert unbilled is not None and unbilled.periods == gap


async def test_the_daily_reconciliation_follows_its_billing_schedule_and_flags_a_month_unbilled(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """It checks the months the billing schedule bills, in that schedule's mode and zone; and
    a firing of it that billed nothing (paused, missed past the catch-up window, its launch cut
    short), which Temporal never makes up, is logged and counted for an alert."""
    zone = ZoneInfo("Pacific/Auckland")
    # Hourly instead of monthly, so that a reconciliation days ahead has firings behind it.
    await firing_every(
        harness, "billing-monthly", 3600, paused=True, time_zone=zone.key, billing="advance"
    )
    reconcile = ("schedule", "create", "--reconcile", "--paused")
    code, out, err = await harness.starter(*reconcile, "--billing", "arrears")
    assert (code, out) == (2, ""), out
    assert "--billing arrears differs from the billing schedule billing-monthly's (advance)" in err
    code, out, err = await harness.starter(*reconcile)
    assert code == 0 and out.rstrip().endswith(
        f"{zone.key}, reconciling the period billed in advance (following billing-monthly)"
    ), (out, err)
    _, request = await schedules.launcher_of(harness.client, schedules.RECONCILE_SCHEDULE_ID)
    assert (request.time_zone, request.billing_schedule_id) == (zone.key, "billing-monthly")
    code, out, _ = await harness.starter(
        "schedule", "describe", "--id", schedules.RECONCILE_SCHEDULE_ID
    )
    assert code == 0 and f" ({zone.key})\n" in out, out
    assert (
        "reconciles the latest period billed, following the billing schedule billing-monthly" in out
    )
    # Its next firings in the zone it fires in, as "fires" reads (+12:00 or +13:00), not UTC.
    [upcoming] = [line for line in out.splitlines() if line.startswith("  next: ")]
    assert "+00:00" not in upcoming and ("+13:00" in upcoming or "+12:00" in upcoming), out
    code, out, _ = await harness.starter("schedule", "describe", "--id", "billing-monthly")
    assert code == 0 and f"\n  bills each firing's month (advance, months in {zone.key})\n" in out
    handle = harness.client.get_schedule_handle(schedules.RECONCILE_SCHEDULE_ID)

    def counted(metric: str = "billing_unbilled_firings_total") -> float:
        return metric_value(metric, schedule="billing-monthly")

    async def ahead(days: int) -> datetime:
        """A launch time `days` ahead: a backfill may be in the future."""
        start = datetime.now(UTC) + timedelta(days=days)
        end = start + timedelta(days=1)
        [nominal] = await schedules.matching_times(harness.client, handle.id, start, end)
        return nominal

    def billed_before(nominal: datetime, zone: ZoneInfo, billing: Billing) -> Period:
        """The month a billing schedule firing an hour before `nominal` bills."""
        return period_for((nominal - schedules.FIRING_GRACE).astimezone(zone), billing)

    async def fired_for(nominal: datetime, zone: ZoneInfo, billing: Billing) -> list[Period]:
        """The months the billing schedule fired for, since its creation, an hour or more
        before `nominal`."""
        billing_schedule = harness.client.get_schedule_handle("billing-monthly")
        created = (await billing_schedule.describe()).info.created_at
        fired = await schedules.matching_times(
            harness.client, billing_schedule.id, created, nominal - schedules.FIRING_GRACE
        )
        return sorted({period_for(at.astimezone(zone), billing) for at in fired})

    async def launch(nominal: datetime) -> tuple[str, WorkflowHistory]:
        """The launch's details, as the Web UI shows them, and its history."""
        window = ScheduleBackfill(
            nominal, nominal + timedelta(minutes=1), ScheduleOverlapPolicy.ALLOW_ALL
        )
        await handle.backfill(window)

        async def launched() -> list[str]:
            actions = (await handle.describe()).info.recent_actions
            return [
                a.action.workflow_id  # type: ignore[attr-defined]
                for a in actions
                if a.scheduled_at == nominal
            ]

        await eventually(lambda: _nonempty(launched()))
        [launcher_id] = await launched()
        return await _ended_with(harness.client.get_workflow_handle(launcher_id))

    def checked_since(moment: datetime) -> bool:
        """Whether a daily check ran since: the gauge a watchdog's alert reads."""
        return counted("billing_schedule_checked_timestamp_seconds") >= moment.timestamp()

    async with harness.running_worker():
        before = counted()
        begun = datetime.now(UTC)
        nominal = await ahead(days=2)
        period = billed_before(nominal, zone, "advance")
        months = await fired_for(nominal, zone, "advance")
        assert months[-1] == period
        listed = ", ".join(map(str, months))
        details, flagged = await launch(nominal)
        assert details.startswith("neither") and "nothing to reconcile; WARNING:" in details
        assert f"no run bills {listed}, though the billing schedule billing-monthly" in details
        assert "(the schedule is paused)" in details
        assert f"backfill --id billing-monthly --start {months[0]} --end {period}" in details
        assert counted() == before + 1 and checked_since(begun)
        [record] = [r for r in caplog.records if getattr(r, "event", "") == "unbilled_firing"]
        assert record.__dict__["period"] == str(period)
        assert record.__dict__["earlier"] == [str(m) for m in months[:-1]]
        # The billing schedule is made anew, in arrears in UTC, firing daily (40 days span two
        # months): the reconciliation follows it, and a month missed stays flagged once a
        # later one is billed.
        await harness.client.get_schedule_handle("billing-monthly").delete()
        # Gone, it bills nothing at all: said as loudly.
        gone = counted("billing_followed_schedule_gone_total")
        begun = datetime.now(UTC)
        details, _ = await launch(await ahead(days=3))
        assert checked_since(begun)
        assert "WARNING: the billing schedule billing-monthly is gone or could not be" in details
        assert counted("billing_followed_schedule_gone_total") == gone + 1
        assert any(getattr(r, "event", "") == "followed_schedule_gone" for r in caplog.records)
        await firing_every(harness, "billing-monthly", 24 * 3600, paused=True)
        # The launch on the 1st (in Auckland, where it fires) 40 days or more ahead: still the
        # month before in UTC, whose clock the billing schedule now follows.
        local = (datetime.now(UTC) + timedelta(days=40)).astimezone(zone)
        first = Period(local.year, local.month).next()
        start = datetime(first.year, first.month, 1, tzinfo=zone)
        [nominal] = await schedules.matching_times(
            harness.client, handle.id, start, start + timedelta(days=1)
        )
        assert period_for(nominal.astimezone(UTC), "advance") != first, nominal
        period = billed_before(nominal, ZoneInfo("UTC"), "arrears")
        months = await fired_for(nominal, ZoneInfo("UTC"), "arrears")
        assert len(months) >= 2, months
        # Billed: the month reconciled, the month an advance schedule in Auckland would
        # reconcile then, and the latest month fired for; not the months fired for before.
        billed = {period, period.next(), months[-1]}
        for month in billed:
            await _billed_in_the_ledger_only(harness, month, charged=0)
        details, _ = await launch(nominal)
        missed = ", ".join(map(str, months[:-1]))
        # The months billed besides are reconciled too, never having been.
        assert f"{period.next()} (never reconciled)" in details
        details = _without_rechecks(details)
        assert details.startswith(f"started {reconcile_workflow_id(period)}; WARNING:"), details
        assert f"no run bills {missed}, though the billing schedule billing-monthly" in details
        assert counted() == before + 2
        # Once those are billed, nothing is flagged.
        await harness.client.get_workflow_handle(reconcile_workflow_id(period)).result()
        [nominal] = await schedules.matching_times(
            harness.client, handle.id, nominal + timedelta(hours=1), nominal + timedelta(days=1)
        )
        period = billed_before(nominal, ZoneInfo("UTC"), "arrears")
        months = await fired_for(nominal, ZoneInfo("UTC"), "arrears")
        for month in {period, period.next(), *months} - billed:
            await _billed_in_the_ledger_only(harness, month, charged=0)
        details, quiet = await launch(nominal)
        assert _without_rechecks(details) == f"started {reconcile_workflow_id(period)}"
        assert counted() == before + 2
    await handle.delete()
    # I6 for the patched path: RECORD_HISTORIES=1 keeps both in tests/histories.
    await replay([flagged, quiet])
    keep([flagged, quiet])


async def test_a_daily_reconciliation_whose_billing_schedule_cannot_be_read_still_runs(
    harness: Harness,
) -> None:
    """The schedule it follows rewritten by a release whose arguments this one cannot read:
    each firing says so and reconciles all the same, in its own mode and zone, reading it
    once (no retry reads it). The launch failed there (helper-207: a local activity's last
    failure reaches the workflow as itself, not in the ActivityError it caught), leaving every
    month unreconciled unsaid."""
    await firing_every(harness, "billing-monthly", 3600, paused=True)
    code, _, err = await harness.starter("schedule", "create", "--reconcile", "--paused")
    assert code == 0, err
    await harness.client.get_schedule_handle("billing-monthly").delete()
    await written_by_another_release(harness, "billing-monthly", paused=True)
    reads = ScheduleReads()
    details, history = await _checked_once(harness, reads)
    warning = "WARNING: the billing schedule billing-monthly is gone or could not be read"
    assert warning in details, details
    assert reads.reads == 1
    # I6 for the patched path: RECORD_HISTORIES=1 keeps it in tests/histories.
    await replay([history])
    keep([history])


class ScheduleReads(Interceptor):
    """Counts the readings of a followed billing schedule (`reads`); with `fail_first`, fails
    the first, as a moment's outage does (`failed`)."""

    def __init__(self, *, fail_first: bool = False) -> None:
        self.fail_first = fail_first
        self.reads = 0
        self.failed = 0

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        counted = self

        class Counting(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                if activity.info().activity_type == "billing_firings":
                    counted.reads += 1
                    if counted.fail_first and not counted.failed:
                        counted.failed += 1
                        raise RuntimeError("the schedule could not be read for a moment")
                return await super().execute_activity(input)

        return Counting(next)


async def _checked_once(harness: Harness, reads: ScheduleReads) -> tuple[str, WorkflowHistory]:
    """The daily reconciliation triggered once, `reads` counting its readings of the billing
    schedule it follows: its launch's details and history. Both schedules are deleted."""
    handle = harness.client.get_schedule_handle(schedules.RECONCILE_SCHEDULE_ID)
    try:
        async with harness.running_worker(interceptors=[reads]):
            await handle.trigger()
            return await _ended_with(await _nth_launch(harness.client, handle, 1))
    finally:
        for made in (handle.id, "billing-monthly"):
            await harness.client.get_schedule_handle(made).delete()


async def test_a_billing_schedule_unread_for_a_moment_is_read_again_not_called_gone(
    harness: Harness,
) -> None:
    """A moment's failure to read the followed billing schedule is tried again: given up at
    once, the firing would warn of a schedule gone and check no month it bills."""
    await firing_every(harness, "billing-monthly", 3600, paused=True)
    code, _, err = await harness.starter("schedule", "create", "--reconcile", "--paused")
    assert code == 0, err
    moment = ScheduleReads(fail_first=True)
    details, _ = await _checked_once(harness, moment)
    assert moment.failed == 1
    assert "gone or could not be read" not in details, details


async def test_a_billing_firing_within_the_hour_is_not_called_unbilled(harness: Harness) -> None:
    """The daily check fires at the billing schedule's time by default (02:00, on the 1st
    too): a firing whose run has had no time to reach the ledger is not yet unbilled, or
    every month would open with a false alert."""
    handle = await firing_every(harness, "just-fired", 3600, paused=True)
    created = (await handle.describe()).info.created_at
    [fired, *_] = await schedules.matching_times(
        harness.client, handle.id, created, created + timedelta(hours=2)
    )

    async def unbilled(now: datetime) -> schedules.UnbilledFiring | None:
        async with harness.pool.acquire() as conn:
            firings = await schedules.billing_firings(harness.client, conn, handle.id, now)
        return firings.unbilled

    try:
        assert await unbilled(fired + schedules.FIRING_GRACE / 2) is None
        late = await unbilled(fired + schedules.FIRING_GRACE)
        assert late is not None and (late.at, late.period) == (fired, period_for(fired)), late
    finally:
        await handle.delete()


async def test_the_daily_reconciliation_checks_the_month_before_until_this_ones_run_starts(
    harness: Harness,
) -> None:
    """Early in a month whose run has yet to start, a daily reconciliation checks the month
    billed last (its charges in doubt, its claims left open); once the new month's run has
    started, that month. Checking only the month not yet billed, it would find nothing
    while the last month's doubts stayed unresolved."""
    latest = PeriodActivities(harness.pool, harness.settings).latest_billed
    assert await latest(str(PERIOD)) is None
    await harness.open_period_by_hand(PERIOD.previous())
    assert await latest(str(PERIOD)) == str(PERIOD.previous())
    await harness.open_period_by_hand(PERIOD)
    assert await latest(str(PERIOD)) == str(PERIOD)


@pytest.mark.parametrize("control", ["running", "paused", "cancelled"])
async def test_a_launched_run_terminated_midway_is_flagged_until_it_is_started_again(
    harness: Harness, control: str
) -> None:
    """A launch starts its month's run, which an operator then terminates (it looked
    stuck): the ledger holds it open for good, no launch starts it again, and reconciliation
    reads only claims, so its customers not yet claimed were billed by nobody while the
    daily check (any ledger row counted as run) and `describe` (the launch had started its
    run) said nothing (helper-138's F1). Both now name the month, until a launch bills it;
    one paused first too, but not one an operator cancelled first, whose customers stay
    unbilled as asked: its remedy would have charged them (helper-140's F1)."""
    customers = await harness.seed(6)
    await harness.set_faults(latency_ms=800)
    period = period_for(datetime.now(UTC), "advance")
    if period_for(datetime.now(UTC) + timedelta(minutes=2), "advance") != period:
        pytest.skip("the month turns during the test")
    config = schedules.MonthlySchedule(schedule_id="cut-short", billing="advance", paused=True)
    # One charge at a time, so that the terminate finds customers unclaimed; hourly, so that
    # the daily check two hours on has a firing for the month behind it.
    schedule = schedules.build_schedule(config, harness.task_queue, RunOptions(max_in_flight=1))
    schedule.spec = ScheduleSpec(intervals=[_fired_every(3600)])
    handle = await harness.client.create_schedule("cut-short", schedule)
    run = harness.client.get_workflow_handle(period_workflow_id(period))
    # A cancelled run finishes its charge in flight, then closes: held there, it is
    # terminated before the ledger has it closed.
    hold = ActivityHold("close_period*")

    async def daily_check() -> schedules.UnbilledFiring | None:
        later = datetime.now(UTC) + timedelta(hours=2)
        async with harness.pool.acquire() as conn:
            firings = await schedules.billing_firings(harness.client, conn, "cut-short", later)
        return firings.unbilled

    try:
        async with harness.running_worker(interceptors=[hold]):
            await handle.trigger()
            await eventually(lambda: _nonempty(harness.ledger_rows(str(period))), timeout=30)
            if control == "paused":
                await operations.control(harness.client, period, "pause", ALICE)
            elif control == "cancelled":
                await operations.control(harness.client, period, "cancel", ALICE)
                await asyncio.wait_for(hold.reached.wait(), 60)
            await run.terminate("looked stuck")
            rows = await harness.ledger_rows(str(period))
            charged = [r for r in rows if r["status"] == "charged"]
            assert len(charged) < len(customers), "the run finished before the terminate"
            unbilled = await daily_check()
            code, _, err = await harness.starter("schedule", "describe", "--id", "cut-short")
            assert code == 0, err
            if control == "cancelled":
                assert unbilled is None, unbilled
                assert "WARNING" not in err, err
                # Nor does a launch undo the cancel: its new run would have charged them.
                code, _, err = await harness.starter(
                    "schedule", "trigger", "--id", "cut-short", "--while-paused", "--early"
                )
                assert code == 2 and f"{period}'s run was cancelled (it may still" in err, err
                await handle.trigger()
                await (await _nth_launch(harness.client, handle, 2)).result()
                assert [r["status"] for r in await harness.ledger_rows(str(period))] == [
                    r["status"] for r in rows
                ]
                return
            assert unbilled is not None and unbilled.period == period, unbilled
            assert unbilled.ended_unfinished == [period]
            assert (
                f"the run of {period} ended (terminated, failed) before it finished"
                in unbilled.describe()
            )
            assert f"WARNING: the runs cut-short launched for {period} ended" in err
            # The schedule is paused: a backfill without --while-paused would be refused.
            backfill = f"schedule backfill --id cut-short --start {period} --end {period}"
            assert backfill + schedules.while_paused(True) in err, err
            # A launch starts the run again (the hourly spec leaves a backfill none to make).
            hold.go.set()
            await handle.trigger()
            await eventually(lambda: _completed(harness, period), timeout=60)
            assert await daily_check() is None
            code, _, err = await harness.starter("schedule", "describe", "--id", "cut-short")
            assert "WARNING" not in err, err
    finally:
        hold.go.set()
        await handle.delete()
    await assert_billed_once(harness, str(period), customers)


@pytest.mark.parametrize(
    "ledger_url",
    ["postgresql://billing@127.0.0.1:1/billing", "postgresql://billing:pa/ss#w@host/db"],
    ids=["unreachable", "malformed"],
)
async def test_describe_says_what_it_could_not_read_and_succeeds(
    harness: Harness, ledger_url: str
) -> None:
    """The ledger is read only to say more: with it away, or its URL malformed, `describe`
    printed the schedule, then exited 2 with the connection's error. Firings it skipped
    are named all the same, as if no month were billed since."""
    handle = await firing_every(harness, "no-ledger", 1, paused=True)
    missed = partial(schedules.missed_launches, harness.client, "no-ledger")
    await eventually(lambda: _nonempty(missed()), timeout=30)
    try:
        process = await harness.starter_process(
            "schedule", "describe", "--id", "no-ledger", DATABASE_URL=ledger_url
        )
        out, err = (part.decode() for part in await process.communicate())
    finally:
        await handle.delete()
    assert process.returncode == 0, err
    assert out.startswith("schedule no-ledger"), out
    assert "note: the ledger could not be read" in err and "Traceback" not in err, err
    assert "WARNING: no-ledger launched nothing at" in err, err
    assert "months billed since by hand are listed too" in err, err
    assert "pa/ss" not in err


def _without_rechecks(details: str) -> str:
    """A launch's details without the earlier periods it reconciled again."""
    return re.sub(r"; also reconciling again [^;]*", "", details)


def test_a_monthly_time_the_clocks_skip_is_refused() -> None:
    # Berlin's clocks jump from 02:00 to 03:00 on the last Sunday of March: 2027-03-28.
    with pytest.raises(
        ValidationError, match="02:30 does not exist in Europe/Berlin on 2027-03-28"
    ):
        schedules.MonthlySchedule(day_of_month=28, hour=2, minute=30, time_zone="Europe/Berlin")
    # An hour the clocks never skip, or a daily reconciliation (the next day covers it).
    schedules.MonthlySchedule(day_of_month=28, hour=3, minute=30, time_zone="Europe/Berlin")
    schedules.MonthlySchedule(
        day_of_month=28, hour=2, minute=30, time_zone="Europe/Berlin", action="reconcile"
    )


def test_backfill_window_is_in_the_schedules_zone() -> None:
    start, end = schedules.backfill_window(
        Period(2026, 1), Period(2026, 3), "arrears", "Europe/Berlin"
    )
    assert start.isoformat() == "2026-02-01T00:00:00+01:00"
    assert end - start < timedelta(days=91)
    assert end.month == 4


@pytest.mark.parametrize(
    ("billing", "run", "after"),
    [("arrears", (3000, 1), (3000, 2)), ("advance", (2999, 12), (3000, 1))],
)
def test_backfill_window_of_the_last_period_there_is(
    billing: Billing, run: tuple[int, int], after: tuple[int, int]
) -> None:
    # Its run in arrears is in the year 3000, where no period is: once a crash, not a window.
    last = Period(2999, 12)
    start, end = schedules.backfill_window(last, last, billing, "UTC")
    assert (start, end) == (
        datetime(*run, 1, tzinfo=UTC),
        datetime(*after, 1, tzinfo=UTC) - timedelta(seconds=1),
    )


async def test_a_pause_of_a_paused_run_and_a_resume_of_a_running_one_are_refused(
    harness: Harness,
) -> None:
    """A second pause would replace the first's reason: for a run that paused itself, the
    advice `status` gives (renew-keys, not resume)."""
    await harness.seed(4)
    await harness.set_faults(latency_ms=300)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, SLOW)
        with pytest.raises(operations.OperatorRefusedError, match="nothing to resume"):
            await operations.control(harness.client, PERIOD, "resume", ALICE)
        await operations.control(harness.client, PERIOD, "pause", ALICE)
        bob = OperatorRequest(reason="me too", operator="bob")
        with pytest.raises(
            operations.OperatorRefusedError, match="paused already, by alice: amounts look wrong"
        ):
            await operations.control(harness.client, PERIOD, "pause", bob)
        progress = await period_status(harness.client, PERIOD)
        assert (progress.operator, progress.reason) == ("alice", "amounts look wrong")
        await operations.control(harness.client, PERIOD, "resume", bob)
        summary = await handle.result()
    assert summary.charged == 4


async def test_skipping_an_unknown_customer_during_a_run_says_so(harness: Harness) -> None:
    await harness.seed(8)
    await harness.set_faults(latency_ms=150)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, SLOW)
        await operations.control(harness.client, PERIOD, "pause", ALICE)
        nobody = SkipRequest(customer_id="nobody", reason="disputed", operator="carol")
        with pytest.raises(operations.OperatorRefusedError, match="'nobody' is not in the ledger"):
            await operations.skip(
                harness.client, harness.settings, harness.database_url, PERIOD, nobody
            )
        await operations.control(harness.client, PERIOD, "cancel", ALICE)
        summary = await handle.result()
    assert (summary.due, summary.charged + summary.cancelled) == (8, 8)
    assert "nobody" not in {r["customer_id"] for r in await harness.ledger_rows(str(PERIOD))}


@pytest.mark.parametrize("cancelled", [False, True], ids=["completed", "cancelled"])
async def test_a_run_is_said_over_only_once_the_ledger_has_it_closed(
    harness: Harness, cancelled: bool
) -> None:
    """`status` and `watch` read the run's query; `backfill` and `trigger` read the ledger.
    The query said completed while the close was still to be written, and a backfill started
    then found the period not yet billed."""
    customers = await harness.seed(2)
    hold = ActivityHold("close_period*")
    async with harness.running_worker(interceptors=[hold]):
        if cancelled:
            await harness.set_faults(latency_ms=1500)
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        if cancelled:
            # Cancelled while both charges are out: it finishes them, then closes.
            await eventually(lambda: at_least(harness.money_requests(), 2))
            await operations.control(harness.client, PERIOD, "cancel", ALICE)
        await asyncio.wait_for(hold.reached.wait(), 60)
        progress = await period_status(harness.client, PERIOD)
        assert progress.state == ("cancelling" if cancelled else "closing"), progress
        assert progress.in_flight == 0
        async with harness.pool.acquire() as conn:
            assert await ledger.completed_runs(conn, [str(PERIOD)]) == {}
        hold.go.set()
        summary = await asyncio.wait_for(handle.result(), 60)
        progress = await period_status(harness.client, PERIOD)
    assert progress.state == ("cancelled" if cancelled else "completed")
    async with harness.pool.acquire() as conn:
        assert str(PERIOD) in await ledger.completed_runs(conn, [str(PERIOD)])
    assert summary.charged == 2
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_skip_sent_as_the_run_closes_is_written_before_it_ends(harness: Harness) -> None:
    """Refused while the run wrote its close, a skip was to be sent again once it had ended;
    but the close may find customers imported behind the listing, which the run then bills.
    The skip is taken, and the run waits for it: a customer imported as the run closed and
    skipped then is not billed by it, and is counted skipped."""
    customers = await harness.seed(1)
    hold = ActivityHold("close_period*")
    async with harness.running_worker(interceptors=[hold]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await asyncio.wait_for(hold.reached.wait(), 60)
        (added,) = await harness.seed(1, prefix="late")
        late = SkipRequest(customer_id=added.customer_id, reason="disputed", operator="carol")
        accepted = await accepted_updates(handle)
        skipping = asyncio.create_task(
            operations.skip(harness.client, harness.settings, harness.database_url, PERIOD, late)
        )
        await update_taken(handle, skipping, accepted)
        hold.go.set()
        summary = await asyncio.wait_for(handle.result(), 60)
        assert (await skipping).skipped
    assert (summary.due, summary.charged, summary.skipped) == (2, 1, 1)
    rows = {r["customer_id"]: r["status"] for r in await harness.ledger_rows(str(PERIOD))}
    assert rows == {customers[0].customer_id: "charged", added.customer_id: "skipped"}


class ProgressQueriesFail(Interceptor):
    """A run's `progress` query fails: always, or with `replaying` only when answered by
    replaying the run's history, as one once did right after its run closed (a
    nondeterminism error from the SDK's core)."""

    def __init__(self, *, replaying: bool = False) -> None:
        self._replaying = replaying

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor]:
        replaying_only = self._replaying

        class Failing(WorkflowInboundInterceptor):
            def handle_query(self, input: HandleQueryInput) -> Any:
                if input.query == "progress" and (
                    workflow.unsafe.is_replaying() or not replaying_only
                ):
                    raise RuntimeError("query handler broken")
                return super().handle_query(input)

        return Failing


async def test_a_status_asked_as_the_run_closes_says_how_it_ended(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Open when `status` (or `watch`) looked, closed when it queried: the query is answered
    by replaying the run's history, and when that fails, the run's summary answers."""
    customers = await harness.seed(2)
    async with harness.running_worker(interceptors=[ProgressQueriesFail(replaying=True)]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        summary = await handle.result()
        describe = WorkflowHandle.describe

        async def seen_open_once(self: WorkflowHandle[Any, Any], **kwargs: Any) -> Any:
            monkeypatch.setattr(WorkflowHandle, "describe", describe)
            seen = await describe(self, **kwargs)
            return dataclasses.replace(seen, status=WorkflowExecutionStatus.RUNNING)

        monkeypatch.setattr(WorkflowHandle, "describe", seen_open_once)
        progress = await period_status(harness.client, PERIOD)
    assert summary.charged == 2
    assert (progress.state, progress.charged) == ("completed", 2)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_status_of_an_open_run_whose_query_fails_says_so_and_does_not_wait(
    harness: Harness,
) -> None:
    """A failed query of a run still open is the answer: `status` does not wait for the run
    to end (as it does for one that closed meanwhile) without a word."""
    await harness.seed(2)
    hold = BillHold()
    async with harness.running_worker(interceptors=[ProgressQueriesFail(), hold]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await asyncio.wait_for(hold.reached.wait(), 30)
        with pytest.raises(WorkflowQueryFailedError, match="query handler broken"):
            await asyncio.wait_for(period_status(harness.client, PERIOD), 30)
        hold.go.set()
        assert (await handle.result()).charged == 2


@pytest.mark.parametrize("wait", [False, True], ids=["once", "wait"])
async def test_run_in_a_namespace_without_the_search_attributes_says_to_run_setup(
    harness: Harness, wait: bool
) -> None:
    """Temporal refuses a start naming a search attribute its namespace lacks: the command
    says what to run, not only Temporal's words (helper-163 F5). Nothing starts. With
    --wait, a refusal is an answer, not Temporal away: it is not tried again for ever."""
    bare = f"bare-{uuid.uuid4().hex[:8]}"
    await harness.client.workflow_service.register_namespace(
        RegisterNamespaceRequest(
            namespace=bare, workflow_execution_retention_period=Duration(seconds=86400)
        )
    )
    flags = ["--wait"] if wait else []
    process = await harness.starter_process("run", str(PERIOD), *flags, TEMPORAL_NAMESPACE=bare)
    try:
        _, err = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
    stderr = err.decode()
    assert process.returncode == 2, stderr
    assert "search attribute" in stderr and "`python starter.py setup` registers them" in stderr

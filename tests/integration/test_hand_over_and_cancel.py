"""Temporal's cancel and a run handing over to its next (continue-as-new) at the same time
(helper-160): the cancel is never lost, and a customer is counted by one run only.

The billing task hands over by raising continue-as-new, which the SDK applies only once it
leaves the top-level `run`: a cancel `run` is writing lands first. A run that hands over waits
one short timer (SETTLE_BEFORE_HAND_OVER), so that a cancel that came in the same workflow task
as the signals that took it past its limit reaches `run` before it ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import timedelta
from functools import partial
from typing import Any, NamedTuple

import pytest
import temporalio.workflow
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from activities.stripe_gateway import StripeGateway
from billing import operations
from billing.customers import CustomerRow
from billing.keys import customer_workflow_id, period_workflow_id
from billing.models import ChargeFailure, OperatorRequest, PeriodSummary, RunOptions, SkipRequest
from billing.periods import Period
from billing.runs import start_period
from tests.integration.harness import (
    Harness,
    accepted_updates,
    at_least,
    single_batch_activations,
)
from tests.integration.invariants import assert_billed_once
from tests.integration.replay import keep, replay
from tests.integration.timeline import timeline
from tests.waiting import eventually
from workflows.billing_period import HAND_OVER_SETTLE, BillingPeriodWorkflow

PERIOD = Period(2026, 12)
BOB = OperatorRequest(reason="looking into it", operator="bob")
LIMIT = 200  # RunOptions.history_event_limit's least
IN_FLIGHT = 60  # children whose starts are sent before the pause, every one held at its bill
HELD = 3  # children kept in flight through the hand-over, to meet the paused gate
DUE = IN_FLIGHT + 10  # the rest are never started: the cancel marks them
# Set-ups of a paused run past its limit tried, each on a period of its own, before failing:
# on a loaded machine the starts' events may take the run past its limit first
# (_premise_missed).
ATTEMPTS = 3

E = EventType
# The hand-over's timer, widened so that a test can act within it (_stretch_hand_over_timer).
STRETCHED = timedelta(seconds=6)
# A run's history at most: the limit, then each child's report while the hand-over waits (an
# event and, on a loaded machine, a workflow task each), and the cancel's writes.
REPORTS_BOUND = LIMIT + 4 * IN_FLIGHT + 40


class HoldWritesAndBills(Interceptor):
    """Holds the period's first control write of each word ("paused", "cancelled") until
    let go; holds every customer's bill of `period` until `bills_go`, and those of `late`
    customers until `late_go`, and fails those of other periods (_abandon)."""

    def __init__(self, late: set[str], period: Period = PERIOD) -> None:
        self.late = late
        self.period = str(period)
        self.reached: dict[str, asyncio.Event] = {
            w: asyncio.Event() for w in ("paused", "cancelled")
        }
        self.go: dict[str, asyncio.Event] = {w: asyncio.Event() for w in ("paused", "cancelled")}
        self.bills_go = asyncio.Event()
        self.late_go = asyncio.Event()
        self.billing: set[str] = set()
        self.abandoned = False

    def release_all(self) -> None:
        """Let everything go (a failed test then shuts its worker down at once)."""
        for event in (*self.go.values(), self.bills_go, self.late_go):
            event.set()

    def abandon(self) -> None:
        """Fail everything held, with nothing written or charged (an abandoned set-up's)."""
        self.abandoned = True
        self.release_all()

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        hold = self

        class Held(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                name = activity.info().activity_type
                if name == "set_control":
                    word = input.args[0].control
                    if word in hold.go and not hold.go[word].is_set():
                        hold.reached[word].set()
                        await asyncio.wait_for(hold.go[word].wait(), 90)
                elif name == "bill":
                    if input.args[0].period != hold.period:
                        # A child of an abandoned set-up, started as it was torn down.
                        raise ApplicationError("another set-up's bill", non_retryable=True)
                    customer_id = input.args[0].customer_id
                    hold.billing.add(customer_id)
                    await asyncio.wait_for(hold.bills_go.wait(), 90)
                    if customer_id in hold.late:
                        await asyncio.wait_for(hold.late_go.wait(), 90)
                if hold.abandoned:
                    raise ApplicationError("the test abandoned this set-up", non_retryable=True)
                return await super().execute_activity(input)

        return Held(next)


async def _events(handle: WorkflowHandle[Any, Any]) -> list[HistoryEvent]:
    return [e async for e in handle.fetch_history_events()]


async def _running(handle: WorkflowHandle[Any, Any]) -> bool:
    return (await handle.describe()).status == WorkflowExecutionStatus.RUNNING


def _first(events: list[HistoryEvent], match: Callable[[HistoryEvent], bool]) -> int | None:
    return next((e.event_id for e in events if match(e)), None)


def _is(kind: int) -> Callable[[HistoryEvent], bool]:
    return lambda e: e.event_type == kind


class PausedPastTheLimit(NamedTuple):
    period: Period
    hold: HoldWritesAndBills
    handle: WorkflowHandle[Any, PeriodSummary]
    first: WorkflowHandle[Any, Any]
    pausing: asyncio.Task[Any]


@contextlib.asynccontextmanager
async def _cancelled_while_paused_past_the_limit(
    harness: Harness,
    late: set[str],
    options: RunOptions,
    customer_ids: list[str],
    released: Iterable[asyncio.Event] = (),
) -> AsyncIterator[PausedPastTheLimit]:
    """A run paused past its limit and cancelled (_set_up), with a worker whose
    HoldWritesAndBills holds `late`. Yields it, the worker still running; `released` (whatever
    else the test holds) is let go with the hold before the worker stops. A set-up whose first
    run was not paused under its limit is abandoned and made again on the next period."""
    missed: list[str] = []
    for attempt in range(ATTEMPTS):
        period = Period(*PERIOD.later(attempt))
        hold = HoldWritesAndBills(late, period)
        async with harness.running_worker(interceptors=[hold]):
            try:
                made = await _set_up(harness, hold, period, options, customer_ids)
                if isinstance(made, PausedPastTheLimit):
                    yield made
                    return
                missed.append(f"{period}: {made}")
            finally:
                hold.release_all()
                for event in released:
                    event.set()
    pytest.fail(
        f"no set-up's first run was paused under its limit in {ATTEMPTS} attempts: "
        + "; ".join(missed)
    )


async def _set_up(
    harness: Harness,
    hold: HoldWritesAndBills,
    period: Period,
    options: RunOptions,
    customer_ids: list[str],
) -> PausedPastTheLimit | str:
    """Starts the period's run; once it has sent its children's starts, pauses it, its write
    held (`pausing`), and lets the bills go: the ledger still says running, so every child but
    the late ones charges and reports, past the run's history limit. Then Temporal's cancel,
    taken by the run. If the first run did not take the pause under its limit, the set-up is
    abandoned (_abandon) before any bill goes: what happened instead."""
    handle = await start_period(harness.client, period, harness.task_queue, options)
    first = harness.client.get_workflow_handle(handle.id, run_id=(await handle.describe()).run_id)
    told = partial(timeline, first)
    # Paused as soon as it can be (a pause while the run lists its batch puts the batch
    # back): the starts' own events, up to five each on a loaded machine, are still to come.
    await eventually(lambda: _starts_sent(first), timeout=30, explain=told)
    pausing = asyncio.create_task(operations.control(harness.client, period, "pause", BOB))
    await asyncio.wait_for(hold.reached["paused"].wait(), 30)
    missed = await _premise_missed(first)
    if missed is not None:
        await _abandon(harness, hold, period, customer_ids, pausing)
        return missed
    hold.bills_go.set()
    await eventually(lambda: _paused_past_the_limit(first), timeout=60, explain=told)
    await handle.cancel()
    await eventually(lambda: _cancel_taken(first), timeout=30, explain=told)
    return PausedPastTheLimit(period, hold, handle, first, pausing)


async def _starts_sent(first: WorkflowHandle[Any, Any]) -> bool:
    """The run has sent every child's start (in one workflow task): its batch is taken."""
    events = await _events(first)
    kind = E.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
    return sum(e.event_type == kind for e in events) == IN_FLIGHT


async def _premise_missed(first: WorkflowHandle[Any, Any]) -> str | None:
    """Unless the pause was taken by the first run in a workflow task begun under its limit
    (the run then waits for it in the fan-out's paused branch), what happened instead. On a
    loaded machine the starts' events may pass the limit first, each start brought in a
    workflow task of its own (up to five events a start: no window both fits under the limit
    and reports past it for sure): the run then hands over before the pause, or takes it while
    handing over."""
    events = await _events(first)
    accepted = _first(events, _is(E.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED))
    if accepted is None:
        ended = events[-1]
        return (
            f"the first run ended ({EventType.Name(ended.event_type)}, event {ended.event_id})"
            " before it took the pause"
        )
    task = max(
        e.workflow_task_completed_event_attributes.started_event_id
        for e in events
        if e.event_type == E.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and e.event_id < accepted
    )
    if task >= LIMIT:
        return f"the first run took the pause in a workflow task begun at event {task}"
    return None


async def _abandon(
    harness: Harness,
    hold: HoldWritesAndBills,
    period: Period,
    customer_ids: list[str],
    pausing: asyncio.Task[Any],
) -> None:
    """Ends a set-up with nothing written or charged: the period's run and every child it
    started terminated, then what the hold kept failed. (A child whose start was under way
    may escape: the next set-up's hold fails its bill.)"""
    pausing.cancel()
    # Its end, whichever error the client makes of the cancel.
    await asyncio.gather(pausing, return_exceptions=True)
    ids = [period_workflow_id(period), *(customer_workflow_id(period, c) for c in customer_ids)]
    for workflow_id in ids:
        try:
            await harness.client.get_workflow_handle(workflow_id).terminate("set-up abandoned")
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:  # a customer never started
                raise
    hold.abandon()


async def _paused_past_the_limit(first: WorkflowHandle[Any, Any]) -> bool:
    """The pause accepted, every child but the HELD ones reported, and a workflow task past
    the limit done after both: the run waits for the pause's write to hand over."""
    events = await _events(first)
    accepted = _first(events, _is(E.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED))
    reported = [
        e.event_id
        for e in events
        if e.event_type == E.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED
    ]
    if accepted is None or len(reported) < IN_FLIGHT - HELD:
        return False
    return _task_done_after(events, max(accepted, *reported), started_at=LIMIT)


async def _cancel_taken(first: WorkflowHandle[Any, Any]) -> bool:
    """Temporal's cancel requested, and a workflow task done since."""
    events = await _events(first)
    asked = _first(events, _is(E.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED))
    return asked is not None and _task_done_after(events, asked)


def _control_writes(events: list[HistoryEvent]) -> dict[str, tuple[int, int | None]]:
    """Each set_control's word: (scheduled event id, completed event id or None)."""
    scheduled: dict[int, str] = {}
    found: dict[str, tuple[int, int | None]] = {}
    for e in events:
        if e.event_type == E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = e.activity_task_scheduled_event_attributes
            if attrs.activity_type.name == "set_control":
                word = json.loads(attrs.input.payloads[0].data)["control"]
                scheduled[e.event_id] = word
                found.setdefault(word, (e.event_id, None))
        elif e.event_type == E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            sid = e.activity_task_completed_event_attributes.scheduled_event_id
            if sid in scheduled:
                word = scheduled[sid]
                found[word] = (found[word][0], e.event_id)
    return found


def _task_done_after(events: list[HistoryEvent], event_id: int, *, started_at: int = 0) -> bool:
    """A workflow task started after `event_id` (at or past event `started_at`) completed."""
    started = [
        e.event_id
        for e in events
        if e.event_type == E.EVENT_TYPE_WORKFLOW_TASK_STARTED
        and e.event_id > event_id
        and e.event_id >= started_at
    ]
    return any(
        e.event_type == E.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
        and e.workflow_task_completed_event_attributes.started_event_id in started
        for e in events
    )


@pytest.mark.parametrize("single_batch", [False, True], ids=["sdk-default", "sdk-flag-2"])
async def test_a_temporal_cancel_of_a_paused_run_handing_over_lands_before_it_continues(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, single_batch: bool
) -> None:
    """Paused, its pause's write held; its children (the ledger still running) report and
    push its history past the limit: the billing task waits, in the paused branch, for the
    pause's answer to hand over. Temporal's cancel then comes; the pause's write lands and
    the billing task hands over in the activation that schedules the cancel's write: the run
    continues as new only once that write has landed, and its next run ends the period
    cancelled, the children it handed over woken and never charged. Also under the
    activation rule the SDK means to make its default (its logic flag 2)."""
    if single_batch:
        single_batch_activations(monkeypatch)
    customers = await harness.seed(DUE)
    ids = sorted(c.customer_id for c in customers)
    late = set(ids[:HELD])  # listed first: among the children started
    options = RunOptions(
        max_in_flight=IN_FLIGHT,
        max_starting=IN_FLIGHT,
        history_event_limit=LIMIT,
        hand_over_after_seconds=1,
    )
    async with _cancelled_while_paused_past_the_limit(harness, late, options, ids) as (
        period,
        hold,
        handle,
        first,
        pausing,
    ):
        assert not pausing.done()
        # The pause's write lands: its handler finishes, the billing task hands over, and
        # `run` schedules the cancel's write, all in one activation.
        hold.go["paused"].set()

        async def written_or_closed() -> bool:
            return hold.reached["cancelled"].is_set() or not await _running(first)

        await eventually(written_or_closed, timeout=30)
        # The workflow task that scheduled the cancel's write has completed; the run has not
        # continued as new: the cancel's write is still held.
        assert await _running(first), "the run continued as new before the cancel's write"
        answered = await asyncio.wait_for(pausing, 30)
        assert answered.state == "cancelling"
        # The late children now meet the ledger's gate paused, and wait for the period's word.
        hold.late_go.set()

        async def waiting_at_the_gate() -> bool:
            for customer_id in late:
                child = harness.client.get_workflow_handle(
                    customer_workflow_id(period, customer_id)
                )
                events = await _events(child)
                if _first(events, _is(E.EVENT_TYPE_TIMER_STARTED)) is None:
                    return False
            return True

        await eventually(waiting_at_the_gate, timeout=30)
        assert await _running(first)
        assert not _first(
            await _events(first), _is(E.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW)
        )
        hold.go["cancelled"].set()
        summary: PeriodSummary = await asyncio.wait_for(handle.result(), 60)

    events = await _events(first)
    ended = events[-1]
    assert ended.event_type == E.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
    writes = _control_writes(events)
    accepted = _first(events, _is(E.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED))
    asked = _first(events, _is(E.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED))
    assert accepted is not None and asked is not None
    # The pause came before the cancel (taken under the limit: the fan-out's paused branch)...
    assert accepted < asked < (writes["paused"][1] or 0)
    # ... which the run took while the pause's write was held: its write scheduled only once
    # the pause's had landed, and landed before the run continued as new.
    paused_done = writes["paused"][1]
    cancel_scheduled, cancel_done = writes["cancelled"]
    assert paused_done is not None and cancel_done is not None
    assert paused_done < cancel_scheduled < cancel_done < ended.event_id
    # The billing task handed over from the paused branch: it never began the cancel's paging.
    scheduled_here = {
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in events
        if e.event_type == E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    }
    assert "cancel_unstarted" not in scheduled_here
    # The children in flight were woken after the cancel's write, before the run ended.
    woken = [
        e.event_id
        for e in events
        if e.event_type == E.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
    ]
    assert len(woken) == HELD and all(cancel_done < w < ended.event_id for w in woken)

    assert (summary.cancelled_by, summary.due) == ("temporal", DUE)
    assert (summary.charged, summary.cancelled) == (IN_FLIGHT - HELD, DUE - IN_FLIGHT + HELD)
    control, _, _ = await harness.period_control(period)
    assert control == "cancelled"
    charged = {c["metadata"]["customer_id"] for c in await harness.charges()}
    cancelled = frozenset(c.customer_id for c in customers if c.customer_id not in charged)
    assert late <= cancelled and len(cancelled) == DUE - IN_FLIGHT + HELD
    await assert_billed_once(harness, str(period), customers, cancelled=cancelled)
    runs = await harness.chain_of_runs(handle.id, bound=REPORTS_BOUND)
    assert runs[0].run_id == first.run_id
    await replay(runs)


async def test_a_temporal_cancel_with_signals_taking_a_paused_run_past_its_limit_is_kept(
    harness: Harness,
) -> None:
    """A paused run, under its history limit, gets signals that take it past the limit and
    Temporal's cancel in one workflow task. Under the SDK's job order without its logic flag 2
    the signals run a pass first, in which the run handed over; the cancel, applied after and
    not carried across continue-as-new, was lost: the next run stayed paused, the ledger too,
    and a resume billed the customers the cancel was to stop (helper-160 F1)."""
    await harness.seed(5)
    await harness.set_faults(latency_ms=1000)
    options = RunOptions(max_in_flight=1, history_event_limit=LIMIT)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, options)
        first = harness.client.get_workflow_handle(
            handle.id, run_id=(await handle.describe()).run_id
        )
        await eventually(lambda: at_least(harness.money_requests(), 1))
        await operations.control(harness.client, PERIOD, "pause", BOB)
        await eventually(lambda: at_least(harness.succeeded(), 1))

        async def idle() -> bool:
            return (await first.describe()).raw_description.pending_activities == []

        await eventually(idle, timeout=30)
    length = (await first.describe()).raw_description.workflow_execution_info.history_length
    assert length < LIMIT
    # With no worker, all of these reach the run in its next workflow task.
    blocked = ChargeFailure(code="card_declined", message="not a key's refusal")
    for _ in range(LIMIT - length + 5):
        await first.signal(BillingPeriodWorkflow.period_blocked, blocked)
    await first.cancel()
    async with harness.running_worker():
        summary: PeriodSummary = await asyncio.wait_for(handle.result(), 60)
    assert summary.cancelled_by == "temporal"
    control, _, _ = await harness.period_control(PERIOD)
    assert control == "cancelled"
    events = await _events(first)
    assert events[-1].event_type == E.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
    runs = await harness.chain_of_runs(handle.id, bound=LIMIT + 100)
    await replay(runs)
    keep(runs)


async def test_children_reporting_between_the_hand_over_and_the_cancels_write_count_once(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Children past the gate report while `run` writes Temporal's cancel, the billing task
    having handed over already: they were counted in this run and handed over all the same,
    the next run counting them again (due 70, counted 73; helper-160 F2)."""

    customers = await harness.seed(DUE)
    ids = sorted(c.customer_id for c in customers)
    late = set(ids[:HELD])
    charge_go = asyncio.Event()
    real = StripeGateway.charge

    async def held_charge(self: StripeGateway, claim: Any, *args: Any, **kwargs: Any) -> Any:
        if claim.customer_id in late:
            await asyncio.wait_for(charge_go.wait(), 90)
        return await real(self, claim, *args, **kwargs)

    monkeypatch.setattr(StripeGateway, "charge", held_charge)
    options = RunOptions(max_in_flight=IN_FLIGHT, max_starting=IN_FLIGHT, history_event_limit=LIMIT)
    async with _cancelled_while_paused_past_the_limit(
        harness, set(), options, ids, released=[charge_go]
    ) as (period, hold, handle, first, pausing):
        hold.go["paused"].set()
        await asyncio.wait_for(hold.reached["cancelled"].wait(), 30)
        await asyncio.wait_for(pausing, 30)
        charge_go.set()

        async def reported() -> bool:
            events = await _events(first)
            done = [
                e.event_id
                for e in events
                if e.event_type == E.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED
            ]
            return len(done) == IN_FLIGHT and _task_done_after(events, max(done))

        await eventually(reported, timeout=30)
        assert await _running(first)
        hold.go["cancelled"].set()
        summary: PeriodSummary = await asyncio.wait_for(handle.result(), 60)
    assert (summary.due, summary.charged, summary.cancelled) == (
        DUE,
        IN_FLIGHT,
        DUE - IN_FLIGHT,
    )
    await assert_billed_once(
        harness,
        str(period),
        customers,
        cancelled=frozenset(ids) - {c["metadata"]["customer_id"] for c in await harness.charges()},
    )


async def _billing(hold: HoldWritesAndBills, count: int) -> bool:
    return len(hold.billing) >= count


def _stretch_hand_over_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Widens the hand-over's wait for a later workflow task (its timer, HAND_OVER_SETTLE)
    so that a test can act within it on a run with nothing else to bring one."""
    real = temporalio.workflow.wait_condition

    async def wait_condition(
        fn: Callable[[], bool],
        *,
        timeout: timedelta | float | None = None,
        timeout_summary: str | None = None,
    ) -> None:
        if timeout == HAND_OVER_SETTLE:
            timeout = STRETCHED
        await real(fn, timeout=timeout, timeout_summary=timeout_summary)

    monkeypatch.setattr(temporalio.workflow, "wait_condition", wait_condition)


async def _settling(first: WorkflowHandle[Any, Any]) -> bool:
    """The run has handed over and waits its stretched timer (_stretch_hand_over_wait)."""
    return any(
        e.event_type == E.EVENT_TYPE_TIMER_STARTED
        and e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta() == STRETCHED
        for e in await _events(first)
    )


async def _skipped_into_the_hand_over(
    harness: Harness, first: WorkflowHandle[Any, Any], customers: list[CustomerRow]
) -> None:
    """Skips of customers not yet listed, from the last, take the run past its limit: it
    hands over, its children in flight, and waits for a later workflow task."""
    for customer in reversed(customers):
        if await _settling(first):
            break
        skip = SkipRequest(customer_id=customer.customer_id, reason="r", operator="o")
        await operations.skip(harness.client, harness.settings, harness.database_url, PERIOD, skip)
    assert await _settling(first), "the run never handed over"


@contextlib.asynccontextmanager
async def _handed_over(
    harness: Harness, hold: HoldWritesAndBills, customers: list[CustomerRow]
) -> AsyncIterator[tuple[WorkflowHandle[Any, Any], WorkflowHandle[Any, Any]]]:
    """A run whose bills `hold` keeps (no child reports: nothing brings it a workflow task),
    skipped past its limit: it has handed over and waits its stretched timer. Yields its
    handle and its first run's; terminated after."""
    options = RunOptions(
        max_in_flight=5, max_starting=5, history_event_limit=LIMIT, hand_over_after_seconds=0
    )
    async with harness.running_worker(interceptors=[hold]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue, options)
        first = harness.client.get_workflow_handle(
            handle.id, run_id=(await handle.describe()).run_id
        )
        try:
            await eventually(lambda: _billing(hold, 5), timeout=30)
            await _skipped_into_the_hand_over(harness, first, customers)
            yield handle, first
        finally:
            hold.release_all()
            with contextlib.suppress(Exception):
                await handle.terminate("test over")


async def test_a_pause_given_as_the_run_hands_over_is_taken_by_its_next_run(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that has handed over refuses an update (HANDING_OVER) until its next run takes
    over: the operator's pause is tried again on that run, not refused with a "try again"."""
    _stretch_hand_over_wait(monkeypatch)
    customers = await harness.seed(60)
    hold = HoldWritesAndBills(set())  # every bill held: nothing else brings a workflow task
    for released in (hold.late_go, *hold.go.values()):
        released.set()
    async with _handed_over(harness, hold, customers) as (_, first):
        progress = await operations.control(harness.client, PERIOD, "pause", BOB)
        assert progress.state == "paused"
        assert await accepted_updates(first, "pause") == 0, "the run handing over took it"


async def test_a_temporal_cancel_while_the_hand_over_awaits_a_handler_is_kept(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handing over, `run` waits for a handler (a child's key refusal pausing the run, its
    write held); Temporal's cancel then came and was taken for the wait's end: the run
    handed over paused, the cancel lost (helper-164 R1)."""
    _stretch_hand_over_wait(monkeypatch)
    customers = await harness.seed(60)
    # Every bill held (no child reports: nothing brings the run a workflow task), and the
    # run's first write of "paused".
    hold = HoldWritesAndBills(set())
    for released in (hold.late_go, hold.go["cancelled"]):
        released.set()
    async with _handed_over(harness, hold, customers) as (handle, first):
        # A child's key refusal arrives: the run pauses, its write held, and `_settled`
        # waits for that handler.
        await first.signal(
            BillingPeriodWorkflow.period_blocked,
            ChargeFailure(code="spend_cap_exceeded", message="cap reached"),
        )
        await asyncio.wait_for(hold.reached["paused"].wait(), 30)
        await first.cancel()
        await eventually(lambda: _cancel_taken(first), timeout=30)
        hold.go["paused"].set()
        hold.bills_go.set()

        async def ledger_cancelled() -> bool:
            control, _, _ = await harness.period_control(PERIOD)
            return control == "cancelled"

        # The cancel is written and carried on: the chain ends cancelled.
        await eventually(ledger_cancelled, timeout=30)
        summary: PeriodSummary = await asyncio.wait_for(handle.result(), 60)
        assert summary.cancelled_by == "temporal"

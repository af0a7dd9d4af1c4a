"""A period's runs are told apart in the ledger (migrations/031): a run terminated as it
closed, whose close activity still finishes on its worker, leaves alone the period a later run
has opened since."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from temporalio import activity
from temporalio import workflow as wf
from temporalio.api.common.v1 import WorkflowExecution as ExecutionRef
from temporalio.api.enums.v1 import EventType, PendingActivityState
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

import activities.period as period_activities
import billing.ledger.runs as ledger_runs
from billing import ledger, operations
from billing.customers import CustomerRow, import_customers
from billing.models import OperatorRequest, PeriodPlan, PeriodSummary, RunIdentity
from billing.periods import Period
from billing.runs import start_period
from billing.seeding import create_demo_customers
from tests.integration.harness import Harness
from tests.integration.holds import ActivityHold
from tests.integration.invariants import assert_billed_once
from tests.integration.test_vault_integration import (
    charging_one_at_a_time,
    period_key,
    priced_past_the_cap,
)
from tests.waiting import eventually
from workflows.billing_period import LISTINGS_MARKED

PERIOD = Period(2026, 12)
OPENED = datetime(2026, 12, 1, 3, 0, tzinfo=UTC)


class HoldEachRun(Interceptor):
    """Holds each run's activities of the given kinds ("prepare_period", "close_period",
    matched as prefixes of the activity's type), each (kind, run) until let go (with
    `first_try_only`, only their first tries), and says when one is reached and when it has
    ended."""

    def __init__(self, *kinds: str, first_try_only: bool = False) -> None:
        self.kinds = kinds
        self.first_try_only = first_try_only
        self._reached: defaultdict[tuple[str, str], asyncio.Event] = defaultdict(asyncio.Event)
        self._go_on: defaultdict[tuple[str, str], asyncio.Event] = defaultdict(asyncio.Event)
        self._ended: defaultdict[tuple[str, str], asyncio.Event] = defaultdict(asyncio.Event)
        self._any: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self._released: set[str] = set()

    async def reached(self, kind: str, run: str) -> None:
        await asyncio.wait_for(self._reached[kind, run].wait(), 60)

    async def reached_any(self, kind: str) -> None:
        """Once any run's activity of `kind` is held (a customer's, whose run is its own)."""
        await asyncio.wait_for(self._any[kind].wait(), 60)

    def release(self, kind: str, run: str) -> None:
        self._go_on[kind, run].set()

    def release_all(self, kind: str) -> None:
        """Let every activity of `kind` go, those held and those to come."""
        self._released.add(kind)
        for held, run in list(self._reached):
            if held == kind:
                self._go_on[held, run].set()

    def hold_again(self, kind: str) -> None:
        """Hold the activities of `kind` to come again, after release_all."""
        self._released.discard(kind)

    async def ended(self, kind: str, run: str) -> None:
        await asyncio.wait_for(self._ended[kind, run].wait(), 30)

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        hold = self

        class Held(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                info = activity.info()
                kind = [k for k in hold.kinds if info.activity_type.startswith(k)]
                if (
                    not kind
                    or kind[0] in hold._released
                    or (hold.first_try_only and info.attempt > 1)
                ):
                    return await super().execute_activity(input)
                key = (kind[0], info.workflow_run_id or "")
                hold._reached[key].set()
                hold._any[kind[0]].set()
                await asyncio.wait_for(hold._go_on[key].wait(), 60)
                try:
                    return await super().execute_activity(input)
                finally:
                    hold._ended[key].set()

        return Held(next)


CLOSE = "close_period"
PREPARE = "prepare_period"
SET_CONTROL = "set_control"
BILL = "bill"
CLOSE_IF_ALL_MARKED = "close_period_if_all_marked"
CLOSE_IF_ALL_REACHED = "close_period_if_all_reached"
DUE = "due_customers"
CANCEL_UNSTARTED = "cancel_unstarted"
RENEW = "renew_period_keys"
ALICE = OperatorRequest(reason="prices raised", operator="alice")


async def _terminated_at_its_close(
    harness: Harness, hold: HoldEachRun
) -> tuple[WorkflowHandle[Any, PeriodSummary], str]:
    """A run started, let through its opening (if `hold` holds openings), held at its close
    and terminated there: its workflow and its run id."""
    handle = await start_period(harness.client, PERIOD, harness.task_queue)
    run = (await handle.describe()).run_id
    if PREPARE in hold.kinds:
        hold.release(PREPARE, run)
    await hold.reached(CLOSE, run)
    await handle.terminate(reason="stuck at its close")
    return handle, run


@pytest.mark.parametrize("cancelled", [False, True], ids=["completed", "cancelled"])
async def test_a_terminated_runs_close_leaves_a_later_runs_period_alone(
    harness: Harness, cancelled: bool
) -> None:
    """The first run is terminated while its close waits; a rerun opens the period; the first
    close then finishes. It marked the rerun's period completed with its own summary, and the
    rerun's close, finding it so, wrote nothing."""
    customers = await harness.seed(2)
    hold = HoldEachRun(CLOSE)
    async with harness.running_worker(interceptors=[hold]):
        first = await start_period(harness.client, PERIOD, harness.task_queue)
        if cancelled:
            await first.cancel()
        first_run = (await first.describe()).run_id
        await hold.reached(CLOSE, first_run)
        await first.terminate(reason="stuck, says the operator")
        rerun = await start_period(harness.client, PERIOD, harness.task_queue)
        rerun_id = (await rerun.describe()).run_id
        assert rerun_id != first_run
        await hold.reached(CLOSE, rerun_id)
        hold.release(CLOSE, first_run)
        await hold.ended(CLOSE, first_run)
        async with harness.pool.acquire() as conn:
            record = await ledger.period_record(conn, str(PERIOD))
        assert record is not None and (record.state, record.run_id) == ("running", rerun_id)
        hold.release(CLOSE, rerun_id)
        summary = await asyncio.wait_for(rerun.result(), 30)
    assert summary.run_id == rerun_id
    async with harness.pool.acquire() as conn:
        record = await ledger.period_record(conn, str(PERIOD))
    assert record is not None
    assert (record.state, record.summary) == ("completed", summary)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_terminated_runs_late_opening_leaves_a_later_runs_period_alone(
    harness: Harness,
) -> None:
    """The first run is terminated while its opening is on its way (a slow vault, say); a
    rerun opens the period; the first opening then finishes. It wrote its own run over the
    rerun's row, whose close then wrote nothing (helper-154 F1): it is refused now."""
    customers = await harness.seed(2)
    hold = HoldEachRun(PREPARE, CLOSE)
    async with harness.running_worker(interceptors=[hold]):
        first = await start_period(harness.client, PERIOD, harness.task_queue)
        first_run = (await first.describe()).run_id
        await hold.reached(PREPARE, first_run)
        await first.terminate(reason="stuck at its opening")
        rerun = await start_period(harness.client, PERIOD, harness.task_queue)
        rerun_id = (await rerun.describe()).run_id
        await hold.reached(PREPARE, rerun_id)
        hold.release(PREPARE, rerun_id)
        await hold.reached(CLOSE, rerun_id)
        hold.release(PREPARE, first_run)
        await hold.ended(PREPARE, first_run)
        hold.release(CLOSE, rerun_id)
        summary = await asyncio.wait_for(rerun.result(), 30)
    async with harness.pool.acquire() as conn:
        record = await ledger.period_record(conn, str(PERIOD))
    assert record is not None
    assert (record.state, record.run_id, record.summary) == ("completed", rerun_id, summary)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_an_opening_by_a_release_from_before_clears_the_runs_identity(
    harness: Harness,
) -> None:
    """An opening by a worker of the release before migrations/031 (a rolling upgrade, a
    rollback) writes neither column: the row would keep the last run's, and its opening time
    (migrations/031's trigger clears both; the database's clock stands in)."""
    await harness.seed(1)
    plan = PeriodPlan(period=str(PERIOD), due=1, to_charge=1, expected_total_cents=1_000)
    async with harness.pool.acquire() as conn:
        await ledger.start_period(
            conn, plan, "by-hand", RunIdentity(run_id="r-1", opened_at=OPENED)
        )
        assert await ledger.run_opened_at(conn, str(PERIOD)) == OPENED
        # The release before's opening, as it wrote the row.
        await conn.execute(
            "UPDATE billing_periods SET state = 'running', summary = NULL, started_at = now()"
            " WHERE billing_period = $1",
            str(PERIOD),
        )
        record = await ledger.period_record(conn, str(PERIOD))
        opened = await ledger.run_opened_at(conn, str(PERIOD))
        started = await conn.fetchval(
            "SELECT started_at FROM billing_periods WHERE billing_period = $1", str(PERIOD)
        )
    assert record is not None and record.run_id is None
    assert opened == started


async def test_a_stale_try_of_a_runs_opening_leaves_the_period_it_closed_alone(
    harness: Harness,
) -> None:
    """The opening's first try, on a worker frozen past its timeout, finishes after the
    second try opened the period and the run closed it: it reopened the month (running, no
    summary, its control reset) for good (helper-155 A1). It is not the current try."""
    customers = await harness.seed(2)
    hold = HoldEachRun(PREPARE, first_try_only=True)
    async with harness.running_worker(interceptors=[hold]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        run = (await handle.describe()).run_id
        await hold.reached(PREPARE, run)
        # As its timeout would: Temporal fails the first try, and the second runs.
        [pending] = (await handle.describe()).raw_description.pending_activities
        await harness.client.get_async_activity_handle(
            workflow_id=handle.id, run_id=run, activity_id=pending.activity_id
        ).fail(ApplicationError("its worker froze"))
        summary = await asyncio.wait_for(handle.result(), 60)
        hold.release(PREPARE, run)
        await hold.ended(PREPARE, run)
        async with harness.pool.acquire() as conn:
            record = await ledger.period_record(conn, str(PERIOD))
    assert record is not None and (record.state, record.summary) == ("completed", summary)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_terminated_runs_close_leaves_its_reset_run_alone(harness: Harness) -> None:
    """A stuck at its close, terminated; a customer imported; A reset to before its opening.
    A' opens and bills all three; A's close, still on its worker, then wrote A's summary over
    A''s period (the same first run id), and A''s close found it completed (helper-157 H1)."""
    customers = await harness.seed(2)
    hold = HoldEachRun(PREPARE, CLOSE)
    async with harness.running_worker(interceptors=[hold]):
        handle, stuck = await _terminated_at_its_close(harness, hold)
        customers += await harness.seed(1, prefix="late")
        reset = await _reset_to(harness, handle.id, stuck, after_opening=False)
        hold.release(PREPARE, reset)
        await hold.reached(CLOSE, reset)
        hold.release(CLOSE, stuck)
        await hold.ended(CLOSE, stuck)
        hold.release(CLOSE, reset)
        summary = await _result_of(harness, handle.id, reset)
        async with harness.pool.acquire() as conn:
            record = await ledger.period_record(conn, str(PERIOD))
    assert summary.due == 3
    assert record is not None and (record.state, record.summary) == ("completed", summary)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_terminated_runs_late_control_leaves_a_reruns_alone(harness: Harness) -> None:
    """A cancelled (Temporal's cancel) as it opens, its write of the cancel held on a frozen
    worker; A terminated, a rerun B opens and bills. A's write then landed on B's row: B's
    customers met a cancelled gate, and the month read as cancelled (helper-157 H2)."""
    customers = await harness.seed(2)
    hold = HoldEachRun(PREPARE, SET_CONTROL, BILL)
    async with harness.running_worker(interceptors=[hold]):
        first = await start_period(harness.client, PERIOD, harness.task_queue)
        stuck = (await first.describe()).run_id
        await hold.reached(PREPARE, stuck)
        await first.cancel()
        await hold.reached(SET_CONTROL, stuck)
        await first.terminate(reason="stuck, says the operator")
        rerun = await start_period(harness.client, PERIOD, harness.task_queue)
        rerun_id = (await rerun.describe()).run_id
        hold.release(PREPARE, rerun_id)
        await hold.reached_any(BILL)
        hold.release(SET_CONTROL, stuck)
        await hold.ended(SET_CONTROL, stuck)
        hold.release_all(BILL)
        hold.release(PREPARE, stuck)
        summary = await asyncio.wait_for(rerun.result(), 60)
        control, _, _ = await harness.period_control(PERIOD)
    assert (summary.charged, summary.cancelled, control) == (2, 0, "running")
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_terminated_runs_late_cancel_of_its_unstarted_leaves_a_reruns_alone(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancelled (Temporal's cancel) as it opens, its page of customers not started held on
    a frozen worker as it marks them cancelled; A terminated, a rerun B opens and claims its
    customers. A's page then marked B's claims cancelled before their charge: B charged none
    of them, and no later run could (a claimed row cancelled is not reopened)."""
    customers = await harness.seed(2)
    hold = HoldEachRun(PREPARE, CANCEL_UNSTARTED)
    claims: list[str] = []
    charge = asyncio.Event()
    begin_charge = ledger.begin_charge

    async def claimed_then_held(conn: asyncpg.Connection, claim: Any, route: Any) -> Any:
        claims.append(claim.customer_id)
        await asyncio.wait_for(charge.wait(), 60)
        return await begin_charge(conn, claim, route)

    monkeypatch.setattr(ledger, "begin_charge", claimed_then_held)
    async with harness.running_worker(interceptors=[hold]):
        first = await start_period(harness.client, PERIOD, harness.task_queue)
        stuck = (await first.describe()).run_id
        await hold.reached(PREPARE, stuck)
        await first.cancel()
        hold.release(PREPARE, stuck)
        await hold.reached(CANCEL_UNSTARTED, stuck)
        await first.terminate(reason="stuck, says the operator")
        rerun = await start_period(harness.client, PERIOD, harness.task_queue)
        hold.release(PREPARE, (await rerun.describe()).run_id)
        await eventually(lambda: _all_claimed(claims, customers))
        hold.release(CANCEL_UNSTARTED, stuck)
        await hold.ended(CANCEL_UNSTARTED, stuck)
        charge.set()
        summary = await asyncio.wait_for(rerun.result(), 60)
    assert (summary.charged, summary.cancelled) == (2, 0), summary
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_terminated_runs_late_key_renewal_leaves_a_reruns_keys_alone(
    vaulted: Harness,
) -> None:
    """A run paused at its key's cap, its renewal held on a frozen worker; the run terminated,
    a rerun opens with a key capped for what is left, and prices rise again before it lists
    anyone. The late renewal replaced the rerun's key, and revoked it under its workers."""
    await vaulted.seed(4)
    assert vaulted.vault is not None
    hold = HoldEachRun(RENEW, DUE)
    async with vaulted.running_worker(interceptors=[hold]):
        hold.release_all(DUE)
        first = await charging_one_at_a_time(vaulted)
        stuck = (await first.describe()).run_id
        await priced_past_the_cap(vaulted)
        hold.hold_again(DUE)
        renewing = asyncio.create_task(operations.renew_keys(vaulted.client, PERIOD, ALICE))
        await hold.reached(RENEW, stuck)
        await first.terminate(reason="stuck, says the operator")
        with pytest.raises(operations.OperatorRefusedError):
            await renewing
        rerun = await start_period(vaulted.client, PERIOD, vaulted.task_queue)
        try:
            await hold.reached(DUE, (await rerun.describe()).run_id)
            opened_with = await period_key(vaulted)
            async with vaulted.pool.acquire() as conn:
                await conn.execute("UPDATE customers SET amount_cents = amount_cents * 10")
            hold.release(RENEW, stuck)
            await hold.ended(RENEW, stuck)
            assert await period_key(vaulted) == opened_with
            assert not (await vaulted.vault.admin.get_key(opened_with)).revoked
        finally:
            await rerun.terminate(reason="test over")


async def _all_claimed(claims: list[str], customers: list[CustomerRow]) -> bool:
    return sorted(claims) == sorted(c.customer_id for c in customers)


@pytest.mark.parametrize("rerun_between", [False, True], ids=["alone", "after-a-rerun"])
async def test_a_run_reset_past_its_opening_closes_as_the_run_that_opened_it(
    harness: Harness, rerun_between: bool
) -> None:
    """An operator who terminated a run stuck at its close may reset it to after its opening
    once the fault is fixed: the reset run keeps the first run id of its chain (Temporal copies
    the start event), so its close is the opening's, and writes. Had a rerun been tried in
    between (stuck at its close too, and terminated), the row is the rerun's: the reset run,
    open while the rerun is not, takes it over (it wrote nothing, helper-155 A2)."""
    customers = await harness.seed(2)
    hold = HoldEachRun(CLOSE)
    async with harness.running_worker(interceptors=[hold]):
        handle, stuck = await _terminated_at_its_close(harness, hold)
        ended = [stuck]
        if rerun_between:
            rerun = await start_period(harness.client, PERIOD, harness.task_queue)
            ended.append((await rerun.describe()).run_id)
            await hold.reached(CLOSE, ended[-1])
            await rerun.terminate(reason="stuck at its close too")
        reset = await _reset_to(harness, handle.id, stuck)
        await hold.reached(CLOSE, reset)
        hold.release(CLOSE, reset)
        summary = await _result_of(harness, handle.id, reset)
        async with harness.pool.acquire() as conn:
            record = await ledger.period_record(conn, str(PERIOD))
        # The ended runs' closes, still on the worker, write nothing: their runs are over.
        for run in ended:
            hold.release(CLOSE, run)
            await hold.ended(CLOSE, run)
        async with harness.pool.acquire() as conn:
            assert await ledger.period_record(conn, str(PERIOD)) == record
    assert summary.run_id == stuck
    assert record is not None and (record.state, record.summary) == ("completed", summary)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_terminated_reruns_late_opening_leaves_the_period_a_reset_run_closed(
    harness: Harness,
) -> None:
    """A stuck at its close, terminated; a rerun B stuck at its opening (a slow vault, a
    frozen worker), terminated; the operator resets A past its opening. A' closes. B's
    opening then finishes: tried after A's opening, it passed the time guard and reopened
    the closed month for good (helper-156 G1). An opening whose run has ended opens nothing."""
    customers = await harness.seed(2)
    hold = HoldEachRun(PREPARE, CLOSE)
    async with harness.running_worker(interceptors=[hold]):
        handle, a = await _terminated_at_its_close(harness, hold)
        rerun = await start_period(harness.client, PERIOD, harness.task_queue)
        b = (await rerun.describe()).run_id
        await hold.reached(PREPARE, b)
        await rerun.terminate(reason="stuck at its opening too")
        reset = await _reset_to(harness, handle.id, a)
        await hold.reached(CLOSE, reset)
        hold.release(CLOSE, reset)
        summary = await _result_of(harness, handle.id, reset)
        async with harness.pool.acquire() as conn:
            closed = await ledger.period_record(conn, str(PERIOD))
        assert closed is not None and closed.state == "completed"
        # The terminated runs' activities, still on their worker, finish.
        hold.release(CLOSE, a)
        await hold.ended(CLOSE, a)
        hold.release(PREPARE, b)
        await hold.ended(PREPARE, b)
        async with harness.pool.acquire() as conn:
            record = await ledger.period_record(conn, str(PERIOD))
    assert record is not None
    assert (record.state, record.run_id, record.summary) == ("completed", a, summary), record
    await assert_billed_once(harness, str(PERIOD), customers)


async def _result_of(harness: Harness, workflow_id: str, run_id: str) -> PeriodSummary:
    """The summary of the workflow's run `run_id` (a reset's), once it has closed."""
    run = harness.client.get_workflow_handle(workflow_id, run_id=run_id, result_type=PeriodSummary)
    return await asyncio.wait_for(run.result(), 30)


async def _reset_to(
    harness: Harness, workflow_id: str, run_id: str, *, after_opening: bool = True
) -> str:
    """Reset the run to the workflow task after its opening (or its first, before it); the
    new run's id."""
    run = harness.client.get_workflow_handle(workflow_id, run_id=run_id)
    events = [e async for e in run.fetch_history_events()]
    opened = next(
        e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
    )
    task = next(
        e.event_id
        for e in events
        if (e.event_id > opened or not after_opening)
        and e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
    )
    reset = await harness.client.workflow_service.reset_workflow_execution(
        ResetWorkflowExecutionRequest(
            namespace=harness.client.namespace,
            workflow_execution=ExecutionRef(workflow_id=workflow_id, run_id=run_id),
            reason="the fault is fixed",
            workflow_task_finish_event_id=task,
            request_id=f"reset-{run_id}-{task}",
        )
    )
    return reset.run_id


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "from-before"])
async def test_the_opening_time_is_temporals_when_recorded(
    harness: Harness, recorded: bool
) -> None:
    """Read against children's close times, which are Temporal's: the opening's time by
    Temporal's clock, or the database's for a row from before migrations/031."""
    await harness.seed(1)
    run = RunIdentity(run_id="r-1", opened_at=OPENED) if recorded else None
    async with harness.pool.acquire() as conn:
        await ledger.open_period(conn, str(PERIOD), "by-hand", run=run)
        record = await ledger.period_record(conn, str(PERIOD))
        opened = await ledger.run_opened_at(conn, str(PERIOD))
    assert record is not None and record.run_id == (run and run.run_id)
    assert (opened == OPENED) is recorded


class FreezeAfterCheck:
    """A worker frozen (a GC pause, a slow vault) right after `_not_current_try` said it is
    current: the activities named, of the runs named, wait there until let go."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._checked: dict[tuple[str, str], asyncio.Event] = {}
        self._go: dict[tuple[str, str], asyncio.Event] = {}
        original = period_activities._not_current_try

        async def frozen() -> str | None:
            why = await original()
            if activity.in_activity():
                info = activity.info()
                key = (info.activity_type, info.workflow_run_id or "")
                if why is None and key in self._go and not self._checked[key].is_set():
                    self._checked[key].set()
                    await asyncio.wait_for(self._go[key].wait(), 90)
            return why

        monkeypatch.setattr(period_activities, "_not_current_try", frozen)

    def freeze(self, activity_type: str, run: str) -> None:
        self._checked[activity_type, run] = asyncio.Event()
        self._go[activity_type, run] = asyncio.Event()

    async def checked(self, activity_type: str, run: str) -> None:
        await asyncio.wait_for(self._checked[activity_type, run].wait(), 60)

    def release(self, activity_type: str, run: str) -> None:
        self._go[activity_type, run].set()


async def _row(harness: Harness) -> tuple[str, str | None, PeriodSummary | None, str | None]:
    async with harness.pool.acquire() as conn:
        record = await ledger.period_record(conn, str(PERIOD))
    control, _, _ = await harness.period_control(PERIOD)
    assert record is not None
    return record.state, record.run_id, record.summary, control


async def _written_or_waiting(harness: Harness, workflow_id: str, kind: str, value: str) -> None:
    """Until the row's control or state (`kind`) is `value`, or a writer of the row of the
    latest run (its control or its close) has waited seconds for the row's lock, which a
    frozen writer holds (with the fix)."""

    async def there() -> bool:
        state, _, _, control = await _row(harness)
        if (control if kind == "control" else state) == value:
            return True
        latest = await harness.client.get_workflow_handle(workflow_id).describe()
        now = datetime.now(UTC)
        return any(
            p.activity_type.name.startswith((SET_CONTROL, CLOSE))
            and p.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
            and now - p.last_started_time.ToDatetime(UTC) > timedelta(seconds=2)
            for p in latest.raw_description.pending_activities
        )

    await eventually(there, timeout=60)


@pytest.mark.parametrize("marked", [True, False], ids=["marked", "begun-before-marks"])
async def test_a_close_that_checked_then_froze_lands_before_the_reset_runs_close(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, marked: bool
) -> None:
    """A's close checks it is current, and its worker freezes; the operator resets A past
    its opening; A' is cancelled and closes. A's close, checked under OPENING_LOCK but not
    the row's, wrote A's summary over A''s for good (helper-158 G1): the row's lock, held
    from the check to the write, now orders A's write before A''s. Also for a run begun
    before LISTINGS_MARKED, which closes through close_period_if_all_reached."""
    if not marked:
        real = wf.patched
        monkeypatch.setattr(wf, "patched", lambda p: p != LISTINGS_MARKED and real(p))
    close = CLOSE_IF_ALL_MARKED if marked else CLOSE_IF_ALL_REACHED
    customers = await harness.seed(2)
    freeze = FreezeAfterCheck(monkeypatch)
    handle = None
    a = ""
    # The reset run's listing is held (a slow ledger), so that the cancel reaches it first.
    gate = ActivityHold(
        lambda info: bool(a) and info.activity_type == DUE and info.workflow_run_id != a, timeout=90
    )
    async with harness.running_worker(interceptors=[gate]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        a = (await handle.describe()).run_id
        freeze.freeze(close, a)
        await freeze.checked(close, a)
        reset = await _reset_to(harness, handle.id, a)
        await asyncio.wait_for(gate.reached.wait(), 60)
        await harness.client.get_workflow_handle(handle.id).cancel()
        await _written_or_waiting(harness, handle.id, "control", "cancelled")
        gate.go.set()
        await _written_or_waiting(harness, handle.id, "state", "completed")
        freeze.release(close, a)  # A's frozen close goes on
        summary = await asyncio.wait_for(
            harness.client.get_workflow_handle(
                handle.id, run_id=reset, result_type=PeriodSummary
            ).result(),
            60,
        )
        await asyncio.sleep(1)
        state, _, written, control = await _row(harness)
    assert summary.cancel_reason is not None
    assert (state, written, control) == ("completed", summary, "cancelled")
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_an_opening_that_checked_then_waited_on_the_vault_opens_nothing(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stuck at its close, terminated; rerun B's opening checks it is current, then waits
    on a slow vault; the operator terminates B and resets A past its opening; A' is
    cancelled and closes. B's opening then left the month A' closed running, with no
    summary, for good (helper-158 G2): it checks again under the row's lock after the keys."""
    customers = await harness.seed(2)
    freeze = FreezeAfterCheck(monkeypatch)
    hold = HoldEachRun(PREPARE, CLOSE)
    # The late customer's charge is held, so that the reset run has one in flight.
    bill = ActivityHold(
        lambda info: info.activity_type == "bill" and "late" in (info.workflow_id or ""), timeout=90
    )
    async with harness.running_worker(interceptors=[hold, bill]):
        handle, a = await _terminated_at_its_close(harness, hold)
        customers += await harness.seed(1, prefix="late")
        rerun = await start_period(harness.client, PERIOD, harness.task_queue)
        b = (await rerun.describe()).run_id
        await hold.reached(PREPARE, b)
        freeze.freeze(PREPARE, b)
        hold.release(PREPARE, b)
        await freeze.checked(PREPARE, b)  # B was current; now its vault is slow
        await rerun.terminate(reason="stuck at its opening")
        reset = await _reset_to(harness, handle.id, a)
        hold.release(CLOSE, reset)
        await asyncio.wait_for(bill.reached.wait(), 60)
        await harness.client.get_workflow_handle(handle.id).cancel()
        await _written_or_waiting(harness, handle.id, "control", "cancelled")
        bill.go.set()
        await _written_or_waiting(harness, handle.id, "state", "completed")
        freeze.release(PREPARE, b)  # B's vault answers
        await hold.ended(PREPARE, b)
        summary = await asyncio.wait_for(
            harness.client.get_workflow_handle(
                handle.id, run_id=reset, result_type=PeriodSummary
            ).result(),
            60,
        )
        state, _, written, control = await _row(harness)
    assert summary.cancel_reason is not None
    assert (state, written, control) == ("completed", summary, "cancelled")
    # The late customer is charged or cancelled as the cancel races its charge: once at most.
    succeeded = [c for c in await harness.charges() if c["status"] == "succeeded"]
    assert len(succeeded) in (2, 3)
    assert len({c.get("customer") for c in succeeded}) == len(succeeded)


async def test_a_stale_opening_refused_after_the_vault_revokes_the_keys_it_issued(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run terminated while its opening, found current, waited on the vault: refused under
    the row's lock, it writes nothing, and the keys the vault issued it, which no run stores,
    are revoked at once. Left, they held their caps against the worker budget until they
    expired, the month perhaps closed, with no opening or close to come (helper-159 I3)."""
    await vaulted.seed(1)
    freeze = FreezeAfterCheck(monkeypatch)
    hold = HoldEachRun(PREPARE)
    async with vaulted.running_worker(interceptors=[hold]):
        handle = await start_period(vaulted.client, PERIOD, vaulted.task_queue)
        run = (await handle.describe()).run_id
        await hold.reached(PREPARE, run)
        freeze.freeze(PREPARE, run)
        hold.release(PREPARE, run)
        await freeze.checked(PREPARE, run)  # current; now the vault is slow
        await handle.terminate(reason="stuck at its opening")
        freeze.release(PREPARE, run)  # the vault answers
        await hold.ended(PREPARE, run)
    assert vaulted.vault is not None
    keys = await vaulted.vault.admin.find_keys(period=str(PERIOD))
    assert keys, "the stale try issued no key: the test no longer reaches the second check"
    assert [k.id for k in keys if not k.revoked] == []
    async with vaulted.pool.acquire() as conn:
        assert await ledger.period_record(conn, str(PERIOD)) is None


async def test_a_refused_try_says_what_did_not_match(harness: Harness) -> None:
    """A try refused as not current says why: another run is the latest, its run has ended,
    Temporal waits on another attempt or on none. A refusal no one expected can then be told
    from a stale try's (helper-159 I2)."""
    await harness.seed(1)
    hold = HoldEachRun(PREPARE)
    async with harness.running_worker(interceptors=[hold]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        run = (await handle.describe()).run_id
        await hold.reached(PREPARE, run)
        [pending] = (await handle.describe()).raw_description.pending_activities

        async def why(**differs: Any) -> str | None:
            environment = ActivityEnvironment(client=harness.client)
            current: dict[str, Any] = {
                "workflow_id": handle.id,
                "workflow_run_id": run,
                "activity_id": pending.activity_id,
                "attempt": pending.attempt,
            }
            environment.info = dataclasses.replace(environment.info, **(current | differs))
            return await environment.run(period_activities._not_current_try)

        assert await why() is None
        assert await why(attempt=pending.attempt + 1) == (
            f"it is attempt {pending.attempt + 1}, and Temporal waits on attempt {pending.attempt}"
        )
        assert await why(activity_id="99") == "Temporal no longer waits on activity 99 of its run"
        assert await why(workflow_run_id="an-earlier-run") == (
            f"its run an-earlier-run is not the workflow's latest, {run}"
        )
        await handle.terminate(reason="checked")
        assert await why() == f"its run {run} has ended (terminated)"
        hold.release(PREPARE, run)


async def test_a_writer_frozen_holding_the_periods_row_lets_it_go(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every charge's gate shares the period's row: a writer frozen while it holds it (asking
    Temporal whether it may write) would hold up the period's charges (helper-159 I1).
    Postgres ends its session, and its write never lands."""
    monkeypatch.setattr(ledger_runs, "ROW_HELD_IDLE", "1s")
    await harness.seed(1)
    async with harness.pool.acquire() as conn:
        await ledger.open_period(conn, str(PERIOD), "by-hand")
    async with harness.pool.acquire() as frozen:
        await frozen.transaction().start()
        await ledger.lock_period(frozen, str(PERIOD))
        pid = frozen.get_server_pid()
        # The client must have read the end too: a statement sent between Postgres's error
        # and its closing the socket meets asyncpg mid-error (an internal error of its own).
        lost = asyncio.Event()
        frozen.add_termination_listener(lambda _conn: lost.set())

        async def ended() -> bool:
            # Postgres ends the session idle past ROW_HELD_IDLE; how soon after is its own.
            found = await harness.pool.fetchval(
                "SELECT 1 FROM pg_stat_activity WHERE pid = $1", pid
            )
            return found is None and lost.is_set()

        await eventually(ended)
        with pytest.raises(asyncpg.InterfaceError):
            await ledger.set_control(frozen, str(PERIOD), "paused", "frozen", "nobody")
    async with harness.pool.acquire() as conn, conn.transaction():
        await ledger.lock_period(conn, str(PERIOD))
        assert await ledger.open_runs(conn, [str(PERIOD)]) == {str(PERIOD): "running"}


class StaleListing(Interceptor):
    """Holds the first listing (`due_customers`, local) of the first run to list, as a worker
    waiting for a pool connection would, then lets it run to its end though its run's
    eviction cancels it (a query Postgres had already run)."""

    def __init__(self) -> None:
        self.stale_run: str | None = None
        self.reached = asyncio.Event()
        self.go = asyncio.Event()
        self.done = asyncio.Event()

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        outer = self

        class Held(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                info = activity.info()
                if info.activity_type == DUE and outer.stale_run is None:
                    outer.stale_run = info.workflow_run_id
                    outer.reached.set()
                    stale = asyncio.ensure_future(self._stale(input))
                    while not stale.done():
                        with contextlib.suppress(asyncio.CancelledError):
                            await asyncio.shield(stale)
                    outer.done.set()
                    return stale.result()
                return await super().execute_activity(input)

            async def _stale(self, input: ExecuteActivityInput) -> Any:
                await asyncio.wait_for(outer.go.wait(), 120)
                return await super().execute_activity(input)

        return Held(next)


async def test_a_reset_runs_stale_listing_does_not_hide_a_customer_from_its_close(
    harness: Harness,
) -> None:
    """A's first listing waits on its worker; the operator resets A to before its opening.
    A' lists and bills the three customers and reaches its close; a customer is imported
    behind its listing. A's listing then runs, and marks every due customer, the late one
    too, under the chain's first run id, which A' shares: A''s close found them all marked,
    and closed without the late one, neither billed nor counted (helper-167 F1). A customer
    with no row is reached only if the run's workflow for it says so."""
    customers = await harness.seed(3)
    stale = StaleListing()
    # The close of every run but the stale listing's, until that listing has run.
    close = ActivityHold(
        lambda info: (
            info.activity_type.startswith(CLOSE) and info.workflow_run_id != stale.stale_run
        ),
        timeout=120,
    )
    async with harness.running_worker(interceptors=[stale, close]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await asyncio.wait_for(stale.reached.wait(), 60)
        assert stale.stale_run is not None
        reset = await _reset_to(harness, handle.id, stale.stale_run, after_opening=False)
        await asyncio.wait_for(close.reached.wait(), 60)
        assert await harness.succeeded() == len(customers)
        late = await create_demo_customers(harness.stripe, 1, prefix="a-late")
        await import_customers(harness.pool, late, while_running=True, reactivate=True)
        stale.go.set()
        await asyncio.wait_for(stale.done.wait(), 60)
        close.go.set()
        summary = await _result_of(harness, handle.id, reset)
    assert (summary.due, summary.charged) == (4, 4), summary
    await assert_billed_once(harness, str(PERIOD), [*customers, *late])

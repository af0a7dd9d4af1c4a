"""A period's runs are told apart in the ledger (migrations/031): a run terminated as it
closed, whose close activity still finishes on its worker, leaves alone the period a later run
has opened since."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution as ExecutionRef
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from billing import ledger
from billing.errors import RunSupersededError
from billing.models import PeriodPlan, PeriodSummary, RunIdentity
from billing.periods import Period
from billing.runs import start_period
from tests.integration.harness import Harness
from tests.integration.invariants import assert_billed_once

PERIOD = Period(2026, 12)
OPENED = datetime(2026, 12, 1, 3, 0, tzinfo=UTC)


class HoldEachRun(Interceptor):
    """Holds each run's activities of the given kinds ("prepare_period", "close_period",
    matched as prefixes of the activity's type), each (kind, run) until let go, and says when
    one is reached and when it has ended."""

    def __init__(self, *kinds: str) -> None:
        self.kinds = kinds
        self._reached: defaultdict[tuple[str, str], asyncio.Event] = defaultdict(asyncio.Event)
        self._go_on: defaultdict[tuple[str, str], asyncio.Event] = defaultdict(asyncio.Event)
        self._ended: defaultdict[tuple[str, str], asyncio.Event] = defaultdict(asyncio.Event)

    async def reached(self, kind: str, run: str) -> None:
        await asyncio.wait_for(self._reached[kind, run].wait(), 60)

    def release(self, kind: str, run: str) -> None:
        self._go_on[kind, run].set()

    async def ended(self, kind: str, run: str) -> None:
        await asyncio.wait_for(self._ended[kind, run].wait(), 30)

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        hold = self

        class Held(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                info = activity.info()
                kind = [k for k in hold.kinds if info.activity_type.startswith(k)]
                if not kind:
                    return await super().execute_activity(input)
                key = (kind[0], info.workflow_run_id or "")
                hold._reached[key].set()
                await asyncio.wait_for(hold._go_on[key].wait(), 60)
                try:
                    return await super().execute_activity(input)
                finally:
                    hold._ended[key].set()

        return Held(next)


CLOSE = "close_period"
PREPARE = "prepare_period"


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


async def test_an_opening_by_a_release_from_before_leaves_the_next_close_free(
    harness: Harness,
) -> None:
    """An opening by a worker of the release before migrations/031 (a rolling upgrade, a
    rollback) writes no run id: the row kept the last run's, and the close of the run it
    opened matched nothing (helper-154 F2). It is cleared (migrations/031's trigger)."""
    await harness.seed(1)
    plan = PeriodPlan(period=str(PERIOD), due=1, to_charge=1, expected_total_cents=1_000)
    summary = PeriodSummary.empty(str(PERIOD), "by-hand").model_dump_json()
    async with harness.pool.acquire() as conn:
        await ledger.start_period(
            conn, plan, "by-hand", RunIdentity(run_id="r-1", opened_at=OPENED)
        )
        assert await ledger.finish_period(conn, str(PERIOD), summary, "r-1")
        # The release before's opening, as it wrote the row.
        await conn.execute(
            "UPDATE billing_periods SET state = 'running', summary = NULL, started_at = now()"
            " WHERE billing_period = $1",
            str(PERIOD),
        )
        record = await ledger.period_record(conn, str(PERIOD))
        assert record is not None and record.run_id is None
        assert await ledger.finish_period(conn, str(PERIOD), summary, "r-2")


async def test_an_opening_tried_again_keeps_its_run_and_takes_its_new_time(
    harness: Harness,
) -> None:
    """The same run's opening, tried again after its answer was lost, is its own: a later
    run's is refused, an earlier run's too."""
    await harness.seed(1)
    plan = PeriodPlan(period=str(PERIOD), due=1, to_charge=1, expected_total_cents=1_000)
    later = OPENED + timedelta(minutes=5)
    async with harness.pool.acquire() as conn:
        await ledger.start_period(
            conn, plan, "by-hand", RunIdentity(run_id="r-1", opened_at=OPENED)
        )
        await ledger.start_period(conn, plan, "by-hand", RunIdentity(run_id="r-1", opened_at=later))
        assert await ledger.run_opened_at(conn, str(PERIOD)) == later
        await ledger.start_period(
            conn, plan, "by-hand", RunIdentity(run_id="r-2", opened_at=later + timedelta(1))
        )
        with pytest.raises(RunSupersededError, match="the period was opened after this"):
            await ledger.start_period(
                conn, plan, "by-hand", RunIdentity(run_id="r-1", opened_at=later)
            )
        # A stale try of the run that opened it last, finishing after a later try did.
        with pytest.raises(RunSupersededError, match="or a later try of this one"):
            await ledger.start_period(
                conn, plan, "by-hand", RunIdentity(run_id="r-2", opened_at=later)
            )
        record = await ledger.period_record(conn, str(PERIOD))
    assert record is not None and record.run_id == "r-2"


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
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        stuck = (await handle.describe()).run_id
        await hold.reached(CLOSE, stuck)
        await handle.terminate(reason="stuck at its close")
        ended = [stuck]
        if rerun_between:
            rerun = await start_period(harness.client, PERIOD, harness.task_queue)
            ended.append((await rerun.describe()).run_id)
            await hold.reached(CLOSE, ended[-1])
            await rerun.terminate(reason="stuck at its close too")
        reset = await _reset_past_its_opening(harness, handle.id, stuck)
        await hold.reached(CLOSE, reset)
        hold.release(CLOSE, reset)
        summary = await asyncio.wait_for(
            harness.client.get_workflow_handle(
                handle.id, run_id=reset, result_type=PeriodSummary
            ).result(),
            30,
        )
        async with harness.pool.acquire() as conn:
            record = await ledger.period_record(conn, str(PERIOD))
        # The ended runs' closes, still on the worker, write nothing: their runs are over.
        for run in ended:
            hold.release(CLOSE, run)
            await hold.ended(CLOSE, run)
        async with harness.pool.acquire() as conn:
            assert await ledger.period_record(conn, str(PERIOD)) == record
    assert summary.run_id == stuck
    assert record is not None
    assert (record.state, record.run_id, record.summary) == ("completed", stuck, summary)
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
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        a = (await handle.describe()).run_id
        hold.release(PREPARE, a)
        await hold.reached(CLOSE, a)
        await handle.terminate(reason="stuck at its close")
        rerun = await start_period(harness.client, PERIOD, harness.task_queue)
        b = (await rerun.describe()).run_id
        await hold.reached(PREPARE, b)
        await rerun.terminate(reason="stuck at its opening too")
        reset = await _reset_past_its_opening(harness, handle.id, a)
        await hold.reached(CLOSE, reset)
        hold.release(CLOSE, reset)
        summary = await asyncio.wait_for(
            harness.client.get_workflow_handle(
                handle.id, run_id=reset, result_type=PeriodSummary
            ).result(),
            30,
        )
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


async def _reset_past_its_opening(harness: Harness, workflow_id: str, run_id: str) -> str:
    """Reset the run to the workflow task after its opening; the new run's id."""
    run = harness.client.get_workflow_handle(workflow_id, run_id=run_id)
    events = [e async for e in run.fetch_history_events()]
    opened = next(
        e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
    )
    after_opening = next(
        e.event_id
        for e in events
        if e.event_id > opened and e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
    )
    reset = await harness.client.workflow_service.reset_workflow_execution(
        ResetWorkflowExecutionRequest(
            namespace=harness.client.namespace,
            workflow_execution=ExecutionRef(workflow_id=workflow_id, run_id=run_id),
            reason="the fault is fixed",
            workflow_task_finish_event_id=after_opening,
            request_id=f"reset-{run_id}",
        )
    )
    return reset.run_id


@pytest.mark.parametrize(
    ("opened_by", "closed_by", "written"),
    [("r-1", "r-1", True), ("r-1", "r-2", False), (None, "r-2", True), ("r-1", None, True)],
    ids=["its-own", "another-runs", "row-from-before", "run-from-before"],
)
async def test_a_close_writes_only_over_its_own_run(
    harness: Harness, opened_by: str | None, closed_by: str | None, written: bool
) -> None:
    """A row opened, or a summary sent, by a worker from before migrations/031 carries no run
    id: the close writes, as it did."""
    await harness.seed(1)
    run = None if opened_by is None else RunIdentity(run_id=opened_by, opened_at=OPENED)
    summary = PeriodSummary.empty(str(PERIOD), "by-hand").model_dump_json()
    async with harness.pool.acquire() as conn:
        await ledger.open_period(conn, str(PERIOD), "by-hand", run=run)
        assert await ledger.finish_period(conn, str(PERIOD), summary, closed_by) is written
        record = await ledger.period_record(conn, str(PERIOD))
        opened = await ledger.run_opened_at(conn, str(PERIOD))
    assert record is not None
    assert (record.state, record.run_id) == ("completed" if written else "running", opened_by)
    # Read against children's close times, which are Temporal's: the opening's, if recorded.
    assert (opened == OPENED) is (run is not None)

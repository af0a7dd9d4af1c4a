"""A period's runs are told apart in the ledger (migrations/031): a run terminated as it
closed, whose close activity still finishes on its worker, leaves alone the period a later run
has opened since."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution as ExecutionRef
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from billing import ledger
from billing.models import PeriodSummary, RunIdentity
from billing.periods import Period
from billing.runs import start_period
from tests.integration.harness import Harness
from tests.integration.invariants import assert_billed_once

PERIOD = Period(2026, 12)
OPENED = datetime(2026, 12, 1, 3, 0, tzinfo=UTC)


class HoldEachRunsClose(Interceptor):
    """Holds the close activity of each run (by its workflow run id) until that run's is let
    go, and says when it has ended."""

    def __init__(self) -> None:
        self.closing: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.go_on: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.closed: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        hold = self

        class Held(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                info = activity.info()
                if not info.activity_type.startswith("close_period"):
                    return await super().execute_activity(input)
                run = info.workflow_run_id or ""
                hold.closing[run].set()
                await asyncio.wait_for(hold.go_on[run].wait(), 60)
                try:
                    return await super().execute_activity(input)
                finally:
                    hold.closed[run].set()

        return Held(next)


@pytest.mark.parametrize("cancelled", [False, True], ids=["completed", "cancelled"])
async def test_a_terminated_runs_close_leaves_a_later_runs_period_alone(
    harness: Harness, cancelled: bool
) -> None:
    """The first run is terminated while its close waits; a rerun opens the period; the first
    close then finishes. It marked the rerun's period completed with its own summary, and the
    rerun's close, finding it so, wrote nothing."""
    customers = await harness.seed(2)
    hold = HoldEachRunsClose()
    async with harness.running_worker(interceptors=[hold]):
        first = await start_period(harness.client, PERIOD, harness.task_queue)
        if cancelled:
            await first.cancel()
        first_run = (await first.describe()).run_id
        await asyncio.wait_for(hold.closing[first_run].wait(), 60)
        await first.terminate(reason="stuck, says the operator")
        rerun = await start_period(harness.client, PERIOD, harness.task_queue)
        rerun_id = (await rerun.describe()).run_id
        assert rerun_id != first_run
        await asyncio.wait_for(hold.closing[rerun_id].wait(), 60)
        hold.go_on[first_run].set()
        await asyncio.wait_for(hold.closed[first_run].wait(), 30)
        async with harness.pool.acquire() as conn:
            record = await ledger.period_record(conn, str(PERIOD))
        assert record is not None and (record.state, record.run_id) == ("running", rerun_id)
        hold.go_on[rerun_id].set()
        summary = await asyncio.wait_for(rerun.result(), 30)
    assert summary.run_id == rerun_id
    async with harness.pool.acquire() as conn:
        record = await ledger.period_record(conn, str(PERIOD))
    assert record is not None
    assert (record.state, record.summary) == ("completed", summary)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_run_reset_past_its_opening_is_still_the_run_that_opened_it(
    harness: Harness,
) -> None:
    """An operator who terminated a run stuck at its close may reset it to after its opening
    once the fault is fixed: the reset run keeps the first run id of its chain (Temporal copies
    the start event), so its close is the opening's, and writes."""
    customers = await harness.seed(2)
    hold = HoldEachRunsClose()
    async with harness.running_worker(interceptors=[hold]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        stuck = (await handle.describe()).run_id
        await asyncio.wait_for(hold.closing[stuck].wait(), 60)
        await handle.terminate(reason="stuck at its close")
        events = [e async for e in handle.fetch_history_events()]
        opened = next(
            e.event_id
            for e in events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
        )
        after_opening = next(
            e.event_id
            for e in events
            if e.event_id > opened and e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
        )
        reset = await harness.client.workflow_service.reset_workflow_execution(
            ResetWorkflowExecutionRequest(
                namespace=harness.client.namespace,
                workflow_execution=ExecutionRef(workflow_id=handle.id, run_id=stuck),
                reason="the fault is fixed",
                workflow_task_finish_event_id=after_opening,
                request_id=f"reset-{stuck}",
            )
        )
        await asyncio.wait_for(hold.closing[reset.run_id].wait(), 60)
        hold.go_on[reset.run_id].set()
        summary = await asyncio.wait_for(
            harness.client.get_workflow_handle(
                handle.id, run_id=reset.run_id, result_type=PeriodSummary
            ).result(),
            30,
        )
        hold.go_on[stuck].set()
    assert summary.run_id == stuck
    async with harness.pool.acquire() as conn:
        record = await ledger.period_record(conn, str(PERIOD))
    assert record is not None and (record.state, record.summary) == ("completed", summary)
    await assert_billed_once(harness, str(PERIOD), customers)


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

"""Starting and inspecting period runs from outside Temporal (CLI, tests, benchmarks)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from temporalio.api.enums.v1 import PendingWorkflowTaskState
from temporalio.client import (
    Client,
    WorkflowContinuedAsNewError,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
)
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import CancelledError, TerminatedError
from temporalio.exceptions import TimeoutError as TemporalTimeoutError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.types import MethodAsyncSingleParam, SelfType

from billing import search_attributes
from billing.errors import NoWorkerError, RunEndedError
from billing.keys import period_workflow_id, reconcile_workflow_id
from billing.models import (
    BillingPeriodInput,
    PeriodProgress,
    PeriodRecord,
    PeriodSummary,
    RunOptions,
)
from billing.periods import Period, run_command
from billing.reconciliation import ReconcileInput, ReconcileReport
from billing.reporting import failure_chain
from billing.temporal_client import described, workflow_status
from workflows.billing_period import BillingPeriodWorkflow
from workflows.reconcile import ReconcileWorkflow

# A worker answers a query in milliseconds; without one the server would wait much longer.
QUERY_TIMEOUT = timedelta(seconds=10)
_REFUSED = RPCStatusCode.FAILED_PRECONDITION
_NO_WORKER = (RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED, _REFUSED)

# What a call to Temporal ends in, once the SDK's client has retried it for some seconds, while
# the server or the way to it is away (a restart, a deploy, a network cut): not an answer.
TEMPORAL_AWAY = frozenset(
    {RPCStatusCode.UNAVAILABLE, RPCStatusCode.UNKNOWN, RPCStatusCode.CANCELLED}
)
# How long a waiter pauses before it asks again after that.
AWAY_RETRY = timedelta(seconds=2)

ArgT = TypeVar("ArgT")
ResultT = TypeVar("ResultT")
CallT = TypeVar("CallT")


async def started_across_outages(
    client: Client,
    workflow_id: str,
    start: Callable[[], Awaitable[WorkflowHandle[Any, ResultT]]],
    result_type: type[ResultT],
    on_away: Callable[[RPCError], None],
) -> WorkflowHandle[Any, ResultT]:
    """`start()`'s run, tried again while Temporal is away. A start whose answer an outage
    lost may have started or joined the run: still open, the next start joins it
    (USE_EXISTING); ended since, it is the workflow ID's latest run, and either not the one
    before the first try or one open then, and is the run returned, not started again."""
    latest_run = client.get_workflow_handle(workflow_id)
    earlier = await _while_away(lambda: described(latest_run), on_away)
    before = earlier.run_id if earlier is not None else None
    # Open then, the first try joined it.
    joined = earlier is not None and earlier.status == WorkflowExecutionStatus.RUNNING
    tried = False

    async def start_unless_ended() -> WorkflowHandle[Any, ResultT]:
        nonlocal tried
        if tried:
            latest = await described(latest_run)
            if (
                latest is not None
                and (latest.run_id != before or joined)
                and latest.status != WorkflowExecutionStatus.RUNNING
            ):
                return client.get_workflow_handle(
                    workflow_id, run_id=latest.run_id, result_type=result_type
                )
        tried = True
        return await start()

    return await _while_away(start_unless_ended, on_away)


def tell_if_away(exc: RPCError, on_away: Callable[[RPCError], None]) -> None:
    """Tell `on_away` of `exc` if it says Temporal is away; raise it if it is an answer."""
    if exc.status not in TEMPORAL_AWAY:
        raise exc
    on_away(exc)


async def _while_away(
    call: Callable[[], Awaitable[CallT]], on_away: Callable[[RPCError], None]
) -> CallT:
    """`call()`'s answer, asked again every AWAY_RETRY while Temporal is away."""
    while True:
        try:
            return await call()
        except RPCError as exc:
            tell_if_away(exc, on_away)
        await asyncio.sleep(AWAY_RETRY.total_seconds())


async def result_across_outages(
    client: Client,
    handle: WorkflowHandle[Any, ResultT],
    result_type: type[ResultT],
    on_away: Callable[[RPCError], None],
    on_back: Callable[[], None] | None = None,
) -> ResultT:
    """The workflow's result, waiting out Temporal being away. The run goes on on the server
    whatever its waiter sees (its workers reconnect), so an outage ends only the wait:
    `on_away` hears each time Temporal could not be reached, `on_back` once it can again (and
    with the result, so it must be a no-op when nothing was away), and the wait resumes from
    the latest run it had reached: a run continued as new many times need not be walked
    again, and its first run may have passed the namespace's retention."""
    run = handle
    away = False
    while True:
        try:
            if away and on_back is not None:
                # The wait itself is a long poll, silent until the run ends: a short call
                # tells that Temporal answers again.
                await run.describe()
                on_back()
            away = False
            result = await run.result(follow_runs=False)
            if on_back is not None:
                # Another call sharing `on_away` may have met the outage while the long poll,
                # retried inside the SDK, outlasted it without a word.
                on_back()
            return result
        except WorkflowContinuedAsNewError as exc:
            run = client.get_workflow_handle(
                handle.id, run_id=exc.new_execution_run_id, result_type=result_type
            )
            continue
        except RPCError as exc:
            tell_if_away(exc, on_away)
            away = True
        await asyncio.sleep(AWAY_RETRY.total_seconds())


async def start_period(
    client: Client, period: Period, task_queue: str, options: RunOptions | None = None
) -> WorkflowHandle[BillingPeriodWorkflow, PeriodSummary]:
    """Start the period's run, or attach to the one already running.

    A period has one workflow ID, so starters racing on any number of machines share one run;
    a finished period may run again, and its children then find the ledger already settled.
    """
    return await _run_or_join(
        client,
        BillingPeriodWorkflow.run,
        BillingPeriodInput(period=str(period), options=options or RunOptions()),
        period_workflow_id(period),
        task_queue,
        f"Billing period {period}",
        period,
    )


async def start_reconcile(
    client: Client, period: Period, task_queue: str
) -> WorkflowHandle[ReconcileWorkflow, ReconcileReport]:
    """Start the period's reconciliation, or attach to the one already running."""
    return await _run_or_join(
        client,
        ReconcileWorkflow.run,
        ReconcileInput(period=str(period)),
        reconcile_workflow_id(period),
        task_queue,
        f"Reconcile {period}",
        period,
    )


async def awaits_a_worker(handle: WorkflowHandle[Any, Any], longer_than: timedelta) -> bool:
    """Whether the workflow's task has waited `longer_than` for a worker to take it (one
    polling takes it within milliseconds), or keeps failing on the workers that do."""
    raw = (await handle.describe()).raw_description
    if not raw.HasField("pending_workflow_task"):
        return False
    task = raw.pending_workflow_task
    if task.attempt > 1:
        return True
    waited = datetime.now(UTC) - task.original_scheduled_time.ToDatetime(tzinfo=UTC)
    scheduled = task.state == PendingWorkflowTaskState.PENDING_WORKFLOW_TASK_STATE_SCHEDULED
    return scheduled and waited >= longer_than


async def _run_or_join(
    client: Client,
    run: MethodAsyncSingleParam[SelfType, ArgT, ResultT],
    argument: ArgT,
    workflow_id: str,
    task_queue: str,
    summary: str,
    period: Period,
) -> WorkflowHandle[SelfType, ResultT]:
    return await client.start_workflow(
        run,
        argument,
        id=workflow_id,
        task_queue=task_queue,
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        static_summary=summary,
        search_attributes=TypedSearchAttributes(
            [SearchAttributePair(search_attributes.BILLING_PERIOD, str(period))]
        ),
    )


def summary_progress(summary: PeriodSummary) -> PeriodProgress:
    """How a run with this summary stands: completed, or cancelled."""
    counts = summary.model_dump(exclude={"cancel_reason", "cancelled_by", "run_id"})
    return PeriodProgress(
        state="cancelled" if summary.cancelled_by else "completed",
        in_flight=0,
        reason=summary.cancel_reason,
        operator=summary.cancelled_by,
        **counts,
    )


def status_from_ledger(
    period: Period, record: PeriodRecord | None, not_started: PeriodProgress
) -> PeriodProgress:
    """The status of a period Temporal holds no run of: none was started, or its last run
    closed longer ago than the namespace keeps runs (its retention). The ledger remembers a
    completed run's summary."""
    if record is None:
        return not_started
    if record.summary is not None:
        return summary_progress(record.summary)
    again = run_command(period, datetime.now(UTC))
    raise RunEndedError(
        f"the ledger shows a run of {period} ({record.workflow_id}) that never finished, and"
        " Temporal no longer holds it (terminated, or closed longer ago than the namespace"
        f" keeps runs): run the period again to finish it (`{again}`)",
        period=str(period),
        workflow_id=record.workflow_id,
        state="unfinished",
    )


async def period_status(client: Client, period: Period) -> PeriodProgress:
    """What the period's latest run says: live counts while running, the summary after;
    `not_started` when Temporal holds no run (see status_from_ledger)."""
    workflow_id = period_workflow_id(period)
    handle = client.get_workflow_handle_for(BillingPeriodWorkflow.run, workflow_id)
    description = await described(handle)
    if description is None:
        empty = PeriodSummary.empty(str(period), workflow_id)
        return summary_progress(empty).model_copy(update={"state": "not_started"})
    status = description.status
    if status == WorkflowExecutionStatus.RUNNING:
        try:
            return await handle.query(BillingPeriodWorkflow.progress, rpc_timeout=QUERY_TIMEOUT)
        except WorkflowQueryFailedError:
            # A run that closed after the describe is answered by replaying its whole
            # history, which has failed so (a nondeterminism error from the SDK's core, once,
            # under load): what it ended with says how it stands.
            status = await workflow_status(handle)
            if status == WorkflowExecutionStatus.RUNNING:
                raise
        except RPCError as exc:
            # No answer in time, or (once the server has seen no poller for a while) a
            # refusal: either way no worker is there to say how the run stands.
            if exc.status not in _NO_WORKER:
                raise
            if exc.status != _REFUSED:
                # A query cut off by Temporal going away (a partition: no refusal, only
                # silence) times out as one no worker answered: a second look tells them
                # apart, raising what Temporal's absence raises.
                await described(handle, rpc_timeout=QUERY_TIMEOUT)
            # Temporal's refusal says why; a timeout's words are its transport's.
            said = f" (Temporal: {exc.message})" if exc.status == _REFUSED else ""
            raise NoWorkerError(
                f"the run of {period} ({workflow_id}) is open, but no worker answered its"
                f" query within {QUERY_TIMEOUT.total_seconds():.0f} s, so whether it runs, is"
                f" paused or is being cancelled is unknown: is a worker polling task queue"
                f" {description.task_queue}? Nothing is charged until one does{said}"
            ) from None
    if status in (WorkflowExecutionStatus.COMPLETED, WorkflowExecutionStatus.CONTINUED_AS_NEW):
        return summary_progress(await handle.result())
    state = status.name.lower() if status else "unknown"
    try:
        await handle.result(follow_runs=False)
    except WorkflowFailureError as exc:
        raise run_ended(period, workflow_id, state, exc) from None
    raise run_ended(period, workflow_id, state, None)


def run_ended(
    period: Period, workflow_id: str, state: str, failure: WorkflowFailureError | None
) -> RunEndedError:
    """How a run of the period that gave no summary ended (`state`, as Temporal names its
    status), with what ended it."""
    why = f" ({failure_chain(failure.cause)})" if failure is not None else ""
    return RunEndedError(
        f"the run of {period} ended {state}{why}: see {workflow_id} in the Web UI",
        period=str(period),
        workflow_id=workflow_id,
        state=state,
    )


def ended_as(failure: WorkflowFailureError) -> str:
    """The status a run's failure leaves it in, named as period_status names it."""
    cause = failure.cause
    if isinstance(cause, TerminatedError):
        return "terminated"
    if isinstance(cause, CancelledError):
        return "canceled"
    if isinstance(cause, TemporalTimeoutError):
        return "timed_out"
    return "failed"


async def drain(client: Client, task_queue: str, timeout: float = 120.0) -> bool:
    """Wait until no workflow runs on the task queue: a child closes a moment after its
    parent heard of it. False if some still run after `timeout` seconds."""
    query = f'TaskQueue="{task_queue}" AND ExecutionStatus="Running"'
    deadline = time.monotonic() + timeout
    while (await client.count_workflows(query)).count:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.5)
    return True

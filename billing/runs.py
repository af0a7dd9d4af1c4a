"""Starting and inspecting period runs from outside Temporal (CLI, tests, benchmarks)."""

from __future__ import annotations

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.service import RPCError, RPCStatusCode

from billing import search_attributes
from billing.errors import RunEndedError
from billing.keys import period_workflow_id
from billing.models import BillingPeriodInput, PeriodProgress, PeriodSummary, RunOptions
from billing.periods import Period
from workflows.billing_period import BillingPeriodWorkflow


async def start_period(
    client: Client, period: Period, task_queue: str, options: RunOptions | None = None
) -> WorkflowHandle[BillingPeriodWorkflow, PeriodSummary]:
    """Start the period's run, or attach to the one already running.

    A period has one workflow ID, so starters racing on any number of machines share one run;
    a finished period may run again, and its children then find the ledger already settled.
    """
    return await client.start_workflow(
        BillingPeriodWorkflow.run,
        BillingPeriodInput(period=str(period), options=options or RunOptions()),
        id=period_workflow_id(period),
        task_queue=task_queue,
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        static_summary=f"Billing period {period}",
        search_attributes=TypedSearchAttributes(
            [SearchAttributePair(search_attributes.BILLING_PERIOD, str(period))]
        ),
    )


def _progress(summary: PeriodSummary) -> PeriodProgress:
    counts = summary.model_dump(exclude={"cancel_reason", "cancelled_by"})
    return PeriodProgress(
        state="cancelled" if summary.cancelled_by else "completed",
        in_flight=0,
        reason=summary.cancel_reason,
        operator=summary.cancelled_by,
        **counts,
    )


async def period_status(client: Client, period: Period) -> PeriodProgress:
    """What the period's latest run says: live counts while running, the summary after."""
    workflow_id = period_workflow_id(period)
    handle = client.get_workflow_handle_for(BillingPeriodWorkflow.run, workflow_id)
    try:
        description = await handle.describe()
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:
            raise
        empty = PeriodSummary(
            period=str(period),
            workflow_id=workflow_id,
            due=0,
            charged=0,
            already_billed=0,
            failed=0,
            skipped=0,
            cancelled=0,
            total_charged_cents=0,
        )
        return _progress(empty).model_copy(update={"state": "not_started"})
    status = description.status
    if status == WorkflowExecutionStatus.RUNNING:
        return await handle.query(BillingPeriodWorkflow.progress)
    if status in (WorkflowExecutionStatus.COMPLETED, WorkflowExecutionStatus.CONTINUED_AS_NEW):
        return _progress(await handle.result())
    state = status.name.lower() if status else "unknown"
    raise RunEndedError(f"the run of {period} ended {state}: see {workflow_id} in the Web UI")

"""What a Temporal Schedule starts: resolve the period, then run (or join) its one workflow.

A schedule names its runs `{id}-{time}`, so it cannot start `billing-period-{period}` itself;
this small workflow does, as a child with the period's deterministic ID. A firing, a trigger,
a backfill and a manual run of one period therefore share one period workflow.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import (
    SearchAttributeKey,
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from activities.period import ScheduledPeriodRequest, scheduled_period
    from billing import search_attributes
    from billing.keys import period_workflow_id
    from billing.models import BillingPeriodInput, PeriodSummary, ScheduledBillingInput
    from billing.periods import parse_period
    from workflows.billing_period import BillingPeriodWorkflow

SCHEDULED_START = SearchAttributeKey.for_datetime("TemporalScheduledStartTime")


@workflow.defn(name="ScheduledBillingWorkflow")
class ScheduledBillingWorkflow:
    @workflow.run
    async def run(self, request: ScheduledBillingInput) -> PeriodSummary | None:
        nominal = workflow.info().typed_search_attributes.get(SCHEDULED_START)
        if nominal is None:
            raise ApplicationError(
                "started without a schedule's nominal time; use `starter.py run PERIOD`",
                type="NotScheduled",
                non_retryable=True,
            )
        # A local activity: the month is read in the schedule's time zone, and the time-zone
        # database is I/O the workflow sandbox keeps out.
        period = await workflow.execute_local_activity(
            scheduled_period,
            ScheduledPeriodRequest(
                nominal_time=nominal,
                time_zone=request.time_zone,
                billing=request.options.billing,
            ),
            start_to_close_timeout=timedelta(seconds=10),
            summary=f"which period: nominal time in {request.time_zone}",
        )
        workflow.set_current_details(f"billing {period} (nominal time {nominal.isoformat()})")
        try:
            handle = await workflow.start_child_workflow(
                BillingPeriodWorkflow.run,
                BillingPeriodInput(period=period, options=request.options),
                id=period_workflow_id(parse_period(period)),
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                static_summary=f"Billing period {period}",
                search_attributes=TypedSearchAttributes(
                    [SearchAttributePair(search_attributes.BILLING_PERIOD, period)]
                ),
            )
        except WorkflowAlreadyStartedError:
            workflow.set_current_details(f"{period} was already running: nothing more started")
            return None
        return await handle

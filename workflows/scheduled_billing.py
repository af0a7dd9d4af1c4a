"""What a Temporal Schedule starts: resolve the period, then start (or join) its one
workflow: its billing run, or its reconciliation.

A schedule names its runs `{id}-{time}`, so it cannot start `billing-period-{period}` itself;
this small workflow does, as a child with the period's deterministic ID. A firing, a trigger,
a backfill and a manual run of one period therefore share one period workflow (likewise
`billing-reconcile-{period}`).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import (
    RetryPolicy,
    SearchAttributeKey,
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import ActivityError, ApplicationError, WorkflowAlreadyStartedError
from temporalio.types import MethodAsyncSingleParam

with workflow.unsafe.imports_passed_through():
    from activities.period import PeriodActivities, ScheduledPeriodRequest, scheduled_period
    from activities.schedule_checks import FiringsRequest, ScheduleCheckActivities
    from billing import schedules, search_attributes
    from billing.keys import period_workflow_id, reconcile_workflow_id
    from billing.models import BillingPeriodInput, PeriodSummary, ScheduledBillingInput
    from billing.periods import parse_period
    from billing.reconciliation import ReconcileInput, ReconcileReport
    from workflows.billing_period import BillingPeriodWorkflow
    from workflows.failures import LOCAL_ACTIVITY_FAILURES
    from workflows.identity import given, one_input
    from workflows.reconcile import ReconcileWorkflow

SCHEDULED_START = SearchAttributeKey.for_datetime("TemporalScheduledStartTime")
# Launches recorded before this patch waited for the run they started.
RETURN_ONCE_STARTED = "return-once-started"
# Launches recorded before this patch started a period again after its run had completed.
KEEP_FINISHED_PERIODS = "keep-finished-periods"
# Reconciliations recorded before this patch checked the period the schedule would bill now,
# billed or not.
RECONCILE_LAST_BILLED = "reconcile-last-billed"
# Reconciliations recorded before this patch read no billing schedule.
FOLLOW_BILLING_SCHEDULE = "follow-billing-schedule"
# Reconciliations recorded before this patch went back to no earlier period.
RECHECK_EARLIER = "recheck-earlier"
# Reconciliations recorded before this patch failed when the billing schedule could not be read.
UNREAD_SCHEDULE_WARNS = "unread-schedule-warns"
ArgT = TypeVar("ArgT")
ResultT = TypeVar("ResultT")


@workflow.defn(name="ScheduledBillingWorkflow")
class ScheduledBillingWorkflow:
    @workflow.run
    @one_input(ScheduledBillingInput)
    async def run(
        self, request: ScheduledBillingInput | None = None
    ) -> PeriodSummary | ReconcileReport | None:
        request = given(request, ScheduledBillingInput)
        nominal = workflow.info().typed_search_attributes.get(SCHEDULED_START)
        if nominal is None:
            raise ApplicationError(
                "started without a schedule's nominal time; use `starter.py run PERIOD`",
                type="NotScheduled",
                non_retryable=True,
            )
        billing, time_zone, alert = request.options.billing, request.time_zone, ""
        followed = request.billing_schedule_id
        if followed is not None and workflow.patched(FOLLOW_BILLING_SCHEDULE):
            firings = await self._billing_firings(followed, nominal)
            if firings is None:
                alert = (
                    f"; WARNING: the billing schedule {followed} is gone or could not be read"
                    " (the worker's log says which), so no month it bills was checked:"
                    f" `python starter.py schedule describe --id {followed}`"
                )
            else:
                billing, time_zone = firings.billing, firings.time_zone
                if firings.unbilled is not None:
                    alert = f"; WARNING: {firings.unbilled.describe()}"
        # A local activity: the month is read in the schedule's time zone, and the time-zone
        # database is I/O the workflow sandbox keeps out.
        period = await workflow.execute_local_activity(
            scheduled_period,
            ScheduledPeriodRequest(nominal_time=nominal, time_zone=time_zone, billing=billing),
            start_to_close_timeout=timedelta(seconds=10),
            summary=f"which period: nominal time in {time_zone}",
        )
        if request.action == "reconcile" and workflow.patched(RECONCILE_LAST_BILLED):
            # A schedule billing on the 28th bills November on December 28th: until then the
            # daily reconciliation keeps checking October, not a month nobody billed yet.
            billed = await workflow.execute_local_activity_method(
                PeriodActivities.latest_billed,
                period,
                start_to_close_timeout=timedelta(seconds=10),
                summary=f"the latest period billed: {period} or the one before",
            )
            if billed is None:
                rechecked = await self._recheck_earlier(period)
                workflow.set_current_details(
                    f"neither {period} nor the month before has been billed: nothing to"
                    f" reconcile{rechecked}{alert}"
                )
                return None
            period = billed
        words = "reconciling" if request.action == "reconcile" else "billing"
        workflow.set_current_details(
            f"{words} {period} (nominal time {nominal.isoformat()}){alert}"
        )
        if request.action == "reconcile":
            rechecked = await self._recheck_earlier(period)
            # Reconciled again on every firing: each finds what changed since.
            return await _reconcile(period, rechecked + alert)
        # A period whose run completed (cancelled ones too) is not started again: a backfill
        # over a billed month, or a time the clocks repeat, would charge the customers added
        # since, or undo an operator's cancel. Billing one again is `starter.py run`'s, by
        # hand. A failed or terminated run is started again. The ledger remembers a run
        # past the namespace's retention; the reuse policy covers a run completing meanwhile.
        reuse = WorkflowIDReusePolicy.ALLOW_DUPLICATE
        if workflow.patched(KEEP_FINISHED_PERIODS):
            if await workflow.execute_local_activity_method(
                PeriodActivities.completed,
                period,
                start_to_close_timeout=timedelta(seconds=10),
                summary=f"has a run of {period} completed?",
            ):
                workflow.set_current_details(
                    f"a run of {period} has completed or was cancelled: nothing started (bill it"
                    f" again by hand once it has ended: `python starter.py run {period}`)"
                )
                return None
            reuse = WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY
        return await _run_or_join(
            BillingPeriodWorkflow.run,
            BillingPeriodInput(period=period, options=request.options),
            period_workflow_id(parse_period(period)),
            f"Billing period {period}",
            period,
            reuse,
            alert,
        )

    async def _recheck_earlier(self, period: str) -> str:
        """Reconcile again the periods besides `period` that their last reconciliation left
        something in, or that have been run since (ledger.periods_to_recheck), a few at a
        firing; returns the words the launch's details end with."""
        if not workflow.patched(RECHECK_EARLIER):
            return ""
        earlier = await workflow.execute_local_activity_method(
            PeriodActivities.periods_to_recheck,
            period,
            start_to_close_timeout=timedelta(seconds=10),
            summary=f"earlier periods to reconcile again besides {period}",
        )
        for each in earlier:
            await _reconcile(each.period, "")
        if not earlier:
            return ""
        return "; also reconciling again " + ", ".join(f"{e.period} ({e.why})" for e in earlier)

    async def _billing_firings(
        self, schedule_id: str, nominal: datetime
    ) -> schedules.BillingFirings | None:
        """The followed billing schedule's settings and the months it left unbilled; None when it
        is gone or cannot be read, which holds back no reconciliation."""
        try:
            return await workflow.execute_local_activity_method(
                ScheduleCheckActivities.billing_firings,
                FiringsRequest(schedule_id=schedule_id, nominal_time=nominal),
                start_to_close_timeout=timedelta(seconds=10),
                retry_policy=RetryPolicy(maximum_attempts=5),
                summary=f"has the billing schedule {schedule_id} billed the months it fired for?",
            )
        except LOCAL_ACTIVITY_FAILURES as err:
            if not isinstance(err, ActivityError) and not workflow.patched(UNREAD_SCHEDULE_WARNS):
                raise
            workflow.logger.warning(
                "could not read the billing schedule %s (%s): reconciling with this"
                " schedule's own billing mode and zone",
                schedule_id,
                err.cause or err,
            )
            return None


async def _reconcile(period: str, alert: str) -> ReconcileReport | None:
    """Start the period's reconciliation, or join the one running."""
    return await _run_or_join(
        ReconcileWorkflow.run,
        ReconcileInput(period=period),
        reconcile_workflow_id(parse_period(period)),
        f"Reconcile {period}",
        period,
        WorkflowIDReusePolicy.ALLOW_DUPLICATE,
        alert,
    )


async def _run_or_join(
    run: MethodAsyncSingleParam[Any, ArgT, ResultT],
    argument: ArgT,
    workflow_id: str,
    summary: str,
    period: str,
    reuse: WorkflowIDReusePolicy,
    alert: str,
) -> ResultT | None:
    """Start the run, or join the one there; `alert` stays at the end of the details shown."""
    try:
        handle = await workflow.start_child_workflow(
            run,
            argument,
            id=workflow_id,
            id_reuse_policy=reuse,
            parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            static_summary=summary,
            search_attributes=TypedSearchAttributes(
                [SearchAttributePair(search_attributes.BILLING_PERIOD, period)]
            ),
        )
    except WorkflowAlreadyStartedError:
        workflow.set_current_details(f"{workflow_id} runs or has run: nothing more started{alert}")
        return None
    if workflow.patched(RETURN_ONCE_STARTED):
        # The schedule skips (overlap `skip`) or holds back (`buffer_all`) a firing while
        # this launch is open: waiting for a period paused for weeks would drop or delay the
        # next month's. The run goes on alone
        # (ABANDON); its own workflow holds its summary.
        workflow.set_current_details(f"started {workflow_id}{alert}")
        return None
    return await handle

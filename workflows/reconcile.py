"""Reconcile one period: settle what crashes and lost answers left open, and report what
Stripe holds that the ledger does not account for.

1. Vault reservations left unknown are settled with what Stripe has (committed or released).
2. Claims with no recorded outcome that no workflow owns (see
   billing.reconciliation.left_alone) are looked up on Stripe by the key in their
   metadata and recorded; a claim Stripe knows nothing of is charged again, with the same key,
   by a new run of the customer's own workflow ID: Temporal refuses that run if one appeared
   meanwhile, so a claim is never worked on twice at once.
3. Every customer's charges of the period on Stripe are compared with the ledger: duplicates,
   orphans and unrecorded charges are reported with their ids and amounts. A long comparison
   continues as new, carrying what the steps before found.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import (
    ActivityError,
    ChildWorkflowError,
    FailureError,
    RetryState,
    WorkflowAlreadyStartedError,
)

with workflow.unsafe.imports_passed_through():
    from activities.reconcile import ReconcileActivities
    from billing import search_attributes
    from billing.keys import customer_workflow_id
    from billing.models import Claim, CustomerChargeInput
    from billing.periods import parse_period
    from billing.reconciliation import (
        CarriedOver,
        ChargesPageRequest,
        ClaimResolution,
        Comparison,
        ReconcileInput,
        ReconcileReport,
        ReconcileVerdict,
        Settled,
    )
    from billing.redact import redact
    from workflows.customer_charge import CustomerChargeWorkflow
    from workflows.identity import checked, given, one_input

# Reconciliations recorded before this patch kept nothing of their report in the ledger.
RECORD_VERDICT = "record-verdict"
ACTIVITY_TIMEOUT = timedelta(seconds=60)
PAGE_TIMEOUT = timedelta(minutes=10)
PAGE_HEARTBEAT = timedelta(seconds=20)
# Bounded, unlike a charge's retries: a reconciliation that cannot read Stripe or the vault
# says so in its report (or fails), and the next daily run tries again.
RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=8,
)


@workflow.defn(name="ReconcileWorkflow")
class ReconcileWorkflow:
    @workflow.run
    @one_input(ReconcileInput)
    async def run(self, request: ReconcileInput | None = None) -> ReconcileReport:
        request = given(request, ReconcileInput)
        checked(parse_period, request.period)
        carried = request.carried
        # When the chain began: the ledger keeps the verdict of the latest to begin.
        began = workflow.info().workflow_start_time
        if carried is not None and carried.began_at is not None:
            began = carried.began_at
        if carried is None:
            settled = await self._settle(request)
            compared = await self._compare(request, settled, Comparison(), None, began)
        else:
            settled = carried.settled
            compared = await self._compare(
                request, settled, carried.compared, carried.cursor, began
            )
        report = ReconcileReport(
            period=request.period,
            workflow_id=workflow.info().workflow_id,
            claims=settled.claims,
            more_claims=settled.more_claims,
            reservations=settled.reservations,
            vault_checked=settled.vault_checked,
            customers_checked=compared.customers_checked,
            charges_checked=compared.charges_checked,
            pending_charges=compared.pending_count,
            unchecked_customers=compared.unchecked_customers,
            unchecked_count=compared.unchecked_count,
            findings=compared.findings,
            finding_counts=compared.finding_counts,
            handled_count=compared.handled_count,
            unclaimed_by_ended_run=settled.unclaimed_by_ended_run,
        )
        claims = settled.claims
        counts = compared.finding_counts
        # Counts only: each finding was logged by the activity that found it.
        workflow.logger.info(
            "reconciled %s: %d open claims (%s), %d reservations settled, findings: %s",
            request.period,
            len(claims),
            ", ".join(f"{c.customer_id} {c.action}" for c in claims) or "none",
            sum(r.state != "unknown" for r in report.reservations),
            ", ".join(f"{n} {kind}" for kind, n in counts.items()) or "none",
        )
        workflow.set_current_details(
            f"{len(claims)} open claims, {counts.get('duplicate', 0)} duplicates,"
            f" {counts.get('orphan', 0)} orphans, {sum(counts.values())} findings in all"
        )
        if workflow.patched(RECORD_VERDICT):
            await self._record_verdict(report, began)
        return report

    async def _record_verdict(self, report: ReconcileReport, began: datetime) -> None:
        """Keep what is left to look at again, for the daily reconciliation to come back to;
        a ledger that cannot take it costs the report nothing, and the next run records it."""
        try:
            await workflow.execute_activity_method(
                ReconcileActivities.record_verdict,
                ReconcileVerdict(
                    period=report.period, open_reason=report.open_reason, began_at=began
                ),
                start_to_close_timeout=ACTIVITY_TIMEOUT,
                retry_policy=RETRY,
                summary=f"keep what {report.period}'s reconciliation left to look at again",
            )
        except ActivityError as err:
            workflow.logger.warning(
                "could not record what reconciling %s left (%s): the report stands",
                report.period,
                err.cause or err,
            )

    async def _settle(self, request: ReconcileInput) -> Settled:
        """Unknown vault reservations, then open claims: what the first run does before it
        compares."""
        reservations = await workflow.execute_activity_method(
            ReconcileActivities.settle_reservations,
            request,
            start_to_close_timeout=PAGE_TIMEOUT,
            heartbeat_timeout=PAGE_HEARTBEAT,
            retry_policy=RETRY,
            summary=f"settle {request.period}'s unknown vault reservations from Stripe",
        )
        plan = await workflow.execute_activity_method(
            ReconcileActivities.open_claims,
            request,
            start_to_close_timeout=ACTIVITY_TIMEOUT,
            retry_policy=RETRY,
            summary=f"find {request.period}'s open claims no workflow owns",
        )
        claims = list(plan.left) + await self._resolve_all(plan.resolve, request)
        return Settled(
            # Those for a person first, wherever they came from (a stable sort).
            claims=sorted(claims, key=lambda c: not c.needs_person),
            more_claims=plan.more,
            reservations=reservations or [],
            vault_checked=reservations is not None,
            unclaimed_by_ended_run=plan.unclaimed_by_ended_run,
        )

    async def _resolve_all(
        self, claims: list[Claim], request: ReconcileInput
    ) -> list[ClaimResolution]:
        redrive_timeout = timedelta(seconds=request.redrive_timeout_seconds)
        at_once = request.claims_at_once
        if workflow.patched("reconcile-sliding-window"):
            # A claim starts as soon as any before it is done: a re-drive retried up to its
            # time limit (a saved Stripe 500) holds one place, not a whole batch.
            places = asyncio.Semaphore(at_once)

            async def resolve(claim: Claim) -> ClaimResolution:
                async with places:
                    return await self._resolve(claim, redrive_timeout)

            return list(await asyncio.gather(*(resolve(claim) for claim in claims)))
        resolved: list[ClaimResolution] = []
        for start in range(0, len(claims), at_once):
            batch = claims[start : start + at_once]
            resolved += await asyncio.gather(
                *(self._resolve(claim, redrive_timeout) for claim in batch)
            )
        return resolved

    async def _resolve(self, claim: Claim, redrive_timeout: timedelta) -> ClaimResolution:
        try:
            found = await workflow.execute_activity_method(
                ReconcileActivities.settle_claim,
                claim,
                start_to_close_timeout=PAGE_TIMEOUT,  # it waits its turn in the Stripe rate
                retry_policy=RETRY,
                summary=f"look {claim.customer_id}'s charge up on Stripe",
            )
        except ActivityError as err:
            return _lookup_failed(claim, err)
        return found if found is not None else await self._redrive(claim, redrive_timeout)

    async def _redrive(self, claim: Claim, timeout: timedelta) -> ClaimResolution:
        """Charge again with the claim's key (Stripe replays a charge it has) and record it,
        by running the customer's own workflow again."""
        workflow_id = customer_workflow_id(parse_period(claim.period), claim.customer_id)
        try:
            outcome = await workflow.execute_child_workflow(
                CustomerChargeWorkflow.run,
                CustomerChargeInput(period=claim.period, customer_id=claim.customer_id),
                id=workflow_id,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                # A charge under way finishes and is recorded even if this run ends.
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                execution_timeout=timeout,
                static_summary=f"Re-drive {claim.customer_id} for {claim.period} (reconcile)",
                search_attributes=search_attributes.for_customer(claim.period, claim.customer_id),
            )
        except WorkflowAlreadyStartedError:
            return _left(claim, "a run of its workflow started meanwhile", needs_person=False)
        except ChildWorkflowError as err:
            if err.retry_state == RetryState.TIMEOUT:
                # Stopped with its key unchanged: the next reconciliation sends the same key.
                return _left(claim, _still_retried(workflow_id, timeout))
            return _left(claim, f"re-drive ended without an outcome: {_reason(err)}")
        return ClaimResolution(
            customer_id=claim.customer_id,
            action="redriven",
            outcome=outcome.outcome,
            charge_id=outcome.charge_id,
            detail=outcome.failure_code,
        )

    async def _compare(
        self,
        request: ReconcileInput,
        settled: Settled,
        compared: Comparison,
        cursor: str | None,
        began: datetime,
    ) -> Comparison:
        period = request.period
        while True:
            page = await workflow.execute_activity_method(
                ReconcileActivities.compare_charges,
                ChargesPageRequest(
                    period=period,
                    after=cursor,
                    limit=request.page_size,
                    listed_room=compared.room,
                ),
                start_to_close_timeout=PAGE_TIMEOUT,
                heartbeat_timeout=PAGE_HEARTBEAT,
                retry_policy=RETRY,
                summary=f"compare Stripe's charges of {period} with the ledger",
            )
            compared.add(page)
            cursor = page.next_cursor
            if cursor is None:
                return compared
            if _history_full(request) and workflow.patched("reconcile-continue-as-new"):
                # Each page adds to the history: a million customers would pass its limits.
                carried = CarriedOver(
                    settled=settled, compared=compared, cursor=cursor, began_at=began
                )
                workflow.continue_as_new(request.model_copy(update={"carried": carried}))


def _history_full(request: ReconcileInput) -> bool:
    info = workflow.info()
    return (
        info.is_continue_as_new_suggested()
        or info.get_current_history_length() >= request.history_event_limit
    )


def _left(claim: Claim, detail: str, *, needs_person: bool = True) -> ClaimResolution:
    return ClaimResolution(
        customer_id=claim.customer_id, action="left", detail=detail, needs_person=needs_person
    )


def _lookup_failed(claim: Claim, err: ActivityError) -> ClaimResolution:
    """A person's, even when retried to its limit (Stripe's rate, an outage): such a
    failure may as well last, and a claim left quietly would stay open for good."""
    passing = err.retry_state in (RetryState.MAXIMUM_ATTEMPTS_REACHED, RetryState.TIMEOUT)
    then = (
        "; retried to its limit: if Stripe or the vault was away a while, the next"
        " reconciliation looks again, and if it fails again, the worker's log says why"
    )
    return _left(claim, f"lookup failed: {_reason(err)}{then if passing else ''}")


def _still_retried(workflow_id: str, timeout: timedelta) -> str:
    return (
        f"re-drive stopped after {timeout.total_seconds():g} s, its charge still being"
        " retried, or waiting (at the gate while its period is paused, or for its turn in"
        f" Stripe's rate); the worker's log has each try's error (workflow_id {workflow_id})."
        " A 500 Stripe saved for the key is replayed until Stripe forgets the key, a day"
        " after its first request, and the next reconciliation after that charges it once;"
        " a refused vault key or a pause waits for what `python starter.py status` advises"
    )


def _reason(err: FailureError) -> str:
    cause = err.cause or err
    return redact(str(cause))

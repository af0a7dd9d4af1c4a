"""One customer, one period: claim the row, charge it once, record the result."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, FailureError

with workflow.unsafe.imports_passed_through():
    from activities.charging import (
        CANCELLED,
        CLAIM_CLOSED,
        SKIPPED,
        UNKNOWN_CUSTOMER,
        ChargingActivities,
        RecordCharge,
        RecordUnbilled,
    )
    from activities.stripe_failures import DECLINED, PERIOD_BLOCKERS, REFUSED
    from billing import search_attributes
    from billing.models import (
        TERMINAL_STATUSES,
        ChargeFailure,
        ChargeResult,
        Claim,
        CustomerChargeInput,
        CustomerOutcome,
        LedgerStatus,
        Outcome,
        finished_outcome,
    )
    from workflows.signals import PERIOD_BLOCKED

LEDGER_TIMEOUT = timedelta(seconds=30)
# Stripe's own timeout is 30 s; a worker that dies mid-call is noticed by the heartbeat.
CHARGE_TIMEOUT = timedelta(seconds=60)
CHARGE_HEARTBEAT_TIMEOUT = timedelta(seconds=10)
BLOCKED_RETRY = timedelta(seconds=5)
# Retried without limit: a charge is never abandoned while its outcome is unknown; every
# attempt carries the claim's key, so Stripe executes it at most once.
CHARGE_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
)
# Failures recorded as the customer's outcome (ledger status) rather than failing the workflow.
RECORDED_FAILURES: dict[str, LedgerStatus] = {
    DECLINED: "failed",
    REFUSED: "failed",
    SKIPPED: "skipped",
    CANCELLED: "cancelled",
}


@workflow.defn(name="CustomerChargeWorkflow")
class CustomerChargeWorkflow:
    @workflow.run
    async def run(self, request: CustomerChargeInput) -> CustomerOutcome:
        try:
            claim = await workflow.execute_local_activity_method(
                ChargingActivities.claim,
                request,
                start_to_close_timeout=LEDGER_TIMEOUT,
                summary=f"claim {request.customer_id} for {request.period}",
            )
        except (ActivityError, ApplicationError) as err:
            # A local activity's final failure can arrive unwrapped.
            cause = err.cause if isinstance(err, ActivityError) else err
            if not isinstance(cause, ApplicationError) or cause.type != UNKNOWN_CUSTOMER:
                raise
            # Deactivated or removed after the period listed it: nothing to charge.
            return CustomerOutcome(
                customer_id=request.customer_id, outcome="failed", failure_code="unknown_customer"
            )
        if claim.status == "claimed":
            outcome = await self._charge(request, claim)
        else:
            outcome = _outcome(claim, finished_outcome(claim.status))
        workflow.upsert_search_attributes(
            [search_attributes.BILLING_STATUS.value_set(outcome.outcome)]
        )
        # The period hears the outcome from this result, not from a signal.
        return outcome

    async def _charge(self, request: CustomerChargeInput, claim: Claim) -> CustomerOutcome:
        try:
            result = await self._charge_until_unblocked(request, claim)
        except ActivityError as err:
            closed = _closed_status(err)
            if closed is not None:
                return _outcome(claim, finished_outcome(closed))
            recorded = _recorded_failure(err)
            if recorded is None:
                raise
            status, failure = recorded
            await workflow.execute_local_activity_method(
                ChargingActivities.record_unbilled,
                RecordUnbilled(claim=claim, status=status, failure=failure),
                start_to_close_timeout=LEDGER_TIMEOUT,
                summary=f"record {status}: {failure.code}",
            )
            return _outcome(claim, finished_outcome(status), failure_code=failure.code)
        await workflow.execute_local_activity_method(
            ChargingActivities.record_charge,
            RecordCharge(claim=claim, result=result),
            start_to_close_timeout=LEDGER_TIMEOUT,
            summary=f"record charge {result.charge_id}",
        )
        return _outcome(claim, "charged", charge_id=result.charge_id)

    async def _charge_until_unblocked(
        self, request: CustomerChargeInput, claim: Claim
    ) -> ChargeResult:
        """Charge; when the period's key is refused, tell the period (which pauses) and try
        again: the next attempt waits at the ledger's gate until an operator resumes or
        cancels."""
        while True:
            try:
                return await workflow.execute_activity_method(
                    ChargingActivities.charge,
                    claim,
                    start_to_close_timeout=CHARGE_TIMEOUT,
                    heartbeat_timeout=CHARGE_HEARTBEAT_TIMEOUT,
                    retry_policy=CHARGE_RETRY,
                    summary=f"charge {claim.amount_cents} {claim.currency} to {claim.customer_id}",
                )
            except ActivityError as err:
                cause = err.cause
                if not isinstance(cause, ApplicationError) or cause.type not in PERIOD_BLOCKERS:
                    raise
                failure = ChargeFailure.model_validate(cause.details[0])
                await self._tell_period_blocked(request, failure)
                await workflow.sleep(BLOCKED_RETRY)

    async def _tell_period_blocked(
        self, request: CustomerChargeInput, failure: ChargeFailure
    ) -> None:
        if request.parent_workflow_id is None:
            return
        parent = workflow.get_external_workflow_handle(request.parent_workflow_id)
        try:
            await parent.signal(PERIOD_BLOCKED, failure)
        except FailureError:
            # The period run has closed (e.g. terminated): nobody is left to pause.
            workflow.logger.warning("period workflow gone; %s not delivered", PERIOD_BLOCKED)


def _closed_status(err: ActivityError) -> LedgerStatus | None:
    """The status the ledger already gave the claim, when another hand finished it."""
    cause = err.cause
    if not isinstance(cause, ApplicationError) or cause.type != CLAIM_CLOSED:
        return None
    status = ChargeFailure.model_validate(cause.details[0]).code
    return status if status in TERMINAL_STATUSES else "failed"  # type: ignore[return-value]


def _recorded_failure(err: ActivityError) -> tuple[LedgerStatus, ChargeFailure] | None:
    cause = err.cause
    if not isinstance(cause, ApplicationError) or cause.type not in RECORDED_FAILURES:
        return None
    return RECORDED_FAILURES[cause.type], ChargeFailure.model_validate(cause.details[0])


def _outcome(
    claim: Claim,
    outcome: Outcome,
    *,
    charge_id: str | None = None,
    failure_code: str | None = None,
) -> CustomerOutcome:
    return CustomerOutcome(
        customer_id=claim.customer_id,
        outcome=outcome,
        amount_cents=claim.amount_cents,
        currency=claim.currency,
        charge_id=charge_id or claim.charge_id,
        failure_code=failure_code or claim.failure_code,
    )

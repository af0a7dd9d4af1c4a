"""One customer, one period: bill it once (claim, charge, record) and report the outcome."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, FailureError
from temporalio.exceptions import TimeoutError as TemporalTimeoutError

with workflow.unsafe.imports_passed_through():
    from activities.charging import HELD, PAUSED, SLOT_AHEAD, BillRequest, ChargingActivities
    from activities.stripe_failures import PERIOD_BLOCKERS
    from billing import search_attributes
    from billing.customer_start import CUSTOMER_CHARGE_WORKFLOW
    from billing.keys import customer_workflow_id, validate_customer_id
    from billing.models import (
        ChargeFailure,
        CustomerChargeInput,
        CustomerOutcome,
        OperatorRequest,
    )
    from billing.periods import parse_period
    from billing.rate_limit import Slot
    from workflows.failures import LOCAL_ACTIVITY_FAILURES
    from workflows.identity import checked, given, one_input, require_id
    from workflows.signals import PERIOD_BLOCKED, PERIOD_CONTROL

# Stripe's own timeout is 30 s, plus a short wait for a Stripe slot, an old claim's lookup
# and the ledger's few statements. The bill is a local activity: a worker that dies mid-call
# is noticed when the workflow task times out, and the next worker runs it again with the
# same key.
BILL_TIMEOUT = timedelta(seconds=60)
# Retried without limit: a charge is never abandoned while its outcome is unknown; every
# attempt carries the claim's key, so Stripe executes it at most once.
BILL_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
)
# Retries due within this run in the worker, in the same workflow task; later ones (Stripe
# down for minutes) wait on a workflow timer, so no worker holds the task meanwhile.
LOCAL_RETRY_THRESHOLD = timedelta(seconds=5)
# The workflow sleeps until this long before a reserved Stripe slot; the activity sleeps the
# rest (less than its SLOT_SLEEP_MAX), on the database's clock, so a late timer costs no slot.
SLOT_LEAD = timedelta(seconds=1)
# While the period is paused (or told its key was refused), the child waits for the period's
# signal on resume or cancel; these timers are for a period that cannot send it (terminated).
PERIOD_WAIT_FIRST = timedelta(seconds=5)
PERIOD_WAIT_MAX = timedelta(minutes=5)
# Retries that become timers, and waits for the period, add to this run's history: a bill
# retried for this long gives the workflow a look, and past the request's history limit the
# child continues as new (the next run finds the same claim in the ledger).
BILL_ROUND = timedelta(minutes=10)
# Temporal's own cancel of a customer's workflow (the Web UI's Cancel, its API) is a skip of
# the customer, as the period's is a cancel: it used to end the workflow CANCELED with its
# claim left open, which reconciliation then drove on and charged. Every bill after it
# carries the stop, which the bill writes to the ledger before its claim (and a continued run
# carries on): stopped at the gate the customer ends skipped, and a charge already sent (its
# bill running as the cancel arrives) is finished and recorded, as under `skip`.
TEMPORAL_CANCEL_IS_A_STOP = "temporal-cancel-is-a-stop"
# The SDK runs a signal, and the workflow with it, before it applies a cancel that came in the
# same workflow task: a charge the period's signal woke would be sent, or the child continued
# as new, before it could see that cancel. Woken by a signal, the child waits one short timer
# first, so the cancel is known to its next bill or to its next run.
SETTLE_AFTER_SIGNAL = "settle-after-signal"
SETTLE = timedelta(milliseconds=1)
TEMPORAL_CANCEL = OperatorRequest(
    reason="cancelled in Temporal (the Web UI's Cancel, or its API)", operator="temporal"
)


# Outside the sandbox for speed; the tests run it inside (see workflows/__init__.py).
@workflow.defn(name=CUSTOMER_CHARGE_WORKFLOW, sandboxed=False)
class CustomerChargeWorkflow:
    def __init__(self) -> None:
        # The period's signals, and a Temporal cancel: each wakes a charge waiting for the
        # gate to try again.
        self._period_signals = 0
        # The stop every bill carries once a Temporal cancel arrived (this run's or one
        # before it continued as new).
        self._stop: OperatorRequest | None = None
        # Set when run cancels the billing itself (a run recorded before the patch).
        self._billing_cancelled = False

    @workflow.signal(name=PERIOD_CONTROL)
    def period_control(self) -> None:
        """The period resumed or was cancelled: a charge waiting for it tries again."""
        self._period_signals += 1

    @workflow.run
    @one_input(CustomerChargeInput)
    async def run(self, request: CustomerChargeInput | None = None) -> CustomerOutcome:
        request = given(request, CustomerChargeInput)
        period = checked(parse_period, request.period)
        customer_id = checked(validate_customer_id, request.customer_id)
        require_id(
            customer_workflow_id(period, customer_id),
            f"the charge of {customer_id} for {period}",
            f"its period's run starts it (`python starter.py run {period}`)",
        )
        self._stop = request.stop
        # Temporal cancels the task running `run`: billing goes on in a task of its own, so a
        # bill in flight is not cut off, and the cancel reaches it as a skip would.
        billing = asyncio.create_task(self._bill_when_allowed(request))
        try:
            outcome = await asyncio.shield(billing)
        except asyncio.CancelledError:
            if not workflow.patched(TEMPORAL_CANCEL_IS_A_STOP):
                # Recorded before the patch: the cancel reached the wait or the bill itself.
                self._billing_cancelled = True
                billing.cancel()
                await billing
                raise
            self._stop = TEMPORAL_CANCEL
            if not billing.done():
                # Written at once too: a bill retrying carries the request it began with.
                await workflow.execute_local_activity_method(
                    ChargingActivities.stop,
                    BillRequest(
                        period=request.period, customer_id=request.customer_id, stop=self._stop
                    ),
                    start_to_close_timeout=BILL_TIMEOUT,
                    retry_policy=BILL_RETRY,
                    summary=f"stop {request.customer_id}: {TEMPORAL_CANCEL.reason}",
                )
            self._period_signals += 1
            try:
                outcome = await billing
            except workflow.ContinueAsNewError:
                # Continued as new in the cancel's own turn, before the stop: the next run
                # carries it.
                workflow.continue_as_new(self._carried(request))
        workflow.upsert_search_attributes(
            [search_attributes.BILLING_STATUS.value_set(outcome.outcome)]
        )
        # The period hears the outcome from this result, not from a signal.
        return outcome

    async def _bill_when_allowed(self, request: CustomerChargeInput) -> CustomerOutcome:
        """Bill in one local activity (claim, charge, record), which never waits long in the
        workflow task: for a Stripe slot further off, the workflow sleeps and comes back with
        it; while the period is paused, or its key is refused (the period is told, and
        pauses), the workflow waits for the period's signal and tries again, and the
        ledger's gate says go or cancel. A customer held behind its old id's open claim
        waits the same way, the timers bringing it back once that claim has ended."""
        slot: datetime | None = None
        patience = PERIOD_WAIT_FIRST
        while True:
            self._continue_as_new_if_long(request)
            signals_seen = self._period_signals
            try:
                return await workflow.execute_local_activity_method(
                    ChargingActivities.bill,
                    BillRequest(
                        period=request.period,
                        customer_id=request.customer_id,
                        slot=slot,
                        claimant=workflow.info().first_execution_run_id,
                        stop=self._stopped(),
                    ),
                    start_to_close_timeout=BILL_TIMEOUT,
                    schedule_to_close_timeout=BILL_ROUND,
                    retry_policy=BILL_RETRY,
                    local_retry_threshold=LOCAL_RETRY_THRESHOLD,
                    summary=f"bill {request.customer_id} for {request.period}",
                )
            except LOCAL_ACTIVITY_FAILURES as err:
                if _timed_out(err):
                    # A round of retries ran out; the key is the same on the next one.
                    slot = None
                    continue
                failure = _application_failure(err)
                if failure is None:
                    raise
                if failure.type == SLOT_AHEAD:
                    ahead = Slot.model_validate(failure.details[0])
                    slot = ahead.at
                    await workflow.sleep(
                        timedelta(seconds=ahead.wait_seconds) - SLOT_LEAD,
                        summary="wait for a Stripe slot",
                    )
                    continue
                if failure.type in PERIOD_BLOCKERS:
                    blocked = ChargeFailure.model_validate(failure.details[0])
                    await self._tell_period_blocked(request, blocked)
                elif failure.type not in (PAUSED, HELD):
                    raise
            slot = None
            patience = await self._wait_for_period(signals_seen, patience)

    def _stopped(self) -> OperatorRequest | None:
        """The stop the next bill carries: once Temporal's cancel has arrived, before `run`
        hears of it too (the cancel reaches `run` a turn later, after a bill scheduled in
        the same turn)."""
        if (
            self._stop is None
            and not self._billing_cancelled
            and workflow.cancellation_reason() is not None
        ):
            self._stop = TEMPORAL_CANCEL
        return self._stop

    def _carried(self, request: CustomerChargeInput) -> CustomerChargeInput:
        """The next run's input: the same, with the stop once there is one."""
        stop = self._stopped()
        return request if stop is None else request.model_copy(update={"stop": stop})

    def _continue_as_new_if_long(self, request: CustomerChargeInput) -> None:
        info = workflow.info()
        if (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= request.history_event_limit
        ):
            workflow.continue_as_new(self._carried(request))

    async def _wait_for_period(self, signals_seen: int, patience: timedelta) -> timedelta:
        """Wait for a signal from the period later than the first `signals_seen`, or for
        `patience`; returns the patience for the next wait."""
        try:
            await workflow.wait_condition(
                lambda: self._period_signals != signals_seen,
                timeout=patience,
                timeout_summary="wait for the period to resume or cancel",
            )
        except TimeoutError:
            return min(patience * 2, PERIOD_WAIT_MAX)
        except asyncio.CancelledError:
            # Under the SDK's coming activation rule (its logic flag 2), a wait begun before
            # a Temporal cancel raises this when it ends, in whichever task waits: the wait
            # is over, and the next bill carries the stop. Only run's own cancel (a run
            # recorded before the patch) is a cancel of the billing.
            if self._billing_cancelled:
                raise
            return patience
        if self._stopped() is None and workflow.patched(SETTLE_AFTER_SIGNAL):
            await workflow.sleep(SETTLE, summary="let a cancel sent with the signal arrive")
        return patience

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


def _cause(err: FailureError) -> BaseException | None:
    """The activity's own failure: a local activity's final failure can arrive unwrapped."""
    return err.cause if isinstance(err, ActivityError) else err


def _timed_out(err: FailureError) -> bool:
    return isinstance(_cause(err), TemporalTimeoutError)


def _application_failure(err: FailureError) -> ApplicationError | None:
    cause = _cause(err)
    return cause if isinstance(cause, ApplicationError) else None

"""Claim, charge and record one customer's bill for one period."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import stripe
from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from activities.stripe_access import StripeAccess
from activities.stripe_failures import (
    DECLINED,
    KEY_REFUSED,
    PERIOD_BLOCKERS,
    REFUSED,
    RETRYABLE,
    SPEND_CAP_EXCEEDED,
    declined,
    fence_of,
    lookup_failure,
    replays_saved_error,
    to_temporal_failure,
)
from activities.stripe_gateway import StripeGateway
from billing import ledger, logs, metrics
from billing.config import BillingSettings
from billing.errors import (
    BillingError,
    ClaimClosedError,
    HeldCustomerError,
    InvalidInputError,
    UnknownCustomerError,
)
from billing.keys import idempotency_key, validate_customer_id
from billing.models import (
    NO_PERIOD_KEY_CODE,
    ChargeFailure,
    ChargeResult,
    Claim,
    CustomerOutcome,
    Gate,
    LedgerStatus,
    OperatorRequest,
    Outcome,
    Record,
    finished_outcome,
)
from billing.periods import parse_period
from billing.rate_limit import Slot, stripe_rate
from billing.stripe_client import error_code
from vault.endpoints import NOT_SENT_CODES

# The period is paused: the workflow waits for its resume or cancel.
PAUSED = "PeriodPaused"
# A claim closed by another hand whose row is gone when read again (deleted by hand).
CLAIM_MISSING = "claim_missing"
# The customer is held while its Stripe customer's old id has a claim open (see
# ledger.claim): the workflow waits, as for a pause, and tries again.
HELD = "CustomerHeld"
# The request names no valid period or customer id: only a customer workflow started by hand
# can, as a period lists valid ones. A retry cannot mend it, so its workflow fails.
INVALID_INPUT = "InvalidInput"
# The attempt's Stripe slot is further off than it may sleep: the workflow sleeps and comes
# back with the slot (details: the Slot).
SLOT_AHEAD = "StripeSlotAhead"
# What the ledger records for a customer the gate stopped before Stripe.
STOPPED_BY_OPERATOR = {
    "skipped": "an operator skipped this customer",
    "cancelled": "an operator cancelled the period",
}
# The charge is a local activity, run inside its workflow's task: it sleeps for a Stripe slot
# only this long there, and hands a slot further off to the workflow's timer.
SLOT_SLEEP_MAX = 2.0
# The `outcome` of a charge attempt that failed for good; any other failure is an "error".
FAILED_OUTCOMES = {
    DECLINED: "declined",
    REFUSED: "refused",
    SPEND_CAP_EXCEEDED: "refused",
    KEY_REFUSED: "refused",
}

log = logging.getLogger("billing.charging")


class _StoppedBehindSavedError(Exception):
    """Recorded skipped or cancelled: an operator stopped this charge while it was held
    behind a 500 Stripe saved for its key (ledger.stop_behind_saved_error). `failure` is
    the attempt's own, reported as any other."""

    def __init__(self, status: LedgerStatus, failure: ApplicationError) -> None:
        super().__init__(str(failure))
        self.status = status
        self.failure = failure


class BillRequest(Record):
    period: str
    customer_id: str
    # A Stripe slot an earlier attempt reserved and the workflow waited for (database clock).
    slot: datetime | None = None
    # Who claims, as the ledger records it: the first run of the child's continue-as-new
    # chain, so that a later run counts a charge an earlier one recorded as its own ("charged",
    # not "already billed"). None: the activity's own run.
    claimant: str | None = None
    # Stop the customer before claiming, as `skip` would (its workflow was cancelled in
    # Temporal): written by the same activity that then reads the outcome from the ledger,
    # so the two agree. A charge already sent is finished all the same.
    stop: OperatorRequest | None = None

    @property
    def claimant_run(self) -> str | None:
        return self.claimant or activity.info().workflow_run_id


class ChargingActivities:
    def __init__(self, pool: asyncpg.Pool, access: StripeAccess, settings: BillingSettings) -> None:
        self._pool = pool
        self._access = access
        self._settings = settings
        self._stripe_rate = stripe_rate(pool, settings)

    @activity.defn(name="bill")
    async def bill(self, request: BillRequest) -> CustomerOutcome:
        """Claim the customer's row, charge it once and record the outcome: one local
        activity, so a customer costs its workflow one marker and one activation. Every
        attempt starts from the ledger (the claim is found again), so a retry, or a workflow
        task run again after the record, finishes what an earlier one began with the same
        key. It never waits long (a paused period, a far Stripe slot): it raises at once and
        the workflow waits on a timer or a signal instead."""
        try:
            claim = await self._claim(request)
        except HeldCustomerError as exc:
            logs.log_event(
                log,
                "held",
                period=request.period,
                customer_id=request.customer_id,
                held_as=exc.held_as,
                workflow_id=activity.info().workflow_id,
            )
            raise ApplicationError(
                str(exc), type=HELD, non_retryable=True, category=ApplicationErrorCategory.BENIGN
            ) from None
        except InvalidInputError as exc:
            raise ApplicationError(str(exc), type=INVALID_INPUT, non_retryable=True) from None
        except UnknownCustomerError:
            # Deactivated or removed after the period listed it: nothing to charge.
            return CustomerOutcome(
                customer_id=request.customer_id, outcome="failed", failure_code="unknown_customer"
            )
        if claim.status != "claimed":
            return _finished(claim, request.claimant_run)
        await self._wait_for_slot(claim, request.slot)
        # The key is chosen before the gate, which records it on the claim (see
        # ledger.reopen_refused_charge). A missing key is acted on past the gate only, so a
        # pause, cancel or skip still reaches the claim.
        gateway: StripeGateway | BillingError
        try:
            gateway = await self._access.gateway_for(claim)
        except BillingError as exc:
            gateway = exc
        route = gateway.route if isinstance(gateway, StripeGateway) else None
        try:
            async with self._pool.acquire() as conn:
                passage = await ledger.begin_charge(conn, claim, route)
        except ClaimClosedError:
            # Finished by another hand (e.g. cancelled by its run) since it was claimed.
            async with self._pool.acquire() as conn:
                closed = await ledger.claim_by_key(conn, claim.idempotency_key)
            if closed is None:
                # Its row deleted by hand since: nothing says how it ended, so it is failed,
                # by a code that says why.
                missing = {"status": "failed", "failure_code": CLAIM_MISSING}
                closed = claim.model_copy(update=missing)
            return _finished(closed, request.claimant_run)
        gate: Gate = passage.gate
        if gate == "paused":
            # The workflow waits for the period's word (resume or cancel), not this task.
            raise ApplicationError(
                "the period is paused",
                type=PAUSED,
                non_retryable=True,
                category=ApplicationErrorCategory.BENIGN,
            )
        if gate != "go":
            stopped = ChargeFailure(code=gate, message=STOPPED_BY_OPERATOR[gate])
            return await self._record_unbilled(claim, gate, stopped)
        try:
            result = await self._charge(claim, gateway, passage.fencing_token)
        except _StoppedBehindSavedError as stopped:
            _report_failure(claim, stopped.failure)
            return _unbilled(claim, stopped.status, stopped.status)
        except Exception as error:
            _report_failure(claim, error)
            failure = _refusal(error)
            if failure is None:
                raise
            return await self._record_unbilled(claim, "failed", failure)
        _report_charge(claim, result)
        async with self._pool.acquire() as conn:
            recorded = await ledger.record_charge(conn, claim.idempotency_key, result)
        if recorded:
            # Not in _report_charge: an attempt whose record failed is retried, and Stripe
            # replays the same charge to the retry.
            metrics.charge_recorded(result.amount_cents, result.currency, claim.claimed_at)
        _log_event("record", claim, status="charged", charge_id=result.charge_id)
        return _outcome(claim, "charged", charge_id=result.charge_id)

    @activity.defn(name="stop_customer")
    async def stop(self, request: BillRequest) -> None:
        """Write `request.stop` at once, as the workflow hears its cancel: a bill retrying
        then (its retries carry the request it began with) meets it at the gate."""
        assert request.stop is not None, "stop_customer needs the stop"
        customer_id, period, key = self._claim_of(request)
        async with self._pool.acquire() as conn:
            await _write_stop(conn, customer_id, period, key, request.stop)

    def _claim_of(self, request: BillRequest) -> tuple[str, str, str]:
        """The customer, period and idempotency key of the request's claim."""
        period = parse_period(request.period)
        customer_id = validate_customer_id(request.customer_id)
        key = idempotency_key(self._settings.billing_key_namespace, customer_id, period)
        return customer_id, str(period), key

    async def _claim(self, request: BillRequest) -> Claim:
        """The claim, made now or found again; a run that claims an open row owns it."""
        customer_id, period, key = self._claim_of(request)
        async with self._pool.acquire() as conn:
            if request.stop is not None:
                await _write_stop(conn, customer_id, period, key, request.stop)
            claim = await ledger.claim(
                conn,
                customer_id,
                period,
                key,
                request.claimant_run,
                charge_api=self._settings.billing_charge_api,
            )
        _log_event(
            "claim",
            claim,
            status=claim.status,
            amount_cents=claim.amount_cents,
            currency=claim.currency,
        )
        return claim

    async def _record_unbilled(
        self, claim: Claim, status: LedgerStatus, failure: ChargeFailure
    ) -> CustomerOutcome:
        async with self._pool.acquire() as conn:
            await ledger.record_unbilled(conn, claim.idempotency_key, status, failure)
        return _unbilled(claim, status, failure.code)

    def _looks_up_first(self, claim: Claim) -> bool:
        # Stripe forgets keys after 24 hours: past that a replay would charge again, so an
        # old claim is looked up first. Its age by the database's clock, as the vault counts
        # its own window: a worker's clock running slow would take a claim Stripe has
        # forgotten for one it remembers.
        assert claim.claimed_ago is not None, "the bill reads its claim from the ledger"
        return claim.claimed_ago > timedelta(seconds=self._settings.billing_lookup_after_seconds)

    async def _stop_behind_saved_error(
        self, claim: Claim, fencing_token: int
    ) -> LedgerStatus | None:
        """The cancel or skip recorded for a claim whose attempt `fencing_token` met a 500
        Stripe saved for its key with no charge made (ledger.stop_behind_saved_error), once
        the vault has fenced off the attempts before it: one held up on its way (a frozen
        worker) would otherwise send the key once Stripe forgets it, charging a customer the
        ledger says was not. None while no stop applies, or the fence could not be raised
        (the vault away): the retry in 4 minutes tries again."""
        async with self._pool.acquire() as conn:
            due = await ledger.stop_behind_saved_error(
                conn, claim.idempotency_key, fencing_token, record=False
            )
            if due is None:
                return None
            keys = await ledger.vault_keys_sent_through(conn, claim.idempotency_key)
        if not await self._access.fence_off(claim.idempotency_key, keys, fencing_token + 1):
            _log_event("stop_waits_for_fence", claim, level=logging.WARNING, status=due)
            return None
        async with self._pool.acquire() as conn:
            return await ledger.stop_behind_saved_error(
                conn, claim.idempotency_key, fencing_token, record=True
            )

    async def _charge(
        self, claim: Claim, gateway: StripeGateway | BillingError, fencing_token: int
    ) -> ChargeResult:
        if isinstance(gateway, BillingError):
            # No key for this period and currency (e.g. a customer added after the plan):
            # the period pauses until an operator acts. Nothing was sent, so the claim waits
            # at the gate again, where a skip or a cancel reaches it. Only if this was its
            # first attempt: an operator may have deleted a revoked key's row after an
            # earlier attempt reached Stripe with it.
            await self._reopen(claim, fencing_token)
            raise ApplicationError(
                str(gateway),
                ChargeFailure(code=NO_PERIOD_KEY_CODE, message=str(gateway)),
                type=KEY_REFUSED,
                non_retryable=True,
            )
        # Whether what is under way is a lookup, whose error is mapped as one (lookup_failure).
        looking_up = self._looks_up_first(claim)
        try:
            if looking_up:
                found = await gateway.find(claim)
                if found is not None:
                    return _settle(found)
                looking_up = False
            return _settle(await gateway.charge(claim, fencing_token))
        except stripe.StripeError as exc:
            error = exc
            if isinstance(exc, stripe.IdempotencyError) or replays_saved_error(exc):
                # The key replays a 500 saved after the charge began, or refuses other
                # parameters (a setting changed mid-period): either way a charge with this
                # key may exist, and the truth is in the customer's charges.
                try:
                    found = await gateway.find(claim)
                except stripe.StripeError as lookup_error:
                    # The lookup's own failure (Stripe's rate, a key refused) is what the
                    # retry must wait out.
                    error, looking_up = lookup_error, True
                else:
                    if found is not None:
                        return _settle(found)
                    if replays_saved_error(exc):
                        stop = await self._stop_behind_saved_error(claim, fencing_token)
                        if stop is not None:
                            raise _StoppedBehindSavedError(stop, to_temporal_failure(exc))
            metrics.count_vault_refusal(error)
            failure = lookup_failure(error) if looking_up else to_temporal_failure(error)
            # Only the create's own refusal can show that this attempt never reached Stripe;
            # a lookup refused after Stripe answered the create shows nothing of the kind.
            refused_before_stripe = error is exc
            if refused_before_stripe and (
                isinstance(exc, stripe.RateLimitError) or error_code(exc) in NOT_SENT_CODES
            ):
                # Stripe executes nothing it rate-limits, and the vault sent nothing: if this
                # was the claim's only attempt, nothing of it is at Stripe, so the retry
                # passes the gate afresh and a pause, cancel or skip meanwhile still stops it.
                await self._reopen(claim, fencing_token)
            if failure.type in PERIOD_BLOCKERS:
                if await self._access.replaced(claim.period, claim.currency, gateway.vault_key_id):
                    # This worker charged with a key replaced since (by a rerun's preparation
                    # or a renewal, which revoke it, or by an operator's delete): the retry
                    # takes the new one, and nothing pauses. Refused before Stripe, it passes
                    # the gate afresh.
                    if refused_before_stripe:
                        await self._reopen(claim, fencing_token)
                    raise ApplicationError(
                        f"the vault refused a period key replaced since ({failure.message});"
                        " retrying with the new key",
                        type=RETRYABLE,
                    ) from None
                if refused_before_stripe:
                    # The claim waits at the gate for the operator. The vault says whether
                    # it fenced off the attempts before this one.
                    fenced = failure.type == SPEND_CAP_EXCEEDED and fence_of(exc) == fencing_token
                    await self._reopen(
                        claim, fencing_token, fenced_by=gateway.vault_key_id if fenced else None
                    )
            raise failure from None

    async def _reopen(
        self, claim: Claim, fencing_token: int, *, fenced_by: str | None = None
    ) -> None:
        """Undo the gate for an attempt refused before Stripe (see reopen_refused_charge)."""
        async with self._pool.acquire() as conn:
            await ledger.reopen_refused_charge(
                conn, claim.idempotency_key, fencing_token, fenced_by=fenced_by
            )

    async def _wait_for_slot(self, claim: Claim, reserved: datetime | None) -> None:
        """Take this attempt's place in the cluster's Stripe rate, before the gate so that a
        pause still stops a charge that waited. The slots cover the requests an attempt
        makes up front: the create, and an old claim's lookup before it, as one listing.
        What a lookup sends past that (a page past 100 objects, the other API for a claim
        that recorded none, cancels of stalled intents and the listing after them) and
        lookups after an error (a replayed 500, an idempotency error) are rare and take no
        slot: a 429 there is retried with the same key, where waiting mid-charge for turns
        would hold the workflow task (reconciliation's reads, not run in one, take a turn
        per request). A retry takes a slot of its own; the slot the workflow waited for
        serves the first attempt, unless it is long past (rate_limit.LATE_LIMIT)."""
        if self._stripe_rate is None:
            return
        slot: Slot | None = None
        if reserved is not None and activity.info().attempt == 1:
            wait = await self._stripe_rate.seconds_until(reserved)
            slot = None if wait is None else Slot(at=reserved, wait_seconds=wait)
        if slot is None:
            slot = await self._stripe_rate.reserve(2 if self._looks_up_first(claim) else 1)
        if slot.wait_seconds > SLOT_SLEEP_MAX:
            raise ApplicationError(
                f"the next Stripe slot is {slot.wait_seconds:.1f} s away",
                slot,
                type=SLOT_AHEAD,
                non_retryable=True,
                category=ApplicationErrorCategory.BENIGN,
            )
        await asyncio.sleep(slot.wait_seconds)


def _refusal(error: Exception) -> ChargeFailure | None:
    """Stripe's refusal a retry cannot change (a decline, a refused request), recorded as the
    customer's failure; None for anything Temporal retries or the workflow waits out."""
    if not isinstance(error, ApplicationError) or error.type not in (DECLINED, REFUSED):
        return None
    failure = error.details[0]
    return failure if isinstance(failure, ChargeFailure) else None


def _unbilled(claim: Claim, status: LedgerStatus, code: str) -> CustomerOutcome:
    _log_event("record", claim, status=status, code=code)
    return _outcome(claim, finished_outcome(status), failure_code=code)


def _finished(claim: Claim, claimant: str | None) -> CustomerOutcome:
    """A row found finished. Charged by this very claimant, it is "charged": the workflow task
    ran again after the record (a signal or a worker's death failed it), or the child
    continued as new while its attempt recorded it."""
    if claim.status == "charged" and claim.claimed_by_run == claimant:
        return _outcome(claim, "charged")
    return _outcome(claim, finished_outcome(claim.status))


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


def _settle(found: ChargeResult | ChargeFailure) -> ChargeResult:
    if isinstance(found, ChargeResult):
        return found
    raise declined(found)


def _log_event(event: str, claim: Claim, *, level: int = logging.INFO, **fields: Any) -> None:
    logs.log_event(
        log,
        event,
        level=level,
        period=claim.period,
        customer_id=claim.customer_id,
        workflow_id=activity.info().workflow_id,
        key_prefix=logs.key_prefix(claim.idempotency_key),
        **fields,
    )


def _report_charge(claim: Claim, result: ChargeResult) -> None:
    metrics.charge_attempted("charged")
    _log_event(
        "charge",
        claim,
        outcome="charged",
        charge_id=result.charge_id,
        amount_cents=result.amount_cents,
        currency=result.currency,
        replayed=result.replayed,
        pending=result.pending,
        attempt=activity.info().attempt,
    )


def _report_failure(claim: Claim, error: Exception) -> None:
    """A refusal (decline, refused key, cap) is its own event; anything else will be retried."""
    kind = error.type if isinstance(error, ApplicationError) else None
    outcome = FAILED_OUTCOMES.get(kind or "", "error")
    metrics.charge_attempted(outcome)
    details = error.details if isinstance(error, ApplicationError) else ()
    failure = details[0] if details and isinstance(details[0], ChargeFailure) else None
    if failure is None or outcome == "error":
        _log_event(
            "charge",
            claim,
            level=logging.WARNING,
            outcome=outcome,
            error=str(error),
            attempt=activity.info().attempt,
        )
        return
    _log_event(
        "refusal",
        claim,
        level=logging.WARNING,
        outcome=outcome,
        kind=kind,
        code=failure.code,
        decline_code=failure.decline_code,
        attempt=activity.info().attempt,
    )


async def _write_stop(
    conn: asyncpg.Connection, customer_id: str, period: str, key: str, stop: OperatorRequest
) -> None:
    """Skip the customer for a Temporal cancel (ledger.request_skip's `stop`)."""
    with contextlib.suppress(UnknownCustomerError):
        # Not in the ledger (or no run of the period open): the claim says so.
        await ledger.request_skip(
            conn, customer_id, period, key, stop.reason, stop.operator, stop=True
        )

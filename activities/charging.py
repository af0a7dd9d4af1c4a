"""Claim, charge and record one customer's bill for one period."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
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
    SPEND_CAP_EXCEEDED,
    declined,
    is_replayed,
    to_temporal_failure,
)
from billing import ledger, logs, metrics
from billing.config import BillingSettings
from billing.errors import BillingError, ClaimClosedError, UnknownCustomerError
from billing.keys import idempotency_key
from billing.models import (
    ChargeFailure,
    ChargeResult,
    Claim,
    CustomerChargeInput,
    Gate,
    LedgerStatus,
    Record,
)
from billing.periods import parse_period
from billing.rate_limit import Slot, stripe_rate

# ApplicationError types for charges an operator stopped before they reached Stripe.
SKIPPED = "CustomerSkipped"
CANCELLED = "PeriodCancelled"
PAUSED = "PeriodPaused"
# The attempt's Stripe slot is further off than it may sleep: the workflow sleeps and comes
# back with the slot (details: the Slot).
SLOT_AHEAD = "StripeSlotAhead"
# The claim was finished elsewhere (e.g. cancelled by its run) while this child waited.
CLAIM_CLOSED = "ClaimClosed"
# The customer left the ledger (or became inactive) after the period listed it.
UNKNOWN_CUSTOMER = "UnknownCustomer"
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


class ChargeRequest(Record):
    claim: Claim
    # A Stripe slot an earlier attempt reserved and the workflow waited for (database clock).
    slot: datetime | None = None


class RecordCharge(Record):
    claim: Claim
    result: ChargeResult


class RecordUnbilled(Record):
    claim: Claim
    status: LedgerStatus
    failure: ChargeFailure


class ChargingActivities:
    def __init__(self, pool: asyncpg.Pool, access: StripeAccess, settings: BillingSettings) -> None:
        self._pool = pool
        self._access = access
        self._settings = settings
        self._stripe_rate = stripe_rate(pool, settings)

    @activity.defn(name="claim")
    async def claim(self, request: CustomerChargeInput) -> Claim:
        period = parse_period(request.period)
        key = idempotency_key(self._settings.billing_key_namespace, request.customer_id, period)
        try:
            async with self._pool.acquire() as conn:
                claim = await ledger.claim(
                    conn, request.customer_id, request.period, key, activity.info().workflow_run_id
                )
        except UnknownCustomerError as exc:
            raise ApplicationError(str(exc), type=UNKNOWN_CUSTOMER, non_retryable=True) from exc
        _log_event(
            "claim",
            claim,
            status=claim.status,
            amount_cents=claim.amount_cents,
            currency=claim.currency,
        )
        return claim

    @activity.defn(name="charge")
    async def charge(self, request: ChargeRequest) -> ChargeResult:
        """A local activity: it never waits long (a paused period, a far Stripe slot) but
        raises at once, and the workflow waits on a timer or a signal instead."""
        claim = request.claim
        await self._wait_for_slot(request)
        recorded = await self._pass_gate(claim)
        if recorded is not None:
            return recorded
        try:
            result = await self._charge(claim)
        except Exception as error:
            _report_failure(claim, error)
            raise
        _report_charge(claim, result)
        return result

    def _looks_up_first(self, claim: Claim) -> bool:
        # Stripe forgets keys after 24 hours: past that a replay would charge again, so an
        # old claim is looked up first.
        age = datetime.now(UTC) - claim.claimed_at
        return age > timedelta(seconds=self._settings.billing_lookup_after_seconds)

    async def _charge(self, claim: Claim) -> ChargeResult:
        try:
            gateway = await self._access.gateway_for(claim)
        except BillingError as exc:
            # No key for this period and currency (e.g. a customer added after the plan):
            # the period pauses until an operator acts.
            raise ApplicationError(
                str(exc),
                ChargeFailure(code="no_period_key", message=str(exc)),
                type=KEY_REFUSED,
                non_retryable=True,
            ) from None
        try:
            if self._looks_up_first(claim):
                found = await gateway.find(claim)
                if found is not None:
                    return _settle(found)
            return await gateway.charge(claim)
        except stripe.StripeError as exc:
            if isinstance(exc, stripe.IdempotencyError) or (
                is_replayed(exc) and (exc.http_status or 0) >= 500
            ):
                # The key replays a 500 saved after the charge began, or refuses other
                # parameters (a setting changed mid-period): either way a charge with this
                # key may exist, and the truth is in the customer's charges.
                found = await gateway.find(claim)
                if found is not None:
                    return _settle(found)
            metrics.count_vault_refusal(exc)
            failure = to_temporal_failure(exc)
            if failure.type in PERIOD_BLOCKERS:
                # Refused before Stripe: the claim waits at the gate for the operator, and a
                # key replaced since (e.g. after expiry) is read afresh on the next attempt.
                self._access.forget(claim)
                async with self._pool.acquire() as conn:
                    await ledger.reopen_refused_charge(
                        conn, claim.idempotency_key, proven=failure.type == SPEND_CAP_EXCEEDED
                    )
            raise failure from None

    async def _wait_for_slot(self, request: ChargeRequest) -> None:
        """Take this attempt's place in the cluster's Stripe rate, before the gate so that a
        pause still stops a charge that waited. The slots cover the requests an attempt
        makes up front: the create, and an old claim's lookup before it. Lookups after an
        error (a replayed 500, an idempotency error) are rare and take none: a 429 there is
        retried with the same key. A retry takes a slot of its own; the slot the workflow
        waited for serves the first attempt."""
        if self._stripe_rate is None:
            return
        if request.slot is not None and activity.info().attempt == 1:
            wait = await self._stripe_rate.seconds_until(request.slot)
            slot = Slot(at=request.slot, wait_seconds=wait)
        else:
            slot = await self._stripe_rate.reserve(2 if self._looks_up_first(request.claim) else 1)
        if slot.wait_seconds > SLOT_SLEEP_MAX:
            raise ApplicationError(
                f"the next Stripe slot is {slot.wait_seconds:.1f} s away",
                slot,
                type=SLOT_AHEAD,
                non_retryable=True,
                category=ApplicationErrorCategory.BENIGN,
            )
        await asyncio.sleep(slot.wait_seconds)

    async def _pass_gate(self, claim: Claim) -> ChargeResult | None:
        """Stop here if the period is paused or cancelled or the customer skipped. The charge
        this very run recorded comes back instead: its workflow task was retried after the
        record (a signal or a worker's death failed it), and the claim's result was replayed
        from an earlier task, so only the ledger knows."""
        try:
            async with self._pool.acquire() as conn:
                gate: Gate = await ledger.begin_charge(conn, claim)
        except ClaimClosedError as exc:
            own = await self._own_charge(claim)
            if own is not None:
                return own
            raise _stopped(CLAIM_CLOSED, exc.status, str(exc)) from None
        if gate == "skipped":
            raise _stopped(SKIPPED, "skipped", "an operator skipped this customer")
        if gate == "cancelled":
            raise _stopped(CANCELLED, "cancelled", "an operator cancelled the period")
        if gate == "paused":
            # The workflow waits for the period's word (resume or cancel), not this task.
            raise ApplicationError(
                "the period is paused",
                type=PAUSED,
                non_retryable=True,
                category=ApplicationErrorCategory.BENIGN,
            )
        return None

    async def _own_charge(self, claim: Claim) -> ChargeResult | None:
        async with self._pool.acquire() as conn:
            row = await ledger.claim_by_key(conn, claim.idempotency_key)
        if (
            row is None
            or row.status != "charged"
            or row.charge_id is None
            or row.claimed_by_run != activity.info().workflow_run_id
        ):
            return None
        return ChargeResult(
            charge_id=row.charge_id,
            payment_intent_id=row.payment_intent_id,
            amount_cents=row.amount_cents,
            currency=row.currency,
            replayed=True,
        )

    @activity.defn(name="record_charge")
    async def record_charge(self, request: RecordCharge) -> None:
        async with self._pool.acquire() as conn:
            await ledger.record_charge(conn, request.claim.idempotency_key, request.result)
        _log_event("record", request.claim, status="charged", charge_id=request.result.charge_id)

    @activity.defn(name="record_unbilled")
    async def record_unbilled(self, request: RecordUnbilled) -> None:
        async with self._pool.acquire() as conn:
            await ledger.record_unbilled(
                conn, request.claim.idempotency_key, request.status, request.failure
            )
        _log_event("record", request.claim, status=request.status, code=request.failure.code)


def _stopped(kind: str, code: str, message: str) -> ApplicationError:
    return ApplicationError(
        message, ChargeFailure(code=code, message=message), type=kind, non_retryable=True
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
    metrics.charged(result.amount_cents, result.currency, datetime.now(UTC) - claim.claimed_at)
    _log_event(
        "charge",
        claim,
        outcome="charged",
        charge_id=result.charge_id,
        amount_cents=result.amount_cents,
        currency=result.currency,
        replayed=result.replayed,
        attempt=activity.info().attempt,
    )


def _report_failure(claim: Claim, error: Exception) -> None:
    """A refusal (decline, refused key, cap) is its own event; anything else will be retried."""
    kind = error.type if isinstance(error, ApplicationError) else None
    outcome = FAILED_OUTCOMES.get(kind or "", "error")
    metrics.charge_failed(outcome)
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

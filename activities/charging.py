"""Claim, charge and record one customer's bill for one period."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
import stripe
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.stripe_failures import declined, is_replayed, to_temporal_failure
from activities.stripe_gateway import StripeGateway
from billing import ledger
from billing.config import BillingSettings
from billing.errors import UnknownCustomerError
from billing.keys import idempotency_key
from billing.models import ChargeFailure, ChargeResult, Claim, CustomerChargeInput, Record
from billing.periods import parse_period


class RecordCharge(Record):
    claim: Claim
    result: ChargeResult


class RecordFailure(Record):
    claim: Claim
    failure: ChargeFailure


class ChargingActivities:
    def __init__(
        self, pool: asyncpg.Pool, gateway: StripeGateway, settings: BillingSettings
    ) -> None:
        self._pool = pool
        self._gateway = gateway
        self._settings = settings

    @activity.defn(name="claim")
    async def claim(self, request: CustomerChargeInput) -> Claim:
        period = parse_period(request.period)
        key = idempotency_key(self._settings.billing_key_namespace, request.customer_id, period)
        try:
            async with self._pool.acquire() as conn:
                return await ledger.claim(conn, request.customer_id, request.period, key)
        except UnknownCustomerError as exc:
            raise ApplicationError(str(exc), type="UnknownCustomer", non_retryable=True) from exc

    @activity.defn(name="charge")
    async def charge(self, claim: Claim) -> ChargeResult:
        attempt = activity.info().attempt
        age = datetime.now(UTC) - claim.claimed_at
        try:
            # Stripe forgets keys after 24 hours: past that a replay would charge again, so an
            # old claim is looked up first.
            if age > timedelta(seconds=self._settings.billing_lookup_after_seconds):
                found = await self._gateway.find(claim, attempt)
                if found is not None:
                    return _settle(found)
            return await self._gateway.charge(claim, attempt)
        except stripe.StripeError as exc:
            if is_replayed(exc) and (exc.http_status or 0) >= 500:
                # Stripe saved a 500 raised after the charge began: the key will replay it
                # for a day, so the truth is in the customer's charges.
                found = await self._gateway.find(claim, attempt)
                if found is not None:
                    return _settle(found)
            raise to_temporal_failure(exc, attempt) from None

    @activity.defn(name="record_charge")
    async def record_charge(self, request: RecordCharge) -> None:
        async with self._pool.acquire() as conn:
            await ledger.record_charge(conn, request.claim.idempotency_key, request.result)

    @activity.defn(name="record_failure")
    async def record_failure(self, request: RecordFailure) -> None:
        async with self._pool.acquire() as conn:
            await ledger.record_failure(conn, request.claim.idempotency_key, request.failure)


def _settle(found: ChargeResult | ChargeFailure) -> ChargeResult:
    if isinstance(found, ChargeResult):
        return found
    raise declined(found)

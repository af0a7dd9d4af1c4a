"""Charging one claim on Stripe, through PaymentIntents or the legacy Charges API."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

import stripe

from billing.models import ChargeFailure, ChargeResult, Claim
from billing.redact import redact

ChargeApi = Literal["payment_intents", "charges"]
# Customers rarely hold more than a few charges a period; pages this size find ours at once.
_LOOKUP_PAGE = 100
_CLOCK_SKEW_SECONDS = 3600
FAILED_INTENT_STATUSES = frozenset({"requires_payment_method", "canceled"})


def charge_params(claim: Claim, api: ChargeApi) -> dict[str, Any]:
    """The exact parameters of every request for this claim (same key, same parameters)."""
    params: dict[str, Any] = {
        "amount": claim.amount_cents,
        "currency": claim.currency,
        "customer": claim.stripe_customer_id,
        "description": f"Billing period {claim.period}",
        "metadata": {
            "billing_key": claim.idempotency_key,
            "billing_period": claim.period,
            "customer_id": claim.customer_id,
        },
    }
    if api == "payment_intents":
        params.update(confirm=True, off_session=True)
        if claim.payment_method:
            params["payment_method"] = claim.payment_method
    elif claim.payment_method:
        params["source"] = claim.payment_method
    return params


class StripeGateway:
    def __init__(self, client: stripe.StripeClient, api: ChargeApi) -> None:
        self._client = client
        self.api = api

    async def charge(self, claim: Claim) -> ChargeResult:
        """Create the charge with the claim's key; raises stripe errors unchanged."""
        options: stripe.RequestOptions = {"idempotency_key": claim.idempotency_key}
        params = charge_params(claim, self.api)
        if self.api == "payment_intents":
            intent = await self._client.v1.payment_intents.create_async(params, options)  # type: ignore[arg-type]
            return self._from_intent(intent)
        charge = await self._client.v1.charges.create_async(params, options)  # type: ignore[arg-type]
        return ChargeResult(
            charge_id=charge.id,
            payment_intent_id=_id(charge.payment_intent),
            amount_cents=charge.amount,
            currency=charge.currency,
        )

    async def find(self, claim: Claim) -> ChargeResult | ChargeFailure | None:
        """Look the claim's charge up by the key in its metadata."""
        if self.api == "payment_intents":
            intents = await self._ours(self._client.v1.payment_intents.list_async, claim)
            for intent in intents:
                if intent.status == "succeeded":
                    return self._from_intent(intent, replayed=True)
            if not intents:
                return None
            if intents[0].status not in FAILED_INTENT_STATUSES:
                # Still processing or waiting for a step: not an answer yet; try again later.
                raise stripe.APIError(
                    f"payment intent {intents[0].id} is {intents[0].status}", http_status=503
                )
            error = intents[0].last_payment_error
            return ChargeFailure(
                code=(error.code if error else None) or "card_declined",
                decline_code=error.decline_code if error else None,
                message=redact((error.message if error else None) or "the payment failed"),
                payment_intent_id=intents[0].id,
            )
        charges = await self._ours(self._client.v1.charges.list_async, claim)
        for charge in charges:
            if charge.status == "succeeded":
                return ChargeResult(
                    charge_id=charge.id,
                    payment_intent_id=_id(charge.payment_intent),
                    amount_cents=charge.amount,
                    currency=charge.currency,
                    replayed=True,
                )
        if not charges:
            return None
        return ChargeFailure(
            code=charges[0].failure_code or "card_declined",
            message=redact(charges[0].failure_message or "the charge failed"),
            charge_id=charges[0].id,
        )

    @staticmethod
    async def _ours(lister: Callable[..., Awaitable[Any]], claim: Claim) -> list[Any]:
        """The customer's objects carrying the claim's key, listed newest first back to the
        claim's time: listing by customer is read-after-write consistent, Stripe's search is
        not."""
        oldest = int(claim.claimed_at.timestamp()) - _CLOCK_SKEW_SECONDS
        found: list[Any] = []
        params: dict[str, Any] = {"customer": claim.stripe_customer_id, "limit": _LOOKUP_PAGE}
        while True:
            page = await lister(params)
            found += [o for o in page.data if _billing_key(o) == claim.idempotency_key]
            if not page.has_more or not page.data or page.data[-1].created < oldest:
                return found
            params["starting_after"] = page.data[-1].id

    @staticmethod
    def _from_intent(intent: stripe.PaymentIntent, replayed: bool = False) -> ChargeResult:
        charge_id = _id(intent.latest_charge)
        if intent.status != "succeeded" or charge_id is None:
            raise stripe.APIError(
                f"payment intent {intent.id} is {intent.status}, expected succeeded",
                http_status=502,
            )
        return ChargeResult(
            charge_id=charge_id,
            payment_intent_id=intent.id,
            amount_cents=intent.amount,
            currency=intent.currency,
            replayed=replayed,
        )


def _id(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    found = getattr(value, "id", None)
    return found if isinstance(found, str) else None


def _billing_key(obj: stripe.Charge | stripe.PaymentIntent) -> str | None:
    metadata = obj.metadata
    return metadata["billing_key"] if metadata and "billing_key" in metadata else None

"""Charging one claim on Stripe, through PaymentIntents or the legacy Charges API."""

from __future__ import annotations

from typing import Any, Literal

import stripe

from billing.models import ChargeFailure, ChargeResult, Claim

ChargeApi = Literal["payment_intents", "charges"]
# Customers rarely hold more than a few charges a period; pages this size find ours at once.
_LOOKUP_PAGE = 100
_CLOCK_SKEW_SECONDS = 3600


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

    async def charge(self, claim: Claim, attempts: int) -> ChargeResult:
        """Create the charge with the claim's key; raises stripe errors unchanged."""
        options: stripe.RequestOptions = {"idempotency_key": claim.idempotency_key}
        params = charge_params(claim, self.api)
        if self.api == "payment_intents":
            intent = await self._client.v1.payment_intents.create_async(params, options)  # type: ignore[arg-type]
            return self._from_intent(claim, intent, attempts)
        charge = await self._client.v1.charges.create_async(params, options)  # type: ignore[arg-type]
        return ChargeResult(
            charge_id=charge.id,
            payment_intent_id=_id(charge.payment_intent),
            amount_cents=charge.amount,
            currency=charge.currency,
            attempts=attempts,
        )

    async def find(self, claim: Claim, attempts: int) -> ChargeResult | ChargeFailure | None:
        """Look the claim's charge up by the key in its metadata, listing the customer's
        charges newest first (read-after-write consistent, unlike Stripe's search) back to
        the claim's time."""
        oldest = int(claim.claimed_at.timestamp()) - _CLOCK_SKEW_SECONDS
        ours: list[stripe.Charge] = []
        params: dict[str, Any] = {"customer": claim.stripe_customer_id, "limit": _LOOKUP_PAGE}
        while True:
            page = await self._client.v1.charges.list_async(params)  # type: ignore[arg-type]
            ours += [c for c in page.data if _billing_key(c) == claim.idempotency_key]
            if not page.has_more or not page.data or page.data[-1].created < oldest:
                break
            params["starting_after"] = page.data[-1].id
        for charge in ours:
            if charge.status == "succeeded":
                return ChargeResult(
                    charge_id=charge.id,
                    payment_intent_id=_id(charge.payment_intent),
                    amount_cents=charge.amount,
                    currency=charge.currency,
                    attempts=attempts,
                    replayed=True,
                )
        if ours:
            failed = ours[0]
            return ChargeFailure(
                code=failed.failure_code or "card_declined",
                message=failed.failure_message or "the charge failed",
                payment_intent_id=_id(failed.payment_intent),
                charge_id=failed.id,
                attempts=attempts,
            )
        return None

    @staticmethod
    def _from_intent(claim: Claim, intent: stripe.PaymentIntent, attempts: int) -> ChargeResult:
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
            attempts=attempts,
        )


def _id(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    found = getattr(value, "id", None)
    return found if isinstance(found, str) else None


def _billing_key(charge: stripe.Charge) -> str | None:
    metadata = charge.metadata
    return metadata["billing_key"] if metadata and "billing_key" in metadata else None

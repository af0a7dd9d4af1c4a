"""`StripeGateway.find` over the legacy Charges API, for charge states the emulator does not
make (a bank debit stays pending for days): Stripe's listing is stood in for here."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import stripe

from activities.stripe_gateway import StripeGateway
from billing.models import ChargeFailure, ChargeResult
from tests.unit.claims import CLAIM as LEDGER_CLAIM

CLAIM = LEDGER_CLAIM.model_copy(update={"charge_api": "charges"})


def charge(status: str, **extra: Any) -> stripe.Charge:
    return stripe.Charge.construct_from(
        {
            "id": f"ch_{status}",
            "object": "charge",
            "status": status,
            "amount": CLAIM.amount_cents,
            "currency": "usd",
            "payment_intent": None,
            "created": int(CLAIM.claimed_at.timestamp()) + 5,
            "metadata": {"billing_key": CLAIM.idempotency_key},
            **extra,
        },
        "sk_test_unit",
    )


@dataclass
class Listing:
    """Stands in for the client's `v1.charges.list_async`: one page of the given charges."""

    charges: list[stripe.Charge]
    calls: list[dict[str, Any]] = field(default_factory=list)

    async def __call__(self, params: dict[str, Any]) -> SimpleNamespace:
        self.calls.append(params)
        return SimpleNamespace(data=self.charges, has_more=False)


def gateway(listing: Listing) -> StripeGateway:
    client = SimpleNamespace(v1=SimpleNamespace(charges=SimpleNamespace(list_async=listing)))
    return StripeGateway(client, "charges")  # type: ignore[arg-type]


@pytest.mark.parametrize("status", ["succeeded", "pending"])
async def test_a_charge_made_is_found_as_charged_while_pending_too(status: str) -> None:
    listing = Listing([charge(status)])
    found = await gateway(listing).find(CLAIM)
    assert isinstance(found, ChargeResult) and found.charge_id == f"ch_{status}"
    assert listing.calls == [{"customer": "cus_1", "limit": 100}]


async def test_a_failed_charge_is_found_as_failed_with_stripes_code() -> None:
    failed = charge("failed", failure_code="card_declined", failure_message="declined")
    found = await gateway(Listing([failed])).find(CLAIM)
    assert isinstance(found, ChargeFailure)
    assert (found.code, found.charge_id) == ("card_declined", "ch_failed")


async def test_nothing_with_the_claims_key_is_none() -> None:
    assert await gateway(Listing([])).find(CLAIM) is None


async def test_a_claim_of_unrecorded_api_charged_through_the_other_is_found_charged() -> None:
    # Claimed before claims recorded their API: declined through Charges, then charged
    # through PaymentIntents under another setting. The charge made outweighs the failure.
    intent = stripe.PaymentIntent.construct_from(
        {
            "id": "pi_1",
            "object": "payment_intent",
            "status": "succeeded",
            "latest_charge": "ch_by_intent",
            "amount": CLAIM.amount_cents,
            "currency": "usd",
            "created": int(CLAIM.claimed_at.timestamp()) + 60,
            "metadata": {"billing_key": CLAIM.idempotency_key},
        },
        "sk_test_unit",
    )
    failed = Listing([charge("failed", failure_code="card_declined", failure_message="no")])
    client = SimpleNamespace(
        v1=SimpleNamespace(
            charges=SimpleNamespace(list_async=failed),
            payment_intents=SimpleNamespace(list_async=Listing([intent])),  # type: ignore[list-item]
        )
    )
    legacy = CLAIM.model_copy(update={"charge_api": None})
    found = await StripeGateway(client, "charges").find(legacy)  # type: ignore[arg-type]
    assert isinstance(found, ChargeResult) and found.charge_id == "ch_by_intent"

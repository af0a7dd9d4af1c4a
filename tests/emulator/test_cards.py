"""Stripe's test payment methods: success, declines, authentication required."""

from __future__ import annotations

from typing import Any

import pytest
import stripe

from .support import Raw, method_of


async def _confirm(
    sdk: stripe.StripeClient, customer: dict[str, Any], off_session: bool = True
) -> None:
    await sdk.v1.payment_intents.create_async(
        params={
            "amount": 1000,
            "currency": "usd",
            "customer": customer["id"],
            "payment_method": method_of(customer),
            "confirm": True,
            "off_session": off_session,
            "allowed_payment_method_types": ["card"],
        },
        options={"idempotency_key": f"card-{customer['id']}-{off_session}"},
    )


@pytest.mark.parametrize(
    ("card", "brand"),
    [("pm_card_visa", "visa"), ("pm_card_mastercard", "mastercard"), ("pm_card_amex", "amex")],
)
async def test_good_cards_succeed(raw: Raw, card: str, brand: str) -> None:
    reply = await raw.charge(
        await raw.customer(card), f"good-{card}", **{"expand[]": "latest_charge"}
    )
    assert reply.body["status"] == "succeeded"
    assert reply.body["latest_charge"]["payment_method_details"]["card"]["brand"] == brand


async def test_charge_customer_fail_attaches_then_declines(
    sdk: stripe.StripeClient, raw: Raw
) -> None:
    customer = await raw.customer("pm_card_chargeCustomerFail")
    with pytest.raises(stripe.CardError) as caught:
        await _confirm(sdk, customer)
    error = caught.value
    assert (error.http_status, error.code) == (402, "card_declined")
    assert error.error is not None
    assert error.error.decline_code == "generic_decline"
    assert error.error.payment_intent is not None
    assert error.error.payment_intent.status == "requires_payment_method"
    charge_id = error.error.charge
    assert isinstance(charge_id, str) and charge_id.startswith("ch_")
    intent = await sdk.v1.payment_intents.retrieve_async(error.error.payment_intent.id)
    assert intent.status == "requires_payment_method"
    assert intent.latest_charge == charge_id
    assert intent.last_payment_error is not None
    assert intent.last_payment_error.code == "card_declined"
    assert intent.last_payment_error.decline_code == "generic_decline"
    [entry] = (await raw.ledger())["charges"]
    assert (entry["id"], entry["status"], entry["failure_code"]) == (
        charge_id,
        "failed",
        "card_declined",
    )


async def test_authentication_required_off_session(sdk: stripe.StripeClient, raw: Raw) -> None:
    customer = await raw.customer("pm_card_authenticationRequired")
    with pytest.raises(stripe.CardError) as caught:
        await _confirm(sdk, customer)
    assert caught.value.code == "authentication_required"
    assert caught.value.error is not None and caught.value.error.payment_intent is not None
    intent = await sdk.v1.payment_intents.retrieve_async(caught.value.error.payment_intent.id)
    assert intent.status == "requires_payment_method"
    assert intent.last_payment_error is not None
    assert intent.last_payment_error.code == "authentication_required"
    assert intent.latest_charge is None
    assert (await raw.ledger())["charges"] == []


async def test_authentication_required_on_session_needs_action(raw: Raw) -> None:
    customer = await raw.customer("pm_card_authenticationRequired")
    reply = await raw.charge(customer, "on-session", off_session="false")
    assert reply.status == 200
    assert reply.body["status"] == "requires_action"
    assert reply.body["next_action"]["type"] == "use_stripe_sdk"
    assert (await raw.ledger())["charges"] == []


async def test_legacy_charge_declined_is_recorded_failed(
    sdk: stripe.StripeClient, raw: Raw
) -> None:
    customer = await raw.customer("pm_card_chargeCustomerFail")
    with pytest.raises(stripe.CardError) as caught:
        await sdk.v1.charges.create_async(
            params={
                "amount": 300,
                "currency": "usd",
                "customer": customer["id"],
                "source": method_of(customer),
            }
        )
    assert caught.value.code == "card_declined"
    assert caught.value.error is not None
    charge = await sdk.v1.charges.retrieve_async(str(caught.value.error.charge))
    assert (charge.status, charge.failure_code, charge.paid) == ("failed", "card_declined", False)
    assert charge.outcome is not None and charge.outcome.reason == "generic_decline"


async def test_legacy_charge_cannot_authenticate(raw: Raw) -> None:
    customer = await raw.customer("pm_card_authenticationRequired")
    reply = await raw.post(
        "/v1/charges",
        {
            "amount": "300",
            "currency": "usd",
            "customer": customer["id"],
            "source": method_of(customer),
        },
    )
    assert reply.status == 402
    assert reply.body["error"]["decline_code"] == "authentication_required"
    assert [c["status"] for c in (await raw.ledger())["charges"]] == ["failed"]


@pytest.mark.parametrize(
    ("card", "decline_code"),
    [
        ("pm_card_chargeDeclined", "generic_decline"),
        ("pm_card_chargeDeclinedInsufficientFunds", "insufficient_funds"),
    ],
)
async def test_declining_cards_fail_to_attach_and_decline_one_off(
    raw: Raw, card: str, decline_code: str
) -> None:
    attach = await raw.post(
        "/v1/customers",
        {"payment_method": card, "invoice_settings[default_payment_method]": card},
    )
    assert attach.status == 402
    assert attach.body["error"]["decline_code"] == decline_code
    assert (await raw.get("/v1/customers")).body["data"] == []
    one_off = await raw.post(
        "/v1/payment_intents",
        {
            "amount": "100",
            "currency": "usd",
            "payment_method": card,
            "confirm": "true",
            "allowed_payment_method_types[0]": "card",
        },
    )
    assert one_off.status == 402
    assert one_off.body["error"]["decline_code"] == decline_code
    assert one_off.body["error"]["payment_intent"]["status"] == "requires_payment_method"


async def test_a_declined_intent_can_be_confirmed_with_another_card(raw: Raw) -> None:
    customer = await raw.customer("pm_card_chargeCustomerFail")
    declined = await raw.charge(customer, "decline-then-fix")
    intent = declined.body["error"]["payment_intent"]
    visa = await raw.post("/v1/payment_methods/pm_card_visa/attach", {"customer": customer["id"]})
    confirmed = await raw.post(
        f"/v1/payment_intents/{intent['id']}/confirm",
        {"payment_method": visa.body["id"], "off_session": "true"},
        idempotency_key="confirm-with-visa",
    )
    assert confirmed.status == 200
    assert (confirmed.body["status"], confirmed.body["last_payment_error"]) == ("succeeded", None)
    ledger = (await raw.ledger())["charges"]
    assert [(c["status"], c["idempotency_key"]) for c in ledger] == [
        ("failed", "decline-then-fix"),
        ("succeeded", "confirm-with-visa"),
    ]

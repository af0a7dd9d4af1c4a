"""Bank debits (SEPA Direct Debit): pending until the bank answers, then settled or returned."""

from __future__ import annotations

from typing import Any

import stripe

from stripe_emulator import RunningEmulator
from stripe_emulator.client import EmulatorClient

from .support import Raw, method_of

SUCCEEDS = "pm_sepaDebit_succeeds"
FAILS = "pm_sepaDebit_fails"


async def _debit(raw: Raw, method: str, key: str) -> dict[str, Any]:
    customer = await raw.customer(method)
    reply = await raw.charge(customer, key, currency="eur", **{"expand[]": "latest_charge"})
    assert reply.status == 200, reply.body
    return reply.body  # type: ignore[no-any-return]


async def test_a_debit_is_processing_until_it_settles(
    raw: Raw, sdk: stripe.StripeClient, emulator: RunningEmulator
) -> None:
    intent = await _debit(raw, SUCCEEDS, "debit-1")
    assert intent["status"] == "processing"
    charge = intent["latest_charge"]
    # A payment other than a card's, as Stripe names it.
    assert charge["id"].startswith("py_")
    assert (await sdk.v1.charges.retrieve_async(charge["id"])).status == "pending"
    assert (charge["status"], charge["paid"], charge["captured"]) == ("pending", False, True)
    assert charge["payment_method_details"]["type"] == "sepa_debit"
    # Pending money is not refundable yet.
    refused = await raw.post("/v1/refunds", {"charge": charge["id"]})
    assert (refused.status, refused.body["error"]["code"]) == (400, "charge_not_refundable")

    [settled] = await EmulatorClient(emulator.url).settle_debits()
    assert (settled["id"], settled["status"]) == (charge["id"], "succeeded")
    after = await sdk.v1.payment_intents.retrieve_async(intent["id"])
    assert (after.status, after.amount_received) == ("succeeded", 1999)
    assert (await sdk.v1.charges.retrieve_async(charge["id"])).paid is True
    # Nothing left pending: settling again settles nothing.
    assert await EmulatorClient(emulator.url).settle_debits() == []


async def test_a_returned_debit_fails_its_charge_and_reopens_its_intent(
    raw: Raw, sdk: stripe.StripeClient, emulator: RunningEmulator
) -> None:
    returned = await _debit(raw, FAILS, "debit-returned")
    kept = await _debit(raw, SUCCEEDS, "debit-kept")
    charge_id = returned["latest_charge"]["id"]
    # One debit settled by id; the other stays pending.
    [settled] = await EmulatorClient(emulator.url).settle_debits(charge_id)
    assert (settled["status"], settled["failure_code"]) == ("failed", "insufficient_funds")
    intent = await sdk.v1.payment_intents.retrieve_async(returned["id"])
    assert intent.status == "requires_payment_method"
    assert intent.last_payment_error is not None
    assert intent.last_payment_error.code == "insufficient_funds"
    assert intent.latest_charge == charge_id
    ledger = {c["id"]: c["status"] for c in (await raw.ledger())["charges"]}
    assert ledger == {charge_id: "failed", kept["latest_charge"]["id"]: "pending"}


async def test_the_charges_api_refuses_a_bank_account_and_stores_nothing(raw: Raw) -> None:
    # As Stripe does: bank debits go through PaymentIntents.
    customer = await raw.customer(SUCCEEDS)
    reply = await raw.post(
        "/v1/charges",
        {
            "amount": "500",
            "currency": "eur",
            "customer": customer["id"],
            "source": method_of(customer),
        },
    )
    assert (reply.status, reply.body["error"]["param"]) == (400, "source")
    assert "does not take sepa_debit payment methods" in reply.body["error"]["message"]
    assert (await raw.ledger())["charges"] == []


async def test_a_debit_in_a_currency_sepa_does_not_take_is_refused_and_stores_nothing(
    raw: Raw,
) -> None:
    customer = await raw.customer(SUCCEEDS)
    reply = await raw.charge(customer, "debit-usd", currency="usd")
    assert reply.status == 400
    error = reply.body["error"]
    assert error["param"] == "currency" and "sepa_debit" in error["message"]
    assert "eur" in error["message"]
    assert (await raw.ledger())["charges"] == []
    listed = await raw.get("/v1/payment_intents", {"customer": customer["id"]})
    assert listed.body["data"] == []


async def test_payment_methods_list_by_type(raw: Raw) -> None:
    customer = (await raw.customer(SUCCEEDS))["id"]
    await raw.post("/v1/payment_methods/pm_card_visa/attach", {"customer": customer})
    path = f"/v1/customers/{customer}/payment_methods"
    debits = (await raw.get(path, {"type": "sepa_debit"})).body["data"]
    assert [(m["type"], m["sepa_debit"]["last4"]) for m in debits] == [("sepa_debit", "3000")]
    cards = (await raw.get(path, {"type": "card"})).body["data"]
    assert [m["type"] for m in cards] == ["card"]
    assert len((await raw.get(path)).body["data"]) == 2
    refused = await raw.get(path, {"type": "ideal"})
    assert (refused.status, refused.body["error"]["param"]) == (400, "type")


async def test_settling_names_what_was_wrong(raw: Raw, emulator: RunningEmulator) -> None:
    card = await raw.charge(await raw.customer(), "card")
    url = f"{emulator.url}/_emulator/settle_debits"
    for body, words in [
        ({"charge": "ch_nope"}, "No pending bank debit has the id 'ch_nope'"),
        # A card's charge is never pending.
        ({"charge": card.body["latest_charge"]}, "No pending bank debit"),
        ({"charge": 7}, "No pending bank debit has the id 7"),
        ({"charges": []}, "Unknown field(s): charges"),
    ]:
        async with raw.session.post(url, json=body) as response:
            assert response.status == 400, body
            assert words in (await response.json())["error"]["message"]

"""Each resource through the real SDK: customers, payment methods, intents, charges, refunds."""

from __future__ import annotations

import pytest
import stripe

from .support import Raw

Client = stripe.StripeClient


async def _customer(sdk: Client, card: str = "pm_card_visa") -> stripe.Customer:
    return await sdk.v1.customers.create_async(
        params={"payment_method": card, "invoice_settings": {"default_payment_method": card}}
    )


def _default_method(customer: stripe.Customer) -> str | stripe.PaymentMethod | None:
    assert customer.invoice_settings is not None
    return customer.invoice_settings.default_payment_method


def _method_id(customer: stripe.Customer) -> str:
    method = _default_method(customer)
    assert isinstance(method, str)
    return method


async def _intent(
    sdk: Client, customer: stripe.Customer, key: str, **extra: object
) -> stripe.PaymentIntent:
    """An off-session intent confirmed at once, naming the customer's card as the billing
    core names it."""
    params = {
        "amount": 2500,
        "currency": "eur",
        "customer": customer.id,
        "payment_method": _method_id(customer),
        "confirm": True,
        "off_session": True,
        "allowed_payment_method_types": ["card"],
        **extra,
    }
    return await sdk.v1.payment_intents.create_async(
        params=params,  # type: ignore[arg-type]
        options={"idempotency_key": key},
    )


async def test_customer_create_attaches_a_new_payment_method(sdk: Client) -> None:
    customer = await sdk.v1.customers.create_async(
        params={
            "email": "ada@example.com",
            "name": "Ada",
            "description": "first",
            "metadata": {"account": "42"},
            "payment_method": "pm_card_visa",
            "invoice_settings": {"default_payment_method": "pm_card_visa"},
        }
    )
    assert customer.id.startswith("cus_")
    assert customer.metadata is not None
    assert (customer.email, customer.name, customer.metadata["account"]) == (
        "ada@example.com",
        "Ada",
        "42",
    )
    default = _default_method(customer)
    assert isinstance(default, str)
    assert default.startswith("pm_") and default != "pm_card_visa"
    method = await sdk.v1.payment_methods.retrieve_async(default)
    assert (method.customer, method.card and method.card.last4) == (customer.id, "4242")
    fetched = await sdk.v1.customers.retrieve_async(customer.id)
    assert _default_method(fetched) == default


async def test_customer_update_merges_metadata_and_sets_default(sdk: Client) -> None:
    customer = await sdk.v1.customers.create_async(params={"metadata": {"a": "1", "b": "2"}})
    first = await sdk.v1.payment_methods.attach_async(
        "pm_card_mastercard", params={"customer": customer.id}
    )
    updated = await sdk.v1.customers.update_async(
        customer.id,
        params={
            "metadata": {"b": "", "c": "3"},
            "invoice_settings": {"default_payment_method": first.id},
            "email": "new@example.com",
        },
    )
    assert updated.metadata is not None
    assert updated.metadata.to_dict() == {"a": "1", "c": "3"}
    assert _default_method(updated) == first.id
    assert updated.email == "new@example.com"


async def test_customer_update_refuses_a_method_it_does_not_have(sdk: Client) -> None:
    customer = await sdk.v1.customers.create_async()
    with pytest.raises(stripe.InvalidRequestError) as caught:
        await sdk.v1.customers.update_async(
            customer.id, params={"invoice_settings": {"default_payment_method": "pm_card_visa"}}
        )
    assert caught.value.param == "invoice_settings[default_payment_method]"


async def test_unknown_customer_is_404_resource_missing(sdk: Client) -> None:
    with pytest.raises(stripe.InvalidRequestError) as caught:
        await sdk.v1.customers.retrieve_async("cus_nope")
    assert (caught.value.http_status, caught.value.code, caught.value.param) == (
        404,
        "resource_missing",
        "id",
    )


async def test_payment_methods_attach_list_and_refuse_a_second_owner(sdk: Client) -> None:
    owner = await _customer(sdk)
    extra = await sdk.v1.payment_methods.attach_async("pm_card_amex", params={"customer": owner.id})
    assert extra.card is not None and extra.card.brand == "amex"
    listed = await sdk.v1.customers.payment_methods.list_async(owner.id)
    assert listed.data[0].id == extra.id
    assert len(listed.data) == 2
    by_query = await sdk.v1.payment_methods.list_async(params={"customer": owner.id})
    assert [m.id for m in by_query.data] == [m.id for m in listed.data]
    other = await sdk.v1.customers.create_async()
    with pytest.raises(stripe.InvalidRequestError):
        await sdk.v1.payment_methods.attach_async(extra.id, params={"customer": other.id})
    with pytest.raises(stripe.InvalidRequestError) as caught:
        await sdk.v1.payment_methods.attach_async("pm_unknown", params={"customer": other.id})
    assert caught.value.code == "resource_missing"


async def test_payment_intent_succeeds_with_a_new_charge(sdk: Client, raw: Raw) -> None:
    customer = await _customer(sdk)
    intent = await _intent(sdk, customer, "pi-ok", metadata={"billing_key": "k"})
    assert intent.id.startswith("pi_")
    assert (intent.status, intent.amount_received, intent.currency) == ("succeeded", 2500, "eur")
    assert isinstance(intent.latest_charge, str) and intent.latest_charge.startswith("ch_")
    assert intent.payment_method == _default_method(customer)
    charge = await sdk.v1.charges.retrieve_async(intent.latest_charge)
    assert (charge.status, charge.payment_intent, charge.amount, charge.currency) == (
        "succeeded",
        intent.id,
        2500,
        "eur",
    )
    fetched = await sdk.v1.payment_intents.retrieve_async(intent.id)
    assert fetched.status == "succeeded"
    [entry] = (await raw.ledger())["charges"]
    # What the invariant checks compare with the billing ledger: a charge in the wrong
    # currency must show as one.
    assert (entry["id"], entry["amount"], entry["currency"], entry["customer"]) == (
        charge.id,
        2500,
        "eur",
        customer.id,
    )
    assert entry["idempotency_key"] == "pi-ok"
    assert entry["metadata"] == {"billing_key": "k"}


async def _unconfirmed(sdk: Client) -> stripe.PaymentIntent:
    """An intent created with the customer's card and not confirmed."""
    customer = await _customer(sdk)
    method = _method_id(customer)
    return await sdk.v1.payment_intents.create_async(
        params={
            "amount": 700,
            "currency": "usd",
            "customer": customer.id,
            "payment_method": method,
            "allowed_payment_method_types": ["card"],
        }
    )


async def test_payment_intent_without_confirm_then_confirm(sdk: Client) -> None:
    intent = await _unconfirmed(sdk)
    assert (intent.status, intent.latest_charge) == ("requires_confirmation", None)
    confirmed = await sdk.v1.payment_intents.confirm_async(intent.id, params={"off_session": True})
    assert confirmed.status == "succeeded" and confirmed.latest_charge
    with pytest.raises(stripe.InvalidRequestError) as caught:
        await sdk.v1.payment_intents.confirm_async(intent.id)
    assert caught.value.code == "payment_intent_unexpected_state"


async def test_an_unconfirmed_intent_is_cancelled_and_can_then_neither_confirm_nor_cancel(
    sdk: Client, raw: Raw
) -> None:
    intent = await _unconfirmed(sdk)
    assert intent.status == "requires_confirmation"
    cancelled = await sdk.v1.payment_intents.cancel_async(
        intent.id, params={"cancellation_reason": "abandoned"}
    )
    assert (cancelled.status, cancelled.cancellation_reason) == ("canceled", "abandoned")
    assert cancelled.canceled_at is not None
    for call in (sdk.v1.payment_intents.confirm_async, sdk.v1.payment_intents.cancel_async):
        with pytest.raises(stripe.InvalidRequestError) as caught:
            await call(intent.id)
        assert caught.value.code == "payment_intent_unexpected_state"
    assert (await raw.ledger())["charges"] == []


async def test_a_succeeded_intent_or_a_bad_reason_is_not_cancelled(sdk: Client) -> None:
    succeeded = await _intent(sdk, await _customer(sdk), "cancel-succeeded")
    with pytest.raises(stripe.InvalidRequestError, match="status of succeeded"):
        await sdk.v1.payment_intents.cancel_async(succeeded.id)
    with pytest.raises(stripe.InvalidRequestError) as caught:
        await sdk.v1.payment_intents.cancel_async(
            succeeded.id,
            params={"cancellation_reason": "bored"},
        )
    assert caught.value.param == "cancellation_reason"
    assert (await sdk.v1.payment_intents.retrieve_async(succeeded.id)).status == "succeeded"


async def test_payment_intents_list_by_customer_newest_first(sdk: Client) -> None:
    customer = await _customer(sdk)
    other = await _customer(sdk)
    mine = [(await _intent(sdk, customer, f"list-{i}")).id for i in range(4)]
    await _intent(sdk, other, "list-other")
    page = await sdk.v1.payment_intents.list_async(params={"customer": customer.id, "limit": 3})
    assert [i.id for i in page.data] == mine[::-1][:3]
    assert page.has_more
    rest = await sdk.v1.payment_intents.list_async(
        params={"customer": customer.id, "starting_after": page.data[-1].id}
    )
    assert [i.id for i in rest.data] == [mine[0]]
    assert not rest.has_more


async def test_payment_intents_search_by_metadata(sdk: Client) -> None:
    customer = await _customer(sdk)
    ids = [
        (await _intent(sdk, customer, f"s-{i}", metadata={"period": p, "n": str(i)})).id
        for i, p in enumerate(["2026-11", "2026-12", "2026-12", "2026-12"])
    ]
    found = await sdk.v1.payment_intents.search_async(
        params={"query": 'metadata["period"]:"2026-12"', "limit": 2}
    )
    assert found["object"] == "search_result"
    assert [i.id for i in found.data] == [ids[3], ids[2]]
    assert found.has_more and found.next_page
    rest = await sdk.v1.payment_intents.search_async(
        params={"query": 'metadata["period"]:"2026-12"', "limit": 2, "page": found.next_page}
    )
    assert [i.id for i in rest.data] == [ids[1]]
    both = await sdk.v1.payment_intents.search_async(
        params={
            "query": f'metadata["period"]:"2026-12" AND customer:"{customer.id}" AND '
            'metadata["n"]:"2"'
        }
    )
    assert [i.id for i in both.data] == [ids[2]]


@pytest.mark.parametrize("query", ['metadata["period"]', 'metadata["a"]:"b" OR x:"y"', "amount>5"])
async def test_search_refuses_what_it_cannot_parse(sdk: Client, query: str) -> None:
    with pytest.raises(stripe.InvalidRequestError) as caught:
        await sdk.v1.payment_intents.search_async(params={"query": query})
    assert caught.value.param == "query"


async def test_legacy_charge_of_a_customers_card(sdk: Client) -> None:
    customer = await _customer(sdk)
    charge = await sdk.v1.charges.create_async(
        params={
            "amount": 1200,
            "currency": "usd",
            "customer": customer.id,
            "source": _method_id(customer),
            "metadata": {"invoice": "in_1"},
            "description": "December",
        },
        options={"idempotency_key": "legacy-1"},
    )
    assert (charge.object, charge.status, charge.paid, charge.payment_intent) == (
        "charge",
        "succeeded",
        True,
        None,
    )
    assert charge.payment_method == _default_method(customer)
    listed = await sdk.v1.charges.list_async(params={"customer": customer.id})
    assert [c.id for c in listed.data] == [charge.id]
    assert (await sdk.v1.charges.retrieve_async(charge.id)).metadata["invoice"] == "in_1"


async def test_a_customers_legacy_card_source_is_charged_when_no_method_is_named(
    sdk: Client, raw: Raw
) -> None:
    # As Stripe fills a missing `payment_method`/`source` in: with `customer.default_source`.
    customer = await sdk.v1.customers.create_async(params={"source": "tok_mastercard"})
    source = customer.default_source
    assert isinstance(source, str) and source.startswith("card_")
    assert _default_method(customer) is None
    intent = await sdk.v1.payment_intents.create_async(
        params={
            "amount": 2500,
            "currency": "usd",
            "customer": customer.id,
            "confirm": True,
            "off_session": True,
            "allowed_payment_method_types": ["card"],
        },
        options={"idempotency_key": "default-source-intent"},
    )
    assert (intent.status, intent.payment_method) == ("succeeded", source)
    charge = await sdk.v1.charges.create_async(
        params={"amount": 1200, "currency": "usd", "customer": customer.id},
        options={"idempotency_key": "default-source-charge"},
    )
    assert (charge.status, charge.payment_method) == ("succeeded", source)
    ledger = (await raw.ledger())["charges"]
    assert [(c["id"], c["payment_method"]) for c in ledger] == [
        (intent.latest_charge, source),
        (charge.id, source),
    ]
    assert (await sdk.v1.customers.retrieve_async(customer.id)).default_source == source


@pytest.mark.parametrize(
    ("source", "status", "code"),
    [
        ("tok_nope", 400, "resource_missing"),
        ("pm_card_visa", 400, "resource_missing"),
        ("tok_chargeDeclined", 402, "card_declined"),
    ],
)
async def test_a_customer_source_must_be_a_test_card_token_that_attaches(
    raw: Raw, source: str, status: int, code: str
) -> None:
    reply = await raw.post("/v1/customers", {"source": source})
    assert (reply.status, reply.body["error"]["code"]) == (status, code), reply.body
    assert (await raw.get("/v1/customers")).body["data"] == []


async def test_legacy_charge_with_a_source_and_no_customer(sdk: Client) -> None:
    charge = await sdk.v1.charges.create_async(
        params={"amount": 500, "currency": "usd", "source": "tok_visa"}
    )
    assert charge.status == "succeeded" and charge.customer is None


async def test_refunds_full_partial_and_too_much(sdk: Client, raw: Raw) -> None:
    customer = await _customer(sdk)
    intent = await _intent(sdk, customer, "refund-me")
    partial = await sdk.v1.refunds.create_async(
        params={"payment_intent": intent.id, "amount": 1000, "reason": "requested_by_customer"}
    )
    assert (partial.object, partial.amount, partial.charge) == (
        "refund",
        1000,
        intent.latest_charge,
    )
    assert isinstance(partial.charge, str)
    charge_id = partial.charge
    with pytest.raises(stripe.InvalidRequestError) as caught:
        await sdk.v1.refunds.create_async(params={"charge": charge_id, "amount": 1501})
    assert caught.value.code == "amount_too_large"
    rest = await sdk.v1.refunds.create_async(params={"charge": charge_id})
    assert rest.amount == 1500
    assert (await sdk.v1.refunds.retrieve_async(rest.id)).amount == 1500
    assert isinstance(intent.latest_charge, str)
    charge = await sdk.v1.charges.retrieve_async(intent.latest_charge)
    assert (charge.refunded, charge.amount_refunded) == (True, 2500)
    [entry] = (await raw.ledger())["charges"]
    assert (entry["refunded"], entry["amount_refunded"]) == (True, 2500)
    with pytest.raises(stripe.InvalidRequestError) as again:
        await sdk.v1.refunds.create_async(params={"charge": charge_id})
    assert again.value.code == "charge_already_refunded"

"""Validation like Stripe's: codes and params, and nothing stored when a request is refused."""

from __future__ import annotations

import pytest
import stripe

from stripe_emulator.validation import MAX_AMOUNT

from .support import Raw, method_of


@pytest.mark.parametrize(
    ("amount", "code"),
    [
        (None, "parameter_missing"),
        ("abc", "parameter_invalid_integer"),
        ("1.5", "parameter_invalid_integer"),
        ("0", "parameter_invalid_integer"),
        ("-100", "parameter_invalid_integer"),
        ("9" * 40, "parameter_invalid_integer"),
        (str(MAX_AMOUNT + 1), "amount_too_large"),
        ("49", "amount_too_small"),  # Stripe's minimum charge in usd is 50
    ],
)
@pytest.mark.parametrize("path", ["/v1/payment_intents", "/v1/charges"])
async def test_bad_amounts_are_refused(raw: Raw, path: str, amount: str | None, code: str) -> None:
    customer = await raw.customer()
    params = {"currency": "usd", "customer": customer["id"], "confirm": "true"}
    if path == "/v1/charges":
        del params["confirm"]
    if amount is not None:
        params["amount"] = amount
    reply = await raw.post(path, params, idempotency_key=f"bad-amount-{path}-{amount}")
    assert reply.status == 400
    assert (reply.body["error"]["code"], reply.body["error"]["param"]) == (code, "amount")
    assert (await raw.ledger())["charges"] == []


async def test_the_largest_amount_is_accepted(raw: Raw) -> None:
    customer = await raw.customer()
    reply = await raw.charge(customer, "max", amount=str(MAX_AMOUNT))
    assert reply.status == 200
    assert reply.body["amount"] == MAX_AMOUNT


@pytest.mark.parametrize(
    ("currency", "code"), [(None, "parameter_missing"), ("USD", None), ("us", None), ("xyz", None)]
)
async def test_bad_currencies_are_refused(raw: Raw, currency: str | None, code: str | None) -> None:
    customer = await raw.customer()
    params = {"amount": "100", "customer": customer["id"], "confirm": "true"}
    if currency is not None:
        params["currency"] = currency
    reply = await raw.post("/v1/payment_intents", params)
    assert reply.status == 400
    assert reply.body["error"]["param"] == "currency"
    assert reply.body["error"].get("code") == code


async def test_unknown_customer_stores_nothing(sdk: stripe.StripeClient, raw: Raw) -> None:
    with pytest.raises(stripe.InvalidRequestError) as caught:
        await sdk.v1.payment_intents.create_async(
            params={"amount": 100, "currency": "usd", "customer": "cus_nope", "confirm": True}
        )
    assert (caught.value.http_status, caught.value.code, caught.value.param) == (
        400,
        "resource_missing",
        "customer",
    )
    assert (await raw.get("/v1/payment_intents")).body["data"] == []
    assert (await raw.ledger())["charges"] == []


@pytest.mark.parametrize("method", ["pm_card_visa", "pm_not_there", "OTHER"])
async def test_a_method_the_customer_does_not_have_stores_nothing(
    sdk: stripe.StripeClient, raw: Raw, method: str
) -> None:
    customer = await raw.customer()
    other = await raw.customer()
    method_id = method_of(other) if method == "OTHER" else method
    with pytest.raises(stripe.InvalidRequestError) as caught:
        await sdk.v1.payment_intents.create_async(
            params={
                "amount": 100,
                "currency": "usd",
                "customer": customer["id"],
                "payment_method": method_id,
                "confirm": True,
                "off_session": True,
            }
        )
    assert caught.value.param == "payment_method"
    assert (await raw.get("/v1/payment_intents")).body["data"] == []
    methods = await raw.get("/v1/payment_methods", {"customer": customer["id"]})
    assert len(methods.body["data"]) == 1
    assert (await raw.ledger())["charges"] == []


@pytest.mark.parametrize(
    ("path", "param"), [("/v1/payment_intents", "payment_method"), ("/v1/charges", "source")]
)
async def test_a_customers_method_named_without_its_customer_is_refused_and_charges_nothing(
    raw: Raw, path: str, param: str
) -> None:
    """As Stripe refuses it: a charge of a customer's card that names no customer would be
    one the billing ledger cannot tie to anyone."""
    customer = await raw.customer()
    params = {"amount": "100", "currency": "usd", param: method_of(customer)}
    if path == "/v1/payment_intents":
        params |= {"confirm": "true", "allowed_payment_method_types[0]": "card"}
    reply = await raw.post(path, params, idempotency_key=f"no-customer-{param}")
    assert (reply.status, reply.body["error"]["param"]) == (400, "customer"), reply.body
    assert (await raw.ledger())["charges"] == []


async def test_naming_no_method_is_refused_without_a_default_source(raw: Raw) -> None:
    # Stripe takes `customer.default_source` for a request naming no method, never the invoice
    # default (stripe-python 16, params/_payment_intent_create_params.py); this customer has
    # only the invoice default, as the billing core's customers have.
    customer = await raw.customer()
    assert customer["default_source"] is None
    for attempt in range(2):
        reply = await raw.intent(customer["id"], "no-method")
        assert reply.status == 400, reply.body
        assert "Idempotent-Replayed" not in reply.headers, attempt  # nothing saved for the key
        error = reply.body["error"]
        assert (error["type"], error["code"]) == (
            "invalid_request_error",
            "payment_intent_unexpected_state",
        )
        assert error["message"].startswith(
            "You cannot confirm this PaymentIntent because it's missing a payment method."
        )
    legacy = await raw.post(
        "/v1/charges",
        {"amount": "100", "currency": "usd", "customer": customer["id"]},
        idempotency_key="no-source",
    )
    assert legacy.status == 402, legacy.body
    assert legacy.body["error"] == {
        "type": "card_error",
        "code": "missing",
        "doc_url": "https://stripe.com/docs/error-codes/missing",
        "param": "card",
        "message": "Cannot charge a customer that has no active card",
    }
    assert (await raw.get("/v1/payment_intents")).body["data"] == []
    assert (await raw.ledger())["charges"] == []


async def test_confirming_an_intent_with_no_method_and_no_default_source_is_refused(
    raw: Raw,
) -> None:
    customer = await raw.customer()
    created = await raw.post(
        "/v1/payment_intents",
        {
            "amount": "700",
            "currency": "usd",
            "customer": customer["id"],
            "allowed_payment_method_types[0]": "card",
        },
    )
    assert created.body["status"] == "requires_payment_method", created.body
    reply = await raw.post(
        f"/v1/payment_intents/{created.body['id']}/confirm", {"off_session": "true"}
    )
    assert reply.status == 400, reply.body
    error = reply.body["error"]
    assert error["code"] == "payment_intent_unexpected_state"
    assert error["payment_intent"]["status"] == "requires_payment_method"
    assert (await raw.ledger())["charges"] == []


@pytest.mark.parametrize(
    "hostile", ["../../etc/passwd", "cus_" + "x" * 5000, "cus_'; DROP TABLE x;--", "cus_\u202e"]
)
async def test_hostile_ids_are_plain_misses(raw: Raw, hostile: str) -> None:
    reply = await raw.intent(hostile, "hostile")
    assert reply.status == 400
    assert reply.body["error"]["code"] == "resource_missing"
    assert (await raw.ledger())["charges"] == []


async def test_metadata_limits(raw: Raw) -> None:
    too_many = {f"metadata[k{i}]": "v" for i in range(51)}
    assert (await raw.post("/v1/customers", too_many)).status == 400
    long_key = {"metadata[" + "k" * 41 + "]": "v"}
    assert (await raw.post("/v1/customers", long_key)).status == 400
    assert (await raw.get("/v1/customers")).body["data"] == []


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"confirm": "yes"}, "confirm"),
        ({"off_session": "true"}, "off_session"),
        ({"metadata": "not-a-hash"}, "metadata"),
    ],
)
async def test_other_parameters_are_checked(raw: Raw, params: dict[str, str], param: str) -> None:
    customer = await raw.customer()
    reply = await raw.post(
        "/v1/payment_intents",
        {"amount": "100", "currency": "usd", "customer": customer["id"], **params},
    )
    assert reply.status == 400
    assert reply.body["error"]["param"] == param


_REDIRECTS = {
    "automatic_payment_methods[enabled]": "true",
    "automatic_payment_methods[allow_redirects]": "always",
}


@pytest.mark.parametrize(
    "choice",
    [{}, _REDIRECTS],
    ids=["dashboard-methods", "redirects-allowed"],
)
async def test_confirming_where_redirects_are_allowed_needs_a_return_url(
    raw: Raw, choice: dict[str, str]
) -> None:
    """As Stripe, since automatic payment methods became the default: even a card that never
    redirects is refused, and nothing is stored or saved for the key."""
    customer = await raw.customer()
    base = {
        "amount": "100",
        "currency": "usd",
        "customer": customer["id"],
        "payment_method": method_of(customer),
        "confirm": "true",
    }
    refused = await raw.post("/v1/payment_intents", base | choice, idempotency_key="no-url")
    assert (refused.status, refused.body["error"]["param"]) == (400, "return_url")
    assert "allow_redirects]` to `never`" in refused.body["error"]["message"]
    assert (await raw.get("/v1/payment_intents")).body["data"] == []
    assert (await raw.ledger())["charges"] == []
    # The same key, with somewhere to return to, executes: the refusal was not saved.
    sent = base | choice | {"return_url": "https://example.com/back"}
    accepted = await raw.post("/v1/payment_intents", sent, idempotency_key="no-url")
    assert (accepted.status, accepted.body["status"]) == (200, "succeeded")


async def test_an_intent_confirmed_later_needs_the_return_url_then(raw: Raw) -> None:
    customer = await raw.customer()
    created = await raw.post(
        "/v1/payment_intents",
        {
            "amount": "100",
            "currency": "usd",
            "customer": customer["id"],
            "payment_method": method_of(customer),
        },
    )
    assert created.body["status"] == "requires_confirmation"
    path = f"/v1/payment_intents/{created.body['id']}/confirm"
    assert (await raw.post(path, {"off_session": "true"})).body["error"]["param"] == "return_url"
    confirmed = await raw.post(path, {"return_url": "https://example.com/back"})
    assert confirmed.body["status"] == "succeeded"


@pytest.mark.parametrize(
    ("automatic", "param"),
    [
        ({"automatic_payment_methods[allow_redirects]": "never"}, "[enabled]"),
        (
            {
                "automatic_payment_methods[enabled]": "true",
                "automatic_payment_methods[allow_redirects]": "sometimes",
            },
            "[allow_redirects]",
        ),
    ],
)
async def test_automatic_payment_methods_are_checked(
    raw: Raw, automatic: dict[str, str], param: str
) -> None:
    customer = (await raw.customer())["id"]
    sent = {"amount": "100", "currency": "usd", "customer": customer, "confirm": "true"}
    reply = await raw.post("/v1/payment_intents", sent | automatic)
    assert (reply.status, reply.body["error"]["param"]) == (
        400,
        f"automatic_payment_methods{param}",
    )

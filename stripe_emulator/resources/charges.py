"""Legacy Charges: create against a customer's card, retrieve, list by customer."""

from __future__ import annotations

from ..cards import Card, Outcome
from ..errors import JSON, StripeError, invalid, missing_param
from ..listing import list_object
from ..payments import declined, record_charge, source_to_charge
from ..routing import Call, Route
from ..validation import (
    COMMON,
    LIST,
    amount,
    at_least_minimum,
    check_known,
    currency,
    metadata,
    require,
    string,
)

_CREATE = COMMON | {
    "amount",
    "currency",
    "customer",
    "source",
    "payment_method",
    "metadata",
    "description",
    "receipt_email",
    "statement_descriptor",
    "statement_descriptor_suffix",
}
_LIST = LIST | {"customer"}


def _create(call: Call) -> JSON:
    params, store = call.params, call.store
    check_known(params, _CREATE)
    value = require(amount(params), "amount")
    money = currency(params)
    at_least_minimum(value, money)
    customer_id = string(params, "customer")
    source_id = string(params, "source")
    method_id = string(params, "payment_method")
    if source_id is not None and method_id is not None:
        raise invalid(
            "You may only specify one of these parameters: source, payment_method.",
            param="source",
            code="parameters_exclusive",
        )
    param = "payment_method" if method_id is not None else "source"
    method_id = method_id or source_id
    if customer_id is None and method_id is None:
        raise missing_param("source")
    customer = None
    if customer_id is not None:
        customer = store.customers.get(customer_id, param="customer", status=400)
    charge_metadata = metadata(params)
    description = string(params, "description")
    source = source_to_charge(store, customer, method_id, param)
    if source is None:
        raise _no_active_card()
    if not isinstance(source.instrument, Card):
        # Stripe takes bank debits through PaymentIntents only.
        raise invalid(
            f"The Charges API does not take {source.instrument.type} payment methods: create"
            " a PaymentIntent to charge it.",
            param=param,
        )
    card = source.instrument
    method = source.materialise(store)
    # The Charges API cannot run 3D Secure, so such cards are simply declined.
    decline_code = {
        Outcome.SUCCEED: None,
        Outcome.DECLINE: card.decline_code,
        Outcome.AUTHENTICATION_REQUIRED: "authentication_required",
    }[card.outcome]
    charge = record_charge(
        store,
        method,
        amount=value,
        currency=money,
        customer=customer_id,
        payment_intent=None,
        metadata=charge_metadata,
        description=description,
        idempotency_key=call.idempotency_key,
        decline_code=decline_code,
    )
    if decline_code is not None:
        raise declined(charge, decline_code)
    return charge.to_api()


def _no_active_card() -> StripeError:
    """Stripe's answer to charging a customer with no default source and naming none: a card
    error (as reported from Stripe in stripe/stripe-node#282 and stripe/stripe-android#475),
    which, as a 402, is saved for the key."""
    return StripeError(
        402,
        "Cannot charge a customer that has no active card",
        error_type="card_error",
        code="missing",
        param="card",
    )


def _retrieve(call: Call) -> JSON:
    check_known(call.params, COMMON)
    return call.store.charges.get(call.path["id"]).to_api()


def _list(call: Call) -> JSON:
    check_known(call.params, _LIST)
    charges = call.store.charges
    customer = string(call.params, "customer")
    records = charges.order if customer is None else charges.by_customer.get(customer, [])
    return list_object(call, charges, records)


ROUTES = [
    Route("POST", "/v1/charges", _create, moves_money=True),
    Route("GET", "/v1/charges", _list),
    Route("GET", "/v1/charges/{id}", _retrieve),
]

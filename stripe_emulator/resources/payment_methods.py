"""Payment methods: test ids attached to customers become ``pm_...`` objects of their own."""

from __future__ import annotations

from ..cards import BankAccount, Card, Instrument, lookup_test_instrument
from ..errors import JSON, invalid, no_such
from ..listing import list_object
from ..models import PaymentMethod
from ..payments import Source, card_error
from ..routing import Call, Route
from ..store import Store
from ..validation import COMMON, LIST, check_known, require, string

_ATTACH = COMMON | {"customer"}
_LIST = LIST | {"customer", "type"}
_CUSTOMER_LIST = LIST | {"type"}
_TYPES = (Card.type, BankAccount.type)


def attachable(store: Store, method_id: str, customer: str | None, param: str) -> Source:
    """Validate attaching ``method_id`` to ``customer`` (None: a customer being created)."""
    method = store.payment_methods.by_id.get(method_id)
    if method is not None:
        if method.customer is not None and method.customer != customer:
            raise invalid(
                "The payment method you provided has already been attached to a customer.",
                param=param,
            )
        return Source(method.instrument, method)
    instrument = lookup_test_instrument(method_id)
    if instrument is None:
        raise no_such("PaymentMethod", method_id, param=param)
    check_attachable(instrument)
    return Source(instrument, None)


def check_attachable(instrument: Instrument) -> None:
    if not instrument.attachable and instrument.decline_code is not None:
        # Attaching runs an authorisation that these cards decline, as on Stripe.
        raise card_error("card_declined", instrument.decline_code)


def attach(store: Store, source: Source, customer: str) -> PaymentMethod:
    method = source.materialise(store)
    if method.customer is None:
        method.customer = customer
        store.payment_methods.index_customer(method, customer)
    return method


def _attach(call: Call) -> JSON:
    check_known(call.params, _ATTACH)
    customer = require(string(call.params, "customer"), "customer")
    store = call.store
    store.customers.get(customer, param="customer", status=400)
    source = attachable(store, call.path["id"], customer, "payment_method")
    return attach(store, source, customer).to_api()


def _retrieve(call: Call) -> JSON:
    check_known(call.params, COMMON)
    return call.store.payment_methods.get(call.path["id"]).to_api()


def _list_for_customer(call: Call, customer: str, param: str, status: int) -> JSON:
    store = call.store
    store.customers.get(customer, param=param, status=status)
    kind = string(call.params, "type")
    if kind not in (None, *_TYPES):
        raise invalid(
            f"Invalid type: only {' and '.join(_TYPES)} payment methods are emulated.",
            param="type",
        )
    records = store.payment_methods.by_customer.get(customer, [])
    if kind is not None:
        records = [method for method in records if method.instrument.type == kind]
    return list_object(call, store.payment_methods, records)


def _list(call: Call) -> JSON:
    check_known(call.params, _LIST)
    customer = require(string(call.params, "customer"), "customer")
    return _list_for_customer(call, customer, "customer", 400)


def _list_of_customer(call: Call) -> JSON:
    check_known(call.params, _CUSTOMER_LIST)
    return _list_for_customer(call, call.path["id"], "id", 404)


ROUTES = [
    Route("GET", "/v1/payment_methods", _list),
    Route("GET", "/v1/payment_methods/{id}", _retrieve),
    Route("POST", "/v1/payment_methods/{id}/attach", _attach),
    Route("GET", "/v1/customers/{id}/payment_methods", _list_of_customer),
]

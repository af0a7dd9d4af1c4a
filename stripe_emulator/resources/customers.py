"""Customers: create (optionally attaching a payment method, or saving a legacy card source),
retrieve, update, list."""

from __future__ import annotations

from ..cards import Card, lookup_test_card_token
from ..errors import JSON, no_such
from ..listing import list_object
from ..models import Customer, PaymentMethod
from ..payments import not_attached
from ..routing import Call, Route
from ..store import Store
from ..validation import COMMON, LIST, check_known, hash_param, metadata, string
from .payment_methods import attach, attachable, check_attachable

_UPDATE = COMMON | {"email", "name", "description", "metadata", "invoice_settings"}
_CREATE = _UPDATE | {"payment_method", "source"}
_INVOICE_SETTINGS = frozenset({"default_payment_method"})
_DEFAULT_PARAM = "invoice_settings[default_payment_method]"


def _default_method(call: Call) -> str | None:
    return string(
        hash_param(call.params, "invoice_settings", _INVOICE_SETTINGS), "default_payment_method"
    )


def _card_token(token: str) -> Card:
    """The test card behind a token such as ``tok_visa``: what ``source`` takes here (Stripe
    also takes real tokens and Sources)."""
    card = lookup_test_card_token(token)
    if card is None:
        raise no_such("token", token, param="source")
    check_attachable(card)
    return card


def _save_source(store: Store, card: Card, customer: Customer) -> None:
    """Save ``card`` as the customer's legacy card (``card_...``) and its default source."""
    method = PaymentMethod(*store.identity("card"), instrument=card, customer=customer.id)
    store.payment_methods.add(method)
    store.payment_methods.index_customer(method, customer.id)
    customer.default_source = method.id


def _create(call: Call) -> JSON:
    params, store = call.params, call.store
    check_known(params, _CREATE)
    method_id = string(params, "payment_method")
    source = attachable(store, method_id, None, "payment_method") if method_id else None
    token = string(params, "source")
    card = _card_token(token) if token else None
    default = _default_method(call)
    # A new customer has no payment method yet other than the one attached in this request.
    if default is not None and default != method_id:
        raise not_attached(default, _DEFAULT_PARAM)
    customer = Customer(
        *store.identity("cus"),
        email=string(params, "email"),
        name=string(params, "name"),
        description=string(params, "description"),
        metadata=metadata(params),
    )
    store.customers.add(customer)
    if source is not None:
        method = attach(store, source, customer.id)
        if default is not None:
            customer.default_payment_method = method.id
    if card is not None:
        _save_source(store, card, customer)
    return customer.to_api()


def _retrieve(call: Call) -> JSON:
    check_known(call.params, COMMON)
    return call.store.customers.get(call.path["id"]).to_api()


def _update(call: Call) -> JSON:
    params, store = call.params, call.store
    check_known(params, _UPDATE)
    customer = store.customers.get(call.path["id"])
    # Everything is validated before anything changes: a refused update leaves no trace.
    new_metadata = metadata(params, customer.metadata)
    fields = {
        name: string(params, name) for name in ("email", "name", "description") if name in params
    }
    default = customer.default_payment_method
    settings = hash_param(params, "invoice_settings", _INVOICE_SETTINGS)
    if "default_payment_method" in settings:
        default = string(settings, "default_payment_method")
        method = store.payment_methods.by_id.get(default) if default else None
        if default is not None and (method is None or method.customer != customer.id):
            raise not_attached(default, _DEFAULT_PARAM)
    customer.metadata = new_metadata
    customer.default_payment_method = default
    for name, value in fields.items():
        setattr(customer, name, value)
    return customer.to_api()


def _list(call: Call) -> JSON:
    check_known(call.params, LIST)
    customers = call.store.customers
    return list_object(call, customers, customers.order)


ROUTES = [
    Route("POST", "/v1/customers", _create),
    Route("GET", "/v1/customers", _list),
    Route("GET", "/v1/customers/{id}", _retrieve),
    Route("POST", "/v1/customers/{id}", _update),
]

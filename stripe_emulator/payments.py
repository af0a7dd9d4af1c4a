"""Charging a payment method: resolving it for a customer, recording the charge, declines."""

from __future__ import annotations

from dataclasses import dataclass

from .cards import Card, decline_message, lookup_test_card
from .errors import StripeError, invalid, no_such
from .models import Charge, Customer, PaymentMethod
from .store import Store


@dataclass(frozen=True, slots=True)
class Source:
    """A validated payment method; ``method`` is None for a test id not yet materialised."""

    card: Card
    method: PaymentMethod | None

    def materialise(self, store: Store) -> PaymentMethod:
        """The stored payment method, creating a one-off one for a test id (nothing is stored
        while validating, so a request refused later leaves no trace)."""
        if self.method is not None:
            return self.method
        method = PaymentMethod(*store.identity("pm"), card=self.card)
        store.payment_methods.add(method)
        return method


def not_attached(method_id: str, param: str) -> StripeError:
    return invalid(
        f"The customer does not have a payment method with the ID {method_id}. "
        "The payment method must be attached to the customer.",
        param=param,
        code="resource_missing",
    )


def resolve(store: Store, customer: Customer | None, method_id: str | None, param: str) -> Source:
    """The payment method to charge: the one named (attached to ``customer`` when there is a
    customer), else the customer's default."""
    if method_id is None:
        default = customer.default_payment_method if customer else None
        if default is None:
            raise invalid(
                "No payment method was provided and the customer has no default payment method.",
                param=param,
                code="parameter_missing",
            )
        default_method = store.payment_methods.by_id[default]
        return Source(default_method.card, default_method)
    method = store.payment_methods.by_id.get(method_id)
    if customer is not None:
        if method is None or method.customer != customer.id:
            raise not_attached(method_id, param)
        return Source(method.card, method)
    if method is not None:
        if method.customer is not None:
            raise invalid(
                f"The payment method {method_id} belongs to a customer; pass that customer too.",
                param="customer",
            )
        return Source(method.card, method)
    card = lookup_test_card(method_id)
    if card is None:
        raise no_such("PaymentMethod", method_id, param=param)
    return Source(card, None)


def record_charge(
    store: Store,
    method: PaymentMethod,
    *,
    amount: int,
    currency: str,
    customer: str | None,
    payment_intent: str | None,
    metadata: dict[str, str],
    description: str | None,
    idempotency_key: str | None,
    decline_code: str | None,
) -> Charge:
    """Store a charge: succeeded, or failed with ``card_declined`` when ``decline_code`` is set."""
    charge = Charge(
        *store.identity("ch"),
        amount=amount,
        currency=currency,
        customer=customer,
        payment_intent=payment_intent,
        payment_method=method,
        metadata=metadata,
        description=description,
        idempotency_key=idempotency_key,
    )
    if decline_code is not None:
        charge.failure_code = "card_declined"
        charge.failure_message = decline_message(decline_code)
        charge.decline_code = decline_code
    store.charges.add(charge)
    if customer is not None:
        store.charges.index_customer(charge, customer)
    return charge


def card_error(code: str, decline_code: str, method: PaymentMethod | None = None) -> StripeError:
    """A 402 in Stripe's shape; callers add ``charge``/``payment_intent`` where they exist."""
    error = StripeError(
        402,
        decline_message(decline_code),
        error_type="card_error",
        code=code,
        decline_code=decline_code,
    )
    if method is not None:
        error.error["payment_method"] = method.to_api()
    return error


def declined(charge: Charge, decline_code: str) -> StripeError:
    error = card_error("card_declined", decline_code, charge.payment_method)
    error.error["charge"] = charge.id
    return error

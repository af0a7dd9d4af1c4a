"""Charging a payment method: resolving it for a customer, recording the charge, declines."""

from __future__ import annotations

from dataclasses import dataclass

from .cards import (
    BankAccount,
    Card,
    Instrument,
    Outcome,
    decline_message,
    lookup_test_instrument,
    return_message,
)
from .errors import StripeError, invalid, no_such
from .models import Charge, Customer, PaymentMethod
from .store import Store


@dataclass(frozen=True, slots=True)
class Source:
    """A validated payment method; ``method`` is None for a test id not yet materialised."""

    instrument: Instrument
    method: PaymentMethod | None

    def materialise(self, store: Store) -> PaymentMethod:
        """The stored payment method, creating a one-off one for a test id (nothing is stored
        while validating, so a request refused later leaves no trace)."""
        if self.method is not None:
            return self.method
        method = PaymentMethod(*store.identity("pm"), instrument=self.instrument)
        store.payment_methods.add(method)
        return method


def not_attached(method_id: str, param: str) -> StripeError:
    return invalid(
        f"The customer does not have a payment method with the ID {method_id}. "
        "The payment method must be attached to the customer.",
        param=param,
        code="resource_missing",
    )


def resolve(store: Store, customer: Customer | None, method_id: str, param: str) -> Source:
    """The payment method named, attached to ``customer`` when there is a customer."""
    method = store.payment_methods.by_id.get(method_id)
    if customer is not None:
        if method is None or method.customer != customer.id:
            raise not_attached(method_id, param)
        return Source(method.instrument, method)
    if method is not None:
        if method.customer is not None:
            raise invalid(
                f"The payment method {method_id} belongs to a customer; pass that customer too.",
                param="customer",
            )
        return Source(method.instrument, method)
    instrument = lookup_test_instrument(method_id)
    if instrument is None:
        raise no_such("PaymentMethod", method_id, param=param)
    return Source(instrument, None)


def source_to_charge(
    store: Store, customer: Customer | None, method_id: str | None, param: str
) -> Source | None:
    """The payment method named, else what Stripe charges for a request naming none: the
    customer's legacy default source ("`source` automatically populates with
    `customer.default_source`", stripe-python 16 params/_payment_intent_create_params.py),
    never its invoice default. None when there is neither."""
    if method_id is not None:
        return resolve(store, customer, method_id, param)
    if customer is None or customer.default_source is None:
        return None
    method = store.payment_methods.by_id[customer.default_source]
    return Source(method.instrument, method)


def check_currency(source: Source, currency: str) -> None:
    """Refuse, before anything is stored, a currency the payment method cannot pay in."""
    accepted = source.instrument.currencies
    if accepted is not None and currency not in accepted:
        raise invalid(
            f"The currency provided ({currency}) is invalid. Payments with"
            f" {source.instrument.type} support the following currencies:"
            f" {', '.join(sorted(accepted))}.",
            param="currency",
        )


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
    """Store a charge: succeeded, failed with ``card_declined`` when ``decline_code`` is set, or
    pending for a bank debit."""
    # A payment other than a card's is a `py_` on Stripe.
    charge = Charge(
        *store.identity("ch" if isinstance(method.instrument, Card) else "py"),
        amount=amount,
        currency=currency,
        customer=customer,
        payment_intent=payment_intent,
        payment_method=method,
        metadata=metadata,
        description=description,
        idempotency_key=idempotency_key,
        pending=method.instrument.outcome is Outcome.SETTLES_LATER,
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


def settle_debit(store: Store, charge: Charge) -> None:
    """The bank answers a pending debit: it succeeds, or is returned and fails; its
    PaymentIntent follows (a failed one asks for another payment method, as on Stripe)."""
    charge.pending = False
    instrument = charge.payment_method.instrument
    returned_with = instrument.returned_with if isinstance(instrument, BankAccount) else None
    if returned_with is not None:
        charge.failure_code = returned_with
        charge.failure_message = return_message(returned_with)
    if charge.payment_intent is None:
        return
    intent = store.payment_intents.by_id[charge.payment_intent]
    if returned_with is None:
        intent.status = "succeeded"
        return
    intent.status = "requires_payment_method"
    intent.last_payment_error = {
        "type": "card_error",
        "code": returned_with,
        "message": charge.failure_message,
        "charge": charge.id,
        "payment_method": charge.payment_method.to_api(),
    }

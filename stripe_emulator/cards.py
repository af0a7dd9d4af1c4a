"""Stripe's test payment methods (``pm_card_*``, ``tok_*``) and how each one behaves."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Outcome(Enum):
    SUCCEED = "succeed"
    DECLINE = "decline"
    AUTHENTICATION_REQUIRED = "authentication_required"


@dataclass(frozen=True, slots=True)
class Card:
    brand: str
    last4: str
    outcome: Outcome = Outcome.SUCCEED
    decline_code: str | None = None
    funding: str = "credit"
    # Declining cards other than chargeCustomerFail already fail when attached to a customer.
    attachable: bool = True


_CARDS = {
    "visa": Card("visa", "4242"),
    "visa_debit": Card("visa", "5556", funding="debit"),
    "mastercard": Card("mastercard", "4444"),
    "amex": Card("amex", "8431"),
    "chargeCustomerFail": Card("visa", "0341", Outcome.DECLINE, "generic_decline"),
    "authenticationRequired": Card("visa", "3184", Outcome.AUTHENTICATION_REQUIRED),
    "chargeDeclined": Card("visa", "0002", Outcome.DECLINE, "generic_decline", attachable=False),
    "chargeDeclinedInsufficientFunds": Card(
        "visa", "9995", Outcome.DECLINE, "insufficient_funds", attachable=False
    ),
}

_PREFIXES = ("pm_card_", "tok_")

_DECLINE_MESSAGES = {
    "insufficient_funds": "Your card has insufficient funds.",
    "authentication_required": "Your card was declined. This transaction requires authentication.",
}


def decline_message(decline_code: str) -> str:
    return _DECLINE_MESSAGES.get(decline_code, "Your card was declined.")


def lookup_test_card(object_id: str) -> Card | None:
    """The card behind a test id such as ``pm_card_visa`` or ``tok_visa``, else None."""
    for prefix in _PREFIXES:
        if object_id.startswith(prefix):
            return _CARDS.get(object_id[len(prefix) :])
    return None

"""Stripe's test payment methods (``pm_card_*``, ``tok_*``) and how each one behaves, plus
bank debits of the emulator's own (``pm_sepaDebit_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from .errors import JSON


class Outcome(Enum):
    SUCCEED = "succeed"
    DECLINE = "decline"
    AUTHENTICATION_REQUIRED = "authentication_required"
    # A bank debit: its charge is pending, and its PaymentIntent processing, until the bank
    # answers (days later on Stripe, here at `POST /_emulator/settle_debits`).
    SETTLES_LATER = "settles_later"


@dataclass(frozen=True, slots=True)
class Card:
    type: ClassVar[str] = "card"
    # Any currency: the emulated account settles cards in all of them.
    currencies: ClassVar[frozenset[str] | None] = None
    brand: str
    last4: str
    outcome: Outcome = Outcome.SUCCEED
    decline_code: str | None = None
    funding: str = "credit"
    # Declining cards other than chargeCustomerFail already fail when attached to a customer.
    attachable: bool = True

    def details(self) -> JSON:
        return {"brand": self.brand, "country": "US", "funding": self.funding, "last4": self.last4}


@dataclass(frozen=True, slots=True)
class BankAccount:
    """A SEPA Direct Debit account: debited in euros, settled later."""

    type: ClassVar[str] = "sepa_debit"
    currencies: ClassVar[frozenset[str] | None] = frozenset({"eur"})
    outcome: ClassVar[Outcome] = Outcome.SETTLES_LATER
    decline_code: ClassVar[None] = None
    attachable: ClassVar[bool] = True
    last4: str
    # Set: the bank returns the debit when it settles, and the charge fails with this code.
    returned_with: str | None = None

    def details(self) -> JSON:
        return {"bank_code": "37040044", "country": "DE", "last4": self.last4}


Instrument = Card | BankAccount

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

# The emulator's own ids (Stripe tests bank debits with IBANs entered in its forms).
_BANK_ACCOUNTS = {
    "pm_sepaDebit_succeeds": BankAccount("3000"),
    "pm_sepaDebit_fails": BankAccount("3001", returned_with="insufficient_funds"),
}

_PAYMENT_METHOD_PREFIX = "pm_card_"
_TOK_PREFIX = "tok_"

_DECLINE_MESSAGES = {
    "insufficient_funds": "Your card has insufficient funds.",
    "authentication_required": "Your card was declined. This transaction requires authentication.",
}

_RETURN_MESSAGES = {
    "insufficient_funds": "The customer's account has insufficient funds to cover this payment.",
}


def decline_message(decline_code: str) -> str:
    return _DECLINE_MESSAGES.get(decline_code, "Your card was declined.")


def return_message(failure_code: str) -> str:
    return _RETURN_MESSAGES.get(failure_code, "The customer's bank returned the debit.")


def lookup_test_card_token(token: str) -> Card | None:
    """The card behind a test token such as ``tok_visa``, else None."""
    return _card_after(_TOK_PREFIX, token)


def lookup_test_instrument(object_id: str) -> Instrument | None:
    """The instrument behind a test id such as ``pm_card_visa``, ``tok_visa`` or
    ``pm_sepaDebit_succeeds``, else None."""
    if object_id in _BANK_ACCOUNTS:
        return _BANK_ACCOUNTS[object_id]
    return _card_after(_PAYMENT_METHOD_PREFIX, object_id) or lookup_test_card_token(object_id)


def _card_after(prefix: str, object_id: str) -> Card | None:
    return _CARDS.get(object_id.removeprefix(prefix)) if object_id.startswith(prefix) else None

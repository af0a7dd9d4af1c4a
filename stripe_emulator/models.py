"""The emulated Stripe objects and their JSON (API) representations."""

from __future__ import annotations

from dataclasses import dataclass

from .cards import Card, Instrument
from .errors import JSON


@dataclass(slots=True)
class Customer:
    id: str
    seq: int
    created: int
    email: str | None
    name: str | None
    description: str | None
    metadata: dict[str, str]
    # invoice_settings.default_payment_method: for invoices and subscriptions only.
    default_payment_method: str | None = None
    # A legacy card source (card_...): what Stripe charges when a request names no method.
    default_source: str | None = None

    def to_api(self) -> JSON:
        return {
            "id": self.id,
            "object": "customer",
            "balance": 0,
            "created": self.created,
            "currency": None,
            "default_source": self.default_source,
            "delinquent": False,
            "description": self.description,
            "email": self.email,
            "invoice_settings": {
                "custom_fields": None,
                "default_payment_method": self.default_payment_method,
                "footer": None,
                "rendering_options": None,
            },
            "livemode": False,
            "metadata": self.metadata,
            "name": self.name,
            "phone": None,
            "preferred_locales": [],
            "shipping": None,
            "tax_exempt": "none",
        }


@dataclass(slots=True)
class PaymentMethod:
    id: str
    seq: int
    created: int
    instrument: Instrument
    customer: str | None = None

    def to_api(self) -> JSON:
        kind = self.instrument.type
        details = self.instrument.details()
        if isinstance(self.instrument, Card):
            details |= {"exp_month": 12, "exp_year": 2034}
        return {
            "id": self.id,
            "object": "payment_method",
            "billing_details": {"address": None, "email": None, "name": None, "phone": None},
            kind: details,
            "created": self.created,
            "customer": self.customer,
            "livemode": False,
            "metadata": {},
            "type": kind,
        }

    def charge_details(self) -> JSON:
        kind = self.instrument.type
        return {kind: self.instrument.details(), "type": kind}


@dataclass(slots=True)
class Charge:
    id: str
    seq: int
    created: int
    amount: int
    currency: str
    customer: str | None
    payment_intent: str | None
    payment_method: PaymentMethod
    metadata: dict[str, str]
    description: str | None
    idempotency_key: str | None
    failure_code: str | None = None
    failure_message: str | None = None
    decline_code: str | None = None
    amount_refunded: int = 0
    # A bank debit the bank has not answered yet (payments.settle_debit).
    pending: bool = False

    @property
    def status(self) -> str:
        if self.failure_code:
            return "failed"
        return "pending" if self.pending else "succeeded"

    @property
    def refunded(self) -> bool:
        return self.amount_refunded == self.amount

    def to_api(self) -> JSON:
        captured = self.failure_code is None
        return {
            "id": self.id,
            "object": "charge",
            "amount": self.amount,
            "amount_captured": self.amount if captured else 0,
            "amount_refunded": self.amount_refunded,
            "balance_transaction": None,
            "captured": captured,
            "created": self.created,
            "currency": self.currency,
            "customer": self.customer,
            "description": self.description,
            "disputed": False,
            "failure_code": self.failure_code,
            "failure_message": self.failure_message,
            "livemode": False,
            "metadata": self.metadata,
            "outcome": self._outcome(),
            "paid": self.status == "succeeded",
            "payment_intent": self.payment_intent,
            "payment_method": self.payment_method.id,
            "payment_method_details": self.payment_method.charge_details(),
            "receipt_url": None,
            "refunded": self.refunded,
            "status": self.status,
        }

    def _outcome(self) -> JSON:
        if self.failure_code is None:
            return {
                "network_status": "approved_by_network",
                "reason": None,
                "risk_level": "normal",
                "seller_message": "Payment complete.",
                "type": "authorized",
            }
        return {
            "network_status": "declined_by_network",
            "reason": self.decline_code,
            "risk_level": "normal",
            "seller_message": "The bank did not return any further details with this decline.",
            "type": "issuer_declined",
        }

    def to_ledger(self) -> JSON:
        return {
            "id": self.id,
            "object": "charge",
            "status": self.status,
            "amount": self.amount,
            "currency": self.currency,
            "customer": self.customer,
            "payment_intent": self.payment_intent,
            "payment_method": self.payment_method.id,
            "metadata": self.metadata,
            "idempotency_key": self.idempotency_key,
            "refunded": self.refunded,
            "amount_refunded": self.amount_refunded,
            "failure_code": self.failure_code,
            "created": self.created,
        }


@dataclass(slots=True)
class PaymentIntent:
    id: str
    seq: int
    created: int
    amount: int
    currency: str
    customer: str | None
    payment_method: str | None
    metadata: dict[str, str]
    description: str | None
    status: str
    latest_charge: str | None = None
    last_payment_error: JSON | None = None
    next_action: JSON | None = None
    # Automatic payment methods that may redirect: confirming then needs a return_url.
    allows_redirects: bool = True
    canceled_at: int | None = None
    cancellation_reason: str | None = None

    def to_api(self) -> JSON:
        return {
            "id": self.id,
            "object": "payment_intent",
            "amount": self.amount,
            "amount_capturable": 0,
            "amount_received": self.amount if self.status == "succeeded" else 0,
            "canceled_at": self.canceled_at,
            "cancellation_reason": self.cancellation_reason,
            "capture_method": "automatic",
            "client_secret": f"{self.id}_secret_emulated",
            "confirmation_method": "automatic",
            "created": self.created,
            "currency": self.currency,
            "customer": self.customer,
            "description": self.description,
            "last_payment_error": self.last_payment_error,
            "latest_charge": self.latest_charge,
            "livemode": False,
            "metadata": self.metadata,
            "next_action": self.next_action,
            "payment_method": self.payment_method,
            "payment_method_types": ["card", "sepa_debit"],
            "status": self.status,
        }


@dataclass(slots=True)
class Refund:
    id: str
    seq: int
    created: int
    amount: int
    charge: str
    payment_intent: str | None
    currency: str
    reason: str | None
    metadata: dict[str, str]

    def to_api(self) -> JSON:
        return {
            "id": self.id,
            "object": "refund",
            "amount": self.amount,
            "balance_transaction": None,
            "charge": self.charge,
            "created": self.created,
            "currency": self.currency,
            "metadata": self.metadata,
            "payment_intent": self.payment_intent,
            "reason": self.reason,
            "status": "succeeded",
        }

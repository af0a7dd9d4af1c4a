"""Refunds of a charge or a PaymentIntent's charge, in full or in part."""

from __future__ import annotations

from ..errors import JSON, invalid, missing_param
from ..models import Refund
from ..routing import Call, Route
from ..validation import COMMON, amount, check_known, metadata, string

_CREATE = COMMON | {"charge", "payment_intent", "amount", "reason", "metadata"}
_REASONS = ("duplicate", "fraudulent", "requested_by_customer")


def _create(call: Call) -> JSON:
    params, store = call.params, call.store
    check_known(params, _CREATE)
    charge_id = string(params, "charge")
    intent_id = string(params, "payment_intent")
    if charge_id is not None and intent_id is not None:
        raise invalid(
            "You may only specify one of these parameters: charge, payment_intent.",
            param="charge",
            code="parameters_exclusive",
        )
    if intent_id is not None:
        intent = store.payment_intents.get(intent_id, param="payment_intent", status=400)
        if intent.status != "succeeded" or intent.latest_charge is None:
            raise invalid(
                f"PaymentIntent {intent_id} has no successful charge to refund.",
                param="payment_intent",
                code="charge_not_refundable",
            )
        charge_id = intent.latest_charge
    if charge_id is None:
        raise missing_param("charge")
    charge = store.charges.get(charge_id, param="charge", status=400)
    if charge.status != "succeeded":
        raise invalid(
            f"Charge {charge.id} did not succeed and cannot be refunded.",
            param="charge",
            code="charge_not_refundable",
        )
    remaining = charge.amount - charge.amount_refunded
    if remaining == 0:
        raise invalid(
            f"Charge {charge.id} has already been refunded.", code="charge_already_refunded"
        )
    value = amount(params)
    if value is not None and value > remaining:
        raise invalid(
            f"Refund amount ({value}) is greater than unrefunded amount on charge ({remaining})",
            param="amount",
            code="amount_too_large",
        )
    reason = string(params, "reason")
    if reason is not None and reason not in _REASONS:
        raise invalid(f"Invalid reason: must be one of {', '.join(_REASONS)}", param="reason")
    refund = Refund(
        *store.identity("re"),
        amount=remaining if value is None else value,
        charge=charge.id,
        payment_intent=charge.payment_intent,
        currency=charge.currency,
        reason=reason,
        metadata=metadata(params),
    )
    store.refunds.add(refund)
    charge.amount_refunded += refund.amount
    return refund.to_api()


def _retrieve(call: Call) -> JSON:
    check_known(call.params, COMMON)
    return call.store.refunds.get(call.path["id"]).to_api()


ROUTES = [
    Route("POST", "/v1/refunds", _create, moves_money=True),
    Route("GET", "/v1/refunds/{id}", _retrieve),
]

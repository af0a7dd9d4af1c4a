"""PaymentIntents: create (and confirm), confirm, cancel, retrieve, list by customer, search."""

from __future__ import annotations

import bisect
import re
import time

from ..cards import Outcome
from ..errors import JSON, StripeError, invalid
from ..forms import Params
from ..listing import list_object
from ..models import PaymentIntent, PaymentMethod
from ..payments import (
    card_error,
    check_currency,
    declined,
    record_charge,
    source_to_charge,
)
from ..routing import Call, Route
from ..store import seq_of
from ..validation import (
    COMMON,
    LIST,
    amount,
    at_least_minimum,
    boolean,
    check_known,
    currency,
    hash_param,
    integer,
    limit,
    metadata,
    require,
    string,
)

# Accepted so real integrations work unchanged, with no effect here: cards settle at once,
# bank debits when told to (no mandate is checked).
_IGNORED = frozenset(
    {
        "capture_method",
        "confirmation_method",
        "error_on_requires_action",
        "mandate",
        "receipt_email",
        "setup_future_usage",
        "statement_descriptor",
        "statement_descriptor_suffix",
    }
)
_CONFIRM = (
    COMMON
    | _IGNORED
    | {
        "payment_method",
        "off_session",
        "return_url",
        # Accepted, not applied: the payment method's type decides.
        "allowed_payment_method_types",
        "excluded_payment_method_types",
    }
)
_CREATE = _CONFIRM | {
    "amount",
    "currency",
    "customer",
    "confirm",
    "metadata",
    "description",
    "automatic_payment_methods",
}
_AUTOMATIC = frozenset({"enabled", "allow_redirects"})
_LIST = LIST | {"customer"}
_SEARCH = COMMON | {"query", "limit", "page"}
_CONFIRMABLE = ("requires_payment_method", "requires_confirmation")
_CANCEL = COMMON | {"cancellation_reason"}
# What Stripe cancels: nothing is charged in these (a processing debit, which Stripe cancels
# only in rare cases, is not among them here).
_CANCELABLE = (*_CONFIRMABLE, "requires_action")
_CANCELLATION_REASONS = ("duplicate", "fraudulent", "requested_by_customer", "abandoned")


def _create(call: Call) -> JSON:
    params, store = call.params, call.store
    check_known(params, _CREATE)
    value = require(amount(params), "amount")
    money = currency(params)
    at_least_minimum(value, money)
    customer_id = string(params, "customer")
    customer = None
    if customer_id is not None:
        customer = store.customers.get(customer_id, param="customer", status=400)
    confirm = boolean(params, "confirm")
    off_session = boolean(params, "off_session")
    if off_session and not confirm:
        raise invalid("off_session can only be used when confirm=true.", param="off_session")
    redirects = _allows_redirects(params)
    method_id = string(params, "payment_method")
    # Without confirm, only a named method is validated; the default source is taken at
    # confirmation.
    source = None
    if method_id is not None or confirm:
        source = source_to_charge(store, customer, method_id, "payment_method")
        if source is None:
            raise _missing_payment_method()
    if source is not None:
        check_currency(source, money)
    intent = PaymentIntent(
        *store.identity("pi"),
        amount=value,
        currency=money,
        customer=customer_id,
        payment_method=None,
        metadata=metadata(params),
        description=string(params, "description"),
        status="requires_payment_method",
        allows_redirects=redirects,
    )
    if confirm:
        _check_return_url(intent, params)
    store.payment_intents.add(intent)
    if customer_id is not None:
        store.payment_intents.index_customer(intent, customer_id)
    if source is not None:
        method = source.materialise(store)
        intent.payment_method = method.id
        intent.status = "requires_confirmation"
        if confirm:
            _confirm_intent(call, intent, method, off_session)
    return intent.to_api()


def _confirm(call: Call) -> JSON:
    params, store = call.params, call.store
    check_known(params, _CONFIRM)
    intent = store.payment_intents.get(call.path["id"])
    if intent.status not in _CONFIRMABLE:
        raise invalid(
            f"You cannot confirm this PaymentIntent because it has a status of {intent.status}.",
            code="payment_intent_unexpected_state",
        )
    _check_return_url(intent, params)
    off_session = boolean(params, "off_session")
    customer = store.customers.by_id.get(intent.customer) if intent.customer else None
    method_id = string(params, "payment_method") or intent.payment_method
    source = source_to_charge(store, customer, method_id, "payment_method")
    if source is None:
        error = _missing_payment_method()
        error.error["payment_intent"] = intent.to_api()
        raise error
    check_currency(source, intent.currency)
    _confirm_intent(call, intent, source.materialise(store), off_session)
    return intent.to_api()


def _cancel(call: Call) -> JSON:
    params, store = call.params, call.store
    check_known(params, _CANCEL)
    intent = store.payment_intents.get(call.path["id"])
    reason = string(params, "cancellation_reason")
    if reason is not None and reason not in _CANCELLATION_REASONS:
        raise invalid(
            f"Invalid cancellation_reason: must be one of {', '.join(_CANCELLATION_REASONS)}",
            param="cancellation_reason",
        )
    if intent.status not in _CANCELABLE:
        raise invalid(
            f"You cannot cancel this PaymentIntent because it has a status of {intent.status}."
            f" Only a PaymentIntent with one of the following statuses may be canceled:"
            f" {', '.join(_CANCELABLE)}.",
            code="payment_intent_unexpected_state",
        )
    intent.status = "canceled"
    intent.canceled_at = int(time.time())
    intent.cancellation_reason = reason
    intent.next_action = None
    return intent.to_api()


def _missing_payment_method() -> StripeError:
    """Stripe's answer to a confirm naming no payment method when the customer has no
    default source to take (as reported from Stripe in Automattic/woocommerce-payments#487
    and flutter-stripe/flutter_stripe#1236; those reports name no param)."""
    return invalid(
        "You cannot confirm this PaymentIntent because it's missing a payment method. You can"
        " either update the PaymentIntent with a payment method and then confirm it again, or"
        " confirm it again directly with a payment method.",
        code="payment_intent_unexpected_state",
    )


def _allows_redirects(params: Params) -> bool:
    """Since API version 2023-08-16 an intent that lists no payment method types takes the
    ones the account's Dashboard enables, redirect-based ones among them (as this emulated
    account's are) unless `automatic_payment_methods[allow_redirects]` is `never`. Any type
    listed but a card may redirect."""
    automatic = hash_param(params, "automatic_payment_methods", _AUTOMATIC)
    if automatic:
        enabled = boolean(automatic, "enabled")
        if "enabled" not in automatic:
            raise invalid(
                "Missing required param: automatic_payment_methods[enabled].",
                param="automatic_payment_methods[enabled]",
            )
        redirects = string(automatic, "allow_redirects") or "always"
        if redirects not in ("always", "never"):
            raise invalid(
                f"Invalid automatic_payment_methods[allow_redirects]: must be one of always or"
                f" never, not {redirects}",
                param="automatic_payment_methods[allow_redirects]",
            )
        return enabled and redirects == "always"
    listed = params.get("allowed_payment_method_types")
    if listed is None:
        return True
    if not isinstance(listed, list) or not all(isinstance(t, str) for t in listed):
        raise invalid("Invalid array", param="allowed_payment_method_types")
    return any(t != "card" for t in listed)


def _check_return_url(intent: PaymentIntent, params: Params) -> None:
    """Stripe refuses to confirm such an intent without somewhere to send the customer back
    to, whatever the payment method (even a card that never redirects), before executing."""
    if intent.allows_redirects and string(params, "return_url") is None:
        raise invalid(
            "A `return_url` must be specified because this Payment Intent is configured to"
            " automatically accept the payment methods enabled in the Dashboard, some of which"
            " may require a full page redirect to succeed. If you do not want to accept"
            " redirect-based payment methods, set `automatic_payment_methods[enabled]` to"
            " `true` and `automatic_payment_methods[allow_redirects]` to `never` when creating"
            " Setup Intents and Payment Intents.",
            param="return_url",
        )


def _confirm_intent(
    call: Call, intent: PaymentIntent, method: PaymentMethod, off_session: bool
) -> None:
    """Charge the intent's payment method; on failure the intent is left
    ``requires_payment_method`` and a 402 carrying it is raised (after the state change, so the
    402 is saved for the key). A bank debit leaves it ``processing`` until the debit settles."""
    intent.payment_method = method.id
    outcome = method.instrument.outcome
    if outcome is Outcome.AUTHENTICATION_REQUIRED:
        if not off_session:
            intent.status = "requires_action"
            intent.next_action = {"type": "use_stripe_sdk", "use_stripe_sdk": {}}
            return
        _fail(intent, card_error("authentication_required", "authentication_required", method))
    decline_code = method.instrument.decline_code if outcome is Outcome.DECLINE else None
    charge = record_charge(
        call.store,
        method,
        amount=intent.amount,
        currency=intent.currency,
        customer=intent.customer,
        payment_intent=intent.id,
        metadata=intent.metadata,
        description=intent.description,
        idempotency_key=call.idempotency_key,
        decline_code=decline_code,
    )
    intent.latest_charge = charge.id
    if decline_code is not None:
        _fail(intent, declined(charge, decline_code))
    intent.status = "processing" if charge.pending else "succeeded"
    intent.last_payment_error = None
    intent.next_action = None


def _fail(intent: PaymentIntent, error: StripeError) -> None:
    intent.status = "requires_payment_method"
    intent.last_payment_error = dict(error.error)
    error.error["payment_intent"] = intent.to_api()
    raise error


def _retrieve(call: Call) -> JSON:
    check_known(call.params, COMMON)
    return call.store.payment_intents.get(call.path["id"]).to_api()


def _list(call: Call) -> JSON:
    check_known(call.params, _LIST)
    intents = call.store.payment_intents
    customer = string(call.params, "customer")
    records = intents.order if customer is None else intents.by_customer.get(customer, [])
    return list_object(call, intents, records)


# One clause of Stripe's search language: metadata["key"]:"value" or field:"value".
_CLAUSE = re.compile(
    r'\s*(?:metadata\["(?P<key>[^"]*)"\]|(?P<field>customer|status|currency|amount))'
    r'\s*:\s*(?:"(?P<value>[^"]*)"|(?P<number>[0-9]+))\s*'
)
_AND = re.compile(r"AND\b")


def _parse_query(query: str) -> list[tuple[str, str, str]]:
    """``[(field, metadata key, value)]`` joined by AND, or a 400 naming ``query``."""
    clauses = []
    position = 0
    while True:
        match = _CLAUSE.match(query, position)
        if match is None:
            raise invalid(
                f"Invalid search query at character {position}: {query!r}. Supported: "
                'metadata["key"]:"value", customer:, status:, currency:, amount:, joined by AND.',
                param="query",
            )
        value = match["value"] if match["value"] is not None else match["number"]
        clauses.append((match["field"] or "metadata", match["key"] or "", value))
        position = match.end()
        if position == len(query):
            return clauses
        joiner = _AND.match(query, position)
        if joiner is None:
            raise invalid(f"Expected AND at character {position} of {query!r}.", param="query")
        position = joiner.end()


def _matches(intent: PaymentIntent, clauses: list[tuple[str, str, str]]) -> bool:
    for field, key, value in clauses:
        actual = intent.metadata.get(key) if field == "metadata" else getattr(intent, field)
        if str(actual) != value:
            return False
    return True


def _search(call: Call) -> JSON:
    """Newest first; ``next_page`` is the ``seq`` of the last result (an opaque token)."""
    params = call.params
    check_known(params, _SEARCH)
    clauses = _parse_query(require(string(params, "query"), "query"))
    size = limit(params)
    order = call.store.payment_intents.order
    before = integer(params, "page", minimum=0)
    end = len(order) if before is None else bisect.bisect_left(order, before, key=seq_of)
    found: list[PaymentIntent] = []
    for index in range(end - 1, -1, -1):
        intent = order[index]
        if _matches(intent, clauses):
            found.append(intent)
            if len(found) > size:
                break
    has_more = len(found) > size
    page = found[:size]
    return {
        "object": "search_result",
        "data": [intent.to_api() for intent in page],
        "has_more": has_more,
        "next_page": str(page[-1].seq) if has_more else None,
        "url": call.url,
    }


ROUTES = [
    Route("POST", "/v1/payment_intents", _create, moves_money=True),
    Route("GET", "/v1/payment_intents", _list),
    Route("GET", "/v1/payment_intents/search", _search),
    Route("GET", "/v1/payment_intents/{id}", _retrieve),
    Route("POST", "/v1/payment_intents/{id}/confirm", _confirm, moves_money=True),
    Route("POST", "/v1/payment_intents/{id}/cancel", _cancel),
]

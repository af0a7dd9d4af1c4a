"""The one place where Stripe's errors become Temporal failures, retryable or not.

A retry can change nothing about a decline, a refused key or mismatched parameters, so those
are non-retryable and carry a ChargeFailure the workflow records. Everything else (network,
5xx, 409 key in use, 429) is retried by Temporal with the same idempotency key.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

import stripe
from temporalio.exceptions import ApplicationError

from billing.ledger.sql import LOOKUP_REFUSED
from billing.models import (
    SPEND_CAP_EXCEEDED_CODE,
    VAULT_KEY_EXPIRED_CODE,
    VAULT_KEY_REVOKED_CODE,
    ChargeFailure,
)
from billing.redact import redact
from billing.stripe_client import error_code

# What the worker records when Stripe (or the vault) does not know the URL it called: a base
# URL set wrong, not anything of the customer's.
UNRECOGNIZED_URL_CODE = "unrecognized_request_url"
# The vault's own answer to a path it does not forward (vault/proxy.py): the worker's paths are
# fixed, so only a BILLING_VAULT_URL set wrong (say, ending in /stripe) brings it.
VAULT_URL_INVALID_CODE = "url_invalid"

# ApplicationError types the workflow tells apart.
DECLINED = "ChargeDeclined"
REFUSED = "ChargeRefused"
# The period's key itself is refused (cap reached, revoked, expired, not allowed), or the
# URL the worker calls is: no charge of the period can pass, so the period pauses for an
# operator instead of failing customers.
SPEND_CAP_EXCEEDED = "SpendCapExceeded"
KEY_REFUSED = "KeyRefused"
PERIOD_BLOCKERS = frozenset({SPEND_CAP_EXCEEDED, KEY_REFUSED})
RETRYABLE = "StripeUnavailable"
# The vault will not replay a key Stripe may have forgotten (first sent 23 hours ago or more).
# The claim is that old too, so each attempt looks it up on Stripe first; one in doubt waits
# for reconciliation to release it (10 minutes past the vault's upstream timeout at the
# soonest).
KEY_EXPIRED_CODE = "idempotency_key_expired"
# For a wait that a retry now cannot shorten: the key past the vault's window, above, or a 500
# Stripe saved for the key, which it replays until it forgets the key. Shorter than a round of
# the bill's retries (BILL_ROUND), which a longer wait would only time out.
SLOW_RETRY = timedelta(minutes=4)
# A PaymentIntent someone cancelled on Stripe before any attempt of it failed: not a decline.
CANCELED_INTENT = "payment_intent_canceled"
# A PaymentIntent waits for its customer to act on Stripe (off session: a bank account's
# microdeposits to verify, say): they may still pay it, so it is no answer yet, but no retry
# soon changes that. Looked up every SLOW_RETRY, not at the retry policy's pace.
WAITING_ON_CUSTOMER = "payment_intent_waiting_on_customer"
# The vault fenced this attempt off: a later attempt of the claim was refused on the cap
# (billing.ledger.reopen_refused_charge), or met a 500 Stripe saved for the key
# (activities/charging.py). Nothing was sent; the retry takes the gate again.
SUPERSEDED_CODE = "attempt_superseded"


def vault_key_unusable(exc: stripe.StripeError) -> bool:
    """The vault refused the request because the vault key has expired or was revoked."""
    code = error_code(exc)
    return exc.http_status == 401 and code in (VAULT_KEY_EXPIRED_CODE, VAULT_KEY_REVOKED_CODE)


def _error_body(exc: stripe.StripeError) -> dict[str, object]:
    body = exc.json_body
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def _id_of(value: object) -> str | None:
    if isinstance(value, dict):
        found = value.get("id")
        return found if isinstance(found, str) else None
    return value if isinstance(value, str) else None


def fence_of(exc: stripe.StripeError) -> int | None:
    """The fence the vault says a cap refusal left for the request's Idempotency-Key (see
    billing.ledger.reopen_refused_charge); None if it left none."""
    fence = _error_body(exc).get("fenced_below")
    return fence if isinstance(fence, int) else None


def failure_from(exc: stripe.StripeError, default_code: str) -> ChargeFailure:
    error = _error_body(exc)
    code = error_code(exc) or default_code
    decline = error.get("decline_code")
    return ChargeFailure(
        code=str(code),
        decline_code=str(decline) if decline else None,
        message=redact(str(exc.user_message or default_code)),
        payment_intent_id=_id_of(error.get("payment_intent")),
        charge_id=_id_of(error.get("charge")),
    )


def _non_retryable(kind: str, failure: ChargeFailure) -> ApplicationError:
    return ApplicationError(
        f"{failure.code}: {failure.message}", failure, type=kind, non_retryable=True
    )


def declined(failure: ChargeFailure) -> ApplicationError:
    return _non_retryable(DECLINED, failure)


def _key_refused(exc: stripe.StripeError, key: str, then: str) -> ChargeFailure:
    # Stripe's own message can quote part of the key: say what to check instead.
    code = error_code(exc)
    if code == VAULT_KEY_EXPIRED_CODE:
        return ChargeFailure(code=code, message=f"{key} has expired ({then})")
    if code == VAULT_KEY_REVOKED_CODE:
        return ChargeFailure(code=code, message=f"{key} was revoked, the kill switch ({then})")
    return ChargeFailure(
        code="authentication_failed",
        message="the Stripe or vault key was refused (unknown, expired or revoked)",
    )


def _unrecognized_url(exc: stripe.StripeError, then: str) -> ChargeFailure:
    return ChargeFailure(
        code=UNRECOGNIZED_URL_CODE,
        message=f"Stripe does not know the URL called ({redact(str(exc.user_message))}): check"
        " the workers' STRIPE_API_BASE or BILLING_VAULT_URL, or the vault's"
        f" VAULT_UPSTREAM_STRIPE_BASE, {then}",
    )


def _is_unrecognized_url(exc: stripe.StripeError) -> bool:
    # A missing object comes with resource_missing; no code is Stripe's "Unrecognized request
    # URL" (or the vault's for a route it has not), url_invalid the vault's for a path it
    # does not forward: each executed nothing and says nothing of this customer.
    return (
        isinstance(exc, stripe.InvalidRequestError)
        and exc.http_status == 404
        and error_code(exc) in (None, VAULT_URL_INVALID_CODE)
    )


def misdirected(exc: ApplicationError) -> bool:
    """Whether `exc`, raised in this process (its detail a ChargeFailure, not yet the
    mapping Temporal makes of it), says Stripe (or the vault) does not know the URL called:
    a base set wrong, which no retry and no later run gets past until a person sets it."""
    return any(
        isinstance(d, ChargeFailure) and d.code == UNRECOGNIZED_URL_CODE for d in exc.details
    )


def reconciliation_failure(exc: stripe.StripeError) -> ApplicationError:
    """As to_temporal_failure, for a reconciliation's read of Stripe: there is no run to
    resume at a URL Stripe does not know, and what it read for (a charge, a vault
    reservation's) is still unknown."""
    if _is_unrecognized_url(exc):
        then = (
            "then reconcile again. Whether the charge it looked for was made is unknown:"
            " settle nothing by hand as failed before it is known"
        )
        return _non_retryable(KEY_REFUSED, _unrecognized_url(exc, then))
    return to_temporal_failure(exc)


def lookup_key_refused(exc: stripe.StripeError) -> ApplicationError:
    """The vault refused a lookup key (billing.period_keys.issue_lookup_key), which only
    reads: a retry issues another, so nothing is for the period's operator."""
    failure = _key_refused(
        exc, "the vault key issued to read the period's charges", "a retry issues another"
    )
    return ApplicationError(f"{failure.code}: {failure.message}", failure, type=KEY_REFUSED)


def to_temporal_failure(exc: stripe.StripeError) -> ApplicationError:
    """Map one Stripe exception to the failure Temporal acts on. A replayed 5xx is mapped as
    one whose charge a lookup did not find: the caller looks first (activities.charging)."""
    if isinstance(exc, stripe.CardError):
        failure = failure_from(exc, "card_declined")
        if failure.code == SPEND_CAP_EXCEEDED_CODE:
            return _non_retryable(SPEND_CAP_EXCEEDED, failure)
        return declined(failure)
    if isinstance(exc, stripe.RateLimitError):
        # On the bill's retry policy, backing off as Stripe asks: the limit is the account's,
        # which its other traffic (checkout) shares, and a retry each second from every
        # charge in flight would keep it exceeded. A lock_timeout comes as a 429 too.
        return ApplicationError(
            "Stripe rate limit reached; retrying with the same idempotency key, backing off",
            type=RETRYABLE,
        )
    if isinstance(exc, stripe.AuthenticationError):
        failure = _key_refused(
            exc, "the period's vault key", "python starter.py status names what to do"
        )
        return _non_retryable(KEY_REFUSED, failure)
    if isinstance(exc, stripe.PermissionError):
        return _non_retryable(KEY_REFUSED, failure_from(exc, "permission_denied"))
    if isinstance(exc, stripe.IdempotencyError):
        # The lookup before this found no charge. Waiting for Stripe to forget the key would
        # hold the claim past a pause, cancel or skip for a day, then charge afresh: final.
        return _non_retryable(REFUSED, failure_from(exc, "idempotency_error"))
    if _is_unrecognized_url(exc):
        return _non_retryable(
            KEY_REFUSED, _unrecognized_url(exc, "then resume; nothing was charged")
        )
    if isinstance(exc, stripe.InvalidRequestError):
        return _non_retryable(REFUSED, failure_from(exc, "invalid_request"))
    if error_code(exc) == SUPERSEDED_CODE:
        return ApplicationError(
            "the vault refused this attempt: a later attempt of the charge fenced it off since;"
            " retrying with a new fencing token",
            type=RETRYABLE,
        )
    if error_code(exc) == WAITING_ON_CUSTOMER:
        return ApplicationError(
            f"{exc.user_message}; looked up again every"
            f" {SLOW_RETRY.total_seconds() / 60:.0f} minutes until it ends. To stop waiting,"
            " cancel the intent on Stripe (for a reason other than abandoned): the customer"
            f" is then recorded failed ({CANCELED_INTENT})",
            type=RETRYABLE,
            next_retry_delay=SLOW_RETRY,
        )
    if error_code(exc) == KEY_EXPIRED_CODE:
        return ApplicationError(
            f"{KEY_EXPIRED_CODE}: {redact(str(exc.user_message))}",
            type=RETRYABLE,
            next_retry_delay=SLOW_RETRY,
        )
    status = exc.http_status or "no response"
    if replays_saved_error(exc):
        # Stripe began the request, failed and saved the failure for the key; the lookup
        # before this found no charge. Each retry replays the same 500 until Stripe forgets
        # the key and executes it afresh: retried seldom, each retry looking the charge up.
        return ApplicationError(
            f"Stripe replays the {status} it saved for this charge's idempotency key, and"
            " shows no charge made with it: retried every"
            f" {SLOW_RETRY.total_seconds() / 60:.0f} minutes, each time looking for the"
            " charge; Stripe executes the request afresh once it forgets the key, 24 hours"
            " after its first request",
            type=RETRYABLE,
            next_retry_delay=SLOW_RETRY,
        )
    # APIConnectionError, 5xx, 409 idempotency_key_in_use: the outcome is unknown or pending,
    # and a retry with the same key either replays the first result or executes once.
    return ApplicationError(
        f"Stripe did not answer definitively ({status}): {redact(str(exc.user_message))}",
        type=RETRYABLE,
    )


def lookup_failure(exc: stripe.StripeError) -> ApplicationError:
    """The failure of a lookup that was to say whether a charge with the key exists (after
    a replayed 500 or an idempotency error, or before an old claim's create). A refusal of
    the lookup itself (Stripe's "No such customer" once the Stripe customer is deleted, a
    parameter refused) says nothing of that charge, and no retry changes it: recorded as the
    customer's failure, so that the run can end (retried, the claim would hold it for ever,
    past any skip or cancel), under LOOKUP_REFUSED, saying a charge may exist."""
    failure = to_temporal_failure(exc)
    if failure.type not in (DECLINED, REFUSED):
        return failure
    refused = failure.details[0]
    assert isinstance(refused, ChargeFailure)
    return _non_retryable(
        REFUSED,
        ChargeFailure(
            code=LOOKUP_REFUSED,
            message=f"the lookup of a charge this key may have made was refused ({refused.code}:"
            f" {refused.message}): recorded failed, though the charge may exist; check the"
            " customer's payments on Stripe before billing them again",
        ),
    )


def replays_saved_error(exc: stripe.StripeError) -> bool:
    """Stripe answered with an error it saved for the key: it began the request and failed,
    and gives every request with the key the same answer until it forgets the key. A 5xx, or
    another status the SDK has no class for (a 424, External Dependency Failed): Stripe saves
    every answer of a request it began, whatever it was."""
    return is_replayed(exc) and isinstance(exc, stripe.APIError)


def is_replayed(exc: stripe.StripeError) -> bool:
    """Stripe replayed a saved response for this key (e.g. a 500 after the charge committed)."""
    return said_replayed(exc.headers)


def said_replayed(headers: Mapping[str, str] | None) -> bool:
    """A response's headers say Stripe answered from what it saved with the key, executing
    nothing."""
    return any(
        name.lower() == "idempotent-replayed" and str(value).lower() == "true"
        for name, value in (headers or {}).items()
    )

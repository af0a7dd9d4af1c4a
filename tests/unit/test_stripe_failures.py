"""activities.stripe_failures: which Stripe answers Temporal retries, and how soon."""

from __future__ import annotations

from datetime import timedelta

import pytest
import stripe

from activities.stripe_failures import (
    DECLINED,
    KEY_REFUSED,
    REFUSED,
    RETRYABLE,
    SLOW_RETRY,
    SPEND_CAP_EXCEEDED,
    UNRECOGNIZED_URL_CODE,
    WAITING_ON_CUSTOMER,
    fence_of,
    lookup_failure,
    lookup_key_refused,
    misdirected,
    reconciliation_failure,
    replays_saved_error,
    said_replayed,
    to_temporal_failure,
    vault_key_unusable,
)
from billing.ledger.sql import LOOKUP_REFUSED
from billing.models import SPEND_CAP_EXCEEDED_CODE
from workflows.customer_charge import BILL_ROUND


def _error(cls: type[stripe.StripeError], status: int, **error: str) -> stripe.StripeError:
    return cls(error.get("message", "refused"), http_status=status, json_body={"error": error})


def test_a_key_past_stripes_window_is_retried_slowly_within_a_round() -> None:
    failure = to_temporal_failure(
        _error(stripe.APIError, 409, code="idempotency_key_expired", type="invalid_request_error")
    )
    assert (failure.type, failure.non_retryable) == (RETRYABLE, False)
    assert failure.next_retry_delay == SLOW_RETRY
    assert timedelta(minutes=1) <= SLOW_RETRY < BILL_ROUND


def test_an_intent_waiting_on_the_customer_is_looked_up_slowly_and_says_how_to_stop() -> None:
    waiting = stripe.APIError(
        "payment intent pi_1 waits for the customer to act on Stripe (verify_with_microdeposits)",
        http_status=503,
        code=WAITING_ON_CUSTOMER,
    )
    failure = to_temporal_failure(waiting)
    assert (failure.type, failure.non_retryable) == (RETRYABLE, False)
    assert failure.next_retry_delay == SLOW_RETRY
    assert failure.message.startswith("payment intent pi_1 waits for the customer")
    assert "cancel the intent on Stripe" in failure.message


@pytest.mark.parametrize("status", [500, 424])
@pytest.mark.parametrize("replayed", [True, False])
def test_an_error_stripe_saved_for_the_key_is_retried_slowly(replayed: bool, status: int) -> None:
    """Replayed, it says the same until Stripe forgets the key: looked up and retried seldom
    (a 424, External Dependency Failed, as a 500: Stripe saves whatever a request it began
    answered). A first one may be gone on the next try: retried at the policy's pace."""
    error = stripe.APIError(
        "An unknown error occurred",
        http_status=status,
        json_body={"error": {"type": "api_error"}},
        headers={"Idempotent-Replayed": "true"} if replayed else {},
    )
    assert replays_saved_error(error) == replayed
    failure = to_temporal_failure(error)
    assert (failure.type, failure.non_retryable) == (RETRYABLE, False)
    assert failure.next_retry_delay == (SLOW_RETRY if replayed else None)
    assert ("saved for this charge's idempotency key" in failure.message) == replayed


@pytest.mark.parametrize("code", ["rate_limit", "lock_timeout"])
def test_a_429_backs_off_on_the_retry_policy(code: str) -> None:
    """Stripe asks for exponential backoff on a 429; a fixed delay would replace the bill's
    retry policy on every attempt, and keep the account's limit exceeded."""
    failure = to_temporal_failure(
        _error(stripe.RateLimitError, 429, code=code, type="invalid_request_error")
    )
    assert (failure.type, failure.non_retryable, failure.next_retry_delay) == (
        RETRYABLE,
        False,
        None,
    )


@pytest.mark.parametrize("code", [None, "idempotency_key_reused"], ids=["stripe", "vault"])
def test_a_key_held_for_other_parameters_is_final(code: str | None) -> None:
    """Stripe's (a request of an earlier release, with other parameters) or the vault's: the
    lookup before found no charge, and waiting a day for Stripe to forget the key would hold
    the claim past a cancel or skip, then charge it afresh."""
    error = {"type": "idempotency_error"} | ({"code": code} if code else {})
    failure = to_temporal_failure(_error(stripe.IdempotencyError, 400, **error))
    assert (failure.type, failure.non_retryable) == (REFUSED, True)


def test_a_key_in_use_is_retried_at_the_policys_pace() -> None:
    failure = to_temporal_failure(
        _error(stripe.APIError, 409, code="idempotency_key_in_use", type="invalid_request_error")
    )
    assert (failure.type, failure.non_retryable, failure.next_retry_delay) == (
        RETRYABLE,
        False,
        None,
    )


def test_an_attempt_the_vault_fenced_off_is_retried_and_says_why() -> None:
    """Nothing of it was sent: the retry takes the gate again, with a new fencing token."""
    failure = to_temporal_failure(
        _error(stripe.APIError, 409, code="attempt_superseded", message="fenced")
    )
    assert (failure.type, failure.non_retryable, failure.next_retry_delay) == (
        RETRYABLE,
        False,
        None,
    )
    assert "fenced it off since" in failure.message
    assert "did not answer definitively" not in failure.message


def test_declines_and_refused_keys_are_final() -> None:
    body = {"error": {"code": "card_declined", "message": "declined"}}
    declined = to_temporal_failure(
        stripe.CardError(  # type: ignore[no-untyped-call]
            "declined", None, "card_declined", http_status=402, json_body=body
        )
    )
    refused = to_temporal_failure(_error(stripe.AuthenticationError, 401))
    assert (declined.type, declined.non_retryable) == (DECLINED, True)
    assert (refused.type, refused.non_retryable) == (KEY_REFUSED, True)


@pytest.mark.parametrize(
    ("code", "said"),
    [
        ("vault_key_expired", "the period's vault key has expired"),
        ("vault_key_revoked", "the period's vault key was revoked, the kill switch"),
    ],
)
def test_a_vault_key_expired_or_revoked_says_where_to_learn_what_to_do(
    code: str, said: str
) -> None:
    # A resume would only pause the run again: `status` names what mends it, with the period.
    failure = to_temporal_failure(_error(stripe.AuthenticationError, 401, code=code, message=code))
    assert (failure.type, failure.non_retryable) == (KEY_REFUSED, True)
    assert failure.message.startswith(f"{code}: {said}")
    assert "python starter.py status names what to do" in failure.message


def test_a_key_forbidden_an_endpoint_stops_the_period_for_an_operator() -> None:
    """A 403 (the vault's endpoint allowlist, a restricted key missing a permission) is the
    key's matter, not the customer's: not recorded as each customer failing for good."""
    failure = to_temporal_failure(
        _error(stripe.PermissionError, 403, code="endpoint_not_allowed", message="not allowed")
    )
    assert (failure.type, failure.non_retryable) == (KEY_REFUSED, True)
    assert failure.details[0].code == "endpoint_not_allowed"


def test_a_request_stripe_refuses_is_final_and_keeps_its_code() -> None:
    body = {"error": {"code": "resource_missing", "message": "No such customer"}}
    failure = to_temporal_failure(
        stripe.InvalidRequestError(  # type: ignore[no-untyped-call]
            "No such customer", "customer", "resource_missing", http_status=400, json_body=body
        )
    )
    assert (failure.type, failure.non_retryable) == (REFUSED, True)
    assert failure.details[0].code == "resource_missing"


def test_a_url_stripe_does_not_know_stops_the_period_not_the_customer() -> None:
    """Stripe's 404 with no code is its "Unrecognized request URL" (a base URL set wrong):
    recorded as each customer's failure, it failed the whole period for good."""
    message = "Unrecognized request URL (POST: /v1/v1/payment_intents)."
    body = {"error": {"message": message, "type": "invalid_request_error"}}
    failure = to_temporal_failure(
        stripe.InvalidRequestError(  # type: ignore[no-untyped-call]
            message, None, http_status=404, json_body=body
        )
    )
    assert (failure.type, failure.non_retryable) == (KEY_REFUSED, True)
    assert failure.details[0].code == UNRECOGNIZED_URL_CODE
    assert "STRIPE_API_BASE" in failure.details[0].message
    assert misdirected(failure)
    # Met by a reconciliation's read, it has no run to resume, and what it looked for
    # (a vault reservation's charge, say) is still unknown: not "nothing was charged".
    read = reconciliation_failure(
        stripe.InvalidRequestError(  # type: ignore[no-untyped-call]
            message, None, http_status=404, json_body=body
        )
    )
    assert (read.type, read.non_retryable, misdirected(read)) == (KEY_REFUSED, True, True)
    assert "then reconcile again" in read.message and "settle nothing by hand" in read.message
    assert "resume" not in read.message and "nothing was charged" not in read.message
    # An object that is not there is the request's matter, as before.
    body = {"error": {"code": "resource_missing", "message": "No such payment_intent"}}
    missing = stripe.InvalidRequestError(  # type: ignore[no-untyped-call]
        "No such payment_intent", "intent", "resource_missing", http_status=404, json_body=body
    )
    assert to_temporal_failure(missing).type == REFUSED
    assert reconciliation_failure(missing).type == REFUSED


def test_the_vault_cap_refusal_is_its_own_failure_not_a_decline() -> None:
    body = {"error": {"code": SPEND_CAP_EXCEEDED_CODE, "message": "cap"}}
    failure = to_temporal_failure(
        stripe.CardError(  # type: ignore[no-untyped-call]
            "cap", None, SPEND_CAP_EXCEEDED_CODE, http_status=402, json_body=body
        )
    )
    assert (failure.type, failure.non_retryable) == (SPEND_CAP_EXCEEDED, True)


def test_a_decline_keeps_the_issuers_reason_and_stripes_objects() -> None:
    """`failures` groups by the decline code, and support finds the failed intent by id."""
    body = {
        "error": {
            "code": "card_declined",
            "decline_code": "insufficient_funds",
            "message": "Your card has insufficient funds.",
            "payment_intent": {"id": "pi_1", "object": "payment_intent"},
            "charge": "ch_1",
        }
    }
    failure = to_temporal_failure(
        stripe.CardError(  # type: ignore[no-untyped-call]
            "declined", None, "card_declined", http_status=402, json_body=body
        )
    )
    found = failure.details[0]
    assert (found.code, found.decline_code, found.payment_intent_id, found.charge_id) == (
        "card_declined",
        "insufficient_funds",
        "pi_1",
        "ch_1",
    )


@pytest.mark.parametrize(("header", "replayed"), [("true", True), ("false", False)])
def test_only_stripes_true_says_a_response_was_replayed(header: str, replayed: bool) -> None:
    error = stripe.APIError(
        "An unknown error occurred",
        http_status=500,
        json_body={"error": {"type": "api_error"}},
        headers={"Idempotent-Replayed": header},
    )
    assert replays_saved_error(error) is replayed


@pytest.mark.parametrize(
    "headers",
    [
        {"Idempotent-Replayed": "true"},
        {"idempotent-replayed": "true"},
        {"IDEMPOTENT-REPLAYED": "True"},
    ],
)
def test_a_replay_is_told_whatever_the_case_of_its_header(headers: dict[str, str]) -> None:
    """HTTP/2, and proxies such as the vault, may send header names in lowercase."""
    assert said_replayed(headers)
    assert not said_replayed({"Idempotent-Replayed": "false"})
    assert not said_replayed(None)


def test_only_a_replayed_5xx_is_an_error_stripe_saved() -> None:
    """A replayed decline or refusal is that answer again: looked up as a saved 500 it would
    let a cancel or skip meanwhile pass for a decline Stripe already gave."""
    replayed = {"Idempotent-Replayed": "true"}
    body = {"error": {"code": "card_declined"}}
    decline = stripe.CardError(  # type: ignore[no-untyped-call]
        "declined", None, "card_declined", http_status=402, json_body=body, headers=replayed
    )
    refusal = stripe.InvalidRequestError(  # type: ignore[no-untyped-call]
        "No such customer", "customer", http_status=400, json_body=body, headers=replayed
    )
    assert not replays_saved_error(decline)
    assert not replays_saved_error(refusal)


@pytest.mark.parametrize(
    ("cls", "status", "code", "unusable"),
    [
        (stripe.AuthenticationError, 401, "vault_key_expired", True),
        (stripe.AuthenticationError, 401, "vault_key_revoked", True),
        # Stripe's own refusal of a key, and a key refused an endpoint: not the vault's expiry.
        (stripe.AuthenticationError, 401, None, False),
        (stripe.PermissionError, 403, "endpoint_not_allowed", False),
    ],
)
def test_a_vault_key_is_unusable_only_when_the_vault_says_it_expired_or_was_revoked(
    cls: type[stripe.StripeError], status: int, code: str | None, unusable: bool
) -> None:
    error = _error(cls, status, **({"code": code} if code else {}))
    assert vault_key_unusable(error) is unusable


def test_the_fence_a_cap_refusal_left_is_read_only_as_a_number() -> None:
    def refusal(**extra: object) -> stripe.StripeError:
        body = {"error": {"code": SPEND_CAP_EXCEEDED_CODE, **extra}}
        return stripe.CardError(  # type: ignore[no-untyped-call]
            "cap", None, SPEND_CAP_EXCEEDED_CODE, http_status=402, json_body=body
        )

    assert fence_of(refusal(fenced_below=7)) == 7
    assert fence_of(refusal()) is None
    assert fence_of(refusal(fenced_below="7")) is None


@pytest.mark.parametrize(
    "refused",
    [
        stripe.InvalidRequestError(  # type: ignore[no-untyped-call]
            "No such customer",
            "customer",
            "resource_missing",
            http_status=400,
            json_body={"error": {"code": "resource_missing", "message": "No such customer"}},
        ),
        stripe.CardError(  # type: ignore[no-untyped-call]
            "declined",
            None,
            "card_declined",
            http_status=402,
            json_body={"error": {"code": "card_declined"}},
        ),
    ],
    ids=["refused", "declined"],
)
def test_a_refused_lookup_is_final_and_says_a_charge_may_exist(
    refused: stripe.StripeError,
) -> None:
    """Recorded failed, the customer may be billed again by hand: the record must say that the
    charge the lookup was for may have been made."""
    failure = lookup_failure(refused)
    assert (failure.type, failure.non_retryable) == (REFUSED, True)
    assert failure.details[0].code == LOOKUP_REFUSED
    assert "the charge may exist" in failure.details[0].message


def test_a_lookup_stripe_could_not_answer_is_retried_as_any_other() -> None:
    failure = lookup_failure(_error(stripe.RateLimitError, 429, code="rate_limit"))
    assert (failure.type, failure.non_retryable) == (RETRYABLE, False)


@pytest.mark.parametrize("code", ["vault_key_expired", "vault_key_revoked", None])
def test_a_refused_lookup_key_is_retried_with_another(code: str | None) -> None:
    """A lookup key only reads: the retry issues a new one, so nothing is for an operator."""
    failure = lookup_key_refused(
        _error(stripe.AuthenticationError, 401, **({"code": code} if code else {}))
    )
    assert (failure.type, failure.non_retryable) == (KEY_REFUSED, False)
    assert not misdirected(failure)
    if code:
        assert "a retry issues another" in failure.message


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [(404, "url_invalid", KEY_REFUSED), (400, None, REFUSED)],
    ids=["vault-path-not-forwarded", "stripe-400-without-code"],
)
def test_only_a_404_naming_no_object_says_the_url_called_is_set_wrong(
    status: int, code: str | None, kind: str
) -> None:
    """The vault's url_invalid comes only from a BILLING_VAULT_URL set wrong: recorded as each
    customer's failure, it failed the whole period for good. A 400, code or none, is Stripe
    refusing this customer's request: pausing the period would only hold it for an operator."""
    body = {"error": {"message": "refused", "type": "invalid_request_error"}}
    if code:
        body["error"]["code"] = code
    failure = to_temporal_failure(
        stripe.InvalidRequestError(  # type: ignore[no-untyped-call]
            "refused", None, code, http_status=status, json_body=body
        )
    )
    assert (failure.type, failure.non_retryable) == (kind, True)
    assert misdirected(failure) == (kind == KEY_REFUSED)


@pytest.mark.parametrize(
    ("cls", "status", "code"),
    [
        (stripe.AuthenticationError, 401, "vault_key_revoked"),
        (stripe.PermissionError, 403, "endpoint_not_allowed"),
    ],
)
def test_a_lookup_the_periods_key_may_not_make_stops_the_period_not_the_customer(
    cls: type[stripe.StripeError], status: int, code: str
) -> None:
    """A refused key is the period's matter, as on a create: recorded as the customer's
    failure (a charge may exist), a revoked key would fail every customer left to look up for
    good, where the period should pause for an operator to renew the key."""
    failure = lookup_failure(_error(cls, status, code=code))
    assert (failure.type, failure.non_retryable) == (KEY_REFUSED, True)
    assert failure.details[0].code == code


# Shaped as a live secret key, as Stripe may quote one back in an error's message.
QUOTED_KEY = "sk_" + "live_" + "51HxQz2eZvKYlo2C0aB1cD2eF3gH4iJ5"


@pytest.mark.parametrize(
    "error",
    [
        stripe.CardError(  # type: ignore[no-untyped-call]
            f"declined for {QUOTED_KEY}", None, "card_declined", http_status=402
        ),
        stripe.APIError(f"no answer for {QUOTED_KEY}", http_status=500),
        _error(stripe.APIError, 409, code="idempotency_key_expired", message=QUOTED_KEY),
        stripe.InvalidRequestError(  # type: ignore[no-untyped-call]
            f"Unrecognized request URL (POST: /v1/{QUOTED_KEY})", None, http_status=404
        ),
        _error(stripe.AuthenticationError, 401, message=f"Invalid API Key provided: {QUOTED_KEY}"),
    ],
    ids=["decline", "5xx", "key-expired", "unknown-url", "key-refused"],
)
def test_no_failure_repeats_a_key_stripe_quoted(error: stripe.StripeError) -> None:
    """I5: the failure is kept in workflow history, the ledger and the logs, which people
    read; Stripe's own message can quote the key the request carried."""
    failure = to_temporal_failure(error)
    said = [failure.message, *(str(detail) for detail in failure.details)]
    assert not [text for text in said if QUOTED_KEY in text]


@pytest.mark.parametrize("replayed", [True, False], ids=["replayed", "first"])
def test_a_decline_stripe_replays_is_as_final_as_the_first(replayed: bool) -> None:
    """A retry after a lost answer meets the decline Stripe saved for the key: retried, it
    would hold the claim a day, past a cancel or skip, then send the card again once Stripe
    forgets the key."""
    body = {"error": {"code": "card_declined", "decline_code": "generic_decline"}}
    decline = stripe.CardError(  # type: ignore[no-untyped-call]
        "declined",
        None,
        "card_declined",
        http_status=402,
        json_body=body,
        headers={"Idempotent-Replayed": "true"} if replayed else {},
    )
    failure = to_temporal_failure(decline)
    assert (failure.type, failure.non_retryable) == (DECLINED, True)
    assert failure.details[0].decline_code == "generic_decline"

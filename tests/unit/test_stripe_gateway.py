"""`StripeGateway.find`, and `charge` settling on it, for states the emulator makes rarely or
not at all (Stripe leaves a PaymentIntent unconfirmed after an error, or waiting on a step):
Stripe's answers are stood in for here."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import stripe

from activities import stripe_gateway
from activities.stripe_failures import CANCELED_INTENT, WAITING_ON_CUSTOMER
from activities.stripe_gateway import STALLED_AFTER_SECONDS, NoAnswerYet, StripeGateway
from billing.ledger import SENT_DIRECT
from billing.models import ChargeFailure, ChargeResult
from billing.reconciliation import INCOMPLETE_INTENT, left_unknown_because
from tests.unit.claims import CLAIM as LEDGER_CLAIM
from vault.endpoints import CHARGE_IN_FLIGHT, FENCE_HEADER, NOT_IN_DOUBT, UPSTREAM_REFUSED

CLAIM = LEDGER_CLAIM.model_copy(update={"charge_api": "charges"})


def answered(replayed: bool) -> stripe.StripeResponse:
    """The response a create got: `replayed` from what Stripe saved with the key."""
    return stripe.StripeResponse("{}", 200, {"Idempotent-Replayed": "true"} if replayed else {})


def charge(status: str, *, replayed: bool = False, **extra: Any) -> stripe.Charge:
    return stripe.Charge.construct_from(
        {
            "id": f"ch_{status}",
            "object": "charge",
            "status": status,
            "amount": CLAIM.amount_cents,
            "currency": "usd",
            "payment_intent": None,
            "created": int(CLAIM.claimed_at.timestamp()) + 5,
            "metadata": {"billing_key": CLAIM.idempotency_key},
            **extra,
        },
        "sk_test_unit",
        last_response=answered(replayed),
    )


def intent(
    status: str, created: int, *, replayed: bool = False, **extra: Any
) -> stripe.PaymentIntent:
    """An intent as listed, or as a create answered it."""
    return stripe.PaymentIntent.construct_from(
        {
            "id": f"pi_{status}",
            "object": "payment_intent",
            "status": status,
            "latest_charge": None,
            "last_payment_error": None,
            "amount": CLAIM.amount_cents,
            "currency": "usd",
            "created": created,
            "metadata": {"billing_key": CLAIM.idempotency_key},
            **extra,
        },
        "sk_test_unit",
        last_response=answered(replayed),
    )


@dataclass
class Listing:
    """Stands in for the client's `v1.charges.list_async`: one page of the given charges."""

    charges: list[stripe.Charge]
    calls: list[dict[str, Any]] = field(default_factory=list)

    async def __call__(self, params: dict[str, Any]) -> SimpleNamespace:
        self.calls.append(params)
        return SimpleNamespace(data=self.charges, has_more=False)


@dataclass
class Pages:
    """Stands in for `v1.charges.list_async` over many pages, as Stripe pages a customer's
    charges: newest first, `limit` of them after `starting_after`."""

    charges: list[stripe.Charge]
    calls: list[dict[str, Any]] = field(default_factory=list)

    async def __call__(self, params: dict[str, Any]) -> SimpleNamespace:
        self.calls.append(dict(params))
        ids = [listed.id for listed in self.charges]
        start = ids.index(params["starting_after"]) + 1 if "starting_after" in params else 0
        end = start + params["limit"]
        return SimpleNamespace(data=self.charges[start:end], has_more=end < len(self.charges))


def gateway(listing: Listing | Pages) -> StripeGateway:
    client = SimpleNamespace(v1=SimpleNamespace(charges=SimpleNamespace(list_async=listing)))
    return StripeGateway(client, "charges")  # type: ignore[arg-type]


@pytest.mark.parametrize("status", ["succeeded", "pending"])
async def test_a_charge_made_is_found_as_charged_while_pending_too(status: str) -> None:
    listing = Listing([charge(status)])
    found = await gateway(listing).find(CLAIM)
    assert isinstance(found, ChargeResult) and found.charge_id == f"ch_{status}"
    # The worker's `charge` event says which are still to be answered by their bank.
    assert found.pending == (status == "pending")
    # Found, not made by the request at hand: no fresh charge in the worker's event.
    assert found.replayed
    assert listing.calls == [{"customer": "cus_1", "limit": 100}]


@pytest.mark.parametrize(
    ("status", "refunded", "state"),
    [
        ("succeeded", False, "made"),
        ("pending", False, "made"),
        ("succeeded", True, "refunded"),
        ("failed", False, "failed"),
    ],
)
async def test_a_periods_charges_are_listed_with_their_state(
    status: str, refunded: bool, state: str
) -> None:
    # Made under another key (an earlier namespace, a script): a pending one is a charge
    # all the same, which a re-drive must not double, nor the comparison miss. A failed one
    # is listed too: the ledger may hold it as made (a bank debit that failed later).
    listed = charge(status, customer="cus_1", refunded=refunded, failure_code="card_declined")
    listed.metadata.update({"billing_period": CLAIM.period, "customer_id": CLAIM.customer_id})
    [found] = await gateway(Listing([listed])).period_charges("cus_1", CLAIM.period)
    assert (found.charge_id, found.state) == (f"ch_{status}", state)
    assert found.failure_code == ("card_declined" if state == "failed" else None)
    assert found.pending == (status == "pending")


async def test_a_failed_charge_is_found_as_failed_with_stripes_code() -> None:
    failed = charge("failed", failure_code="expired_card", failure_message="expired")
    found = await gateway(Listing([failed])).find(CLAIM)
    assert isinstance(found, ChargeFailure)
    assert (found.code, found.charge_id) == ("expired_card", "ch_failed")


async def test_of_failed_charges_with_the_claims_key_the_latest_is_its_answer() -> None:
    """Sent again once Stripe had forgotten the key, the claim failed twice: Stripe lists the
    latest first, and its reason (the card since replaced, now short of funds) is what a
    person acts on."""
    short = "Your card has insufficient funds."
    latest = charge(
        "failed", id="ch_latest", failure_code="insufficient_funds", failure_message=short
    )
    first = charge("failed", id="ch_first", failure_code="expired_card", failure_message="expired")
    found = await gateway(Listing([latest, first])).find(CLAIM)
    assert isinstance(found, ChargeFailure)
    assert (found.code, found.charge_id, found.message) == (
        "insufficient_funds",
        "ch_latest",
        short,
    )
    # So for PaymentIntents.
    declined = {"code": "card_declined", "decline_code": "insufficient_funds", "message": short}
    expired = {"code": "expired_card", "message": "expired"}
    latest_intent = intent(
        "requires_payment_method", NOW, id="pi_latest", last_payment_error=declined
    )
    first_intent = intent(
        "requires_payment_method", LONG_AGO, id="pi_first", last_payment_error=expired
    )
    found = await intents_gateway(latest_intent, first_intent).find(INTENT_CLAIM)
    assert isinstance(found, ChargeFailure)
    assert (found.decline_code, found.payment_intent_id, found.message) == (
        "insufficient_funds",
        "pi_latest",
        short,
    )


async def test_nothing_with_the_claims_key_is_none() -> None:
    assert await gateway(Listing([])).find(CLAIM) is None


async def test_a_charge_of_the_customer_under_another_key_is_not_the_claims() -> None:
    """Last period's charge carries a billing key too, its own: taken for this claim's, the
    claim would be recorded charged and this period never billed."""
    last_period = charge("succeeded", id="ch_last_period", metadata={"billing_key": "1" * 32})
    assert await gateway(Listing([last_period])).find(CLAIM) is None


async def test_a_claim_of_unrecorded_api_charged_through_the_other_is_found_charged() -> None:
    # Claimed before claims recorded their API: declined through Charges, then charged
    # through PaymentIntents under another setting. The charge made outweighs the failure.
    made = intent("succeeded", int(CLAIM.claimed_at.timestamp()) + 60, latest_charge="ch_by_intent")
    failed = Listing([charge("failed", failure_code="card_declined", failure_message="no")])
    client = SimpleNamespace(
        v1=SimpleNamespace(
            charges=SimpleNamespace(list_async=failed),
            payment_intents=SimpleNamespace(list_async=Listing([made])),  # type: ignore[list-item]
        )
    )
    legacy = CLAIM.model_copy(update={"charge_api": None})
    found = await StripeGateway(client, "charges").find(legacy)  # type: ignore[arg-type]
    assert isinstance(found, ChargeResult) and found.charge_id == "ch_by_intent"
    # Charged through the setting's API, the claim is answered: the other is not listed.
    client.v1.charges.list_async = unlisted
    found = await StripeGateway(client, "payment_intents").find(legacy)  # type: ignore[arg-type]
    assert isinstance(found, ChargeResult) and found.charge_id == "ch_by_intent"


def intents_gateway(
    *listed: stripe.PaymentIntent,
    created: stripe.PaymentIntent | None = None,
    lister: Callable[[dict[str, Any]], Awaitable[Any]] | None = None,
    canceller: Callable[[str, dict[str, Any]], Awaitable[Any]] | None = None,
    may_cancel: bool | None = None,
) -> StripeGateway:
    """A gateway whose listing holds `listed` (or is `lister`), whose create answers
    `created`, as Stripe replays the answer it saved with the key, and whose cancel is
    `canceller` (none by default: a test that cancels says how)."""

    async def create(params: dict[str, Any], options: dict[str, Any]) -> Any:
        return created

    async def not_cancelled(intent_id: str, params: dict[str, Any]) -> Any:
        raise AssertionError(f"{intent_id} was cancelled")

    intents = SimpleNamespace(
        create_async=create,
        list_async=lister or Listing(list(listed)),  # type: ignore[arg-type]
        cancel_async=canceller or not_cancelled,
    )
    client = SimpleNamespace(v1=SimpleNamespace(payment_intents=intents))
    if may_cancel is None:
        # As the worker's gateway to Stripe directly is built: it cancels.
        return StripeGateway(client, "payment_intents")  # type: ignore[arg-type]
    return StripeGateway(client, "payment_intents", may_cancel=may_cancel)  # type: ignore[arg-type]


INTENT_CLAIM = CLAIM.model_copy(update={"charge_api": "payment_intents"})
LONG_AGO = int(time.time()) - STALLED_AFTER_SECONDS - 60


@dataclass
class Account:
    """Stands in for the intents Stripe lists with the claim's key (newest first), and for
    `cancel_async`: it cancels as Stripe does, or raises `refusal`. An intent in `moves_on`
    moves to that status first (Stripe rolled it forward), and the cancel is then refused."""

    intents: list[stripe.PaymentIntent]
    refusal: stripe.StripeError | None = None
    moves_on: dict[str, str] = field(default_factory=dict)
    cancelled: list[str] = field(default_factory=list)

    async def listing(self, params: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(data=list(self.intents), has_more=False)

    async def cancel(self, intent_id: str, params: dict[str, Any]) -> None:
        assert params == {"cancellation_reason": "abandoned"}
        self.cancelled.append(intent_id)
        if intent_id in self.moves_on:
            self._update(intent_id, status=self.moves_on[intent_id], latest_charge="ch_forward")
            raise stripe.InvalidRequestError(  # type: ignore[no-untyped-call]
                "You cannot cancel this PaymentIntent",
                param=None,
                code="payment_intent_unexpected_state",
            )
        if self.refusal is not None:
            raise self.refusal
        self._update(intent_id, status="canceled", cancellation_reason="abandoned", canceled_at=NOW)

    def _update(self, intent_id: str, **changes: Any) -> None:
        for i, listed in enumerate(self.intents):
            if listed.id == intent_id:
                self.intents[i] = intent(
                    changes.pop("status"), listed.created, id=intent_id, **changes
                )

    def gateway(self, may_cancel: bool | None = None) -> StripeGateway:
        return intents_gateway(lister=self.listing, canceller=self.cancel, may_cancel=may_cancel)


NOW = int(time.time())


def stalled(name: str = "stalled", created: int = LONG_AGO) -> stripe.PaymentIntent:
    return intent("requires_confirmation", created, id=f"pi_{name}")


async def test_intents_stripe_left_unconfirmed_are_cancelled_and_the_claim_sent_again() -> None:
    # Stripe answered the create-and-confirm with an error and left the intent unconfirmed
    # (twice, for a key it had forgotten in between): nothing of ours moves it on, and Stripe
    # may still complete it. Cancelled, each charges nothing, and nothing was declined: the
    # claim is as if never sent, to be charged with its key once Stripe forgets the key.
    account = Account([stalled("later"), stalled("first")])
    assert await account.gateway().find(INTENT_CLAIM) is None
    assert account.cancelled == ["pi_later", "pi_first"]
    assert [i.status for i in account.intents] == ["canceled", "canceled"]


def _vault_error(code: str) -> dict[str, object]:
    return {"error": {"code": code, "message": "no", "type": "api_error"}}


@pytest.mark.parametrize(
    "refused",
    [
        stripe.PermissionError("this vault key may not call it", http_status=403),
        stripe.PermissionError("no", http_status=403, json_body=_vault_error(NOT_IN_DOUBT)),
        # As the SDK raises a 502: the code in the body only.
        stripe.APIError("no", http_status=502, json_body=_vault_error(UPSTREAM_REFUSED)),
    ],
    ids=["key-may-not-cancel", "not-in-doubt", "vault-may-not-read"],
)
async def test_an_intent_left_unconfirmed_the_key_may_not_cancel_is_left_to_a_person(
    refused: stripe.StripeError,
) -> None:
    # A period key issued before keys could cancel, an intent the vault does not tie to a
    # charge of the key's period in doubt (none, or one a person settled since: retried for
    # ever before, helper-185), or a vault whose own secret may not read the intent to check
    # it (retried for ever before: helper-184): looked up once more, then failed with advice
    # to a person.
    account = Account([stalled()], refusal=refused)
    found = await account.gateway().find(INTENT_CLAIM)
    assert account.cancelled == ["pi_stalled"]
    assert isinstance(found, ChargeFailure)
    assert (found.code, found.payment_intent_id) == (INCOMPLETE_INTENT, "pi_stalled")
    assert "pi_stalled in requires_confirmation" in found.message
    # Stripe may still complete it: the operator is told to cancel it before billing again.
    assert "cancel it on Stripe" in found.message
    assert left_unknown_because(found) is not None


async def test_a_cancel_the_vault_refuses_while_its_charge_is_sent_again_is_tried_again() -> None:
    # An earlier attempt is sending the charge right now: its reservation is pending, not
    # unknown. Failing the claim for good would leave the customer to a person.
    refused = stripe.APIError(
        "in flight", http_status=409, json_body=_vault_error(CHARGE_IN_FLIGHT)
    )
    account = Account([stalled()], refusal=refused)
    with pytest.raises(
        NoAnswerYet, match="would not cancel payment intent pi_stalled yet"
    ) as raised:
        await account.gateway().find(INTENT_CLAIM)
    assert raised.value.http_status == 503


async def test_an_intent_cancelled_at_two_hours_by_a_worker_clock_ahead_is_abandoned() -> None:
    # The worker's clock ran up to an hour ahead of Stripe's: by Stripe's two times the
    # intent was cancelled before two hours (an hour after it was made, at the earliest),
    # and it is the lookup's cancel all the same.
    early = intent(
        "canceled", LONG_AGO, cancellation_reason="abandoned", canceled_at=LONG_AGO + 3600
    )
    assert await intents_gateway(early).find(INTENT_CLAIM) is None


async def test_a_lookup_key_does_not_try_to_cancel() -> None:
    # It only reads: the vault would refuse the cancel, and audit it as a key reaching past
    # its allowlist.
    account = Account([stalled()])
    found = await account.gateway(may_cancel=False).find(INTENT_CLAIM)
    assert account.cancelled == []
    assert isinstance(found, ChargeFailure) and found.code == INCOMPLETE_INTENT
    # Two left so (the key forgotten in between): the person is told to cancel both, as
    # either may still charge.
    account = Account([stalled("later"), stalled("first")])
    found = await account.gateway(may_cancel=False).find(INTENT_CLAIM)
    assert isinstance(found, ChargeFailure) and found.payment_intent_id == "pi_later"
    assert "payment intents pi_later, pi_first in requires_confirmation" in found.message
    assert "cancel them on Stripe" in found.message


@pytest.mark.parametrize("since", ["succeeded", "requires_confirmation"])
async def test_an_intent_that_moved_on_before_its_cancel_is_looked_up_again(since: str) -> None:
    # Stripe completed it between the listing and the cancel, which it then refuses: the
    # charge made is what happened. Listed unconfirmed still (which a read-after-write
    # consistent listing should not do), it is left to a person, not cancelled in a loop.
    account = Account([stalled()], moves_on={"pi_stalled": since})
    found = await account.gateway().find(INTENT_CLAIM)
    assert account.cancelled == ["pi_stalled"]
    if since == "succeeded":
        assert isinstance(found, ChargeResult) and found.charge_id == "ch_forward"
    else:
        assert isinstance(found, ChargeFailure) and found.code == INCOMPLETE_INTENT


async def test_an_abandoned_intent_is_no_answer_while_another_is_on_its_way() -> None:
    # An older intent with the key (made before Stripe forgot it) may still debit: charging
    # the claim again could charge twice.
    account = Account([intent("requires_action", LONG_AGO - 60, id="pi_waiting"), stalled()])
    account.intents.reverse()  # the stalled one is the newer
    with pytest.raises(stripe.APIError, match="pi_waiting waits for the customer") as raised:
        await account.gateway().find(INTENT_CLAIM)
    assert raised.value.http_status == 503 and account.cancelled == ["pi_stalled"]


@pytest.mark.parametrize(
    "refusal",
    [
        stripe.RateLimitError("Too many requests", http_status=429),
        stripe.APIError("vault could not read it", http_status=503),
        stripe.InvalidRequestError(  # type: ignore[no-untyped-call]
            "No such payment_intent", param=None, code="resource_missing"
        ),
    ],
)
async def test_a_cancel_that_failed_otherwise_is_tried_again(refusal: stripe.StripeError) -> None:
    account = Account([stalled()], refusal=refusal)
    with pytest.raises(type(refusal)):
        await account.gateway().find(INTENT_CLAIM)


async def test_an_intent_still_being_confirmed_is_not_an_answer_yet() -> None:
    # Stripe may still roll the request forward; and an hour younger than the rule, for a
    # worker clock an hour ahead of Stripe's.
    young = int(time.time()) - STALLED_AFTER_SECONDS + 3600 + 60
    with pytest.raises(
        stripe.APIError, match="pi_requires_confirmation is requires_confirmation"
    ) as raised:
        await intents_gateway(intent("requires_confirmation", young)).find(INTENT_CLAIM)
    assert raised.value.http_status == 503 and raised.value.code is None


@pytest.mark.parametrize("created", [LONG_AGO, int(time.time())], ids=["long-ago", "now"])
async def test_an_intent_waiting_on_the_customer_is_no_answer_and_says_so(created: int) -> None:
    # Off session it waits on the customer (a bank account's microdeposits), who may still
    # complete it, however long ago it was made; the create's answer is no lookup refused.
    waiting = intent("requires_action", created, next_action={"type": "verify_with_microdeposits"})
    for attempt in (
        intents_gateway(waiting).find(INTENT_CLAIM),
        intents_gateway(waiting, created=waiting).charge(INTENT_CLAIM),
    ):
        with pytest.raises(stripe.APIError) as raised:
            await attempt
        assert (raised.value.http_status, raised.value.code) == (503, WAITING_ON_CUSTOMER)
        assert str(raised.value) == (
            "payment intent pi_requires_action waits for the customer to act on Stripe"
            " (verify_with_microdeposits): they may still pay it"
        )
    # Stripe names no step: the wait is said all the same.
    with pytest.raises(NoAnswerYet, match=r"to act on Stripe \(an action\): they may"):
        await intents_gateway(intent("requires_action", created)).find(INTENT_CLAIM)


async def test_a_charge_made_outweighs_an_intent_left_unconfirmed() -> None:
    # A later request with the key (e.g. after Stripe forgot it) charged.
    now = int(time.time())
    stalled = intent("requires_confirmation", LONG_AGO)
    made = intent("succeeded", now, latest_charge="ch_made")
    found = await intents_gateway(made, stalled).find(INTENT_CLAIM)
    assert isinstance(found, ChargeResult) and found.charge_id == "ch_made"


async def test_a_create_answered_before_the_intent_ended_settles_on_where_it_stands_now() -> None:
    # The first answer was `processing` (a bank debit); Stripe replays it with the key for a
    # day, while the listing says the intent has since succeeded: the claim is charged now.
    now = int(time.time())
    answered = intent("processing", now, replayed=True)
    done = intent("succeeded", now, latest_charge="ch_settled")
    found = await intents_gateway(done, created=answered).charge(INTENT_CLAIM)
    assert isinstance(found, ChargeResult) and found.charge_id == "ch_settled"


async def test_a_create_answered_before_the_intent_failed_settles_as_the_failure() -> None:
    now = int(time.time())
    error = {"code": "card_declined", "decline_code": "insufficient_funds", "message": "no"}
    failed = intent("requires_payment_method", now, last_payment_error=error)
    returned = intent("processing", now, replayed=True)
    found = await intents_gateway(failed, created=returned).charge(INTENT_CLAIM)
    assert isinstance(found, ChargeFailure)
    assert (found.code, found.decline_code) == ("card_declined", "insufficient_funds")


@pytest.mark.parametrize("lookup", ["find", "charge"])
async def test_a_bank_debit_processing_is_charged_while_its_charge_is_pending(lookup: str) -> None:
    # As a pending Charge is (above): the bank answers in days, and a debit it returns is
    # reconciliation's to report (failed_later), not the period's to wait for.
    debit = intent("processing", LONG_AGO, latest_charge="py_pending")
    gateway = intents_gateway(debit, created=debit, lister=None if lookup == "find" else unlisted)
    found = await (gateway.find(INTENT_CLAIM) if lookup == "find" else gateway.charge(INTENT_CLAIM))
    assert isinstance(found, ChargeResult) and found.pending
    assert (found.charge_id, found.payment_intent_id) == ("py_pending", "pi_processing")
    assert found.replayed == (lookup == "find")


async def unlisted(params: dict[str, Any]) -> Any:
    raise AssertionError("an answer Stripe executed now is where the charge stands: not listed")


@pytest.mark.parametrize("replayed", [True, False], ids=["replayed", "executed-now"])
async def test_a_replayed_pending_charge_is_looked_up_and_a_fresh_one_is_not(
    replayed: bool,
) -> None:
    # Stripe saved the pending answer up to a day ago; the bank may have returned the debit
    # since, and a retry would record it charged.
    returned = charge("failed", failure_code="insufficient_funds", failure_message="returned")

    async def create(params: dict[str, Any], options: dict[str, Any]) -> Any:
        return charge("pending", replayed=replayed)

    listing = Listing([returned]) if replayed else unlisted
    charges = SimpleNamespace(create_async=create, list_async=listing)
    client = SimpleNamespace(v1=SimpleNamespace(charges=charges))
    found = await StripeGateway(client, "charges").charge(CLAIM)  # type: ignore[arg-type]
    if replayed:
        assert isinstance(found, ChargeFailure)
        # Listed nowhere yet: no answer to record, and tried again (as for an intent, below).
        charges.list_async = Listing([])
        with pytest.raises(stripe.APIError, match="no charge is listed with its key") as raised:
            await StripeGateway(client, "charges").charge(CLAIM)  # type: ignore[arg-type]
        assert type(raised.value) is stripe.APIError and raised.value.http_status == 502
    else:
        assert isinstance(found, ChargeResult) and found.pending


@pytest.mark.parametrize("replayed", [True, False], ids=["replayed", "executed-now"])
async def test_a_success_says_whether_stripe_replayed_it(replayed: bool) -> None:
    # The worker's `charge` event says so: a retry after a lost answer, not a second charge.
    async def create(params: dict[str, Any], options: dict[str, Any]) -> Any:
        return charge("succeeded", replayed=replayed)

    charges = SimpleNamespace(create_async=create, list_async=unlisted)
    client = SimpleNamespace(v1=SimpleNamespace(charges=charges))
    found = await StripeGateway(client, "charges").charge(CLAIM)  # type: ignore[arg-type]
    assert isinstance(found, ChargeResult) and found.replayed == replayed
    made = intent("succeeded", LONG_AGO, replayed=replayed, latest_charge="ch_made")
    found = await intents_gateway(made, created=made, lister=unlisted).charge(INTENT_CLAIM)
    assert isinstance(found, ChargeResult) and found.replayed == replayed


async def test_a_charge_expanded_in_its_intent_is_recorded_by_its_id() -> None:
    # Expanded, Stripe answers `latest_charge` as the charge itself, not its id.
    made = intent("succeeded", NOW, latest_charge={"id": "ch_expanded", "object": "charge"})
    found = await intents_gateway(made).find(INTENT_CLAIM)
    assert isinstance(found, ChargeResult) and found.charge_id == "ch_expanded"


async def test_an_intent_processing_without_a_charge_is_not_taken_for_charged() -> None:
    odd = intent("processing", int(time.time()))
    with pytest.raises(stripe.APIError, match="expected succeeded or processing with a charge"):
        await intents_gateway(odd).find(INTENT_CLAIM)


@pytest.mark.parametrize(
    ("reason", "canceled_at"),
    [("requested_by_customer", NOW), ("abandoned", LONG_AGO + 60), (None, NOW)],
    ids=["another-reason", "before-it-stalled", "no-reason"],
)
async def test_an_intent_cancelled_before_any_attempt_failed_is_not_a_decline(
    reason: str | None, canceled_at: int
) -> None:
    # A person cancelled an intent, not as a lookup cancels one Stripe left unconfirmed: the
    # lookup says so, and nothing of it is still to come, nor is the claim sent again.
    cancelled = intent("canceled", LONG_AGO, cancellation_reason=reason, canceled_at=canceled_at)
    found = await intents_gateway(cancelled).find(INTENT_CLAIM)
    assert isinstance(found, ChargeFailure)
    assert (found.code, found.payment_intent_id) == ("payment_intent_canceled", "pi_canceled")
    said = reason or "no reason given"
    assert f"cancelled on Stripe ({said}): nothing was charged" in found.message
    assert left_unknown_because(found) is None
    # Declined first, then cancelled: the decline is what happened.
    error = {"code": "card_declined", "decline_code": "generic_decline", "message": "no"}
    declined = intent("canceled", LONG_AGO, last_payment_error=error)
    found = await intents_gateway(declined).find(INTENT_CLAIM)
    assert isinstance(found, ChargeFailure)
    assert (found.code, found.decline_code) == ("card_declined", "generic_decline")


async def test_a_failed_intent_whose_error_has_no_decline_code_is_found_failed() -> None:
    # Stripe leaves decline_code out for an expired card, a wrong CVC, a processing error.
    error = {"code": "expired_card", "message": "Your card has expired.", "type": "card_error"}
    failed = intent("requires_payment_method", int(time.time()) - 60, last_payment_error=error)
    found = await intents_gateway(failed).find(INTENT_CLAIM)
    assert isinstance(found, ChargeFailure)
    assert (found.code, found.decline_code) == ("expired_card", None)
    # No error at all (Stripe refused to confirm it without a payment method): a failure of
    # the payment, not an intent someone cancelled.
    unconfirmable = intent("requires_payment_method", int(time.time()) - 60)
    found = await intents_gateway(unconfirmable).find(INTENT_CLAIM)
    assert isinstance(found, ChargeFailure) and found.code != CANCELED_INTENT
    assert "cancelled" not in found.message


@pytest.mark.parametrize(
    "refusal",
    [
        stripe.RateLimitError("Too many requests", http_status=429),
        stripe.AuthenticationError("this vault key has been revoked", http_status=401),
    ],
)
async def test_a_refused_lookup_after_a_create_is_not_taken_for_the_creates_refusal(
    refusal: stripe.StripeError,
) -> None:
    # A 429 or a refused key on the create proves nothing reached Stripe (the claim goes back
    # to the gate); these came after the create made the intent.
    async def limited(params: dict[str, Any]) -> Any:
        raise refusal

    answered = intent("processing", int(time.time()), replayed=True)
    gateway = intents_gateway(created=answered, lister=limited)
    with pytest.raises(stripe.APIError) as raised:
        await gateway.charge(INTENT_CLAIM)
    assert type(raised.value) is stripe.APIError
    assert raised.value.http_status == 503


async def test_an_intent_with_no_final_state_after_a_create_is_said_so() -> None:
    # The create was answered before the intent ended, and the lookup after it finds it
    # still to be confirmed: no answer yet, tried again; nothing refused the lookup, as the
    # failure said (helper-153 L1).
    now = int(time.time())
    answered = intent("processing", now, replayed=True)
    young = intent("requires_confirmation", now)
    with pytest.raises(NoAnswerYet, match="is requires_confirmation, with no final state yet"):
        await intents_gateway(young, created=answered).charge(INTENT_CLAIM)


async def test_a_charge_made_just_before_its_claim_by_stripes_clock_is_found_pages_back() -> None:
    """Behind a page of the customer's newer charges, and made before the claim by Stripe's
    clock (the worker's may run an hour ahead): a lookup that stops short of it takes the
    claim for never sent, and charges it again once Stripe has forgotten the key."""
    claimed = int(CLAIM.claimed_at.timestamp())
    # The page's last made an hour before the claim to the second: the next may hold ours.
    newer = [
        charge("succeeded", id=f"ch_newer_{i}", created=claimed - 3600 + 99 - i, metadata={})
        for i in range(100)
    ]
    listing = Pages([*newer, charge("succeeded", id="ch_ours", created=claimed - 3600)])
    found = await gateway(listing).find(CLAIM)
    assert isinstance(found, ChargeResult) and found.charge_id == "ch_ours"
    assert [call.get("starting_after") for call in listing.calls] == [None, "ch_newer_99"]
    # A page reaching past that hour is the last read, and what it held is the answer.
    older = [
        charge("succeeded", id=f"ch_older_{i}", created=claimed - 3601 + 98 - i, metadata={})
        for i in range(100)
    ]
    listing = Pages([charge("succeeded", id="ch_ours", created=claimed), *older])
    found = await gateway(listing).find(CLAIM)
    assert isinstance(found, ChargeResult) and found.charge_id == "ch_ours"
    assert [call.get("starting_after") for call in listing.calls] == [None]


async def test_a_replayed_answer_whose_charge_is_not_listed_yet_is_retried_not_declined() -> None:
    """Stripe saved a `processing` answer for the key and lists no intent with it: the debit
    may still go through, so it is no answer yet. Recorded declined, the customer would be
    failed (and billed again by hand) while the first debit settles."""
    answered = intent("processing", int(time.time()), replayed=True)
    with pytest.raises(stripe.APIError, match="expected succeeded or processing") as raised:
        await intents_gateway(created=answered).charge(INTENT_CLAIM)
    assert type(raised.value) is stripe.APIError and raised.value.http_status == 502


async def test_a_claim_of_unrecorded_api_declined_through_the_other_is_found_failed() -> None:
    """Claimed before claims recorded their API, and declined through the API of an earlier
    setting: that decline is the claim's answer. Found as nothing, the claim would be sent
    again through the setting's API, and charged after Stripe had declined it."""
    failed = Listing([charge("failed", failure_code="card_declined", failure_message="no")])
    client = SimpleNamespace(
        v1=SimpleNamespace(
            charges=SimpleNamespace(list_async=failed),
            payment_intents=SimpleNamespace(list_async=Listing([])),
        )
    )
    legacy = CLAIM.model_copy(update={"charge_api": None})
    found = await StripeGateway(client, "payment_intents").find(legacy)  # type: ignore[arg-type]
    assert isinstance(found, ChargeFailure) and found.charge_id == "ch_failed"


async def test_only_charges_naming_the_period_and_a_customer_are_the_periods() -> None:
    """Reconciliation charges no claim of a customer Stripe holds a charge made for: a charge
    of another period taken for this one would leave the customer unbilled, and one naming
    no customer of ours is nobody's to compare."""
    ours = {"billing_period": CLAIM.period, "customer_id": CLAIM.customer_id}
    last_period = ours | {"billing_period": "2026-11"}
    listed = [
        charge("succeeded", id=charge_id, customer="cus_1", refunded=False, metadata=metadata)
        for charge_id, metadata in [
            ("ch_this", ours),
            ("ch_last", last_period),
            ("ch_nobodys", {"billing_period": CLAIM.period}),
        ]
    ]
    found = await gateway(Listing(listed)).period_charges("cus_1", CLAIM.period)
    assert [charge.charge_id for charge in found] == ["ch_this"]
    # Behind a page of the customer's other charges: every page is read, however old.
    others = [
        charge("succeeded", id=f"ch_other_{i}", customer="cus_1", refunded=False, metadata={})
        for i in range(100)
    ]
    found = await gateway(Pages([*others, *listed])).period_charges("cus_1", CLAIM.period)
    assert [charge.charge_id for charge in found] == ["ch_this"]


async def test_an_intent_left_unconfirmed_under_two_hours_is_not_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An hour for Stripe to roll its request forward, and an hour more for a worker clock
    ahead of Stripe's: cancelled sooner, a charge Stripe was completing is stopped. At two
    hours to the second, it is cancelled (the worker's clock held still to say so)."""
    monkeypatch.setattr(stripe_gateway, "time", SimpleNamespace(time=lambda: NOW))
    a_second_short = NOW - 2 * 3600 + 1
    with pytest.raises(NoAnswerYet, match="is requires_confirmation, with no final state yet"):
        await intents_gateway(intent("requires_confirmation", a_second_short)).find(INTENT_CLAIM)
    account = Account([stalled(created=NOW - 2 * 3600)])
    assert await account.gateway().find(INTENT_CLAIM) is None
    assert account.cancelled == ["pi_stalled"]


async def test_an_intent_declined_then_cancelled_as_abandoned_keeps_the_decline() -> None:
    """Only an intent nothing was attempted on is as if never sent: one Stripe declined, then
    someone cancelled with the lookup's reason, was answered, and is not charged again."""
    error = {"code": "card_declined", "decline_code": "generic_decline", "message": "no"}
    cancelled = intent(
        "canceled",
        LONG_AGO,
        last_payment_error=error,
        cancellation_reason="abandoned",
        canceled_at=NOW,
    )
    found = await intents_gateway(cancelled).find(INTENT_CLAIM)
    assert isinstance(found, ChargeFailure)
    assert (found.code, found.decline_code) == ("card_declined", "generic_decline")


async def test_a_create_carries_the_claims_key_and_through_the_vault_its_fencing_token() -> None:
    """The key makes every attempt of the claim one charge at Stripe (I3). The vault takes a
    request without a token for one below every fence: a cap refusal then fences off no
    attempt held up on its way, and a retry after a fence is refused for good."""
    sent: list[dict[str, Any]] = []

    async def create(params: dict[str, Any], options: dict[str, Any]) -> Any:
        sent.append(options)
        return charge("succeeded")

    charges = SimpleNamespace(create_async=create, list_async=unlisted)
    client = SimpleNamespace(v1=SimpleNamespace(charges=charges))
    through_vault = StripeGateway(client, "charges", vault_key_id="period-key")  # type: ignore[arg-type]
    direct = StripeGateway(client, "charges")  # type: ignore[arg-type]
    await through_vault.charge(CLAIM, fencing_token=7)
    await direct.charge(CLAIM, fencing_token=8)
    # An attempt with no token (none passed the gate for it) sends none, not "None".
    await through_vault.charge(CLAIM)
    assert sent == [
        {"idempotency_key": CLAIM.idempotency_key, "headers": {FENCE_HEADER: "7"}},
        {"idempotency_key": CLAIM.idempotency_key},
        {"idempotency_key": CLAIM.idempotency_key},
    ]
    # What the ledger's gate records as the attempt's route.
    assert (through_vault.route, direct.route) == ("period-key", SENT_DIRECT)


@pytest.mark.parametrize("payment_method", ["pm_1", None], ids=["saved-method", "default-method"])
async def test_a_create_carries_the_claims_parameters_through_the_api_it_recorded(
    payment_method: str | None,
) -> None:
    """I3: every request of a claim sends its amount, currency, Stripe customer and method,
    and its key in the metadata a lookup finds it by; through the API the claim recorded,
    whatever the setting is now (another endpoint for the key is an idempotency error)."""
    sent: list[tuple[str, dict[str, Any]]] = []

    def creating(api: str, made: Any) -> Callable[..., Awaitable[Any]]:
        async def create(params: dict[str, Any], options: dict[str, Any]) -> Any:
            sent.append((api, params))
            return made

        return create

    made = intent("succeeded", NOW, latest_charge="ch_made")
    client = SimpleNamespace(
        v1=SimpleNamespace(
            charges=SimpleNamespace(create_async=creating("charges", charge("succeeded"))),
            payment_intents=SimpleNamespace(create_async=creating("payment_intents", made)),
        )
    )
    claim = CLAIM.model_copy(update={"payment_method": payment_method})
    await StripeGateway(client, "payment_intents").charge(claim)  # type: ignore[arg-type]
    intent_claim = claim.model_copy(update={"charge_api": "payment_intents"})
    await StripeGateway(client, "charges").charge(intent_claim)  # type: ignore[arg-type]
    common = {
        "amount": 1000,
        "currency": "usd",
        "customer": "cus_1",
        "description": "Billing period 2026-12",
        "metadata": {"billing_key": "0" * 32, "billing_period": "2026-12", "customer_id": "cust-1"},
    }
    method = {} if payment_method is None else {"payment_method": payment_method}
    source = {} if payment_method is None else {"source": payment_method}
    assert sent == [
        ("charges", common | source),
        (
            "payment_intents",
            common
            | method
            | {
                "confirm": True,
                "off_session": True,
                "automatic_payment_methods": {"enabled": True, "allow_redirects": "never"},
            },
        ),
    ]


async def test_a_failure_found_by_a_lookup_repeats_no_key_stripe_quoted() -> None:
    """I5, as for the create's own errors: the failure is kept in the ledger and workflow
    history, which people read, and its message is Stripe's."""
    quoted = "sk_" + "live_" + "51HxQz2eZvKYlo2C0aB1cD2eF3gH4iJ5"
    failed = charge("failed", failure_code="card_declined", failure_message=f"no: {quoted}")
    error = {"code": "card_declined", "message": f"no: {quoted}"}
    declined = intent("requires_payment_method", NOW, last_payment_error=error)
    for found in (
        await gateway(Listing([failed])).find(CLAIM),
        await intents_gateway(declined).find(INTENT_CLAIM),
    ):
        assert isinstance(found, ChargeFailure) and quoted not in found.message


@dataclass
class Turns:
    """Stands in for the cluster's Stripe rate (StripeGateway.taking_turns), and records in
    order the turns taken and the requests sent through stand-ins wrapped by `counted`."""

    log: list[str] = field(default_factory=list)

    async def take(self) -> None:
        self.log.append("turn")

    def counted(self, request: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def sent(*args: Any) -> Any:
            self.log.append("request")
            return await request(*args)

        return sent


async def test_a_gateway_taking_turns_takes_one_before_each_request_it_sends() -> None:
    """Reconciliation's reads take a turn of the cluster's Stripe rate for each request, and
    one read may send several: the pages of a listing, both APIs for a claim that recorded
    none, cancels of intents Stripe left unconfirmed and the listing after them. The gateway
    it was made from takes none (the charge's slot is reserved ahead)."""
    turns = Turns()
    listed = [charge("succeeded", id=f"ch_{i}", refunded=False, metadata={}) for i in range(250)]
    pages = turns.counted(Pages(listed))
    client = SimpleNamespace(v1=SimpleNamespace(charges=SimpleNamespace(list_async=pages)))
    plain = StripeGateway(client, "charges")  # type: ignore[arg-type]
    await plain.taking_turns(turns.take).period_charges("cus_1", CLAIM.period)
    assert turns.log == ["turn", "request"] * 3
    await plain.period_charges("cus_1", CLAIM.period)
    assert turns.log == ["turn", "request"] * 3 + ["request"] * 3

    turns = Turns()
    both = SimpleNamespace(
        v1=SimpleNamespace(
            charges=SimpleNamespace(list_async=turns.counted(Listing([charge("succeeded")]))),
            payment_intents=SimpleNamespace(list_async=turns.counted(Listing([]))),
        )
    )
    legacy = CLAIM.model_copy(update={"charge_api": None})
    gateway = StripeGateway(both, "payment_intents").taking_turns(turns.take)  # type: ignore[arg-type]
    assert isinstance(await gateway.find(legacy), ChargeResult)
    assert turns.log == ["turn", "request"] * 2

    turns = Turns()
    account = Account([stalled("later"), stalled("first")])
    gateway = intents_gateway(
        lister=turns.counted(account.listing), canceller=turns.counted(account.cancel)
    ).taking_turns(turns.take)
    assert await gateway.find(INTENT_CLAIM) is None
    assert account.cancelled == ["pi_later", "pi_first"]
    # The listing, two cancels, and the listing after them.
    assert turns.log == ["turn", "request"] * 4

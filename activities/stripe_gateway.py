"""Charging one claim on Stripe, through PaymentIntents or the legacy Charges API."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

import stripe

from activities.stripe_failures import CANCELED_INTENT, WAITING_ON_CUSTOMER, said_replayed
from billing.ledger import SENT_DIRECT
from billing.models import ChargeApi, ChargeFailure, ChargeResult, Claim
from billing.reconciliation import INCOMPLETE_INTENT, MADE_STATUSES, ChargeState, StripeCharge
from billing.redact import redact
from billing.stripe_client import error_code
from vault.endpoints import CHARGE_IN_FLIGHT, FENCE_HEADER, KEY_METADATA, UPSTREAM_REFUSED

# Customers rarely hold more than a few charges a period; pages this size find ours at once.
_LOOKUP_PAGE = 100
_CLOCK_SKEW_SECONDS = 3600
FAILED_INTENT_STATUSES = frozenset({"requires_payment_method", "canceled"})
# A Charge pending has been made (MADE_STATUSES): a bank debit stays so for days, and may
# still fail. So has a PaymentIntent processing, a bank debit's while its charge is pending.
# Recorded as charged at once, as its pending charge is: waiting days for the bank would hold
# the period open; a debit the bank returns later is reconciliation's `failed_later`.
MADE_INTENT_STATUSES = frozenset({"succeeded", "processing"})
# Our one request creates and confirms a PaymentIntent, so it never waits for a confirm. One
# found so, two hours after it was made (one past the clock skew allowed), was left there by
# Stripe after answering that request with an error, and Stripe may yet roll it forward. The
# lookup cancels it (then it can charge nothing), and the claim is then as if never sent:
# charged again with its key once Stripe has forgotten the key (_abandoned). Where the key
# may not cancel (issued before keys could, or a lookup key), the claim fails, the failure
# says to cancel the intent, and its vault reservation stays counted until then
# (billing.reconciliation.left_unknown_because). (`requires_action` is not here: off-session,
# it waits on the customer, e.g. a bank account's microdeposits, and may still debit.)
STALLED_INTENT_STATUS = "requires_confirmation"
STALLED_AFTER_SECONDS = 3600 + _CLOCK_SKEW_SECONDS
ABANDONED = "abandoned"

P = ParamSpec("P")
R = TypeVar("R")
# Awaited before each request a gateway sends (StripeGateway.taking_turns).
Turn = Callable[[], Awaitable[None]]


def charge_params(claim: Claim, api: ChargeApi) -> dict[str, Any]:
    """The exact parameters of every request a worker of this release sends for this claim
    (same key, same parameters). One of an earlier release may have sent others: Stripe then
    answers idempotency_error (see charging, which looks the charge up)."""
    params: dict[str, Any] = {
        "amount": claim.amount_cents,
        "currency": claim.currency,
        "customer": claim.stripe_customer_id,
        "description": f"Billing period {claim.period}",
        "metadata": {
            KEY_METADATA: claim.idempotency_key,
            "billing_period": claim.period,
            "customer_id": claim.customer_id,
        },
    }
    if api == "payment_intents":
        # Off session nobody can be redirected: without `allow_redirects=never` Stripe takes
        # the Dashboard's payment methods and refuses to confirm without a return_url.
        params.update(
            confirm=True,
            off_session=True,
            automatic_payment_methods={"enabled": True, "allow_redirects": "never"},
        )
        if claim.payment_method:
            params["payment_method"] = claim.payment_method
    elif claim.payment_method:
        params["source"] = claim.payment_method
    return params


class StripeGateway:
    def __init__(
        self,
        client: stripe.StripeClient,
        api: ChargeApi,
        vault_key_id: str | None = None,
        may_cancel: bool = True,
        turn: Turn | None = None,
    ) -> None:
        self._client = client
        self._api = api
        self._turn = turn
        # Whether lookups cancel an intent Stripe left unconfirmed (STALLED_INTENT_STATUS):
        # not with a key that only reads, which the vault would refuse and audit.
        self._may_cancel = may_cancel
        # The period's vault key this gateway charges with; None for Stripe directly.
        self.vault_key_id = vault_key_id

    def taking_turns(self, turn: Turn) -> StripeGateway:
        """This gateway, awaiting `turn` before each request it sends: one read may send
        several (pages of a listing, both APIs, cancels and the listing after them)."""
        return StripeGateway(self._client, self._api, self.vault_key_id, self._may_cancel, turn)

    def _sent(self, request: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        """`request` (a method of the client), after its turn where the gateway takes turns."""
        turn = self._turn
        if turn is None:
            return request

        async def in_turn(*args: P.args, **kwargs: P.kwargs) -> R:
            await turn()
            return await request(*args, **kwargs)

        return in_turn

    @property
    def route(self) -> str:
        """What a claim's attempt through this gateway records (ledger.begin_charge)."""
        return self.vault_key_id or SENT_DIRECT

    def _api_for(self, recorded: ChargeApi | None) -> ChargeApi:
        """The API a claim recorded: a setting changed since must not change its requests;
        the setting's for a claim from before the API was recorded."""
        return recorded or self._api

    async def charge(
        self, claim: Claim, fencing_token: int | None = None
    ) -> ChargeResult | ChargeFailure:
        """Create the charge with the claim's key, and through the vault with the attempt's
        `fencing_token` (ledger.Passage); raises stripe errors unchanged."""
        options: stripe.RequestOptions = {"idempotency_key": claim.idempotency_key}
        if self.vault_key_id is not None and fencing_token is not None:
            options["headers"] = {FENCE_HEADER: str(fencing_token)}
        api = self._api_for(claim.charge_api)
        params = charge_params(claim, api)
        made: stripe.PaymentIntent | stripe.Charge
        if api == "payment_intents":
            made = await self._sent(self._client.v1.payment_intents.create_async)(params, options)  # type: ignore[arg-type]
            settling = made.status in MADE_INTENT_STATUSES
        else:
            made = await self._sent(self._client.v1.charges.create_async)(params, options)  # type: ignore[arg-type]
            settling = made.status in MADE_STATUSES
        # A bank debit's answer, processing or pending, is where it stands only if Stripe
        # executed this request; one it replays, it saved up to a day ago, and the bank may
        # have returned the debit since: where it stands now is listed.
        if made.status == "succeeded" or (settling and not _replayed(made)):
            return self._result(made)
        try:
            found = await self._find_through(api, claim)
        except NoAnswerYet:
            raise
        except stripe.StripeError as exc:
            # Not the create's refusal (a 429, a refused key), which proves nothing was
            # sent: this create made its charge, so the claim is not to be reopened.
            raise stripe.APIError(
                f"{made.object} {made.id} is {made.status}, and looking it up was refused"
                f" ({exc.http_status})",
                http_status=503,
            ) from None
        if found is None:
            raise _not_made(made)
        return found

    def _result(self, made: stripe.PaymentIntent | stripe.Charge) -> ChargeResult:
        if isinstance(made, stripe.PaymentIntent):
            return self._from_intent(made, replayed=_replayed(made))
        return ChargeResult(
            charge_id=made.id,
            payment_intent_id=_id(made.payment_intent),
            amount_cents=made.amount,
            currency=made.currency,
            replayed=_replayed(made),
            pending=made.status == "pending",
        )

    async def find(self, claim: Claim) -> ChargeResult | ChargeFailure | None:
        """Look the claim's charge up by the key in its metadata."""
        api = self._api_for(claim.charge_api)
        found = await self._find_through(api, claim)
        if not isinstance(found, ChargeResult) and claim.charge_api is None:
            # Claimed before claims recorded their API (migrations/012): it may have gone
            # out through the other one, under an earlier setting, and a charge made there
            # outweighs a failure here.
            other: ChargeApi = "charges" if api == "payment_intents" else "payment_intents"
            elsewhere = await self._find_through(other, claim)
            if found is None or isinstance(elsewhere, ChargeResult):
                found = elsewhere
        return found

    async def _find_through(
        self, api: ChargeApi, claim: Claim
    ) -> ChargeResult | ChargeFailure | None:
        if api == "payment_intents":
            return await self._find_intent(claim, cancel_stalled=self._may_cancel)
        charges = await self._ours(self._sent(self._client.v1.charges.list_async), claim)
        for charge in charges:
            # Pending (a bank debit) is what charge() records too: the charge was made.
            if charge.status in MADE_STATUSES:
                return ChargeResult(
                    charge_id=charge.id,
                    payment_intent_id=_id(charge.payment_intent),
                    amount_cents=charge.amount,
                    currency=charge.currency,
                    replayed=True,
                    pending=charge.status == "pending",
                )
        if not charges:
            return None
        return ChargeFailure(
            code=charges[0].failure_code or "card_declined",
            message=redact(charges[0].failure_message or "the charge failed"),
            charge_id=charges[0].id,
        )

    async def _find_intent(
        self, claim: Claim, cancel_stalled: bool
    ) -> ChargeResult | ChargeFailure | None:
        intents = await self._ours(self._sent(self._client.v1.payment_intents.list_async), claim)
        for intent in intents:
            if intent.status in MADE_INTENT_STATUSES:
                return self._from_intent(intent, replayed=True)
        if not intents:
            return None
        stalled = [intent for intent in intents if _stalled(intent)]
        if stalled:
            if not cancel_stalled:
                return _incomplete(stalled)
            try:
                for intent in stalled:
                    await self._cancel(intent)
            except stripe.PermissionError:
                # The key may not cancel (issued before keys could), or the vault ties the
                # intent to no charge of the key's period in doubt (its reservation settled
                # since, by a person's resolve say): left to a person.
                pass
            except stripe.InvalidRequestError as exc:
                # It moved on since it was listed: Stripe completed it, or someone cancelled it.
                if error_code(exc) != "payment_intent_unexpected_state":
                    raise
            except stripe.APIError as exc:
                if error_code(exc) == CHARGE_IN_FLIGHT:
                    # Its charge is being sent again right now (its vault reservation
                    # pending): the next retry cancels it.
                    raise NoAnswerYet(
                        f"the vault would not cancel payment intent {intent.id} yet: {exc}",
                        http_status=503,
                    ) from None
                # The vault's own secret may not read the intent to check it: no retry mends
                # that, so the intent is left to a person, as where the key may not cancel.
                if error_code(exc) != UPSTREAM_REFUSED:
                    raise
            # Where the claim stands now, as Stripe holds it; nothing is cancelled twice.
            return await self._find_intent(claim, cancel_stalled=False)
        latest = intents[0]
        abandoned = _abandoned(latest)
        unfinished = [i for i in intents if i.status not in FAILED_INTENT_STATUSES]
        if latest.status not in FAILED_INTENT_STATUSES or (abandoned and unfinished):
            # Waiting for a step (off session, e.g. a bank account's microdeposits), or
            # confirmed by a request still running: not an answer yet; try again later.
            raise _no_answer_yet(unfinished[0])
        if abandoned:
            # Stripe charged nothing and declined nothing: the claim is as if never sent, so
            # it is charged again with its key once Stripe has forgotten the key (the saved
            # error it replays until then is what brought the lookup here).
            return None
        # Stripe leaves out what does not apply (no decline_code for an expired card), and
        # the SDK raises on a field left out.
        error = latest.last_payment_error
        if error is None and latest.status == "canceled":
            # Cancelled before any attempt failed, by a person: not a decline.
            reason = getattr(latest, "cancellation_reason", None) or "no reason given"
            return ChargeFailure(
                code=CANCELED_INTENT,
                message=f"payment intent {latest.id} was cancelled on Stripe ({reason}):"
                " nothing was charged",
                payment_intent_id=latest.id,
            )
        return ChargeFailure(
            code=getattr(error, "code", None) or "card_declined",
            decline_code=getattr(error, "decline_code", None),
            message=redact(getattr(error, "message", None) or "the payment failed"),
            payment_intent_id=latest.id,
        )

    async def period_charges(self, stripe_customer_id: str, period: str) -> list[StripeCharge]:
        """The customer's charges whose metadata names the period, whatever their key and
        state (made, refunded or failed): reconciliation compares them with the ledger, and
        charges no claim of a customer Stripe holds one made for. Listed as Charges,
        whichever API made them: Stripe copies a PaymentIntent's metadata to its charge when
        it confirms it, so a duplicate made through the other API is seen too."""
        found = await _listed(
            self._sent(self._client.v1.charges.list_async),
            stripe_customer_id,
            None,
            lambda o: _metadata(o, "billing_period") == period,
        )
        return [charge for o in found if (charge := _period_charge(o, period)) is not None]

    async def _cancel(self, intent: stripe.PaymentIntent) -> None:
        """Cancels `intent` as abandoned (_abandoned); raises stripe.PermissionError where the
        key may not."""
        await self._sent(self._client.v1.payment_intents.cancel_async)(
            intent.id, {"cancellation_reason": ABANDONED}
        )

    @staticmethod
    async def _ours(lister: Callable[..., Awaitable[Any]], claim: Claim) -> list[Any]:
        """The customer's objects carrying the claim's key, listed back to the claim's time."""
        oldest = int(claim.claimed_at.timestamp()) - _CLOCK_SKEW_SECONDS
        return await _listed(
            lister,
            claim.stripe_customer_id,
            oldest,
            lambda o: _metadata(o, KEY_METADATA) == claim.idempotency_key,
        )

    @staticmethod
    def _from_intent(intent: stripe.PaymentIntent, replayed: bool = False) -> ChargeResult:
        charge_id = _id(intent.latest_charge)
        if intent.status not in MADE_INTENT_STATUSES or charge_id is None:
            raise _not_made(intent)
        return ChargeResult(
            charge_id=charge_id,
            payment_intent_id=intent.id,
            amount_cents=intent.amount,
            currency=intent.currency,
            replayed=replayed,
            pending=intent.status == "processing",
        )


def _not_made(made: stripe.PaymentIntent | stripe.Charge) -> stripe.APIError:
    if isinstance(made, stripe.Charge):
        return stripe.APIError(
            f"charge {made.id} is {made.status}, and no charge is listed with its key",
            http_status=502,
        )
    return stripe.APIError(
        f"payment intent {made.id} is {made.status} with charge {_id(made.latest_charge)},"
        " expected succeeded or processing with a charge",
        http_status=502,
    )


class NoAnswerYet(stripe.APIError):
    """A lookup found the claim's intent with no final state yet: tried again later (a 503,
    as Stripe's own "try again"), and said as such, not as a lookup refused."""


def _no_answer_yet(intent: stripe.PaymentIntent) -> NoAnswerYet:
    if intent.status == "requires_action":
        action = getattr(getattr(intent, "next_action", None), "type", None) or "an action"
        return NoAnswerYet(
            f"payment intent {intent.id} waits for the customer to act on Stripe ({action}):"
            " they may still pay it",
            http_status=503,
            code=WAITING_ON_CUSTOMER,
        )
    return NoAnswerYet(
        f"payment intent {intent.id} is {intent.status}, with no final state yet",
        http_status=503,
    )


def _incomplete(stalled: list[stripe.PaymentIntent]) -> ChargeFailure:
    """Intents left unconfirmed that the worker could not cancel, newest first: a person
    must cancel every one, or one left out may still charge."""
    newest = stalled[0]
    ids = ", ".join(intent.id for intent in stalled)
    if len(stalled) == 1:
        what, their, it = f"payment intent {ids}", "its request", "it"
    else:
        what, their, it = f"payment intents {ids}", "their requests", "them"
    return ChargeFailure(
        code=INCOMPLETE_INTENT,
        message=f"Stripe left {what} in {newest.status} after answering {their} with an"
        f" error, and may still complete {it}: cancel {it} on Stripe (a cancelled intent"
        " charges nothing), then bill the customer there if this period is still due",
        payment_intent_id=newest.id,
    )


def _replayed(made: stripe.PaymentIntent | stripe.Charge) -> bool:
    response = made.last_response
    return said_replayed(response.headers if response is not None else None)


def _stalled(intent: stripe.PaymentIntent) -> bool:
    return (
        intent.status == STALLED_INTENT_STATUS
        and time.time() - intent.created >= STALLED_AFTER_SECONDS
    )


def _abandoned(intent: stripe.PaymentIntent) -> bool:
    """Cancelled once stalled, as a lookup cancels one (or a person, as the incomplete
    failure asks): nothing was attempted, so nothing was charged or declined."""
    canceled_at = getattr(intent, "canceled_at", None)
    return (
        intent.status == "canceled"
        and intent.last_payment_error is None
        and getattr(intent, "cancellation_reason", None) == ABANDONED
        and canceled_at is not None
        # Both Stripe's times: the clock skew _stalled allows for the worker's is not theirs.
        and canceled_at - intent.created >= STALLED_AFTER_SECONDS - _CLOCK_SKEW_SECONDS
    )


def _id(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    found = getattr(value, "id", None)
    return found if isinstance(found, str) else None


async def _listed(
    lister: Callable[..., Awaitable[Any]],
    stripe_customer_id: str,
    oldest: int | None,
    keep: Callable[[Any], bool],
) -> list[Any]:
    """The customer's objects that `keep` accepts, listed newest first back to `oldest` (a
    Unix time; None: all): listing by customer is read-after-write consistent, Stripe's
    search is not."""
    found: list[Any] = []
    params: dict[str, Any] = {"customer": stripe_customer_id, "limit": _LOOKUP_PAGE}
    while True:
        page = await lister(params)
        found += [o for o in page.data if keep(o)]
        if not page.has_more or not page.data:
            return found
        if oldest is not None and page.data[-1].created < oldest:
            return found
        params["starting_after"] = page.data[-1].id


def _period_charge(charge: stripe.Charge, period: str) -> StripeCharge | None:
    """A charge carrying our metadata, as reconciliation sees it."""
    customer_id = _metadata(charge, "customer_id")
    if customer_id is None:
        return None
    state: ChargeState = "made"
    if charge.status not in MADE_STATUSES:
        state = "failed"
    elif charge.refunded:
        state = "refunded"
    return StripeCharge(
        charge_id=charge.id,
        state=state,
        failure_code=charge.failure_code if state == "failed" else None,
        pending=state == "made" and charge.status == "pending",
        payment_intent_id=_id(charge.payment_intent),
        amount_cents=charge.amount,
        currency=charge.currency,
        stripe_customer_id=_id(charge.customer),
        customer_id=customer_id,
        period=period,
        billing_key=_metadata(charge, KEY_METADATA),
    )


def _metadata(obj: stripe.Charge | stripe.PaymentIntent, name: str) -> str | None:
    metadata = obj.metadata
    return metadata[name] if metadata and name in metadata else None

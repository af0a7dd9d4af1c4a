"""The failure modes of the source documents, each reproduced against real services."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any

import pytest
import stripe
from aiohttp import web
from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import charging as charging_module
from activities import stripe_gateway
from activities.charging import (
    CLAIM_MISSING,
    PAUSED,
    SLOT_AHEAD,
    BillRequest,
    ChargingActivities,
)
from activities.stripe_access import DirectAccess, StripeAccess, VaultAccess
from activities.stripe_failures import CANCELED_INTENT, SLOW_RETRY, fence_of
from activities.stripe_gateway import StripeGateway, charge_params
from billing import ledger, period_keys
from billing.customers import CustomerRow
from billing.keys import customer_workflow_id, idempotency_key
from billing.models import (
    ChargeFailure,
    ChargeResult,
    Claim,
    Control,
    PeriodPlan,
    SkipResult,
)
from billing.periods import Period
from billing.rate_limit import stripe_rate
from billing.reconciliation import INCOMPLETE_INTENT
from billing.runs import start_period, start_reconcile
from stripe_emulator.emulator import Emulator
from stripe_emulator.routing import Route
from tests.integration.harness import Harness, always_visa
from tests.integration.holds import BillHold, hold_the_slots
from tests.integration.invariants import assert_billed_once
from tests.waiting import eventually
from vault.client import VaultAdmin, VaultUnavailable
from vault.endpoints import (
    CANCEL,
    DATABASE_UNAVAILABLE,
    HELD_UP,
    KEY_METADATA,
    UPSTREAM_UNREACHABLE,
)
from workflows.signals import PERIOD_CONTROL

PERIOD = Period(2026, 12)


async def test_saved_500_after_commit_is_resolved_by_lookup(harness: Harness) -> None:
    # Stripe committed the charge, answered 500, and replays that 500 for the key: the
    # worker finds the charge among the customer's payments instead of charging again.
    customers = await harness.seed(10)
    await harness.set_faults(error_after_commit=1.0)
    async with harness.running_worker():
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert summary.charged == 10
    assert (await harness.faults_injected())["error_after_commit"] == 10
    await assert_billed_once(harness, str(PERIOD), customers)


class RateLimitedOnce(StripeGateway):
    """Stripe's limiter refuses the first create (429: nothing executed, nothing saved with
    the key); the rest reach the emulator."""

    refused = False

    def refusal(self) -> stripe.StripeError:
        return stripe.RateLimitError("Too many requests", http_status=429)

    async def charge(
        self, claim: Claim, fencing_token: int | None = None
    ) -> ChargeResult | ChargeFailure:
        if not self.refused:
            self.refused = True
            raise self.refusal()
        return await super().charge(claim, fencing_token)


class VaultHeldUpOnce(RateLimitedOnce):
    """The vault sends nothing of the first create: held up past its deadline to send it."""

    def refusal(self) -> stripe.StripeError:
        return _vault_503(HELD_UP)


class VaultDatabaseAwayOnce(RateLimitedOnce):
    """The vault sends nothing of the first create: its key not checkable, the database away."""

    def refusal(self) -> stripe.StripeError:
        return _vault_503(DATABASE_UNAVAILABLE)


class VaultUpstreamUnreachableOnce(RateLimitedOnce):
    """The vault sends nothing of the first create: no connection to Stripe was made."""

    def refusal(self) -> stripe.StripeError:
        return _vault_503(UPSTREAM_UNREACHABLE)


def _vault_503(code: str) -> stripe.APIError:
    """The vault's 503 as the Stripe SDK raises it: the code in the body only (the SDK sets
    `code` on 400s, 402s and 404s)."""
    body = {"error": {"type": "api_error", "code": code, "message": code}}
    return stripe.APIError(code, http_body=json.dumps(body), http_status=503, json_body=body)


async def _billing_one(
    harness: Harness,
    gateway: type[StripeGateway],
    *,
    key_by_admin: bool = False,
    card_for: Callable[[int], str] = always_visa,
) -> tuple[CustomerRow, ChargingActivities, BillRequest]:
    """One customer due in an open period (paying with the card `card_for` gives it), billed
    by hand through `gateway` (or through the harness's vault, if it has one, with a key the
    worker token issued or, if `key_by_admin`, the admin token), attempt by attempt
    (_attempt)."""
    (customer,) = await harness.seed(1, card_for=card_for)
    async with harness.pool.acquire() as conn:
        plan = PeriodPlan(period=str(PERIOD), due=1, to_charge=1, expected_total_cents=0)
        await ledger.start_period(conn, plan, "billing-period-2026-12")
    access: StripeAccess
    if harness.vault is None:
        access = DirectAccess(gateway(harness.stripe, harness.settings.billing_charge_api))
    else:
        box = harness.settings.secret_box()
        await period_keys.issue_key(
            harness.pool,
            harness.vault.admin if key_by_admin else harness.vault.worker,
            box,
            PERIOD,
            customer.currency,
            10 * customer.amount_cents,
            timedelta(days=1),
            known_in=harness.pool,
        )
        access = harness.vault_access()
    charging = ChargingActivities(harness.pool, access, harness.settings)
    return customer, charging, BillRequest(period=str(PERIOD), customer_id=customer.customer_id)


def _attempt(number: int, run_id: str = "test-run") -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, attempt=number, is_local=True, workflow_run_id=run_id)
    return env


async def _behind_a_saved_500(
    harness: Harness, gateway: type[StripeGateway] = StripeGateway, *, key_by_admin: bool = False
) -> tuple[CustomerRow, ChargingActivities, BillRequest]:
    """_billing_one, whose first attempt Stripe began and failed before charging, saving its
    500 for the key (the faults are off again after it)."""
    billing = await _billing_one(harness, gateway, key_by_admin=key_by_admin)
    _, charging, request = billing
    await harness.set_faults(error_saved_before_commit=1.0)
    with pytest.raises(ApplicationError, match="did not answer definitively") as first:
        await _attempt(1).run(charging.bill, request)
    assert first.value.next_retry_delay is None
    await harness.set_faults(error_saved_before_commit=0.0)
    return billing


async def _cancelled(harness: Harness) -> None:
    async with harness.pool.acquire() as conn:
        await ledger.set_control(conn, str(PERIOD), "cancelled", "wrong prices", "ops")


class LookupRateLimitedOnce(StripeGateway):
    """Stripe's limiter refuses the first lookup; the rest reach the emulator."""

    refused = False

    async def find(self, claim: Claim) -> ChargeResult | ChargeFailure | None:
        if not self.refused:
            self.refused = True
            raise stripe.RateLimitError("Too many requests", http_status=429)
        return await super().find(claim)


async def test_a_lookup_after_a_saved_500_that_fails_is_mapped_as_any_stripe_error(
    harness: Harness,
) -> None:
    """The lookup that follows a replayed 500 is rate-limited: the attempt fails as a rate
    limit does (a Temporal failure from the one mapping, its retry a second away), not with
    Stripe's exception, and the next attempt finds the charge."""
    customer, charging, request = await _billing_one(harness, LookupRateLimitedOnce)
    await harness.set_faults(error_after_commit=1.0)
    with pytest.raises(ApplicationError, match="did not answer definitively"):
        await _attempt(1).run(charging.bill, request)
    with pytest.raises(ApplicationError, match="rate limit") as limited:
        await _attempt(2).run(charging.bill, request)
    assert limited.value.type == "StripeUnavailable" and not limited.value.non_retryable
    assert (await _attempt(3).run(charging.bill, request)).outcome == "charged"
    await assert_billed_once(harness, str(PERIOD), [customer])


async def test_a_lookup_refused_after_a_saved_500_never_sends_the_claim_back_to_the_gate(
    harness: Harness,
) -> None:
    """Stripe began the first request (its 500 is saved for the key), so the claim stays
    sent, whatever refuses the lookup after a replay: a 429 there says nothing of the
    create. Checked with the ledger's attempt counter at 1, the one case where reopening
    the claim would otherwise go through."""
    _, charging, request = await _behind_a_saved_500(harness, LookupRateLimitedOnce)
    # The next attempt's gate pass makes it 1.
    await harness.pool.execute("UPDATE billing_runs SET attempts = 0")
    with pytest.raises(ApplicationError, match="rate limit"):
        await _attempt(2).run(charging.bill, request)
    [row] = await harness.ledger_rows(str(PERIOD))
    assert (row["status"], row["attempts"]) == ("claimed", 1)
    assert row["charge_started_at"] is not None


class LookupKeyRevokedOnce(StripeGateway):
    """The vault refuses the first lookup: the period's key was revoked (the kill switch)."""

    refused = False

    async def find(self, claim: Claim) -> ChargeResult | ChargeFailure | None:
        if not self.refused:
            self.refused = True
            body = {"error": {"type": "invalid_request_error", "code": "vault_key_revoked"}}
            raise stripe.AuthenticationError("vault_key_revoked", http_status=401, json_body=body)
        return await super().find(claim)


async def test_a_lookup_key_refused_after_a_saved_500_never_sends_the_claim_back_to_the_gate(
    harness: Harness,
) -> None:
    """As above, for a refusal that pauses the period (the key revoked as the lookup went
    out): only the create's own refusal shows that nothing was sent, so the claim, which
    Stripe began, still counts as sent, and no pause or cancel meanwhile can stop the
    retry that finds out how it ended."""
    _, charging, request = await _behind_a_saved_500(harness, LookupKeyRevokedOnce)
    # The next attempt's gate pass makes it 1.
    await harness.pool.execute("UPDATE billing_runs SET attempts = 0")
    with pytest.raises(ApplicationError) as refused:
        await _attempt(2).run(charging.bill, request)
    assert refused.value.type == "KeyRefused"
    [row] = await harness.ledger_rows(str(PERIOD))
    assert (row["status"], row["attempts"]) == ("claimed", 1)
    assert row["charge_started_at"] is not None


class LookupRefused(StripeGateway):
    """Every lookup is refused as Stripe refuses a list by a customer it no longer has."""

    async def find(self, claim: Claim) -> ChargeResult | ChargeFailure | None:
        raise stripe.InvalidRequestError(  # type: ignore[no-untyped-call]
            f"No such customer: '{claim.stripe_customer_id}'",
            param="customer",
            code="resource_missing",
            http_status=404,
            json_body={"error": {"type": "invalid_request_error", "code": "resource_missing"}},
        )


@pytest.mark.parametrize("looked_up", ["after-a-saved-500", "first-on-an-old-claim"])
async def test_a_refused_lookup_is_recorded_saying_a_charge_may_exist(
    harness: Harness, looked_up: str
) -> None:
    """Where a charge with the key may exist (Stripe began the first request and saved its
    500; a claim past 23 hours), a lookup refused as a create is (404, "No such customer")
    was recorded as if Stripe had refused the charge, under the lookup's code (helper-141's
    F1). It shows nothing of that charge, and no retry changes it (retried, the claim would
    hold the run for ever, past any skip or cancel: helper-142's F1): the customer is
    recorded failed under `lookup_refused`, whose message says to check Stripe first."""
    _, charging, request = await _behind_a_saved_500(harness, LookupRefused)
    if looked_up == "first-on-an-old-claim":
        await harness.stripe_forgets_keys()
        await harness.pool.execute("UPDATE billing_runs SET claimed_at = now() - interval '1 day'")
    outcome = await _attempt(2).run(charging.bill, request)
    assert (outcome.outcome, outcome.failure_code) == ("failed", "lookup_refused")
    [row] = await harness.ledger_rows(str(PERIOD))
    assert (row["status"], row["failure_code"]) == ("failed", "lookup_refused")
    assert "resource_missing" in row["failure_message"]
    assert "the charge may exist" in row["failure_message"]


async def test_a_500_stripe_saved_before_charging_is_retried_until_stripe_forgets_the_key(
    harness: Harness,
) -> None:
    """Stripe began the request, failed before charging and saved its 500 for the key: a
    retry replays it and the lookup after it finds nothing, so the next retry is minutes
    away, not seconds. Once Stripe has forgotten the key, a retry charges once."""
    customer, charging, request = await _behind_a_saved_500(harness)
    with pytest.raises(ApplicationError, match="replays the 500 it saved") as replayed:
        await _attempt(2).run(charging.bill, request)
    assert (replayed.value.non_retryable, replayed.value.next_retry_delay) == (False, SLOW_RETRY)
    assert await harness.succeeded() == 0
    await harness.stripe_forgets_keys()
    assert (await _attempt(3).run(charging.bill, request)).outcome == "charged"
    await assert_billed_once(harness, str(PERIOD), [customer])
    sent = [(r["method"], r["status"], r["replayed"]) for r in await harness.requests()]
    creates = [(status, replay) for method, status, replay in sent if method == "POST"]
    assert creates[-3:] == [(500, False), (500, True), (200, False)]


async def _left_unconfirmed(
    harness: Harness, customer: CustomerRow, key: str
) -> stripe.PaymentIntent:
    """An intent with the claim's key that Stripe left unconfirmed after answering its
    request with an error (planted: the emulator makes none)."""
    return await harness.stripe.v1.payment_intents.create_async(
        {
            "amount": customer.amount_cents,
            "currency": customer.currency,
            "customer": customer.stripe_customer_id,
            "payment_method": customer.payment_method,
            "metadata": {KEY_METADATA: key},
        }
    )


@pytest.mark.parametrize("may_cancel", [True, False], ids=["cancelled", "key-from-before"])
async def test_an_intent_stripe_left_unconfirmed_behind_a_saved_500_is_cancelled(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch, may_cancel: bool
) -> None:
    """Stripe saved a 500 for the key and left the intent it had made unconfirmed (planted
    here: the emulator makes none). Once it is old enough not to be on its way, the lookup
    cancels it through the vault: it can charge nothing any more. A day on, Stripe has
    forgotten the key, and the vault sends it no more while its reservation is in doubt:
    reconciliation releases the reservation and charges the claim once, with its key. (With
    Stripe's day alone passing, the retry charged at once: a timeline that cannot happen,
    helper-185.) A period key from before keys could cancel leaves it, and the claim fails
    saying to cancel it by hand."""
    monkeypatch.setattr(stripe_gateway, "STALLED_AFTER_SECONDS", 0)
    customer, charging, request = await _behind_a_saved_500(vaulted)
    [row] = await vaulted.ledger_rows(str(PERIOD))
    stalled = await _left_unconfirmed(vaulted, customer, row["idempotency_key"])
    if not may_cancel:
        await vaulted.pool.execute(
            "UPDATE vault_keys SET allowed_endpoints = array_remove(allowed_endpoints, $1)",
            CANCEL,
        )
        outcome = await _attempt(2).run(charging.bill, request)
        assert (outcome.outcome, outcome.failure_code) == ("failed", INCOMPLETE_INTENT)
        left = await vaulted.stripe.v1.payment_intents.retrieve_async(stalled.id)
        assert left.status == "requires_confirmation"
        assert await vaulted.succeeded() == 0
        return
    with pytest.raises(ApplicationError, match="replays the 500 it saved") as replayed:
        await _attempt(2).run(charging.bill, request)
    assert replayed.value.next_retry_delay == SLOW_RETRY
    left = await vaulted.stripe.v1.payment_intents.retrieve_async(stalled.id)
    assert (left.status, left.cancellation_reason) == ("canceled", "abandoned")
    await vaulted.day_passes()
    with pytest.raises(ApplicationError, match="first sent 23 hours ago or more") as expired:
        await _attempt(3).run(charging.bill, request)
    assert expired.value.next_retry_delay == SLOW_RETRY
    async with vaulted.running_worker():
        report = await (await start_reconcile(vaulted.client, PERIOD, vaulted.task_queue)).result()
    assert [r.state for r in report.reservations] == ["released"]
    assert [(c.action, c.outcome) for c in report.claims] == [("redriven", "charged")]
    await assert_billed_once(vaulted, str(PERIOD), [customer])


async def test_a_lookup_key_leaves_an_intent_stripe_left_unconfirmed_to_a_person(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup key (reconciliation's, once the period's key can no longer be used) only
    reads: it does not try to cancel, which the vault would refuse and audit as a key
    reaching past its allowlist. The claim's failure says to cancel the intent by hand."""
    monkeypatch.setattr(stripe_gateway, "STALLED_AFTER_SECONDS", 0)
    customer, _, _ = await _behind_a_saved_500(vaulted)
    [row] = await vaulted.ledger_rows(str(PERIOD))
    stalled = await _left_unconfirmed(vaulted, customer, row["idempotency_key"])
    async with vaulted.pool.acquire() as conn:
        claim = await ledger.claim_by_key(conn, row["idempotency_key"])
    assert claim is not None
    lookup = await vaulted.vault_access().lookup_gateway(str(PERIOD), customer.currency)
    found = await lookup.find(claim)
    assert isinstance(found, ChargeFailure)
    assert (found.code, found.payment_intent_id) == (INCOMPLETE_INTENT, stalled.id)
    refused = "SELECT count(*) FROM vault_audit WHERE decision LIKE 'refused%'"
    assert await vaulted.pool.fetchval(refused) == 0


@pytest.mark.parametrize(
    ("claimed_ago", "reached"),
    [(timedelta(hours=21), True), (timedelta(hours=22, minutes=30), False)],
    ids=["within-22-hours", "later"],
)
async def test_a_cancel_reaches_a_charge_behind_a_500_stripe_saved(
    harness: Harness, claimed_ago: timedelta, reached: bool
) -> None:
    """The run is cancelled while Stripe replays a 500 it saved for a charge's key. The
    retry that meets the replay and finds no charge records the claim cancelled: Stripe
    executes nothing with the key until it forgets it, a day after its first request, and
    nothing is sent once the claim is closed. Not near that day's end: a request with the key
    may still be on its way, so the charge goes on as before."""
    customer, charging, request = await _behind_a_saved_500(harness)
    await _cancelled(harness)
    await harness.pool.execute(
        "UPDATE billing_runs SET claimed_at = claimed_at - $1::interval", claimed_ago
    )
    if not reached:
        with pytest.raises(ApplicationError, match="replays the 500 it saved"):
            await _attempt(2).run(charging.bill, request)
        await harness.stripe_forgets_keys()
        assert (await _attempt(3).run(charging.bill, request)).outcome == "charged"
        await assert_billed_once(harness, str(PERIOD), [customer])
        return
    outcome = await _attempt(2).run(charging.bill, request)
    assert (outcome.outcome, outcome.failure_code) == ("cancelled", "cancelled")
    [row] = await harness.ledger_rows(str(PERIOD))
    assert (row["status"], row["reason"], row["decided_by"]) == ("cancelled", "wrong prices", "ops")
    # A retry after Stripe forgets the key (a child's, or another worker's) sends nothing.
    await harness.stripe_forgets_keys()
    assert (await _attempt(3).run(charging.bill, request)).outcome == "cancelled"
    await assert_billed_once(
        harness, str(PERIOD), [customer], cancelled=frozenset([customer.customer_id])
    )
    creates = [
        r
        for r in await harness.requests()
        if (r["method"], r["path"]) == ("POST", "/v1/payment_intents")
    ]
    assert [(r["status"], r["replayed"]) for r in creates] == [(500, False), (500, True)]


async def test_a_cancel_behind_a_saved_500_fences_off_the_attempts_before(
    vaulted: Harness,
) -> None:
    """Attempt 1 is held up on its way (a frozen worker) while attempt 2 meets the 500
    Stripe saved for the key and the run's cancel is recorded. Once Stripe forgets the key
    and reconciliation has released its reservation, attempt 1 would charge a customer the
    ledger says was not: the vault refuses it, as attempt 2 fenced it off."""
    assert vaulted.vault is not None
    customer, charging, request = await _behind_a_saved_500(vaulted)
    await _cancelled(vaulted)
    outcome = await _attempt(2).run(charging.bill, request)
    assert outcome.outcome == "cancelled"
    [row] = await vaulted.ledger_rows(str(PERIOD))
    [key_id] = row["sent_through"]
    await vaulted.stripe_forgets_keys()
    released = await vaulted.vault.admin.resolve(key_id, row["idempotency_key"], "failed")
    assert released.state == "released"
    async with vaulted.pool.acquire() as conn:
        claim = await ledger.claim_by_key(conn, row["idempotency_key"])
    assert claim is not None
    gateway = await vaulted.vault_access().gateway(str(PERIOD), customer.currency)
    with pytest.raises(stripe.APIError) as superseded:
        await gateway.charge(claim, fencing_token=1)
    assert fence_of(superseded.value) == row["gate_passes"] + 1
    assert await vaulted.succeeded() == 0


@pytest.mark.parametrize(
    "why",
    [
        "the vault away",
        "no worker token",
        "a key issued with the admin token",
        "an admin's key the vault cannot describe",
    ],
)
async def test_a_cancel_behind_a_saved_500_waits_for_the_fence(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """No stop is recorded while the attempts before cannot be fenced off (the vault's admin
    API away, a worker without the token to fence, or a key the worker token may not fence,
    live or not known to be dead): the retry comes in 4 minutes, as any behind a saved 500,
    and a skip may still be accepted meanwhile."""
    assert vaulted.vault is not None
    admin_key = "admin" in why
    _, charging, request = await _behind_a_saved_500(vaulted, key_by_admin=admin_key)
    await _cancelled(vaulted)
    if why == "an admin's key the vault cannot describe":

        async def unanswered(self: VaultAdmin, key_id: str) -> Any:
            raise VaultUnavailable(503, None, "the vault did not answer")

        monkeypatch.setattr(VaultAdmin, "get_key", unanswered)
    # Port 9 (discard): nothing answers there.
    async with VaultAdmin("http://127.0.0.1:9", "a-worker-token-0123") as away:
        blocked = charging
        if not admin_key:
            access = VaultAccess(
                vaulted.pool,
                vaulted.settings.secret_box(),
                vaulted.vault.url,
                vaulted.settings.billing_charge_api,
                vaulted.http,
                None if why == "no worker token" else away,
            )
            blocked = ChargingActivities(vaulted.pool, access, vaulted.settings)
        with pytest.raises(ApplicationError, match="replays the 500 it saved") as replayed:
            await _attempt(2).run(blocked.bill, request)
    assert replayed.value.next_retry_delay == SLOW_RETRY
    [row] = await vaulted.ledger_rows(str(PERIOD))
    assert row["status"] == "claimed" and row["saved_error_at"] is not None
    assert await vaulted.pool.fetchval("SELECT count(*) FROM vault_fences") == 0
    if not admin_key:
        # The vault back: the next retry fences, then records the cancel.
        outcome = await _attempt(3).run(charging.bill, request)
        assert outcome.outcome == "cancelled"
    assert await vaulted.succeeded() == 0


@pytest.mark.parametrize("dead", ["expired", "revoked"])
async def test_a_cancel_behind_a_saved_500_needs_no_fence_on_a_key_dead_since(
    vaulted: Harness, dead: str
) -> None:
    """Attempt 1 went out through a key the worker token may not fence (issued with the
    admin token) that has expired or was revoked since, and the claim goes on through the
    key that replaced it. A dead key sends nothing more, so the cancel is recorded once the
    live key is fenced: waiting for a fence nobody can raise would hold the claim, and its
    period, for good."""
    assert vaulted.vault is not None
    customer, charging, request = await _behind_a_saved_500(vaulted, key_by_admin=True)
    [row] = await vaulted.ledger_rows(str(PERIOD))
    [first_key] = row["sent_through"]
    await period_keys.issue_key(
        vaulted.pool,
        vaulted.vault.worker,
        vaulted.settings.secret_box(),
        PERIOD,
        customer.currency,
        10 * customer.amount_cents,
        timedelta(days=1),
        known_in=vaulted.pool,
    )
    if dead == "revoked":
        await vaulted.vault.admin.revoke(first_key)
    else:
        await vaulted.pool.execute(
            "UPDATE vault_keys SET expires_at = now() WHERE id = $1", first_key
        )
    await _cancelled(vaulted)
    with pytest.raises(ApplicationError, match="retrying with the new key"):
        await _attempt(2).run(charging.bill, request)
    outcome = await _attempt(3).run(charging.bill, request)
    assert outcome.outcome == "cancelled"
    [row] = await vaulted.ledger_rows(str(PERIOD))
    [live] = [key_id for key_id in row["sent_through"] if key_id != first_key]
    fenced = await vaulted.pool.fetch("SELECT vault_key_id FROM vault_fences")
    assert [f["vault_key_id"] for f in fenced] == [live]
    assert await vaulted.succeeded() == 0


async def test_a_cap_refusal_that_fenced_nothing_leaves_the_claim_sent(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt 1 went out through the vault and got no answer (a 500: it may yet be at
    Stripe, as far as the worker knows); attempt 2 is refused on the key's cap by a vault
    that says it fenced nothing (no `fenced_below`, as from a vault of before fencing).
    Only the vault's fence proves attempt 1 can no longer charge: without it the claim
    stays sent, so a cancel now cannot record it uncharged while attempt 1 may charge."""
    _, charging, request = await _billing_one(vaulted, StripeGateway)
    await vaulted.set_faults(error_before_commit=1.0)
    with pytest.raises(ApplicationError, match="did not answer definitively"):
        await _attempt(1).run(charging.bill, request)

    async def capped_unfenced(
        _: StripeGateway, claim: Claim, fencing_token: int | None = None
    ) -> ChargeResult | ChargeFailure:
        body = {"error": {"type": "card_error", "code": "spend_cap_exceeded", "message": "cap"}}
        raise stripe.CardError(  # type: ignore[no-untyped-call]
            "cap", None, "spend_cap_exceeded", http_status=402, json_body=body
        )

    monkeypatch.setattr(StripeGateway, "charge", capped_unfenced)
    with pytest.raises(ApplicationError) as refused:
        await _attempt(2).run(charging.bill, request)
    assert refused.value.type == "SpendCapExceeded"
    [row] = await vaulted.ledger_rows(str(PERIOD))
    assert (row["status"], row["attempts"]) == ("claimed", 2)
    assert row["charge_started_at"] is not None


async def test_a_charge_an_earlier_run_of_the_childs_chain_recorded_counts_as_charged(
    harness: Harness,
) -> None:
    """The child continued as new while its attempt recorded the charge: the next run finds
    the row charged, and it is the chain's own charge, not an earlier one. A charge recorded
    by another chain (a re-drive) is already billed."""
    _, charging, request = await _billing_one(harness, StripeGateway)
    chain = request.model_copy(update={"claimant": "run-1"})
    assert (await _attempt(1, "run-1").run(charging.bill, chain)).outcome == "charged"
    assert (await _attempt(1, "run-2").run(charging.bill, chain)).outcome == "charged"
    redrive = request.model_copy(update={"claimant": "run-9"})
    assert (await _attempt(1, "run-9").run(charging.bill, redrive)).outcome == "already_billed"
    assert await harness.succeeded() == 1


async def test_a_skip_reaches_a_charge_behind_a_500_stripe_saved(harness: Harness) -> None:
    """A skip is refused while the charge may be executing at Stripe, and accepted once a
    retry has met the saved 500 and found no charge; the next retry records it skipped."""
    customer, charging, request = await _behind_a_saved_500(harness)
    key = idempotency_key(harness.settings.billing_key_namespace, customer.customer_id, PERIOD)

    async def skip() -> SkipResult:
        async with harness.pool.acquire() as conn:
            return await ledger.request_skip(
                conn, customer.customer_id, str(PERIOD), key, "disputed", "ops"
            )

    assert not (await skip()).skipped
    with pytest.raises(ApplicationError, match="replays the 500 it saved"):
        await _attempt(2).run(charging.bill, request)
    assert (await skip()).skipped
    outcome = await _attempt(3).run(charging.bill, request)
    assert (outcome.outcome, outcome.failure_code) == ("skipped", "skipped")
    await harness.stripe_forgets_keys()
    assert (await _attempt(4).run(charging.bill, request)).outcome == "skipped"
    assert await harness.succeeded() == 0
    [row] = await harness.ledger_rows(str(PERIOD))
    assert (row["status"], row["reason"], row["decided_by"]) == ("skipped", "disputed", "ops")


@pytest.mark.parametrize(
    "refused_once",
    [RateLimitedOnce, VaultHeldUpOnce, VaultDatabaseAwayOnce, VaultUpstreamUnreachableOnce],
    ids=["stripe-429", "vault-held-up", "vault-database-away", "vault-upstream-unreachable"],
)
@pytest.mark.parametrize("control", ["cancelled", "paused"])
async def test_a_stop_reaches_a_charge_whose_only_request_was_not_sent(
    harness: Harness, control: Control, refused_once: type[RateLimitedOnce]
) -> None:
    """Stripe executes nothing it rate-limits, and the vault sends nothing it answers held up
    or cannot check the key of: the retry passes the gate afresh, and a stop given meanwhile
    reaches it (the vault's two were charged after a cancel; helper-162 F3)."""
    _, charging, request = await _billing_one(harness, refused_once)
    with pytest.raises(ApplicationError):
        await _attempt(1).run(charging.bill, request)
    # Before the retry, an operator stops the period: nothing of this charge is at Stripe.
    async with harness.pool.acquire() as conn:
        await ledger.set_control(conn, str(PERIOD), control, "wrong prices", "ops")
    try:
        outcome: str | None = (await _attempt(2).run(charging.bill, request)).outcome
    except ApplicationError as err:
        outcome = err.type
    assert outcome == ("cancelled" if control == "cancelled" else PAUSED)
    assert await harness.charges() == []


async def test_a_claim_whose_row_was_deleted_by_hand_fails_saying_so(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its row gone between the claim and the gate: failed, by a code that says why, not a
    failure with no code (helper-153 L2). Nothing is charged."""
    _, charging, request = await _billing_one(harness, StripeGateway)

    async def deleted(_: ChargingActivities, claim: Claim, reserved: object) -> None:
        await harness.pool.execute(
            "DELETE FROM billing_runs WHERE idempotency_key = $1", claim.idempotency_key
        )

    monkeypatch.setattr(ChargingActivities, "_wait_for_slot", deleted)
    outcome = await _attempt(1).run(charging.bill, request)
    assert (outcome.outcome, outcome.failure_code) == ("failed", CLAIM_MISSING)
    assert await harness.charges() == []


async def test_a_claim_cancelled_by_another_hand_before_its_gate_reports_the_cancel(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its run records the claim cancelled between the bill's claim and its gate: the bill
    reports how the ledger ended it (cancelled), read again from the row, not as a claim
    whose row is gone (failed); nothing is charged."""
    _, charging, request = await _billing_one(harness, StripeGateway)

    async def cancelled(_: ChargingActivities, claim: Claim, reserved: object) -> None:
        await _cancelled(harness)
        async with harness.pool.acquire() as conn:
            stop = ChargeFailure(code="cancelled", message="an operator cancelled the period")
            await ledger.record_unbilled(conn, claim.idempotency_key, "cancelled", stop)

    monkeypatch.setattr(ChargingActivities, "_wait_for_slot", cancelled)
    outcome = await _attempt(1).run(charging.bill, request)
    assert outcome.outcome == "cancelled"
    assert await harness.charges() == []


async def test_a_charge_found_recorded_is_reported_with_its_charge_id(harness: Harness) -> None:
    """A bill that finds its customer's charge recorded already (a re-drive's, here) reports
    that charge's id from the ledger, as reconciliation's report of the re-drive names it."""
    _, charging, request = await _billing_one(harness, StripeGateway)
    charged = await _attempt(1, "run-1").run(charging.bill, request)
    redrive = request.model_copy(update={"claimant": "run-9"})
    again = await _attempt(1, "run-9").run(charging.bill, redrive)
    assert (again.outcome, again.charge_id) == ("already_billed", charged.charge_id)
    assert again.charge_id is not None


async def test_legacy_charges_api(harness: Harness) -> None:
    customers = await harness.seed(8)
    harness.settings = harness.settings.model_copy(update={"billing_charge_api": "charges"})
    await harness.set_faults(drop_after_commit=0.5, error_after_commit=0.2, seed=3)
    async with harness.running_worker():
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert summary.charged == 8
    requests = await harness.requests()
    assert {r["path"] for r in requests if r["method"] == "POST" and "charges" in r["path"]}
    assert not [r for r in requests if r["path"] == "/v1/payment_intents"]
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_charge_in_doubt_keeps_its_api_when_the_setting_changes(harness: Harness) -> None:
    customers = await harness.seed(3)
    # A worker set to the legacy Charges API claimed and charged them, and lost the answers.
    await harness.open_period_by_hand(PERIOD)
    async with harness.pool.acquire() as conn:
        for customer in customers:
            key = idempotency_key(
                harness.settings.billing_key_namespace, customer.customer_id, PERIOD
            )
            claim = await ledger.claim(
                conn, customer.customer_id, str(PERIOD), key, charge_api="charges"
            )
            assert (await ledger.begin_charge(conn, claim, None)).gate == "go"
            await harness.stripe.v1.charges.create_async(
                charge_params(claim, "charges"),  # type: ignore[arg-type]
                {"idempotency_key": key},
            )
    # Redeployed with PaymentIntents, the retries still reach /v1/charges with the same key and
    # Stripe replays the charges; another endpoint for the key would be refused as an
    # idempotency error, and customers who paid recorded as failed.
    assert harness.settings.billing_charge_api == "payment_intents"
    async with harness.running_worker():
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert summary.charged == 3
    assert not [r for r in await harness.requests() if r["path"] == "/v1/payment_intents"]
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_old_claim_is_looked_up_before_a_new_request(harness: Harness) -> None:
    # Past Stripe's 24-hour key window a replay would execute anew: an old claim is first
    # looked up, and a charge found there is recorded without another request.
    customers = await harness.seed(6)
    await harness.set_faults(drop_after_commit=1.0)
    harness.settings = harness.settings.model_copy(update={"billing_lookup_after_seconds": 0.001})
    async with harness.running_worker():
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert summary.charged == 6
    creates = [r for r in await harness.requests() if r["method"] == "POST"]
    # One create per customer (its response dropped); the retry found it by listing.
    assert len([r for r in creates if r["path"] == "/v1/payment_intents"]) == 6
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_charge_made_with_the_key_under_other_parameters_is_found_not_failed(
    harness: Harness,
) -> None:
    """A worker of an earlier release charged the claim with other parameters (here its
    description), and its answer was lost: Stripe refuses the retry's request as an
    idempotency error. A charge with the key may exist, so it is looked up, and the customer
    who paid is recorded charged, not failed (and so billed again by a re-drive)."""
    customer, charging, request = await _billing_one(harness, StripeGateway)
    claim = await harness.claim_by_hand(PERIOD, customer.customer_id)
    earlier = charge_params(claim, "payment_intents") | {"description": "an earlier release's"}
    made = await harness.stripe.v1.payment_intents.create_async(
        earlier,  # type: ignore[arg-type]
        {"idempotency_key": claim.idempotency_key},
    )
    outcome = await _attempt(1).run(charging.bill, request)
    assert (outcome.outcome, outcome.charge_id) == ("charged", made.latest_charge)
    creates = [
        r["status"]
        for r in await harness.requests()
        if (r["method"], r["path"]) == ("POST", "/v1/payment_intents")
    ]
    assert creates == [200, 400], "the bill's request met no idempotency error"
    # (assert_billed_once would flag the earlier release's parameters, as it should.)
    [row] = await harness.ledger_rows(str(PERIOD))
    assert (row["status"], row["charge_id"]) == ("charged", made.latest_charge)
    assert await harness.succeeded() == 1


async def test_an_old_claim_declined_after_its_lookup_keeps_the_decline(harness: Harness) -> None:
    """An old claim is looked up first and nothing is found; the create that follows is
    declined. That decline is Stripe's answer to the charge itself, recorded under its own
    code, not as a refused lookup (whose message says the charge may exist)."""
    customer, charging, request = await _billing_one(
        harness, StripeGateway, card_for=lambda _: "pm_card_chargeCustomerFail"
    )
    await harness.claim_by_hand(PERIOD, customer.customer_id)
    await harness.pool.execute("UPDATE billing_runs SET claimed_at = now() - interval '1 day'")
    outcome = await _attempt(1).run(charging.bill, request)
    assert (outcome.outcome, outcome.failure_code) == ("failed", "card_declined")
    [row] = await harness.ledger_rows(str(PERIOD))
    assert (row["status"], row["failure_code"]) == ("failed", "card_declined")
    sent = [r["method"] for r in await harness.requests() if r["path"] == "/v1/payment_intents"]
    assert sent == ["GET", "POST"], "not looked up before the create"


async def test_an_old_claim_whose_intent_was_cancelled_on_stripe_is_failed_not_sent_again(
    harness: Harness,
) -> None:
    """An intent waits on its customer for days (a bank account's microdeposits) and an
    operator cancels it on Stripe, as the wait's message says to. The claim is then old, so
    its next attempt looks it up first: it finds the cancelled intent and records the
    customer failed (payment_intent_canceled), sending no new charge behind the cancel."""
    customer, charging, request = await _billing_one(harness, StripeGateway)
    claim = await harness.claim_by_hand(PERIOD, customer.customer_id)
    waiting = await harness.stripe.v1.payment_intents.create_async(
        {
            "amount": customer.amount_cents,
            "currency": customer.currency,
            "customer": customer.stripe_customer_id,
            "payment_method": customer.payment_method,
            "metadata": {KEY_METADATA: claim.idempotency_key},
        }
    )
    await harness.stripe.v1.payment_intents.cancel_async(
        waiting.id, {"cancellation_reason": "requested_by_customer"}
    )
    await harness.pool.execute("UPDATE billing_runs SET claimed_at = now() - interval '1 day'")
    outcome = await _attempt(1).run(charging.bill, request)
    assert (outcome.outcome, outcome.failure_code) == ("failed", CANCELED_INTENT)
    [row] = await harness.ledger_rows(str(PERIOD))
    assert (row["status"], row["failure_code"]) == ("failed", CANCELED_INTENT)
    assert await harness.succeeded() == 0
    creates = [
        r
        for r in await harness.requests()
        if (r["method"], r["path"]) == ("POST", "/v1/payment_intents")
    ]
    # The intent planted above only.
    assert len(creates) == 1, "a new charge was sent behind the cancel"


async def test_a_retry_takes_a_stripe_slot_of_its_own(harness: Harness) -> None:
    """The Stripe slot the workflow waited for serves the bill's first attempt only: a retry
    comes after that attempt's requests, so it takes a slot of its own (here 100 s off, so
    it hands the wait back to the workflow) rather than sending at once."""
    harness.settings = harness.settings.model_copy(update={"billing_stripe_rps": 0.01})
    _, charging, request = await _billing_one(harness, StripeGateway)
    rate = stripe_rate(harness.pool, harness.settings)
    assert rate is not None
    waited = await rate.reserve()
    with pytest.raises(ApplicationError) as ahead:
        await _attempt(2).run(charging.bill, request.model_copy(update={"slot": waited.at}))
    assert ahead.value.type == SLOT_AHEAD
    assert await harness.charges() == []


async def test_an_old_claims_lookup_takes_a_stripe_slot_of_its_own(harness: Harness) -> None:
    """An old claim sends two requests up front, its lookup and its create: its attempt
    reserves a slot for each, so the cluster's next request waits for both (200 s at one
    request per 100 s), and together they keep to the rate shared with the account's
    other traffic."""
    harness.settings = harness.settings.model_copy(update={"billing_stripe_rps": 0.01})
    customer, charging, request = await _billing_one(harness, StripeGateway)
    await harness.claim_by_hand(PERIOD, customer.customer_id)
    await harness.pool.execute("UPDATE billing_runs SET claimed_at = now() - interval '1 day'")
    assert (await _attempt(1).run(charging.bill, request)).outcome == "charged"
    rate = stripe_rate(harness.pool, harness.settings)
    assert rate is not None
    assert (await rate.reserve()).wait_seconds > 150


class _TwoHoursSlow(datetime):
    @classmethod
    def now(cls, tz: tzinfo | None = None) -> _TwoHoursSlow:
        return cls.fromtimestamp(datetime.now(UTC).timestamp() - 7200, tz)


async def test_an_old_claim_is_judged_by_the_databases_clock_not_the_workers(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Charged at Stripe, its answer lost, the claim retried a day later, once Stripe has
    forgotten its key: a worker whose clock runs two hours slow would take the claim for
    one Stripe still remembers, and send it again. Its age is the database's."""
    customer, charging, request = await _billing_one(harness, StripeGateway)
    await harness.set_faults(drop_after_commit=1.0)
    with pytest.raises(ApplicationError):
        await _attempt(1).run(charging.bill, request)
    await harness.set_faults(drop_after_commit=0.0)
    await harness.pool.execute(
        "UPDATE billing_runs SET claimed_at = claimed_at - interval '23 hours 30 minutes'"
    )
    await harness.stripe_forgets_keys()
    monkeypatch.setattr(charging_module, "datetime", _TwoHoursSlow)
    assert (await _attempt(2).run(charging.bill, request)).outcome == "charged"
    await assert_billed_once(harness, str(PERIOD), [customer])
    sent = [(r["method"], r["path"]) for r in await harness.requests()]
    assert sent.count(("POST", "/v1/payment_intents")) == 1, sent


async def test_worker_killed_between_claim_and_charge(harness: Harness) -> None:
    customers = await harness.seed(10)
    # Every charge fails before Stripe commits anything, so the claims stand uncharged.
    await harness.set_faults(error_before_commit=1.0)
    worker = harness.worker_process()
    await start_period(harness.client, PERIOD, harness.task_queue)

    async def all_claimed_none_charged() -> bool:
        rows = await harness.ledger_rows(str(PERIOD))
        return len(rows) == 10 and not await harness.charges()

    await eventually(all_claimed_none_charged)
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    assert {r["status"] for r in await harness.ledger_rows(str(PERIOD))} == {"claimed"}
    await harness.set_faults(error_before_commit=0.0)
    async with harness.running_worker():
        handle = harness.client.get_workflow_handle("billing-period-2026-12")
        await handle.result()
    await assert_billed_once(harness, str(PERIOD), customers)


class HoldStripesReplays:
    """Stripe (the emulator, which runs in the test's process) holds its answer to every
    request it replays for an idempotency key, until `go_on` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.go_on = asyncio.Event()
        handle = Emulator.handle

        async def held(emulator: Emulator, request: web.Request, route: Route) -> Any:
            response = await handle(emulator, request, route)
            if response.headers.get("Idempotent-Replayed") == "true":
                await asyncio.wait_for(self.go_on.wait(), 60)
            return response

        monkeypatch.setattr(Emulator, "handle", held)


async def test_worker_killed_between_charge_and_record(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    customers = await harness.seed(10)
    # Stripe commits every charge but the answers are lost: charged in Stripe, not recorded.
    # A retry with the same key replays the charge, a second later; Stripe holds those
    # replays until the worker is dead, so however slow the machine, not one charge is
    # recorded before the kill.
    replays = HoldStripesReplays(monkeypatch)
    await harness.set_faults(drop_after_commit=1.0, latency_ms=0)
    worker = harness.worker_process()
    await start_period(harness.client, PERIOD, harness.task_queue)

    async def all_committed() -> bool:
        return len(await harness.charges()) == 10

    await eventually(all_committed)
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    replays.go_on.set()
    rows = await harness.ledger_rows(str(PERIOD))
    assert [r["status"] for r in rows] == ["claimed"] * 10, "a charge was recorded before the kill"
    async with harness.running_worker():
        await harness.client.get_workflow_handle("billing-period-2026-12").result()
    await assert_billed_once(harness, str(PERIOD), customers)


@pytest.mark.parametrize(
    ("customers", "stripe_rps"),
    [
        # One task: the retried task bills again, and its claim finds the row charged by
        # this very run.
        (1, None),
        # The second customer's Stripe slot is 4 s off (both take theirs once both have
        # claimed, however slow the machine): its first attempt, which claimed, is replayed
        # from an earlier task, and the next attempt's claim finds the charge.
        (2, 0.25),
    ],
    ids=["claim-in-the-same-task", "claim-in-an-earlier-task"],
)
async def test_a_retried_workflow_task_reports_its_own_charge(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, customers: int, stripe_rps: float | None
) -> None:
    # A signal arriving while a child charges makes the server refuse that workflow task's
    # completion, and the task runs again after the record: the charge is still "charged",
    # not "already billed". Each bill that has run waits until its child has taken the
    # signal, so the signal lands inside the charging task however slow the machine.
    seeded = await harness.seed(customers)
    harness.settings = harness.settings.model_copy(update={"billing_stripe_rps": stripe_rps})
    claimed: set[str] = set()
    all_claimed = asyncio.Event()

    async def once_all_claimed(claim: Claim) -> None:
        claimed.add(claim.customer_id)
        if len(claimed) == customers:
            all_claimed.set()
        await asyncio.wait_for(all_claimed.wait(), 60)

    hold_the_slots(monkeypatch, once_all_claimed)
    signalled = SignalledAsItsBillEnds(harness.client)
    async with harness.running_worker(interceptors=[signalled]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        summary = await handle.result()
    assert (summary.charged, summary.already_billed) == (customers, 0)
    children = [customer_workflow_id(PERIOD, c.customer_id) for c in seeded]
    assert signalled.children == set(children)
    waited_for_a_slot = 0
    for child in children:
        events = (await harness.client.get_workflow_handle(child).fetch_history()).events
        assert any(e.HasField("workflow_task_failed_event_attributes") for e in events), (
            f"{child}: the signal did not land inside its charging task"
        )
        waited_for_a_slot += any(e.HasField("timer_started_event_attributes") for e in events)
    # Every customer after the first claimed in a task before the one that charged it.
    assert waited_for_a_slot == customers - 1
    await assert_billed_once(harness, str(PERIOD), seeded)


class SignalledAsItsBillEnds(BillHold):
    """Holds each child's first bill that has run until the child has taken a period signal
    (Temporal has it, the charging task still open); not the bill of the task run again,
    whose completion the signal would refuse in turn."""

    def __init__(self, client: Client) -> None:
        super().__init__()
        self.client = client
        self.children: set[str] = set()

    async def hold(self) -> None:
        child = activity.info().workflow_id
        assert child is not None
        if child not in self.children:
            self.children.add(child)
            await self.client.get_workflow_handle(child).signal(PERIOD_CONTROL)


async def test_stripe_rate_is_held_by_the_shared_limit(harness: Harness) -> None:
    # Stripe (the emulator) answers 429 above 6 requests/s; charges take slots of 4/s from
    # the ledger database, so not one request is refused and every customer is charged once.
    customers = await harness.seed(16)
    await harness.set_faults(rate_limit_rps=6.0)
    harness.settings = harness.settings.model_copy(update={"billing_stripe_rps": 4.0})
    async with harness.running_worker():
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert summary.charged == 16
    assert (await harness.faults_injected())["rate_limited"] == 0
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_two_worker_processes_share_the_stripe_rate(harness: Harness) -> None:
    # 3 requests/s between them, against Stripe's 4/s: two workers each holding 3/s on its
    # own would send 6/s and meet 429s within two seconds.
    customers = await harness.seed(24)
    await harness.set_faults(rate_limit_rps=4.0)
    harness.settings = harness.settings.model_copy(update={"billing_stripe_rps": 3.0})
    workers = [harness.worker_process(), harness.worker_process()]
    await harness.workers_polling(2)
    summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert all(w.poll() is None for w in workers)
    assert summary.charged == 24
    assert (await harness.faults_injected())["rate_limited"] == 0
    created = [c["created"] for c in await harness.charges()]
    assert max(created) - min(created) >= 23 / 3 - 1, "charges were not paced at 3/s"
    # Both processes charged: their identities (pid@host) completed the children's tasks.
    identities: set[str] = set()
    for customer in customers:
        handle = harness.client.get_workflow_handle(
            customer_workflow_id(PERIOD, customer.customer_id)
        )
        identities |= {
            event.workflow_task_completed_event_attributes.identity
            for event in (await handle.fetch_history()).events
            if event.HasField("workflow_task_completed_event_attributes")
        }
    assert len(identities) == 2
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_stripe_429s_are_retried_with_the_same_key(harness: Harness) -> None:
    # Without the queue's limit, the emulator refuses what passes its rate: retries charge
    # each once. One request a minute, until one was refused: at 4 a second, a machine slow
    # enough sent none too many (stop 63's CI).
    customers = await harness.seed(16)
    await harness.set_faults(rate_limit_rps=1 / 60)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue)

        async def refused() -> bool:
            return (await harness.faults_injected())["rate_limited"] > 0

        await eventually(refused)
        await harness.set_faults(rate_limit_rps=None)
        summary = await handle.result()
    assert summary.charged == 16
    await assert_billed_once(harness, str(PERIOD), customers)

"""`POST /v1/payment_intents/{id}/cancel` through the vault: forwarded only for an intent no one
confirmed, of a charge its period's keys sent and have no answer to (vault.cancels)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import aiohttp
import asyncpg
import pytest
import stripe
from aiohttp import web
from pydantic import SecretStr
from stripe.params import PaymentIntentCreateParams

from stripe_emulator import RunningEmulator
from vault import reservations
from vault.app import serve
from vault.client import VaultAdmin
from vault.endpoints import CANCEL, CHARGE_IN_FLIGHT, KEY_METADATA, NOT_IN_DOUBT
from vault.models import IssuedKey
from vault.settings import VaultSettings

from .conftest import Issue
from .support import (
    DEFAULT_ENDPOINTS,
    charge,
    charge_in_doubt,
    closed_port,
    proxied_calls,
    stand_in_upstream,
    via_vault,
)

StripeFor = Callable[[IssuedKey], stripe.StripeClient]
AMOUNT = 2_500


async def unconfirmed(
    direct: stripe.StripeClient,
    customer: str,
    sent_with: str | None = "stalled",
    amount: int = AMOUNT,
    with_method: bool = True,
) -> str:
    """An intent left as Stripe leaves one after answering its create-and-confirm with an
    error: made, not confirmed; its metadata names the request's Idempotency-Key, as the
    billing workers' charges do. Without its payment method, it is left
    `requires_payment_method` instead."""
    method = (await direct.v1.customers.retrieve_async(customer)).default_source
    assert isinstance(method, str)
    params: PaymentIntentCreateParams = {
        "amount": amount,
        "currency": "usd",
        "customer": customer,
        "automatic_payment_methods": {"enabled": True, "allow_redirects": "never"},
        "metadata": {KEY_METADATA: sent_with} if sent_with else {},
    }
    if with_method:
        params["payment_method"] = method
    made = await direct.v1.payment_intents.create_async(params=params)
    assert made.status == ("requires_confirmation" if with_method else "requires_payment_method")
    return made.id


async def cancel(client: stripe.StripeClient, intent_id: str) -> stripe.PaymentIntent:
    return await client.v1.payment_intents.cancel_async(
        intent_id, {"cancellation_reason": "abandoned"}
    )


async def status_of(direct: stripe.StripeClient, intent_id: str) -> str:
    return (await direct.v1.payment_intents.retrieve_async(intent_id)).status


def cancelling(**overrides: object) -> dict[str, object]:
    return {"allowed_endpoints": [*DEFAULT_ENDPOINTS, CANCEL], **overrides}


@pytest.fixture
async def cancelling_key(issue: Issue) -> IssuedKey:
    return await issue(**cancelling())


async def in_doubt(
    emulator: RunningEmulator, client: stripe.StripeClient, customer: str, key: str = "stalled"
) -> None:
    """The key's charge met a 500: the vault has no answer to say what Stripe did."""
    await charge_in_doubt(emulator, client, customer, AMOUNT, key, "error_before_commit")


async def test_an_unconfirmed_intent_of_a_charge_in_doubt_is_cancelled_and_audited(
    cancelling_key: IssuedKey,
    stripe_via_vault: StripeFor,
    direct_stripe: stripe.StripeClient,
    customer: str,
    emulator: RunningEmulator,
    admin: VaultAdmin,
) -> None:
    client = stripe_via_vault(cancelling_key)
    await in_doubt(emulator, client, customer)
    intent_id = await unconfirmed(direct_stripe, customer)
    cancelled = await cancel(client, intent_id)
    assert (cancelled.status, cancelled.cancellation_reason) == ("canceled", "abandoned")
    assert await status_of(direct_stripe, intent_id) == "canceled"
    [row, *_] = await proxied_calls(admin, cancelling_key.id)
    assert (row.method, row.path) == ("POST", f"/v1/payment_intents/{intent_id}/cancel")
    assert (row.decision, row.upstream_status) == ("forwarded", 200)
    # The charge it was made for.
    assert (row.customer, row.amount_cents, row.currency) == (customer, AMOUNT, "usd")


async def test_a_key_renewed_since_cancels_an_intent_of_its_periods_earlier_key(
    cancelling_key: IssuedKey,
    issue: Issue,
    stripe_via_vault: StripeFor,
    direct_stripe: stripe.StripeClient,
    customer: str,
    emulator: RunningEmulator,
) -> None:
    await in_doubt(emulator, stripe_via_vault(cancelling_key), customer)
    intent_id = await unconfirmed(direct_stripe, customer)
    renewed = await issue(**cancelling())
    assert (await cancel(stripe_via_vault(renewed), intent_id)).status == "canceled"


async def test_an_intent_of_no_charge_in_doubt_of_the_keys_period_is_not_cancelled(
    cancelling_key: IssuedKey,
    issue: Issue,
    stripe_via_vault: StripeFor,
    direct_stripe: stripe.StripeClient,
    customer: str,
    emulator: RunningEmulator,
    admin: VaultAdmin,
) -> None:
    # A cancel would stop a payment that is none of this key's, or one already answered.
    client = stripe_via_vault(cancelling_key)
    await in_doubt(emulator, client, customer)
    # Charged, so answered, and a charge that met a 500 under another period's key.
    await charge(client, customer, AMOUNT, "answered")
    await in_doubt(
        emulator,
        stripe_via_vault(await issue(**cancelling(period="2027-01"))),
        customer,
        "next-period",
    )
    others = {
        "another integration's": await unconfirmed(direct_stripe, customer, None),
        "another amount's": await unconfirmed(direct_stripe, customer, amount=AMOUNT + 1),
        "an answered charge's": await unconfirmed(direct_stripe, customer, "answered"),
        "another period's": await unconfirmed(direct_stripe, customer, "next-period"),
        "another integration's paid": await unconfirmed(direct_stripe, customer, None),
    }
    # Nor is the state of an intent not the key's told it (a 400 would say it).
    await direct_stripe.v1.payment_intents.confirm_async(
        others["another integration's paid"], {"off_session": True}
    )
    for what, intent_id in others.items():
        left = await status_of(direct_stripe, intent_id)
        with pytest.raises(stripe.PermissionError) as refused:
            await cancel(client, intent_id)
        assert refused.value.error, what
        assert refused.value.error.code == "payment_intent_not_this_keys", what
        assert await status_of(direct_stripe, intent_id) == left, what
    row = (await proxied_calls(admin, cancelling_key.id))[0]
    assert (row.decision, row.refusal_code, row.upstream_status) == (
        "refused_request",
        "payment_intent_not_this_keys",
        None,
    )
    # Nothing of an intent not the key's is written to its audit.
    assert (row.customer, row.amount_cents) == (None, None)


@pytest.mark.parametrize("left", ["succeeded", "requires_payment_method"])
async def test_an_intent_of_a_charge_in_doubt_not_awaiting_confirmation_is_not_cancelled(
    cancelling_key: IssuedKey,
    stripe_via_vault: StripeFor,
    direct_stripe: stripe.StripeClient,
    customer: str,
    emulator: RunningEmulator,
    left: str,
) -> None:
    """Only `requires_confirmation` may be cancelled, though Stripe cancels others too: an
    intent Stripe rolled forward, or one in any other state (asking for a payment method, say),
    is not the vault's to judge harmless. The caller is told so in Stripe's own code, and looks
    again."""
    client = stripe_via_vault(cancelling_key)
    await in_doubt(emulator, client, customer)
    confirmed = left == "succeeded"
    intent_id = await unconfirmed(direct_stripe, customer, with_method=confirmed)
    if confirmed:
        await direct_stripe.v1.payment_intents.confirm_async(intent_id, {"off_session": True})
    with pytest.raises(stripe.InvalidRequestError) as refused:
        await cancel(client, intent_id)
    assert refused.value.code == "payment_intent_unexpected_state"
    assert f"{intent_id} is {left}" in str(refused.value)
    assert await status_of(direct_stripe, intent_id) == left


async def test_a_key_without_the_cancel_entry_or_an_unknown_intent_is_refused(
    cancelling_key: IssuedKey,
    issue: Issue,
    stripe_via_vault: StripeFor,
    direct_stripe: stripe.StripeClient,
    customer: str,
    emulator: RunningEmulator,
) -> None:
    older = await issue()
    await in_doubt(emulator, stripe_via_vault(older), customer)
    intent_id = await unconfirmed(direct_stripe, customer)
    with pytest.raises(stripe.PermissionError) as refused:
        await cancel(stripe_via_vault(older), intent_id)
    assert refused.value.error and refused.value.error.code == "endpoint_not_allowed"
    with pytest.raises(stripe.InvalidRequestError) as missing:
        await cancel(stripe_via_vault(cancelling_key), "pi_unknown")
    assert missing.value.code == "resource_missing"
    assert await status_of(direct_stripe, intent_id) == "requires_confirmation"


@pytest.mark.parametrize(
    ("read", "status", "code", "retry"),
    [
        (401, 502, "upstream_refused", "false"),
        (403, 502, "upstream_refused", "false"),
        (500, 503, "upstream_unavailable", "true"),
        (None, 502, "upstream_unavailable", "true"),
    ],
    ids=["restricted-key", "forbidden", "stripe-failing", "stripe-unreachable"],
)
async def test_a_vault_that_cannot_read_the_intent_cancels_nothing_and_says_whether_to_retry(
    cancelling_key: IssuedKey,
    stripe_via_vault: StripeFor,
    direct_stripe: stripe.StripeClient,
    customer: str,
    emulator: RunningEmulator,
    vault_settings: VaultSettings,
    read: int | None,
    status: int,
    code: str,
    retry: str,
) -> None:
    """Its read before the cancel refused (401, 403: a restricted key without the right) was
    answered 503 "retry", which no retry mends (helper-183); a read Stripe failed, or that
    reached no Stripe, is one to retry, or the worker leaves an intent it could cancel."""
    await in_doubt(emulator, stripe_via_vault(cancelling_key), customer)
    intent_id = await unconfirmed(direct_stripe, customer)

    async def answer(request: web.Request) -> web.Response:
        assert read is not None
        return web.json_response({"error": {"type": "api_error"}}, status=read)

    update: dict[str, object]
    async with contextlib.AsyncExitStack() as stack:
        if read == 401:
            # The emulator takes test secret keys only, as Stripe refuses a key without the right.
            update = {"upstream_stripe_secret": SecretStr("rk_test_" + "cannot_read_intents")}
        elif read is None:
            update = {
                "upstream_stripe_base": f"http://127.0.0.1:{stack.enter_context(closed_port())}"
            }
        else:
            update = {
                "upstream_stripe_base": await stack.enter_async_context(stand_in_upstream(answer))
            }
        vault = await stack.enter_async_context(serve(vault_settings.model_copy(update=update)))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        client = via_vault(cancelling_key.secret.get_secret_value(), vault.url, session)
        with pytest.raises(stripe.APIError) as refused:
            await cancel(client, intent_id)
    assert refused.value.http_status == status and refused.value.error is not None
    assert refused.value.error.code == code
    assert (refused.value.headers or {}).get("Stripe-Should-Retry") == retry
    if code == "upstream_refused":
        assert "VAULT_UPSTREAM_STRIPE_SECRET" in str(refused.value.user_message)
    assert await status_of(direct_stripe, intent_id) == "requires_confirmation"


async def test_a_charge_sent_again_now_is_waited_for_and_one_settled_since_is_not_cancelled(
    cancelling_key: IssuedKey,
    stripe_via_vault: StripeFor,
    direct_stripe: stripe.StripeClient,
    customer: str,
    emulator: RunningEmulator,
    admin: VaultAdmin,
    db: asyncpg.Pool,
) -> None:
    """Both were 403 `payment_intent_not_this_keys`, which the worker took for "being sent
    again, retry": after a person resolved the reservation by hand, its lookup retried the
    cancel for ever (helper-185). A retry on its way now (the reservation pending) is 409
    `payment_intent_charge_in_flight`, to retry; one settled since is not the key's to
    cancel."""
    client = stripe_via_vault(cancelling_key)
    await in_doubt(emulator, client, customer)
    intent_id = await unconfirmed(direct_stripe, customer)
    # As a takeover leaves it while its request is on its way.
    await db.execute("UPDATE vault_reservations SET state = 'pending'")
    with pytest.raises(stripe.APIError) as in_flight:
        await cancel(client, intent_id)
    assert in_flight.value.http_status == 409 and in_flight.value.error is not None
    assert in_flight.value.error.code == CHARGE_IN_FLIGHT
    assert (in_flight.value.headers or {}).get("Stripe-Should-Retry") == "true"
    await db.execute("UPDATE vault_reservations SET state = 'unknown'")
    await admin.resolve(cancelling_key.id, "stalled", "failed")
    with pytest.raises(stripe.PermissionError) as settled:
        await cancel(client, intent_id)
    assert settled.value.error is not None and settled.value.error.code == NOT_IN_DOUBT
    assert await status_of(direct_stripe, intent_id) == "requires_confirmation"
    decisions = [
        (r.decision, r.refusal_code) for r in await proxied_calls(admin, cancelling_key.id)
    ]
    assert decisions[:2] == [
        ("refused_request", NOT_IN_DOUBT),
        ("refused_in_flight", CHARGE_IN_FLIGHT),
    ]


@pytest.mark.parametrize(
    ("states", "found"),
    [
        (("committed", "unknown"), "unknown"),
        (("unknown", "pending"), "unknown"),
        (("released", "pending"), "pending"),
        (("pending", "committed"), "pending"),
    ],
)
async def test_a_charge_reserved_under_two_keys_of_the_period_stands_where_the_least_settled_is(
    issue: Issue, db: asyncpg.Pool, states: tuple[str, str], found: str
) -> None:
    """A renewal leaves one charge reserved under the old key and the new: in doubt under
    either, its intent may be cancelled; else on its way under either, the cancel waits for
    its answer. Which row the database reads first must not decide."""
    keys = [await issue(**cancelling()), await issue(**cancelling())]
    charge = reservations.Charge("POST /v1/payment_intents", AMOUNT, "usd", "cus_two_keys")
    for key, state in zip(keys, states, strict=True):
        await db.execute(
            "INSERT INTO vault_reservations (vault_key_id, idempotency_key, endpoint,"
            " amount_cents, currency, customer, day, state, committed_cents)"
            " VALUES ($1, 'stalled', $2, $3, 'usd', $4, current_date, $5, $6)",
            key.id,
            charge.endpoint,
            AMOUNT,
            charge.customer,
            state,
            AMOUNT if state == "committed" else None,
        )
    other_label = await issue(**cancelling(label="another-integration"))
    async with db.acquire() as conn:
        for key in keys:
            assert await reservations.charge_state_for(conn, key.id, "stalled", charge) == found
        # Not the charge (another customer, currency or endpoint), or not the key's label:
        # none of the key's to cancel.
        for other in (
            dataclasses.replace(charge, customer="cus_someone_else"),
            dataclasses.replace(charge, currency="eur"),
            dataclasses.replace(charge, endpoint="POST /v1/charges"),
        ):
            assert await reservations.charge_state_for(conn, keys[0].id, "stalled", other) is None
        assert await reservations.charge_state_for(conn, other_label.id, "stalled", charge) is None

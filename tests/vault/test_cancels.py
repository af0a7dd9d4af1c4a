"""`POST /v1/payment_intents/{id}/cancel` through the vault: forwarded only for an intent no one
confirmed that one of the key's own charges could have made (vault.cancels)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import stripe

from stripe_emulator import RunningEmulator
from vault.client import VaultAdmin
from vault.endpoints import CANCEL
from vault.models import IssuedKey

from .conftest import Issue
from .support import DEFAULT_ENDPOINTS, charge, charge_in_doubt, proxied_calls

StripeFor = Callable[[IssuedKey], stripe.StripeClient]
AMOUNT = 2_500


async def unconfirmed(direct: stripe.StripeClient, customer: str, amount: int = AMOUNT) -> str:
    """An intent left as Stripe leaves one after answering its create-and-confirm with an
    error: made, not confirmed."""
    settings = (await direct.v1.customers.retrieve_async(customer)).invoice_settings
    method = settings.default_payment_method if settings else None
    assert isinstance(method, str)
    made = await direct.v1.payment_intents.create_async(
        params={
            "amount": amount,
            "currency": "usd",
            "customer": customer,
            "payment_method": method,
            "automatic_payment_methods": {"enabled": True, "allow_redirects": "never"},
        }
    )
    assert made.status == "requires_confirmation"
    return made.id


async def cancel(client: stripe.StripeClient, intent_id: str) -> stripe.PaymentIntent:
    return await client.v1.payment_intents.cancel_async(
        intent_id, {"cancellation_reason": "abandoned"}
    )


async def status_of(direct: stripe.StripeClient, intent_id: str) -> str:
    return (await direct.v1.payment_intents.retrieve_async(intent_id)).status


@pytest.fixture
async def cancelling_key(issue: Issue) -> IssuedKey:
    return await issue(allowed_endpoints=[*DEFAULT_ENDPOINTS, CANCEL])


async def stalled_charge(
    emulator: RunningEmulator,
    client: stripe.StripeClient,
    direct: stripe.StripeClient,
    customer: str,
) -> str:
    """The key's charge met a 500, and Stripe left an intent of it unconfirmed."""
    await charge_in_doubt(emulator, client, customer, AMOUNT, "stalled", "error_before_commit")
    return await unconfirmed(direct, customer)


async def test_an_unconfirmed_intent_of_the_keys_own_charge_is_cancelled_and_audited(
    cancelling_key: IssuedKey,
    stripe_via_vault: StripeFor,
    direct_stripe: stripe.StripeClient,
    customer: str,
    emulator: RunningEmulator,
    admin: VaultAdmin,
) -> None:
    client = stripe_via_vault(cancelling_key)
    intent_id = await stalled_charge(emulator, client, direct_stripe, customer)
    cancelled = await cancel(client, intent_id)
    assert (cancelled.status, cancelled.cancellation_reason) == ("canceled", "abandoned")
    assert await status_of(direct_stripe, intent_id) == "canceled"
    [row, *_] = await proxied_calls(admin, cancelling_key.id)
    assert (row.method, row.path) == ("POST", f"/v1/payment_intents/{intent_id}/cancel")
    assert (row.decision, row.upstream_status) == ("forwarded", 200)
    # The charge it was made for, as Stripe holds it.
    assert (row.customer, row.amount_cents, row.currency) == (customer, AMOUNT, "usd")


async def test_an_intent_none_of_the_keys_charges_made_is_not_cancelled(
    cancelling_key: IssuedKey,
    issue: Issue,
    stripe_via_vault: StripeFor,
    direct_stripe: stripe.StripeClient,
    customer: str,
    declining_customer: str,
    emulator: RunningEmulator,
    admin: VaultAdmin,
) -> None:
    # Another integration's intents on the account: one of another amount for a customer the
    # key charged, and one for a customer another key charged. A cancel would stop a payment
    # that is none of this key's.
    client = stripe_via_vault(cancelling_key)
    await stalled_charge(emulator, client, direct_stripe, customer)
    other_key = await issue(allowed_endpoints=[*DEFAULT_ENDPOINTS, CANCEL])
    others = [
        await unconfirmed(direct_stripe, customer, AMOUNT + 1),
        await stalled_charge(
            emulator, stripe_via_vault(other_key), direct_stripe, declining_customer
        ),
    ]
    for intent_id in others:
        with pytest.raises(stripe.PermissionError) as refused:
            await cancel(client, intent_id)
        assert refused.value.error and refused.value.error.code == "payment_intent_not_this_keys"
        assert await status_of(direct_stripe, intent_id) == "requires_confirmation"
    row = (await proxied_calls(admin, cancelling_key.id))[0]
    assert (row.decision, row.refusal_code, row.upstream_status) == (
        "refused_request",
        "payment_intent_not_this_keys",
        None,
    )


async def test_an_intent_of_the_keys_own_that_was_confirmed_is_not_cancelled(
    cancelling_key: IssuedKey,
    stripe_via_vault: StripeFor,
    direct_stripe: stripe.StripeClient,
    customer: str,
) -> None:
    # Made and charged: the caller is told so in Stripe's own code, and looks it up again.
    client = stripe_via_vault(cancelling_key)
    made = await charge(client, customer, AMOUNT, "made")
    with pytest.raises(stripe.InvalidRequestError) as refused:
        await cancel(client, made.id)
    assert refused.value.code == "payment_intent_unexpected_state"
    assert f"{made.id} is succeeded" in str(refused.value)
    assert await status_of(direct_stripe, made.id) == "succeeded"


async def test_a_key_without_the_cancel_entry_or_an_unknown_intent_is_refused(
    cancelling_key: IssuedKey,
    issue: Issue,
    stripe_via_vault: StripeFor,
    direct_stripe: stripe.StripeClient,
    customer: str,
    emulator: RunningEmulator,
) -> None:
    older = await issue()
    intent_id = await stalled_charge(emulator, stripe_via_vault(older), direct_stripe, customer)
    with pytest.raises(stripe.PermissionError) as refused:
        await cancel(stripe_via_vault(older), intent_id)
    assert refused.value.error and refused.value.error.code == "endpoint_not_allowed"
    with pytest.raises(stripe.InvalidRequestError) as missing:
        await cancel(stripe_via_vault(cancelling_key), "pi_unknown")
    assert missing.value.code == "resource_missing"
    assert await status_of(direct_stripe, intent_id) == "requires_confirmation"

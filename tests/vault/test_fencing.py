"""A cap refusal fences off the earlier attempts of its request (the proof behind
billing.ledger.reopen_refused_charge): once room is freed, an attempt below the refused one's
fencing token, or without one, is refused and never reaches Stripe; a later one charges once."""

from __future__ import annotations

from collections.abc import Callable

import asyncpg
import pytest
import stripe

from activities.stripe_failures import fence_of
from stripe_emulator import RunningEmulator
from vault.client import VaultAdmin
from vault.models import IssuedKey

from .conftest import Issue
from .support import assert_consistent, charge, charge_in_doubt, emulator_ledger

StripeFor = Callable[[IssuedKey], stripe.StripeClient]


async def _cap_refused_then_freed(
    issue: Issue,
    client_for: StripeFor,
    admin: VaultAdmin,
    emulator: RunningEmulator,
    customer: str,
    refused_fence: str | None,
) -> tuple[IssuedKey, stripe.StripeClient]:
    """A key whose room is held by a charge in doubt refuses an attempt of "claim" on its
    cap; then that charge is found failed, which frees the room."""
    key = await issue(cap_cents=1_500)
    client = client_for(key)
    await charge_in_doubt(emulator, client, customer, 1_000, "filler", "error_before_commit")
    with pytest.raises(stripe.CardError) as refused:
        await charge(client, customer, 1_000, "claim", fence=refused_fence)
    assert refused.value.code == "spend_cap_exceeded"
    # The refusal says the fence it left, which is the worker's proof (charging._charge).
    assert fence_of(refused.value) == (None if refused_fence is None else int(refused_fence))
    released = await admin.resolve(key.id, "filler", "failed")
    assert released.state == "released"
    return key, client


async def test_an_earlier_attempt_is_refused_after_a_later_one_met_the_cap(
    issue: Issue,
    stripe_via_vault: StripeFor,
    admin: VaultAdmin,
    emulator: RunningEmulator,
    customer: str,
    db: asyncpg.Pool,
) -> None:
    """Attempt 1 of a claim is still on its way when attempt 2 is refused on the cap, and the
    claim is reopened on that proof. With the room freed, attempt 1 must not charge: a cancel
    may already have recorded that nothing was."""
    key, client = await _cap_refused_then_freed(
        issue, stripe_via_vault, admin, emulator, customer, refused_fence="2"
    )
    for earlier in ("1", None):
        with pytest.raises(stripe.APIError) as superseded:
            await charge(client, customer, 1_000, "claim", fence=earlier)
        assert superseded.value.http_status == 409
        assert '"code":"attempt_superseded"' in str(superseded.value.http_body)
        assert fence_of(superseded.value) == 2
        assert "fencing token 2" in str(superseded.value.user_message)
    assert await emulator_ledger(emulator) == []
    # The claim's next attempt, numbered past the fence, charges once.
    intent = await charge(client, customer, 1_000, "claim", fence="3")
    assert intent.status == "succeeded"
    assert [c["amount"] for c in await emulator_ledger(emulator)] == [1_000]
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 1_000)
    audit = [(e.decision, e.refusal_code) for e in await admin.audit(key.id)]
    assert audit[:3] == [
        ("forwarded", None),
        ("refused_request", "attempt_superseded"),
        ("refused_request", "attempt_superseded"),
    ]


async def test_a_refusal_without_a_token_fences_nothing(
    issue: Issue,
    stripe_via_vault: StripeFor,
    admin: VaultAdmin,
    emulator: RunningEmulator,
    customer: str,
) -> None:
    """A client that numbers no attempts (not a billing worker) keeps the vault as it was:
    a cap refusal leaves no reservation behind, and a retry charges once room is freed."""
    _, client = await _cap_refused_then_freed(
        issue, stripe_via_vault, admin, emulator, customer, refused_fence=None
    )
    intent = await charge(client, customer, 1_000, "claim", fence="1")
    assert intent.status == "succeeded"


@pytest.mark.parametrize("token", ["0", "-1", "1.5", "01", "1234567890", "x"])
async def test_a_malformed_fencing_token_is_refused_before_anything_is_reserved(
    issue: Issue, stripe_via_vault: StripeFor, customer: str, db: asyncpg.Pool, token: str
) -> None:
    key = await issue()
    with pytest.raises(stripe.InvalidRequestError) as refused:
        await charge(stripe_via_vault(key), customer, 1_000, "claim", fence=token)
    assert refused.value.code == "fencing_token_invalid"
    assert "Vault-Fencing-Token must be a whole number" in str(refused.value.user_message)
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 0)

"""A cap refusal fences off the earlier attempts of its request (the proof behind
billing.ledger.reopen_refused_charge): once room is freed, an attempt below the refused one's
fencing token, or without one, is refused and never reaches Stripe; a later one charges once."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import quote

import aiohttp
import asyncpg
import pytest
import stripe

from activities.stripe_failures import fence_of
from stripe_emulator import RunningEmulator
from vault.app import RunningVault
from vault.client import VaultAdmin, VaultForbidden
from vault.models import IssuedKey

from .conftest import Issue
from .support import (
    ADMIN_TOKEN,
    assert_consistent,
    charge,
    charge_in_doubt,
    emulator_ledger,
    key_request,
)

StripeFor = Callable[[IssuedKey], stripe.StripeClient]


async def _cap_refused_then_freed(
    issue: Issue,
    client_for: StripeFor,
    admin: VaultAdmin,
    emulator: RunningEmulator,
    customer: str,
    refused_fence: str | None,
    daily: bool = False,
) -> tuple[IssuedKey, stripe.StripeClient]:
    """A key whose room (or, `daily`, the day's) is held by a charge in doubt refuses an
    attempt of "claim" on its cap; then that charge is found failed, which frees the room."""
    caps = {"cap_cents": 100_000, "daily_cap_cents": 1_500} if daily else {"cap_cents": 1_500}
    key = await issue(**caps)
    client = client_for(key)
    await charge_in_doubt(emulator, client, customer, 1_000, "filler", "error_before_commit")
    with pytest.raises(stripe.CardError) as refused:
        await charge(client, customer, 1_000, "claim", fence=refused_fence)
    assert refused.value.code == "spend_cap_exceeded"
    assert ("daily cap" in str(refused.value.user_message)) == daily
    # The refusal says the fence it left, which is the worker's proof (charging._charge).
    assert fence_of(refused.value) == (None if refused_fence is None else int(refused_fence))
    released = await admin.resolve(key.id, "filler", "failed")
    assert released.state == "released"
    return key, client


@pytest.mark.parametrize("daily", [False, True], ids=["cap", "daily-cap"])
async def test_an_earlier_attempt_is_refused_after_a_later_one_met_the_cap(
    issue: Issue,
    stripe_via_vault: StripeFor,
    admin: VaultAdmin,
    emulator: RunningEmulator,
    customer: str,
    db: asyncpg.Pool,
    daily: bool,
) -> None:
    """Attempt 1 of a claim is still on its way when attempt 2 is refused on the cap, and the
    claim is reopened on that proof. With the room freed, attempt 1 must not charge: a cancel
    may already have recorded that nothing was. The worker reopens a claim on a refusal on
    either cap, so the daily cap's is as much a proof (helper-193)."""
    key, client = await _cap_refused_then_freed(
        issue, stripe_via_vault, admin, emulator, customer, refused_fence="2", daily=daily
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
    db: asyncpg.Pool,
) -> None:
    """A client that numbers no attempts (not a billing worker) keeps the vault as it was:
    a cap refusal leaves no reservation or fence behind, and a retry charges once room is
    freed, numbered or not."""
    key, client = await _cap_refused_then_freed(
        issue, stripe_via_vault, admin, emulator, customer, refused_fence=None
    )
    fences = "SELECT count(*) FROM vault_fences WHERE vault_key_id = $1"
    assert await db.fetchval(fences, key.id) == 0
    intent = await charge(client, customer, 1_000, "claim", fence=None)
    assert intent.status == "succeeded"
    assert [c["amount"] for c in await emulator_ledger(emulator)] == [1_000]


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


async def test_a_fence_raised_through_the_admin_api_refuses_the_earlier_attempts(
    issue: Issue,
    stripe_via_vault: StripeFor,
    admin: VaultAdmin,
    emulator: RunningEmulator,
    customer: str,
) -> None:
    """A worker whose attempt 3 met a 500 Stripe saved for the key fences attempts 1 and 2
    off: one held up on its way (a frozen worker) must not send the key once Stripe has
    forgotten it, after an operator's cancel was recorded."""
    key = await issue()
    client = stripe_via_vault(key)
    assert (await admin.fence(key.id, "claim", 2)).fenced_below == 2
    fence = await admin.fence(key.id, "claim", 4)  # a later attempt raises it
    assert (fence.idempotency_key, fence.fenced_below) == ("claim", 4)
    # Never lowered: a late fence of an older attempt keeps the higher one.
    assert (await admin.fence(key.id, "claim", 2)).fenced_below == 4
    for earlier in ("3", None):
        with pytest.raises(stripe.APIError) as superseded:
            await charge(client, customer, 1_000, "claim", fence=earlier)
        assert fence_of(superseded.value) == 4
        assert "fenced this one off" in str(superseded.value.user_message)
    assert await emulator_ledger(emulator) == []
    # Another idempotency key is not fenced; the claim's next attempt charges once.
    assert (await charge(client, customer, 500, "other", fence="1")).status == "succeeded"
    assert (await charge(client, customer, 1_000, "claim", fence="4")).status == "succeeded"
    assert sorted(c["amount"] for c in await emulator_ledger(emulator)) == [500, 1_000]
    fenced = [e for e in await admin.audit(key.id) if e.decision == "fenced"]
    assert [(e.idempotency_key, e.actor) for e in fenced] == [("claim", "admin")] * 3


async def test_the_worker_token_fences_only_the_keys_it_issued(
    issue: Issue, worker: VaultAdmin, admin: VaultAdmin, db: asyncpg.Pool
) -> None:
    by_admin = await issue()
    with pytest.raises(VaultForbidden, match="issued with the admin token: fence it with it"):
        await worker.fence(by_admin.id, "claim", 2)
    assert await db.fetchval("SELECT count(*) FROM vault_fences") == 0
    own = await worker.issue_key(key_request())
    assert (await worker.fence(own.id, "claim", 2)).fenced_below == 2
    [entry] = [e for e in await admin.audit(own.id) if e.decision == "fenced"]
    assert entry.actor == "worker"


@pytest.mark.parametrize(
    ("idempotency_key", "body"),
    [
        ("claim", {"below": 0}),
        ("claim", {"below": "2"}),
        ("claim", {"below": 2, "extra": 1}),
        ("bad key!", {"below": 2}),
    ],
)
async def test_a_malformed_fence_is_refused_and_fences_nothing(
    issue: Issue,
    vault: RunningVault,
    http: aiohttp.ClientSession,
    db: asyncpg.Pool,
    idempotency_key: str,
    body: dict[str, object],
) -> None:
    key = await issue()
    async with http.post(
        f"{vault.url}/vault/keys/{key.id}/fences/{quote(idempotency_key, safe='')}",
        json=body,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as response:
        assert response.status == 422, await response.text()
        assert (await response.json())["error"]["code"] == "parameter_invalid"
    assert await db.fetchval("SELECT count(*) FROM vault_fences") == 0

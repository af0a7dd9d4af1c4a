"""The worker token: what workers need and no more, and keys only within the worker budget."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
import stripe
from pydantic import ValidationError

from vault import VaultSettings, serve
from vault.client import VaultAdmin, VaultAuthError, VaultForbidden
from vault.models import IssuedKey

from .conftest import Issue, Secrets
from .support import (
    ADMIN_TOKEN,
    UPSTREAM_SECRET,
    WORKER_BUDGET_CENTS,
    WORKER_TOKEN,
    charge,
    key_request,
)

LOOKUP_ONLY = ["GET /v1/charges", "GET /v1/payment_intents/*"]


async def _issue(worker: VaultAdmin, secrets_seen: Secrets, **overrides: object) -> IssuedKey:
    issued = await worker.issue_key(key_request(**overrides))
    secrets_seen.values.append(issued.secret.get_secret_value())
    return issued


async def test_a_worker_issues_reads_and_resolves_but_cannot_revoke_or_read_the_audit(
    worker: VaultAdmin, admin: VaultAdmin, secrets_seen: Secrets, issue: Issue
) -> None:
    mine = await _issue(worker, secrets_seen)
    theirs = await issue()
    assert (mine.issued_by, theirs.issued_by) == ("worker", "admin")
    assert (await worker.get_key(mine.id)).id == mine.id
    assert {k.id for k in await worker.find_keys(period="2026-12")} == {mine.id, theirs.id}
    assert await worker.unknown_reservations(mine.id) == []
    with pytest.raises(VaultForbidden, match="needs the admin token") as refused:
        await worker.revoke(mine.id)
    assert refused.value.code == "admin_token_required"
    with pytest.raises(VaultForbidden, match="needs the admin token"):
        await worker.audit(theirs.id)
    # Only an operator pulls the kill switch.
    assert not (await admin.get_key(mine.id)).revoked
    assert (await admin.revoke(mine.id)).revoked


async def test_worker_keys_stop_at_the_budget_and_other_keys_do_not_count(
    worker: VaultAdmin, admin: VaultAdmin, secrets_seen: Secrets, issue: Issue
) -> None:
    for _ in range(3):
        await _issue(worker, secrets_seen, cap_cents=WORKER_BUDGET_CENTS // 3)
    with pytest.raises(VaultForbidden, match="VAULT_WORKER_BUDGET_CENTS=300000") as refused:
        await _issue(worker, secrets_seen, cap_cents=1)
    assert refused.value.code == "worker_key_refused"
    assert "revoke unused worker keys" in refused.value.message
    # The budget is per currency; keys that move no money and the admin's keys are free.
    await _issue(worker, secrets_seen, currency="eur")
    await _issue(worker, secrets_seen, cap_cents=1, allowed_endpoints=LOOKUP_ONLY)
    await issue(cap_cents=WORKER_BUDGET_CENTS)
    assert len(await admin.find_keys(period="2026-12")) == 6


async def test_a_dead_worker_key_counts_what_it_took_and_an_old_one_nothing(
    worker: VaultAdmin,
    admin: VaultAdmin,
    secrets_seen: Secrets,
    db: asyncpg.Pool,
    customer: str,
    stripe_via_vault: Callable[[IssuedKey], stripe.StripeClient],
) -> None:
    third = WORKER_BUDGET_CENTS // 3
    spent = await _issue(worker, secrets_seen, cap_cents=third)
    await charge(stripe_via_vault(spent), customer, 40_000, "budget-spent-1")
    unused = await _issue(worker, secrets_seen, cap_cents=third)
    expiring = await _issue(worker, secrets_seen, cap_cents=third)
    with pytest.raises(VaultForbidden):
        await _issue(worker, secrets_seen, cap_cents=1)
    # Revoked, a key counts only what it took: 40,000 here, nothing for the unused one.
    await admin.revoke(spent.id)
    await admin.revoke(unused.id)
    async with db.acquire() as conn:
        await conn.execute(
            "UPDATE vault_keys SET expires_at = now() - interval '1 second' WHERE id = $1",
            expiring.id,
        )
    await _issue(worker, secrets_seen, cap_cents=WORKER_BUDGET_CENTS - 40_000)
    with pytest.raises(VaultForbidden, match="would take worker keys to 300001"):
        await _issue(worker, secrets_seen, cap_cents=1)
    # Issued before the window: no longer counted (such a key has expired by then).
    async with db.acquire() as conn:
        await conn.execute(
            "UPDATE vault_keys SET created_at = now() - interval '46 days' WHERE id = $1",
            spent.id,
        )
    await _issue(worker, secrets_seen, cap_cents=40_000)


async def test_a_worker_key_lives_no_longer_than_the_budget_window(
    worker: VaultAdmin, secrets_seen: Secrets, issue: Issue
) -> None:
    far = datetime.now(UTC) + timedelta(days=46)
    with pytest.raises(VaultForbidden, match="at most 45 days") as refused:
        await _issue(worker, secrets_seen, expires_at=far)
    assert "raise the window" in refused.value.message
    # Not even a lookup key: the window is what makes every live worker key counted.
    with pytest.raises(VaultForbidden):
        await _issue(worker, secrets_seen, expires_at=far, allowed_endpoints=LOOKUP_ONLY)
    assert (await issue(expires_at=far)).issued_by == "admin"


async def test_concurrent_worker_keys_never_pass_the_budget(
    worker: VaultAdmin, admin: VaultAdmin, secrets_seen: Secrets
) -> None:
    tries = await asyncio.gather(
        *(_issue(worker, secrets_seen, cap_cents=WORKER_BUDGET_CENTS // 3) for _ in range(10)),
        return_exceptions=True,
    )
    assert sum(isinstance(t, IssuedKey) for t in tries) == 3
    assert all(isinstance(t, IssuedKey | VaultForbidden) for t in tries)
    keys = await admin.find_keys(period="2026-12")
    assert sum(k.cap_cents for k in keys) == WORKER_BUDGET_CENTS


@pytest.mark.parametrize(
    ("worker_settings", "message"),
    [
        ({"worker_token": WORKER_TOKEN}, "VAULT_WORKER_BUDGET_CENTS is needed too"),
        (
            {"worker_token": ADMIN_TOKEN, "worker_budget_cents": 1},
            "VAULT_WORKER_TOKEN must differ from VAULT_ADMIN_TOKEN",
        ),
        ({"worker_token": "short", "worker_budget_cents": 1}, "at least 16 characters"),
    ],
)
def test_a_worker_token_needs_a_budget_and_its_own_value(
    worker_settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        VaultSettings(
            admin_token=ADMIN_TOKEN,
            upstream_stripe_secret=UPSTREAM_SECRET,
            max_cap_cents=100,
            **worker_settings,  # type: ignore[arg-type]
        )


async def test_without_a_worker_token_only_the_admin_token_opens(
    vault_settings: VaultSettings,
) -> None:
    plain = vault_settings.model_copy(update={"worker_token": None, "worker_budget_cents": None})
    async with serve(plain) as running, VaultAdmin(running.url, WORKER_TOKEN) as stranger:
        with pytest.raises(VaultAuthError):
            await stranger.find_keys()

"""The worker token: what workers need and no more, and keys only within the worker budget."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
import stripe
from pydantic import ValidationError

from stripe_emulator import RunningEmulator
from vault.app import serve
from vault.client import VaultAdmin, VaultAuthError, VaultForbidden
from vault.models import IssuedKey
from vault.settings import VaultSettings

from .conftest import Issue, Secrets
from .support import (
    ADMIN_TOKEN,
    UPSTREAM_SECRET,
    WORKER_BUDGET_CENTS,
    WORKER_TOKEN,
    charge,
    charge_in_doubt,
    key_request,
    refusals_counted,
    set_faults,
)

LOOKUP_ONLY = ["GET /v1/charges", "GET /v1/payment_intents/*"]
# Every call of the billing workers: their charges, the lookups of them, and the cancel of an
# intent Stripe left unconfirmed (activities/stripe_gateway.py).
BILLING_CALLS = [
    "POST /v1/payment_intents",
    "GET /v1/payment_intents",
    "GET /v1/payment_intents/*",
    "POST /v1/payment_intents/*/cancel",
    "POST /v1/charges",
    "GET /v1/charges",
    "GET /v1/charges/*",
]


async def _issue(worker: VaultAdmin, secrets_seen: Secrets, **overrides: object) -> IssuedKey:
    issued = await worker.issue_key(key_request(**overrides))
    secrets_seen.values.append(issued.secret.get_secret_value())
    return issued


async def test_a_worker_issues_reads_resolves_and_revokes_its_own_but_cannot_read_the_audit(
    worker: VaultAdmin, admin: VaultAdmin, secrets_seen: Secrets, issue: Issue
) -> None:
    mine = await _issue(worker, secrets_seen, allowed_endpoints=BILLING_CALLS)
    theirs = await issue()
    assert (mine.issued_by, theirs.issued_by) == ("worker", "admin")
    assert mine.allowed_endpoints == BILLING_CALLS
    assert (await worker.get_key(mine.id)).id == mine.id
    assert {k.id for k in await worker.find_keys(period="2026-12")} == {mine.id, theirs.id}
    assert await worker.unknown_reservations(mine.id) == []
    before = refusals_counted("admin_token_required")
    with pytest.raises(VaultForbidden, match="needs the admin token") as refused:
        await worker.audit(theirs.id)
    assert refused.value.code == "admin_token_required"
    assert refusals_counted("admin_token_required") == before + 1
    # A worker revokes a key it issued and no run uses (it moves no money); an operator's
    # keys are the operator's to revoke.
    with pytest.raises(VaultForbidden, match="issued with the admin token: revoke it with it"):
        await worker.revoke(theirs.id)
    assert not (await admin.get_key(theirs.id)).revoked
    assert (await worker.revoke(mine.id)).revoked


async def test_worker_keys_stop_at_the_budget_and_other_keys_do_not_count(
    worker: VaultAdmin, admin: VaultAdmin, secrets_seen: Secrets, issue: Issue
) -> None:
    # A lookup key's cap (it needs one) takes no room from the keys that move money.
    await _issue(worker, secrets_seen, cap_cents=1, allowed_endpoints=LOOKUP_ONLY)
    for _ in range(3):
        await _issue(worker, secrets_seen, cap_cents=WORKER_BUDGET_CENTS // 3)
    with pytest.raises(VaultForbidden, match="VAULT_WORKER_BUDGET_CENTS=300000") as refused:
        await _issue(worker, secrets_seen, cap_cents=1)
    assert refused.value.code == "worker_key_refused"
    assert "usd 0.01 past" in refused.value.message
    assert "revoke unused worker keys" in refused.value.message
    # The budget is per currency; keys that move no money and the admin's keys are free.
    await _issue(worker, secrets_seen, currency="eur")
    await _issue(worker, secrets_seen, cap_cents=1, allowed_endpoints=LOOKUP_ONLY)
    await issue(cap_cents=WORKER_BUDGET_CENTS)
    assert len(await admin.find_keys(period="2026-12")) == 7


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # Each currency allowed adds a budget, so only those listed are.
        ({"currency": "gbp"}, "currency gbp is not in VAULT_WORKER_CURRENCIES"),
        # Not even free lookup keys may read the rest of the account.
        ({"allowed_endpoints": ["GET /v1/customers/*"]}, "not GET /v1/customers/*"),
        ({"allowed_endpoints": ["GET /v1/*"]}, "not GET /v1/*"),
    ],
)
async def test_a_worker_key_stays_in_the_workers_currencies_and_endpoints(
    worker: VaultAdmin,
    secrets_seen: Secrets,
    issue: Issue,
    overrides: dict[str, object],
    message: str,
) -> None:
    with pytest.raises(VaultForbidden, match=re.escape(message)):
        await _issue(worker, secrets_seen, **overrides)
    await issue(**overrides)


async def test_a_dead_worker_key_counts_what_it_took_within_the_window(
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
    # Revoked by the worker token (a key it replaced, or left unstored), a key counts only
    # what it took: 40,000 here, nothing for the unused one.
    await worker.revoke(spent.id)
    await worker.revoke(unused.id)
    await _age(db, expiring.id, expires_days_ago=0)
    await _issue(worker, secrets_seen, cap_cents=WORKER_BUDGET_CENTS - 40_000)
    with pytest.raises(VaultForbidden, match=r"usd 0\.01 past"):
        await _issue(worker, secrets_seen, cap_cents=1)
    # Dead for most of the window (45 days), it still counts; for longer than the window it
    # no longer does, and a live one always does, however old (the window may have been
    # shortened since it was issued).
    await _age(db, spent.id, revoked_days_ago=44)
    with pytest.raises(VaultForbidden, match=r"usd 0\.01 past"):
        await _issue(worker, secrets_seen, cap_cents=1)
    await _age(db, spent.id, revoked_days_ago=46)
    await _issue(worker, secrets_seen, cap_cents=40_000)
    async with db.acquire() as conn:
        await conn.execute("UPDATE vault_keys SET created_at = now() - interval '400 days'")
    with pytest.raises(VaultForbidden, match=r"usd 0\.01 past"):
        await _issue(worker, secrets_seen, cap_cents=1)


async def test_a_worker_key_the_admin_revokes_keeps_its_cap_counted_for_the_window(
    worker: VaultAdmin,
    admin: VaultAdmin,
    secrets_seen: Secrets,
    db: asyncpg.Pool,
    customer: str,
    stripe_via_vault: Callable[[IssuedKey], stripe.StripeClient],
) -> None:
    # The operator's kill switch on a worker that may be taken over: the revoke must not
    # hand the unspent cap back to the worker token, which would at once mint it again.
    whole = await _issue(worker, secrets_seen, cap_cents=WORKER_BUDGET_CENTS)
    await charge(stripe_via_vault(whole), customer, 50_000, "before-kill")
    killed = await admin.revoke(whole.id)
    assert (killed.revoked, killed.revoked_by) == (True, "admin")
    with pytest.raises(VaultForbidden, match=r"usd 0\.01 past"):
        await _issue(worker, secrets_seen, cap_cents=1)
    # A worker revoking it again changes nothing; nor does a worker key the admin revokes
    # after the worker token did: it is counted whole from then on.
    assert (await worker.revoke(whole.id)).revoked_by == "admin"
    async with db.acquire() as conn:
        await conn.execute("UPDATE vault_keys SET cap_cents = 100_000 WHERE id = $1", whole.id)
    replaced = await _issue(worker, secrets_seen, cap_cents=WORKER_BUDGET_CENTS - 100_000)
    assert (await worker.revoke(replaced.id)).revoked_by == "worker"
    await _issue(worker, secrets_seen, cap_cents=50_000)  # room its worker revoke freed
    await admin.revoke(replaced.id)
    assert (await worker.get_key(replaced.id)).revoked_by == "admin"
    with pytest.raises(VaultForbidden):
        await _issue(worker, secrets_seen, cap_cents=1)
    # Once the window has passed since the revoke, the key no longer counts.
    await _age(db, whole.id, revoked_days_ago=46)
    await _age(db, replaced.id, revoked_days_ago=46)
    await _issue(worker, secrets_seen, cap_cents=WORKER_BUDGET_CENTS - 50_000)


async def _age(
    db: asyncpg.Pool,
    key_id: str,
    *,
    expires_days_ago: int | None = None,
    revoked_days_ago: int | None = None,
) -> None:
    async with db.acquire() as conn:
        if expires_days_ago is not None:
            await conn.execute(
                "UPDATE vault_keys SET expires_at = now() - make_interval(days => $2)"
                " - interval '1 second' WHERE id = $1",
                key_id,
                expires_days_ago,
            )
        if revoked_days_ago is not None:
            await conn.execute(
                "UPDATE vault_keys SET revoked_at = now() - make_interval(days => $2)"
                " WHERE id = $1",
                key_id,
                revoked_days_ago,
            )


@pytest.mark.parametrize(
    "window_days",
    [45, pytest.param(10, marks=pytest.mark.vault_settings(worker_budget_days=10))],
)
async def test_a_worker_key_lives_no_longer_than_the_budget_window(
    worker: VaultAdmin, secrets_seen: Secrets, issue: Issue, window_days: int
) -> None:
    far = datetime.now(UTC) + timedelta(days=90)
    shortened = await _issue(worker, secrets_seen, expires_at=far)
    window_end = datetime.now(UTC) + timedelta(days=window_days)
    assert abs(shortened.expires_at - window_end) < timedelta(minutes=1)
    near = datetime.now(UTC) + timedelta(days=2)
    assert (await _issue(worker, secrets_seen, expires_at=near)).expires_at == near
    assert (await issue(expires_at=far)).expires_at == far


async def test_cents_a_worker_frees_count_against_the_budget(
    worker: VaultAdmin,
    admin: VaultAdmin,
    secrets_seen: Secrets,
    issue: Issue,
    db: asyncpg.Pool,
    customer: str,
    emulator: RunningEmulator,
    stripe_via_vault: Callable[[IssuedKey], stripe.StripeClient],
) -> None:
    """Settled as failed, a charge in doubt frees its room for another: had it gone through
    after all, a worker lying about it would spend past the cap, so the budget counts it."""
    mine = await _issue(worker, secrets_seen, cap_cents=200_000)
    other = await _issue(worker, secrets_seen, cap_cents=50_000)
    theirs = await issue(cap_cents=100_000)
    await set_faults(emulator, drop_after_commit=1.0)
    for key, idempotency_key in ((mine, "a"), (mine, "b"), (other, "c"), (theirs, "d")):
        with pytest.raises(stripe.APIError):
            await charge(stripe_via_vault(key), customer, 30_000, f"in-doubt-{idempotency_key}")
    await set_faults(emulator, drop_after_commit=0.0)
    # 250,000 of live caps leave 50,000: freeing 30,000 fits, another 30,000 does not.
    await worker.resolve(mine.id, "in-doubt-a", "failed")
    with pytest.raises(VaultForbidden, match=r"freeing usd 300\.00 reserved") as refused:
        await worker.resolve(mine.id, "in-doubt-b", "failed")
    assert "usd 100.00 past" in refused.value.message
    assert "settle it with the admin token" in refused.value.message
    assert {r.idempotency_key for r in await admin.unknown_reservations(mine.id)} == {"in-doubt-b"}
    # Settled as charged for less, the rest is freed: 5,000, which fits.
    await worker.resolve(mine.id, "in-doubt-b", "succeeded", amount_cents=25_000)
    # The admin's keys are settled by the admin: the budget does not count them.
    with pytest.raises(VaultForbidden, match="issued with the admin token"):
        await worker.resolve(theirs.id, "in-doubt-d", "failed")
    async with db.acquire() as conn:
        freed = await conn.fetchval(
            "SELECT sum(worker_released_cents) FROM vault_keys WHERE currency = 'usd'"
        )
    assert freed == 30_000 + 5_000
    with pytest.raises(
        VaultForbidden, match=r"a cap of usd 150\.01 would take worker keys usd 0\.01 past"
    ):
        await _issue(worker, secrets_seen, cap_cents=15_001)
    # Freed on a dead key, reserved cents only change name: allowed with no room left. (A
    # key the worker token revoked: one the admin revoked would count its whole cap.)
    await worker.revoke(other.id)
    await _issue(worker, secrets_seen, cap_cents=15_000 + 50_000 - 30_000)
    # Dead, the key still counts what it holds in doubt: had that charge gone through, the
    # room handed back would be spent twice.
    with pytest.raises(VaultForbidden, match=r"usd 0\.01 past"):
        await _issue(worker, secrets_seen, cap_cents=1)
    await worker.resolve(other.id, "in-doubt-c", "failed")
    with pytest.raises(VaultForbidden, match=r"usd 0\.01 past"):
        await _issue(worker, secrets_seen, cap_cents=1)


# In eur, the usd budget untouched: what a worker frees is weighed against its key's currency.
@pytest.mark.parametrize("currency", ["usd", "eur"])
async def test_a_worker_frees_the_room_left_to_the_cent_and_not_a_cent_more(
    worker: VaultAdmin,
    secrets_seen: Secrets,
    customer: str,
    emulator: RunningEmulator,
    stripe_via_vault: Callable[[IssuedKey], stripe.StripeClient],
    currency: str,
) -> None:
    mine = await _issue(
        worker, secrets_seen, cap_cents=WORKER_BUDGET_CENTS - 20_000, currency=currency
    )
    await charge_in_doubt(
        emulator, stripe_via_vault(mine), customer, 30_000, "in-doubt", currency=currency
    )
    # 20,000 left: settled as charged 9,999 of 30,000 would free 20,001.
    with pytest.raises(VaultForbidden, match=rf"{currency} 0\.01 past"):
        await worker.resolve(mine.id, "in-doubt", "succeeded", amount_cents=9_999)
    resolved = await worker.resolve(mine.id, "in-doubt", "succeeded", amount_cents=10_000)
    assert (resolved.state, resolved.committed_cents) == ("committed", 10_000)
    with pytest.raises(VaultForbidden, match=rf"{currency} 0\.01 past"):
        await _issue(worker, secrets_seen, cap_cents=1, currency=currency)


async def test_an_expired_worker_key_counts_what_it_spent_for_the_window_only(
    worker: VaultAdmin,
    secrets_seen: Secrets,
    db: asyncpg.Pool,
    customer: str,
    stripe_via_vault: Callable[[IssuedKey], stripe.StripeClient],
) -> None:
    spent = await _issue(worker, secrets_seen, cap_cents=WORKER_BUDGET_CENTS)
    await charge(stripe_via_vault(spent), customer, 40_000, "expiring-spent")
    await _age(db, spent.id, expires_days_ago=44)
    await _issue(worker, secrets_seen, cap_cents=WORKER_BUDGET_CENTS - 40_000)
    with pytest.raises(VaultForbidden, match=r"usd 0\.01 past"):
        await _issue(worker, secrets_seen, cap_cents=1)
    await _age(db, spent.id, expires_days_ago=46)
    await _issue(worker, secrets_seen, cap_cents=40_000)


async def test_a_worker_frees_what_an_expired_key_holds_in_doubt_with_no_room_left(
    worker: VaultAdmin,
    secrets_seen: Secrets,
    db: asyncpg.Pool,
    customer: str,
    emulator: RunningEmulator,
    stripe_via_vault: Callable[[IssuedKey], stripe.StripeClient],
) -> None:
    """Reconciliation settles charges in doubt after their key expired: on a dead key the
    freed cents only change name (the budget counts them either way), so no room is needed
    and the worker need not call for the admin token."""
    expired = await _issue(worker, secrets_seen, cap_cents=WORKER_BUDGET_CENTS)
    await charge_in_doubt(emulator, stripe_via_vault(expired), customer, 30_000, "in-doubt")
    await _age(db, expired.id, expires_days_ago=0)
    await _issue(worker, secrets_seen, cap_cents=WORKER_BUDGET_CENTS - 30_000 - 10_000)
    assert (await worker.resolve(expired.id, "in-doubt", "failed")).state == "released"
    await _issue(worker, secrets_seen, cap_cents=10_000)
    with pytest.raises(VaultForbidden, match=r"usd 0\.01 past"):
        await _issue(worker, secrets_seen, cap_cents=1)


async def test_what_the_admin_api_does_to_a_key_is_in_its_audit_with_the_token(
    worker: VaultAdmin,
    admin: VaultAdmin,
    secrets_seen: Secrets,
    customer: str,
    emulator: RunningEmulator,
    stripe_via_vault: Callable[[IssuedKey], stripe.StripeClient],
) -> None:
    """Issuing, settling a reservation (which can free cap room) and revoking are audited
    beside the requests through the key, with the token that did each."""
    mine = await _issue(worker, secrets_seen, cap_cents=50_000)
    await set_faults(emulator, drop_after_commit=1.0)
    for idempotency_key in ("in-doubt", "never-went"):
        with pytest.raises(stripe.APIError):
            await charge(stripe_via_vault(mine), customer, 20_000, idempotency_key)
    await set_faults(emulator, drop_after_commit=0.0)
    await admin.resolve(mine.id, "in-doubt", "succeeded", amount_cents=20_000)
    await worker.resolve(mine.id, "never-went", "failed")
    await worker.revoke(mine.id)
    entries = await admin.audit(mine.id)
    # A settlement's amount: what it committed, or the room it freed.
    assert [(e.decision, e.actor, e.reservation_state, e.amount_cents) for e in entries] == [
        ("revoked", "worker", None, None),
        ("resolved", "worker", "released", 20_000),
        ("resolved", "admin", "committed", 20_000),
        ("forwarded", None, "unknown", 20_000),
        ("forwarded", None, "unknown", 20_000),
        ("issued", "worker", None, None),
    ]
    resolved = entries[2]
    assert (resolved.idempotency_key, resolved.currency, resolved.customer) == (
        "in-doubt",
        "usd",
        customer,
    )
    assert resolved.path == f"/vault/keys/{mine.id}/reservations/in-doubt/resolve"


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
        (
            {"worker_token": WORKER_TOKEN, "worker_currencies": "usd"},
            "VAULT_WORKER_BUDGET_CENTS is needed too",
        ),
        (
            {"worker_token": WORKER_TOKEN, "worker_budget_cents": 1},
            "VAULT_WORKER_CURRENCIES is needed too",
        ),
        ({"worker_currencies": "usd, EUR"}, r"'EUR' is not one Stripe charges in \(in lowercase\)"),
        ({"worker_currencies": "usd,xts"}, "'xts' is not one Stripe charges in"),
        (
            {"worker_token": ADMIN_TOKEN, "worker_budget_cents": 1, "worker_currencies": "usd"},
            "VAULT_WORKER_TOKEN must differ from VAULT_ADMIN_TOKEN",
        ),
        ({"worker_token": "short", "worker_budget_cents": 1}, "at least 16 characters"),
        ({"admin_token": "a" * 15}, "at least 16 characters"),
        # Past it, sums of caps and amounts would overflow Postgres' bigint.
        ({"max_cap_cents": 2**62 + 1}, "max_cap_cents"),
        # A live key in clear text, and a blank database URL asyncpg would fill in with
        # local defaults.
        *(
            (
                {
                    "upstream_stripe_secret": live + "Q7" * 12,
                    "upstream_stripe_base": "http://api.stripe.com",
                },
                "must be an https:// URL for a live Stripe key",
            )
            for live in ("sk_live_", "rk_live_")
        ),
        ({"database_url": ""}, "is set but blank"),
        ({"database_url": " "}, "is set but blank"),
        ({"upstream_stripe_base": "https://ops:hunter2@stripe.internal"}, "upstream_stripe_base"),
        # Read from a file with its newline: sent in a header, every request would fail 500.
        (
            {"upstream_stripe_secret": UPSTREAM_SECRET + "\n"},
            "upstream_stripe_secret\n  Value error, has spaces or a line break around it",
        ),
        ({"admin_token": ADMIN_TOKEN + "\n"}, "admin_token\n  Value error, has spaces"),
        # Stripe's client path added to it: every request forwarded to /v1/v1/... (helper-188).
        (
            {"upstream_stripe_base": "https://api.stripe.com/v1/"},
            "upstream_stripe_base\n  Value error, ends in /v1, which the client adds itself",
        ),
    ],
)
def test_vault_settings_that_cannot_work_are_refused(
    worker_settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message) as refused:
        VaultSettings(
            **{
                "admin_token": ADMIN_TOKEN,
                "upstream_stripe_base": "https://api.stripe.com",
                "upstream_stripe_secret": UPSTREAM_SECRET,
                "max_cap_cents": 100,
                **worker_settings,
            }  # type: ignore[arg-type]
        )
    # Whoever prints the error prints no secret, the refused ones included.
    secrets = (ADMIN_TOKEN, WORKER_TOKEN, UPSTREAM_SECRET, "Q7" * 12, "hunter2")
    assert [s for s in secrets if s in str(refused.value)] == []


async def test_without_a_worker_token_only_the_admin_token_opens(
    vault_settings: VaultSettings,
) -> None:
    plain = vault_settings.model_copy(update={"worker_token": None, "worker_budget_cents": None})
    async with serve(plain) as running, VaultAdmin(running.url, WORKER_TOKEN) as stranger:
        with pytest.raises(VaultAuthError):
            await stranger.find_keys()

"""I5: no secret (the upstream Stripe key, a vault key, the admin token) in audit rows, stored
reservations, responses or logs (the autouse fixture checks the captured logs of every test)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable

import aiohttp
import asyncpg
import pytest
import stripe
from aiohttp import web
from yarl import URL

from stripe_emulator import RunningEmulator
from vault import RunningVault, VaultSettings, serve
from vault.models import IssuedKey

from .conftest import Issue, Secrets
from .support import ADMIN_TOKEN, UPSTREAM_SECRET, charge, charge_in_doubt, via_vault

StripeFor = Callable[[IssuedKey], stripe.StripeClient]


async def _table_text(db: asyncpg.Pool) -> str:
    rows = []
    for table in ("vault_audit", "vault_reservations", "vault_keys", "vault_key_days"):
        rows += [repr(dict(row)) for row in await db.fetch(f"SELECT * FROM {table}")]
    return "\n".join(rows)


async def test_no_secret_in_audit_rows_reservations_or_responses(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    declining_customer: str,
    vault: RunningVault,
    emulator: RunningEmulator,
    http: aiohttp.ClientSession,
    db: asyncpg.Pool,
    secrets_seen: Secrets,
) -> None:
    key = await issue(cap_cents=3_000)
    vk = key.secret.get_secret_value()
    client = stripe_via_vault(key)
    replies: list[str] = []

    async def raw(method: str, path: str, **kwargs: object) -> None:
        url = URL(vault.url + path, encoded=True)  # sent as written, percent-escapes too
        async with http.request(method, url, **kwargs) as response:  # type: ignore[arg-type]
            replies.append(f"{response.status} {dict(response.headers)} {await response.text()}")

    await charge(client, customer, 1_000, "ok")
    with pytest.raises(stripe.CardError):
        await charge(client, declining_customer, 1_000, "declined")
    with pytest.raises(stripe.CardError):
        await charge(client, customer, 5_000, "over")
    await charge_in_doubt(emulator, client, customer, 1_000, "dropped")
    bearer = {"Authorization": f"Bearer {vk}"}
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    # Secrets sent where they do not belong: refused, and never stored or echoed.
    await raw(
        "POST",
        "/stripe/v1/payment_intents",
        headers=bearer | form | {"Idempotency-Key": vk},
        data="amount=1&currency=usd",
    )
    await raw(
        "POST",
        "/stripe/v1/payment_intents",
        headers=bearer | form | {"Idempotency-Key": "c"},
        data=f"amount=1&currency=usd&customer={UPSTREAM_SECRET}",
    )
    await raw("GET", f"/stripe/v1/payment_intents/{vk}", headers=bearer)
    # Glued to other text, or in a query string, percent-encoded or not.
    await raw("GET", f"/stripe/v1/payment_intents/X{vk}", headers=bearer)
    await raw("GET", f"/stripe/v1/payment_intents/pi{UPSTREAM_SECRET}", headers=bearer)
    await raw("GET", f"/stripe/v1/charges?customer={vk}", headers=bearer)
    encoded = UPSTREAM_SECRET.replace("_", "%5F")
    await raw("GET", f"/stripe/v1/charges?customer=x{encoded}", headers=bearer)
    # In a body a GET should not have, or a header the vault forwards.
    await raw("GET", "/stripe/v1/payment_intents/pi_1", headers=bearer | form, data=f"x={vk}")
    await raw("GET", "/stripe/v1/charges", headers=bearer | {"Stripe-Version": UPSTREAM_SECRET})
    await raw("GET", "/stripe/v1/charges", headers={"Authorization": f"Bearer {UPSTREAM_SECRET}"})
    await raw("GET", "/stripe/v1/charges", headers={"Authorization": f"Bearer {vk}x"})
    await raw("GET", f"/vault/keys/{key.id}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    await raw(
        "GET", f"/vault/keys/{key.id}/audit", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    await raw(
        "GET",
        f"/vault/keys/{key.id}/reservations",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    await raw("GET", "/vault/keys", headers={"Authorization": f"Bearer {vk}"})

    assert secrets_seen.found_in("\n".join(replies)) == []
    stored = await _table_text(db)
    assert secrets_seen.found_in(stored) == []
    assert [reply[:3] for reply in replies[3:9]] == ["400"] * 6, replies[3:9]
    assert await db.fetchval("SELECT count(*) FROM vault_audit WHERE actor IS NULL") == 15
    assert "[redacted key]" in stored  # the vk_ secret sent as a path and idempotency key


async def test_words_holding_sk_are_not_taken_for_keys(
    issue: Issue, vault: RunningVault, http: aiohttp.ClientSession, db: asyncpg.Pool
) -> None:
    key = await issue(allowed_endpoints=["GET /v1/charges"])
    async with http.get(
        vault.url + "/stripe/v1/charges?customer=cus_risky&starting_after=ch_task",
        headers={"Authorization": f"Bearer {key.secret.get_secret_value()}"},
    ):
        pass
    assert await db.fetchval("SELECT decision FROM vault_audit WHERE actor IS NULL") == "forwarded"


@pytest.fixture
async def echoing_upstream() -> AsyncIterator[str]:
    """A broken upstream that echoes the request's Authorization header in its body."""

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(
            {"error": {"type": "api_error", "message": request.headers["Authorization"]}},
            status=500,
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def test_the_upstream_secret_is_scrubbed_from_what_the_upstream_echoes(
    vault_settings: VaultSettings,
    echoing_upstream: str,
    issue: Issue,
    http: aiohttp.ClientSession,
) -> None:
    key = await issue()
    echoing = vault_settings.model_copy(update={"upstream_stripe_base": echoing_upstream})
    async with (
        serve(echoing) as vault,
        http.get(
            f"{vault.url}/stripe/v1/payment_intents/pi_1",
            headers={"Authorization": f"Bearer {key.secret.get_secret_value()}"},
        ) as response,
    ):
        body = await response.text()
    assert response.status == 500
    assert UPSTREAM_SECRET not in body
    assert "Bearer [redacted]" in body


async def test_unreachable_upstream_is_logged_without_secrets(
    vault_settings: VaultSettings,
    issue: Issue,
    customer: str,
    db: asyncpg.Pool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = await issue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    nowhere = vault_settings.model_copy(
        update={"upstream_stripe_base": f"http://127.0.0.1:{closed_port}"}
    )
    async with serve(nowhere) as vault, aiohttp.ClientSession() as session:
        client = via_vault(key.secret.get_secret_value(), vault.url, session)
        with pytest.raises(stripe.APIError) as failed:
            await charge(client, customer, 100, "nowhere")
    assert failed.value.http_status == 502
    assert "upstream gave no answer" in caplog.text
    # Nothing reached Stripe, but the vault cannot know that: the money stays reserved.
    state = await db.fetchval("SELECT state FROM vault_reservations")
    assert state == "unknown"

"""Helpers shared by the vault's tests: the secrets they use, requests as the worker makes
them, the emulator's ledger and faults, and the cap invariants checked against the tables."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import aiohttp
import asyncpg
import pytest
import stripe
from aiohttp import web
from stripe.params import PaymentIntentCreateParams
from yarl import URL

from stripe_emulator import RunningEmulator
from tests.prometheus import metric_value
from tests.waiting import eventually
from vault import reservations
from vault.client import VaultAdmin
from vault.endpoints import FENCE_HEADER
from vault.models import AuditEntry, IssueKeyRequest

ADMIN_TOKEN = "adm_test_token_4f9c2e7a1b"  # noqa: S105 (test-only values)
WORKER_TOKEN = "wrk_test_token_8d3b6f0c5e"  # noqa: S105
UPSTREAM_SECRET = "sk_test_51VaultUpstream9d1e44c0"  # noqa: S105
MAX_CAP_CENTS = 5_000_000
# Three keys of key_request()'s default cap.
WORKER_BUDGET_CENTS = 300_000
WORKER_CURRENCIES = "usd,eur"
DEFAULT_ENDPOINTS = [
    "POST /v1/payment_intents",
    "POST /v1/charges",
    "GET /v1/payment_intents/*",
]


def via_vault(secret: str, vault_url: str, session: aiohttp.ClientSession) -> stripe.StripeClient:
    """The stock Stripe SDK, async over aiohttp, calling Stripe through the vault."""
    return stripe.StripeClient(
        secret,
        base_addresses={"api": vault_url + "/stripe"},
        http_client=stripe.AIOHTTPClient(session=session),
    )


def key_request(**overrides: Any) -> IssueKeyRequest:
    fields: dict[str, Any] = {
        "label": "billing",
        "period": "2026-12",
        "cap_cents": 100_000,
        "currency": "usd",
        "allowed_endpoints": DEFAULT_ENDPOINTS,
        "expires_at": datetime.now(UTC) + timedelta(days=1),
    }
    return IssueKeyRequest(**(fields | overrides))


async def charge(
    client: stripe.StripeClient,
    customer: str,
    amount: int,
    idempotency_key: str,
    currency: str = "usd",
    fence: str | None = None,
    payment_method: str | None = None,
) -> stripe.PaymentIntent:
    """An off-session recurring charge, as the worker makes it (the worker sends its
    attempt's fencing token too, as `fence`); naming no `payment_method`, it charges the
    customer's default source."""
    options: stripe.RequestOptions = {"idempotency_key": idempotency_key}
    if fence is not None:
        options["headers"] = {FENCE_HEADER: fence}
    params: PaymentIntentCreateParams = {
        "amount": amount,
        "currency": currency,
        "customer": customer,
        "confirm": True,
        "off_session": True,
        "automatic_payment_methods": {"enabled": True, "allow_redirects": "never"},
    }
    if payment_method is not None:
        params["payment_method"] = payment_method
    return await client.v1.payment_intents.create_async(params=params, options=options)


async def proxied_calls(admin: VaultAdmin, key_id: str) -> list[AuditEntry]:
    """The key's audit rows for requests through it, without what the admin API did to it."""
    return [entry for entry in await admin.audit(key_id) if entry.actor is None]


async def emulator_ledger(emulator: RunningEmulator) -> list[dict[str, Any]]:
    return await _inspected(emulator, "ledger", "charges")


async def emulator_requests(emulator: RunningEmulator) -> list[dict[str, Any]]:
    """Every request the emulator received, in order, with its status."""
    return await _inspected(emulator, "requests", "requests")


async def _inspected(emulator: RunningEmulator, view: str, field: str) -> list[dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{emulator.url}/_emulator/{view}") as response,
    ):
        found: list[dict[str, Any]] = (await response.json())[field]
        return found


async def set_faults(emulator: RunningEmulator, **faults: Any) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(emulator.url + "/_emulator/faults", json=faults) as response,
    ):
        assert response.status == 200, await response.text()


async def charge_in_doubt(
    emulator: RunningEmulator,
    client: stripe.StripeClient,
    customer: str,
    amount: int,
    idempotency_key: str,
    fault: Literal["drop_after_commit", "error_before_commit"] = "drop_after_commit",
    currency: str = "usd",
    payment_method: str | None = None,
) -> None:
    """A charge in doubt: one Stripe makes but whose answer is lost on the way back, or
    (error_before_commit) one it answers with a 500 before executing anything."""
    await set_faults(emulator, **{fault: 1.0})
    with pytest.raises(stripe.APIError):
        await charge(
            client, customer, amount, idempotency_key, currency, payment_method=payment_method
        )
    await set_faults(emulator, **{fault: 0.0})


async def assert_consistent(db: asyncpg.Pool, key_id: str) -> asyncpg.Record:
    """The key's counters equal the sums over its reservations (per key and per UTC day; a
    charge another key counts is not this one's) and stay within the caps. Returns the key's
    totals."""
    key = await db.fetchrow(
        """
        SELECT k.cap_cents, k.daily_cap_cents, k.reserved_cents, k.spent_cents,
               coalesce(sum(r.amount_cents) FILTER (WHERE r.state IN ('pending', 'unknown')), 0)
                   AS live_reserved,
               coalesce(sum(r.committed_cents) FILTER (WHERE r.state = 'committed'
                                                       AND r.counted_under IS NULL), 0)
                   AS live_spent
        FROM vault_keys k LEFT JOIN vault_reservations r ON r.vault_key_id = k.id
        WHERE k.id = $1 GROUP BY k.id
        """,
        key_id,
    )
    assert key["reserved_cents"] == key["live_reserved"]
    assert key["spent_cents"] == key["live_spent"]
    assert key["reserved_cents"] + key["spent_cents"] <= key["cap_cents"]
    days = await db.fetch(
        """
        SELECT d.day, d.reserved_cents, d.spent_cents,
               coalesce(sum(r.amount_cents) FILTER (WHERE r.state IN ('pending', 'unknown')), 0)
                   AS live_reserved,
               coalesce(sum(r.committed_cents) FILTER (WHERE r.state = 'committed'
                                                       AND r.counted_under IS NULL), 0)
                   AS live_spent
        FROM vault_key_days d
        LEFT JOIN vault_reservations r ON r.vault_key_id = d.vault_key_id AND r.day = d.day
        WHERE d.vault_key_id = $1 GROUP BY d.day, d.reserved_cents, d.spent_cents
        """,
        key_id,
    )
    for day in days:
        assert (day["reserved_cents"], day["spent_cents"]) == (
            day["live_reserved"],
            day["live_spent"],
        )
        assert day["reserved_cents"] + day["spent_cents"] <= key["daily_cap_cents"]
    return key


async def assert_a_slow_body_is_refused(
    vault_url: str, method: str, path: str, headers: dict[str, str], body: bytes
) -> None:
    """Send the request's head and the start of its body, then nothing more: the vault
    answers 408 `body_timeout` and closes the connection, within its 1 s body timeout (the
    test's setting) and well before the 5 s this waits."""
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: vault",
        *(f"{k}: {v}" for k, v in headers.items()),
        f"Content-Length: {len(body)}",
    ]
    url = URL(vault_url)
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body[:10])
        await writer.drain()
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"\r\nContent-Length: *([0-9]+)", head, re.IGNORECASE)
            assert length is not None, head
            answer = head + await reader.readexactly(int(length[1]))
    finally:
        writer.close()
    assert time.monotonic() - started < 3
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"\r\nConnection: close\r\n" in answer
    # Nothing was reserved: the client sends it again, whole.
    assert b"\r\nStripe-Should-Retry: true\r\n" in answer
    assert b'"code":"body_timeout"' in answer


def refusals_counted(code: str) -> float:
    """The vault's `vault_refusals_total` for `code`, in this process."""
    return metric_value("vault_refusals_total", code=code)


async def reserve_behind_a_lock(
    db: asyncpg.Pool, key_id: str, idempotency_key: str, sent: reservations.Charge
) -> asyncio.Task[reservations.Reservation]:
    """A reservation on a connection of its own, made while the caller holds a lock it
    needs: returned once it waits for that lock, for the caller to let go when it chooses."""

    async def reserve() -> reservations.Reservation:
        async with db.acquire() as conn:
            return await reservations.reserve(
                conn, key_id, idempotency_key, sent, timedelta(minutes=5)
            )

    waiting = asyncio.create_task(reserve())
    await a_reservation_waits_for_a_lock(db)
    return waiting


async def a_reservation_waits_for_a_lock(db: asyncpg.Pool) -> None:
    """Returns once one reservation (the vault's, or a test's own) waits for a lock."""

    async def blocked() -> bool:
        waiters: int = await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND query LIKE '%vault_reserve%'"
        )
        return waiters == 1

    await eventually(blocked, timeout=10)


@contextmanager
def closed_port() -> Iterator[int]:
    """A port nothing listens on: a connect is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@asynccontextmanager
async def stand_in_upstream(
    answer: Callable[[web.Request], Awaitable[web.Response]],
) -> AsyncIterator[str]:
    """An upstream answering every request with `answer`, for what the emulator never says
    (a broken upstream, an answer Stripe gives rarely): its URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()

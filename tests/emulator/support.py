"""Helpers shared by the emulator's tests: raw HTTP calls and the suite's API key."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import stripe

API_KEY = "sk_test_emulator_suite_key"


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]
    body: Any


class Raw:
    """Plain HTTP against the emulator, for what the SDK hides (headers, exact status codes)."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url

    async def request(
        self,
        method: str,
        path: str,
        data: Mapping[str, str] | None = None,
        *,
        key: str | None = API_KEY,
        idempotency_key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        sent = dict(headers or {})
        if key is not None:
            sent.setdefault("Authorization", f"Bearer {key}")
        if idempotency_key is not None:
            sent["Idempotency-Key"] = idempotency_key
        options: dict[str, Any] = {"data": data} if method == "POST" else {"params": data}
        async with self.session.request(
            method, self.url + path, headers=sent, **options
        ) as response:
            return Reply(response.status, response.headers, await response.json())

    async def post(self, path: str, data: Mapping[str, str] | None = None, **kw: Any) -> Reply:
        return await self.request("POST", path, data, **kw)

    async def get(self, path: str, query: Mapping[str, str] | None = None, **kw: Any) -> Reply:
        return await self.request("GET", path, query, **kw)

    async def ledger(self) -> dict[str, Any]:
        return (await self.request("GET", "/_emulator/ledger", key=None)).body  # type: ignore[no-any-return]

    async def request_log(self) -> list[dict[str, Any]]:
        return (await self.request("GET", "/_emulator/requests", key=None)).body["requests"]  # type: ignore[no-any-return]

    async def faults(self, **changes: Any) -> Reply:
        async with self.session.post(self.url + "/_emulator/faults", json=changes) as response:
            return Reply(response.status, response.headers, await response.json())

    async def customer(self, card: str = "pm_card_visa", **extra: str) -> dict[str, Any]:
        """A customer whose default payment method is ``card`` (attached as a new pm_...)."""
        reply = await self.post(
            "/v1/customers",
            {"payment_method": card, "invoice_settings[default_payment_method]": card, **extra},
        )
        assert reply.status == 200, reply.body
        return reply.body  # type: ignore[no-any-return]

    async def intent(self, customer: str, idempotency_key: str, **extra: str) -> Reply:
        """An off-session PaymentIntent confirmed at once, as the billing core sends it."""
        params = {
            "amount": "1999",
            "currency": "usd",
            "customer": customer,
            "confirm": "true",
            "off_session": "true",
            # As the billing core confirms: off session, no redirect, so no return_url.
            "automatic_payment_methods[enabled]": "true",
            "automatic_payment_methods[allow_redirects]": "never",
            **extra,
        }
        return await self.post("/v1/payment_intents", params, idempotency_key=idempotency_key)

    async def charge(
        self, customer: Mapping[str, Any], idempotency_key: str, **extra: str
    ) -> Reply:
        """``intent`` naming the payment method of ``customer`` (as ``customer`` returns it), as
        the billing core names the ledger's: Stripe would not take the invoice default."""
        return await self.intent(
            customer["id"], idempotency_key, payment_method=method_of(customer), **extra
        )


def method_of(customer: Mapping[str, Any]) -> str:
    """The payment method ``Raw.customer`` saved for ``customer`` (its invoice default)."""
    method: str = customer["invoice_settings"]["default_payment_method"]
    return method


def response_headers(resource: stripe.StripeObject) -> Mapping[str, str]:
    """The HTTP headers of the response the SDK built `resource` from."""
    assert resource.last_response is not None
    return resource.last_response.headers


class Clock:
    """The emulator's clock, moved only by the test (in place of its module's `time`): its
    rate buckets refill, and its saved keys age, as the test says, not by however long a
    loaded machine takes between two requests."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class HeldLatency:
    """The emulator's latency (in place of its module's `asyncio`), lasting until the test
    lets the requests go: a request is in flight for as long as the test needs it to be."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.go = asyncio.Event()

    async def sleep(self, _seconds: float) -> None:
        self.entered.set()
        await self.go.wait()

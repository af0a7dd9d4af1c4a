"""The one way the project opens Stripe clients (async, closed when done)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import stripe

from billing.config import BillingSettings


@asynccontextmanager
async def stripe_http(timeout: float) -> AsyncIterator[stripe.HTTPClient]:
    """One connection pool shared by every client of a process."""
    http = stripe.AIOHTTPClient(timeout=timeout)
    try:
        yield http
    finally:
        await http.close_async()  # type: ignore[no-untyped-call]


def error_code(exc: stripe.StripeError) -> str | None:
    """The error's code as Stripe (or the vault) sent it. The SDK sets `exc.code` for some
    errors only (most 400s, 402s, 404s); the body holds it for every one, e.g. the vault's
    503s."""
    body = exc.json_body
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return str(code) if code else exc.code


def stripe_client(api_key: str, api_base: str, http: stripe.HTTPClient) -> stripe.StripeClient:
    # No max_network_retries: Temporal retries, always with the claim's idempotency key.
    return stripe.StripeClient(api_key, base_addresses={"api": api_base}, http_client=http)


@asynccontextmanager
async def stripe_session(settings: BillingSettings) -> AsyncIterator[stripe.StripeClient]:
    """A client with STRIPE_API_KEY at STRIPE_API_BASE."""
    async with stripe_http(settings.billing_stripe_timeout_seconds) as http:
        yield stripe_client(
            settings.stripe_api_key.get_secret_value(), settings.stripe_api_base, http
        )

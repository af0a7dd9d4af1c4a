"""The one way the project opens a Stripe client (async, closed when done)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import stripe

from billing.config import BillingSettings


@asynccontextmanager
async def stripe_session(settings: BillingSettings) -> AsyncIterator[stripe.StripeClient]:
    # No max_network_retries: Temporal retries, always with the claim's idempotency key.
    http = stripe.AIOHTTPClient(timeout=settings.billing_stripe_timeout_seconds)
    try:
        yield stripe.StripeClient(
            settings.stripe_api_key.get_secret_value(),
            base_addresses={"api": settings.stripe_api_base},
            http_client=http,
        )
    finally:
        await http.close_async()  # type: ignore[no-untyped-call]

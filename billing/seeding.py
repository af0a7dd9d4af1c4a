"""Demo customers: created in Stripe (the emulator locally), then written to the ledger."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import stripe

from billing.config import BillingSettings, DatabaseSettings, load_settings
from billing.customers import CustomerRow, upsert_customers
from billing.db import create_pool
from billing.errors import BillingError, ConfigurationError, ServiceUnavailableError
from billing.models import Record
from billing.redact import redact
from billing.stripe_client import stripe_session

# One customer in this many gets a card that Stripe declines, so the demo shows failures.
DECLINE_EVERY = 97
DECLINED_CARD = "pm_card_chargeCustomerFail"
_CONCURRENCY = 32
# Created a batch at a time, so that a large count holds one batch of tasks, not all of them.
_BATCH = 1000
# What `demo` and `customers seed-demo` take: ten times the largest period measured (bench/);
# more would take hours against the emulator.
MAX_DEMO_CUSTOMERS = 1_000_000


def demo_amount(index: int) -> int:
    """A spread of plausible monthly prices, from $9.00 to $98.99."""
    return 900 + (index * 731) % 9000


def demo_card(index: int) -> str:
    """Stripe's test card for customer `index`: every DECLINE_EVERY-th one is declined."""
    return DECLINED_CARD if index % DECLINE_EVERY == 0 else "pm_card_visa"


async def create_demo_customers(
    client: stripe.StripeClient,
    count: int,
    prefix: str = "demo",
    card_for: Callable[[int], str] = demo_card,
) -> list[CustomerRow]:
    """Create `count` customers, each with the saved test card `card_for(index)`; created
    again within a day (an interrupted seeding run again), each is Stripe's replay of the
    first."""
    gate = asyncio.Semaphore(_CONCURRENCY)

    async def create(index: int) -> CustomerRow:
        card = card_for(index)
        customer_id = f"{prefix}-{index:06d}"
        async with gate:
            customer = await client.v1.customers.create_async(
                {
                    "name": f"Demo customer {index}",
                    "metadata": {"customer_id": customer_id},
                    "payment_method": card,
                    "invoice_settings": {"default_payment_method": card},
                },
                {"idempotency_key": f"seed-{prefix}-{index}"},
            )
        default = (
            customer.invoice_settings.default_payment_method if customer.invoice_settings else None
        )
        payment_method = default if isinstance(default, str) else getattr(default, "id", "")
        return CustomerRow(
            customer_id=customer_id,
            stripe_customer_id=customer.id,
            payment_method=payment_method,
            amount_cents=demo_amount(index),
            currency="usd",
        )

    rows: list[CustomerRow] = []
    for first in range(1, count + 1, _BATCH):
        last = min(first + _BATCH, count + 1)
        rows += await asyncio.gather(*(create(i) for i in range(first, last)))
    return rows


def _stripe_failed(exc: stripe.StripeError, base: str) -> BillingError:
    nothing = (
        "; nothing was written to the ledger (a seeding run again within a day reuses the"
        " customers Stripe created)"
    )
    if isinstance(exc, stripe.APIConnectionError):
        return ServiceUnavailableError(f"cannot reach Stripe at {base} (STRIPE_API_BASE){nothing}")
    if isinstance(exc, stripe.AuthenticationError | stripe.PermissionError):
        return ConfigurationError(f"Stripe at {base} refused STRIPE_API_KEY{nothing}")
    return ServiceUnavailableError(
        f"Stripe at {base} refused a demo customer ({exc.http_status}:"
        f" {redact(str(exc.user_message))}){nothing}"
    )


class DemoSeed(Record):
    """What seeding left in the ledger: a period's run bills every active customer, not
    only the demo's."""

    written: int
    active: int
    # Active customers the demo did not create (imported from a CSV, say).
    not_demo: int


async def seed_demo(count: int, prefix: str = "demo") -> DemoSeed:
    """Create demo customers in the configured Stripe and upsert them into the ledger (reached
    first: customers created on Stripe for a ledger that cannot be written are wasted)."""
    settings = load_settings(BillingSettings)
    pool = await create_pool(load_settings(DatabaseSettings).database_url)
    try:
        async with stripe_session(settings) as client:
            try:
                rows = await create_demo_customers(client, count, prefix)
            except stripe.StripeError as exc:
                raise _stripe_failed(exc, settings.stripe_api_base) from None
        written = await upsert_customers(pool, rows)
        counts = await pool.fetchrow(
            "SELECT count(*) AS active, count(*) FILTER (WHERE customer_id NOT LIKE $1)"
            " AS not_demo FROM customers WHERE active",
            f"{prefix}-%",
        )
    finally:
        await pool.close()
    return DemoSeed(written=written, active=counts["active"], not_demo=counts["not_demo"])

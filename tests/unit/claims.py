"""A claim as the ledger returns it, for unit tests to vary with `model_copy`."""

from __future__ import annotations

from datetime import UTC, datetime

from billing.models import Claim

CLAIM = Claim(
    customer_id="cust-1",
    period="2026-12",
    idempotency_key="0" * 32,
    amount_cents=1000,
    currency="usd",
    stripe_customer_id="cus_1",
    payment_method="pm_1",
    status="claimed",
    claimed_at=datetime(2027, 1, 5, tzinfo=UTC),
)

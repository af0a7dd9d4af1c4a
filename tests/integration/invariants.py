"""I1-I3 of DESIGN section 4, checked from the emulator's ledger, its request log and Postgres."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable

from billing.customers import CustomerRow
from tests.integration.harness import Harness


async def assert_billed_once(
    harness: Harness,
    period: str,
    customers: Iterable[CustomerRow],
    *,
    declined: frozenset[str] = frozenset(),
    cancelled: frozenset[str] = frozenset(),
) -> None:
    customers = list(customers)
    charges = [c for c in await harness.charges() if c["metadata"].get("billing_period") == period]
    succeeded: dict[str, list[dict[str, object]]] = defaultdict(list)
    for charge in charges:
        if charge["status"] == "succeeded":
            succeeded[str(charge["metadata"]["customer_id"])].append(charge)

    # I1: at most one successful charge per (customer, period); exactly one unless declined.
    for row in customers:
        expected = 0 if row.customer_id in declined | cancelled else 1
        got = succeeded.get(row.customer_id, [])
        assert len(got) == expected, f"{row.customer_id}: {len(got)} successful charges"
        for charge in got:
            assert charge["amount"] == row.amount_cents
            assert charge["currency"] == row.currency
            assert charge["customer"] == row.stripe_customer_id

    # I2: every due customer is in a terminal state that agrees with Stripe.
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(period)}
    assert set(rows) == {c.customer_id for c in customers}
    for customer_id, row in rows.items():
        assert row["status"] != "claimed", f"{customer_id} left claimed"
        if customer_id in declined:
            assert row["status"] == "failed" and row["failure_code"], customer_id
        elif customer_id in cancelled:
            assert row["status"] == "cancelled" and row["charge_started_at"] is None, customer_id
        else:
            assert row["status"] == "charged", f"{customer_id} is {row['status']}"
            assert row["charge_id"] == succeeded[customer_id][0]["id"]
    ledger_total = sum(r["amount_cents"] for r in rows.values() if r["status"] == "charged")
    stripe_total = sum(int(c[0]["amount"]) for c in succeeded.values() if c)  # type: ignore[call-overload]
    assert ledger_total == stripe_total

    # I3: every request for one key carried the same key and the same parameters.
    by_key: dict[str, set[str]] = defaultdict(set)
    for request in await harness.requests():
        if request["method"] == "POST" and request["path"] in (
            "/v1/payment_intents",
            "/v1/charges",
        ):
            assert request["idempotency_key"], "a money-moving request without a key"
            by_key[request["idempotency_key"]].add(json.dumps(request["params"], sort_keys=True))
    # A row cancelled at the gate holds a key that never went to Stripe.
    keys = {r["idempotency_key"] for r in rows.values() if r["charge_started_at"] is not None}
    assert keys <= set(by_key)
    for key in keys:
        assert len(by_key[key]) == 1, f"key {key[:8]} sent with different parameters"

"""I1-I3 of DESIGN section 4, checked from the emulator's ledger, its request log and Postgres
(the checks themselves are chaos.invariants, which the chaos run uses too)."""

from __future__ import annotations

from collections.abc import Iterable

from billing.customers import CustomerRow
from chaos.invariants import Expected, check_billed_once
from tests.integration.harness import Harness


async def assert_billed_once(
    harness: Harness,
    period: str,
    customers: Iterable[CustomerRow],
    *,
    declined: frozenset[str] = frozenset(),
    cancelled: frozenset[str] = frozenset(),
) -> None:
    expected = Expected(period, list(customers), declined, cancelled)
    found = check_billed_once(
        expected,
        await harness.charges(),
        await harness.requests(),
        await harness.ledger_rows(period),
    )
    assert not found.violations, "\n".join(found.violations)

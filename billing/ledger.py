"""The billing ledger in PostgreSQL: every query the activities and the CLI run against it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import asyncpg

from billing.errors import LedgerConflictError, UnknownCustomerError
from billing.models import (
    ChargeFailure,
    ChargeResult,
    Claim,
    CustomerOutcome,
    DueCustomer,
    DuePage,
    LedgerStatus,
    PeriodPlan,
    finished_outcome,
)

# Customers a period bills: active ones, and any with a row for it (a claim is always finished).
_DUE = """
    FROM customers c
    LEFT JOIN billing_runs r ON r.customer_id = c.customer_id AND r.billing_period = $1
    WHERE (c.active OR r.status IS NOT NULL)
"""

_CLAIM_COLUMNS = """
    customer_id, billing_period AS period, idempotency_key, amount_cents, currency,
    stripe_customer_id, payment_method, status, claimed_at, payment_intent_id, charge_id,
    failure_code
"""


async def plan_period(conn: asyncpg.Connection, period: str) -> PeriodPlan:
    row = await conn.fetchrow(
        f"""
        SELECT count(*) AS due,
               count(*) FILTER (WHERE r.status IS NULL OR r.status = 'claimed') AS to_charge,
               coalesce(sum(coalesce(r.amount_cents, c.amount_cents))
                        FILTER (WHERE r.status IS NULL OR r.status = 'claimed'), 0) AS total
        {_DUE}
        """,
        period,
    )
    return PeriodPlan(
        period=period, due=row["due"], to_charge=row["to_charge"], expected_total_cents=row["total"]
    )


async def due_page(conn: asyncpg.Connection, period: str, after: str | None, limit: int) -> DuePage:
    rows = await conn.fetch(
        f"""
        SELECT c.customer_id, r.status {_DUE} AND c.customer_id > $2
        ORDER BY c.customer_id LIMIT $3
        """,
        period,
        after or "",
        limit,
    )
    customers = [DueCustomer(customer_id=r["customer_id"], status=r["status"]) for r in rows]
    next_cursor = customers[-1].customer_id if len(customers) == limit else None
    return DuePage(customers=customers, next_cursor=next_cursor)


async def claim(conn: asyncpg.Connection, customer_id: str, period: str, key: str) -> Claim:
    """Insert the claim, or return the one that exists: a retry charges the same row."""
    async with conn.transaction():
        await conn.execute(
            """
            INSERT INTO billing_runs (customer_id, billing_period, idempotency_key, amount_cents,
                                      currency, stripe_customer_id, payment_method)
            SELECT customer_id, $2, $3, amount_cents, currency, stripe_customer_id, payment_method
            FROM customers WHERE customer_id = $1 AND active
            ON CONFLICT DO NOTHING
            """,
            customer_id,
            period,
            key,
        )
        row = await conn.fetchrow(
            f"SELECT {_CLAIM_COLUMNS} FROM billing_runs"
            " WHERE customer_id = $1 AND billing_period = $2",
            customer_id,
            period,
        )
    if row is None:
        raise UnknownCustomerError(
            f"customer {customer_id!r} is not in the ledger or is inactive; nothing was charged"
        )
    return Claim(**dict(row))


async def _finish(
    conn: asyncpg.Connection, key: str, status: LedgerStatus, sets: str, *args: Any
) -> None:
    """Move a claim to a terminal status once; repeating the same result is a no-op."""
    updated = await conn.fetchval(
        f"""
        UPDATE billing_runs SET status = $2, {sets}, updated_at = now(), completed_at = now()
        WHERE idempotency_key = $1 AND status = 'claimed' RETURNING 1
        """,
        key,
        status,
        *args,
    )
    if updated is None:
        current = await conn.fetchrow(
            "SELECT status, charge_id FROM billing_runs WHERE idempotency_key = $1", key
        )
        if current is None:
            raise LedgerConflictError(f"no claim with idempotency key {key[:8]}... to finish")
        same_charge = status != "charged" or current["charge_id"] == args[0]
        if current["status"] != status or not same_charge:
            raise LedgerConflictError(
                f"claim {key[:8]}... is already {current['status']}"
                f" (charge {current['charge_id']}); refusing to record {status} over it"
            )


async def record_charge(conn: asyncpg.Connection, key: str, result: ChargeResult) -> None:
    await _finish(
        conn,
        key,
        "charged",
        "charge_id = $3, payment_intent_id = $4, attempts = $5",
        result.charge_id,
        result.payment_intent_id,
        result.attempts,
    )


async def record_failure(conn: asyncpg.Connection, key: str, failure: ChargeFailure) -> None:
    await _finish(
        conn,
        key,
        "failed",
        "failure_code = $3, decline_code = $4, failure_message = $5, payment_intent_id = $6,"
        " attempts = $7",
        failure.code,
        failure.decline_code,
        failure.message[:500],
        failure.payment_intent_id,
        failure.attempts,
    )


async def outcomes(
    conn: asyncpg.Connection, period: str, customer_ids: Sequence[str]
) -> list[CustomerOutcome]:
    """Outcomes of customers already finished in the ledger (a row charged earlier counts as
    already billed); customers without a finished row are left out."""
    rows = await conn.fetch(
        """
        SELECT customer_id, status, amount_cents, currency, charge_id, failure_code
        FROM billing_runs
        WHERE billing_period = $1 AND customer_id = ANY($2::text[]) AND status <> 'claimed'
        """,
        period,
        list(customer_ids),
    )
    return [outcome_from_row(row) for row in rows]


def outcome_from_row(row: asyncpg.Record) -> CustomerOutcome:
    return CustomerOutcome(
        customer_id=row["customer_id"],
        outcome=finished_outcome(row["status"]),
        amount_cents=row["amount_cents"],
        currency=row["currency"],
        charge_id=row["charge_id"],
        failure_code=row["failure_code"],
    )


async def start_period(conn: asyncpg.Connection, plan: PeriodPlan, workflow_id: str) -> None:
    await conn.execute(
        """
        INSERT INTO billing_periods (billing_period, workflow_id, state, due, expected_total_cents)
        VALUES ($1, $2, 'running', $3, $4)
        ON CONFLICT (billing_period) DO UPDATE SET
            workflow_id = EXCLUDED.workflow_id, state = 'running', due = EXCLUDED.due,
            expected_total_cents = EXCLUDED.expected_total_cents, started_at = now(),
            finished_at = NULL, summary = NULL
        """,
        plan.period,
        workflow_id,
        plan.due,
        plan.expected_total_cents,
    )


async def finish_period(conn: asyncpg.Connection, period: str, summary_json: str) -> None:
    await conn.execute(
        """
        UPDATE billing_periods SET state = 'completed', summary = $2::jsonb, finished_at = now()
        WHERE billing_period = $1
        """,
        period,
        summary_json,
    )


async def status_counts(conn: asyncpg.Connection, period: str) -> dict[str, tuple[int, int]]:
    """(count, cents) per ledger status for one period."""
    rows = await conn.fetch(
        "SELECT status, count(*) AS n, coalesce(sum(amount_cents), 0) AS cents"
        " FROM billing_runs WHERE billing_period = $1 GROUP BY status",
        period,
    )
    return {row["status"]: (row["n"], row["cents"]) for row in rows}

"""A period's failed customers, grouped by what Stripe answered: the question after "failed 10"."""

from __future__ import annotations

import asyncpg

from billing.models import Record

# Each group names its first customers; `customers show` tells one's whole story.
CUSTOMERS_NAMED = 20


class FailureGroup(Record):
    failure_code: str
    # The issuer's reason for a card_declined (insufficient_funds, ...), when Stripe gave one.
    decline_code: str | None
    count: int
    # The first CUSTOMERS_NAMED, by id.
    customer_ids: list[str]
    # Stripe's message of the first of them, and how many messages the group holds: one
    # code may name each customer's own object ("No such customer: 'cus_...'").
    message: str | None
    messages: int = 1


class PeriodFailures(Record):
    """The ledger's failed rows of a period. A run also counts failed, with no row, a customer
    it found gone before its claim (unknown_customer) and one whose workflow ended before it
    (ended_without_claim): the Web UI's search finds those."""

    period: str
    failed: int
    groups: list[FailureGroup]


async def period_failures(conn: asyncpg.Connection, period: str) -> PeriodFailures:
    """The period's failed rows by failure and decline code, the largest group first."""
    rows = await conn.fetch(
        """
        SELECT failure_code, decline_code, count(*) AS count,
               (array_agg(customer_id ORDER BY customer_id))[1:$2] AS customer_ids,
               (array_agg(failure_message ORDER BY customer_id))[1] AS message,
               count(DISTINCT failure_message) AS messages
        FROM billing_runs
        WHERE billing_period = $1 AND status = 'failed'
        GROUP BY failure_code, decline_code
        ORDER BY count(*) DESC, failure_code, decline_code NULLS FIRST
        """,
        period,
        CUSTOMERS_NAMED,
    )
    groups = [FailureGroup(**dict(row)) for row in rows]
    return PeriodFailures(period=period, failed=sum(g.count for g in groups), groups=groups)

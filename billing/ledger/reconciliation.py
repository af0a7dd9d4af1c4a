"""What reconciliation reads from the ledger and keeps in it: verdicts, open claims, the
customers and charges to compare with Stripe, and the findings a person marked handled."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime, timedelta
from typing import Literal

import asyncpg

from billing.ledger.sql import CLAIM_COLUMNS
from billing.models import Claim
from billing.reconciliation import (
    CustomerToCheck,
    Finding,
    FindingKind,
    HandledMark,
    HandledRequest,
    HandledResult,
    LedgerEntry,
    OpenClaim,
    PeriodToRecheck,
)


async def record_reconciliation(
    conn: asyncpg.Connection,
    period: str,
    open_reason: str | None,
    began_at: datetime | None = None,
) -> None:
    """Keep what the period's latest reconciliation left to look at again (None: nothing),
    as of when it began (`began_at`; now if None): a verdict of one that began before the
    one kept is stale (an attempt landing days late) and is dropped. Kept as of its start,
    a reconciliation counts a run started while it read as started since (periods_to_recheck),
    by Temporal's clock against Postgres's: one started within their skew of it may not."""
    await conn.execute(
        """
        INSERT INTO period_reconciliations (billing_period, open_reason, reconciled_at)
        VALUES ($1, $2, coalesce($3, now()))
        ON CONFLICT (billing_period) DO UPDATE
        SET reconciled_at = EXCLUDED.reconciled_at, open_reason = EXCLUDED.open_reason
        WHERE period_reconciliations.reconciled_at <= EXCLUDED.reconciled_at
        """,
        period,
        open_reason,
        began_at,
    )


async def periods_to_recheck(
    conn: asyncpg.Connection, besides: str, run_within: timedelta, limit: int
) -> list[PeriodToRecheck]:
    """Periods other than `besides` to reconcile again, those reconciled longest ago (or
    never) first, so that periods left open for good take turns with the rest: those whose
    latest reconciliation left something, and those with a run started within `run_within`
    and since they were last reconciled, if ever (older runs were there before
    reconciliations were kept, and a person reconciles them by hand)."""
    rows = await conn.fetch(
        """
        SELECT p.billing_period, r.open_reason, r.reconciled_at IS NULL AS never
        FROM billing_periods p LEFT JOIN period_reconciliations r USING (billing_period)
        WHERE p.billing_period <> $1
          AND (r.open_reason IS NOT NULL
               OR (p.started_at > now() - $2::interval
                   AND (r.reconciled_at IS NULL OR r.reconciled_at < p.started_at)))
        ORDER BY r.reconciled_at NULLS FIRST, p.billing_period
        LIMIT $3
        """,
        besides,
        run_within,
        limit,
    )
    return [
        PeriodToRecheck(
            period=row["billing_period"],
            why=row["open_reason"]
            or ("never reconciled" if row["never"] else "run again since it was reconciled"),
        )
        for row in rows
    ]


async def open_claims(
    conn: asyncpg.Connection, period: str, limit: int, after: Claim | None = None
) -> list[OpenClaim]:
    """Claims of the period with no recorded outcome, oldest first (after `after`), for
    reconciliation."""
    rows = await conn.fetch(
        f"""
        SELECT {CLAIM_COLUMNS}, skip_reason, charge_started_at IS NOT NULL AS sent,
               (SELECT control FROM billing_periods p
                WHERE p.billing_period = billing_runs.billing_period) AS control
        FROM billing_runs WHERE billing_period = $1 AND status = 'claimed'
          AND ($3::timestamptz IS NULL OR (claimed_at, customer_id) > ($3, $4))
        ORDER BY claimed_at, customer_id LIMIT $2
        """,
        period,
        limit,
        None if after is None else after.claimed_at,
        None if after is None else after.customer_id,
    )
    return [
        OpenClaim(
            claim=Claim(**{k: v for k, v in row.items() if k not in ("sent", "control")}),
            sent=row["sent"],
            control=row["control"],
        )
        for row in rows
    ]


async def claim_by_key(conn: asyncpg.Connection, key: str) -> Claim | None:
    row = await conn.fetchrow(
        f"SELECT {CLAIM_COLUMNS} FROM billing_runs WHERE idempotency_key = $1", key
    )
    return None if row is None else Claim(**dict(row))


# The Stripe customer whose charges reconciliation lists for customer `c`: the one its period's
# row `r` charged (or would charge), else its own.
_LISTED_UNDER = "coalesce(r.stripe_customer_id, c.stripe_customer_id)"


async def customers_page(
    conn: asyncpg.Connection, period: str, after: str | None, limit: int
) -> list[CustomerToCheck]:
    """Every customer, active or not, with the Stripe customer it is listed under."""
    rows = await conn.fetch(
        f"""
        SELECT c.customer_id, {_LISTED_UNDER} AS stripe_customer_id,
               coalesce(r.currency, c.currency) AS currency,
               r.customer_id IS NOT NULL AS in_ledger
        FROM customers c
        LEFT JOIN billing_runs r ON r.customer_id = c.customer_id AND r.billing_period = $1
        WHERE c.customer_id > $2 ORDER BY c.customer_id LIMIT $3
        """,
        period,
        after or "",
        limit,
    )
    return [CustomerToCheck(**dict(row)) for row in rows]


async def mark_handled(conn: asyncpg.Connection, request: HandledRequest) -> HandledResult:
    """Record that a person handled the finding of this kind for this charge (a record
    standing stays as it is), or, with `undo`, take the standing record back."""
    change: Literal["recorded", "already", "undone", "none"]
    if request.undo:
        row = await conn.fetchrow(
            """
            UPDATE handled_findings
            SET undone_at = now(), undone_by = $4, undo_reason = $3
            WHERE charge_id = $1 AND kind = $2 AND undone_at IS NULL
            RETURNING billing_period, reason, handled_by
            """,
            request.charge_id,
            request.kind,
            request.reason,
            request.operator,
        )
        change = "none" if row is None else "undone"
    else:
        row = await conn.fetchrow(
            """
            INSERT INTO handled_findings (charge_id, kind, billing_period, reason, handled_by)
            VALUES ($1, $2, $3, $4, $5)
            ON CONFLICT (charge_id, kind) DO UPDATE
                SET billing_period = EXCLUDED.billing_period, reason = EXCLUDED.reason,
                    handled_by = EXCLUDED.handled_by, handled_at = now(), undone_at = NULL,
                    undone_by = NULL, undo_reason = NULL
                WHERE handled_findings.undone_at IS NOT NULL
            RETURNING billing_period, reason, handled_by
            """,
            request.charge_id,
            request.kind,
            request.period,
            request.reason,
            request.operator,
        )
        change = "recorded"
        if row is None:
            # Its own statement, so that it sees a record committed after the insert began.
            row = await conn.fetchrow(
                "SELECT billing_period, reason, handled_by FROM handled_findings"
                " WHERE charge_id = $1 AND kind = $2",
                request.charge_id,
                request.kind,
            )
            change = "already"
    return HandledResult(
        charge_id=request.charge_id,
        kind=request.kind,
        change=change,
        period=row["billing_period"] if row else None,
        handled_by=row["handled_by"] if row else None,
        reason=row["reason"] if row else None,
    )


async def handled_marks(conn: asyncpg.Connection, period: str) -> list[HandledMark]:
    """Every mark made under the period, the taken back ones too, oldest first."""
    rows = await conn.fetch(
        """
        SELECT charge_id, kind, reason, handled_by, handled_at, undone_at, undone_by, undo_reason
        FROM handled_findings WHERE billing_period = $1 ORDER BY handled_at, charge_id, kind
        """,
        period,
    )
    return [HandledMark(**dict(row)) for row in rows]


async def handled_among(
    conn: asyncpg.Connection, findings: Collection[Finding]
) -> dict[tuple[str, str], str]:
    """Those of the findings a person marked handled, by (charge id, kind): who did."""
    rows = await conn.fetch(
        """
        SELECT h.charge_id, h.kind, h.handled_by FROM handled_findings h
        JOIN unnest($1::text[], $2::text[]) AS f (charge_id, kind) USING (charge_id, kind)
        WHERE h.undone_at IS NULL
        """,
        [f.charge_id for f in findings],
        [f.kind for f in findings],
    )
    return {(row["charge_id"], row["kind"]): row["handled_by"] for row in rows}


async def record_reported(
    conn: asyncpg.Connection, period: str, findings: Collection[Finding]
) -> None:
    """Keep that these findings were reported (under `period`), for `handled` to check a
    charge id against."""
    await conn.execute(
        """
        INSERT INTO reported_findings (charge_id, kind, billing_period)
        -- Once each (a charge two customers of ours share is found under both), in one
        -- order, so that two pages writing the same charges wait rather than deadlock.
        SELECT DISTINCT f.charge_id, f.kind, $3
        FROM unnest($1::text[], $2::text[]) AS f (charge_id, kind) ORDER BY 1, 2
        ON CONFLICT (charge_id, kind) DO UPDATE
            SET billing_period = EXCLUDED.billing_period, last_reported_at = now()
        """,
        [f.charge_id for f in findings],
        [f.kind for f in findings],
        period,
    )


async def reported_kinds(conn: asyncpg.Connection, charge_id: str) -> dict[FindingKind, str]:
    """The kinds of finding reconciliation has reported for the charge, each with the period
    it was last reported under."""
    rows = await conn.fetch(
        "SELECT kind, billing_period FROM reported_findings WHERE charge_id = $1 ORDER BY kind",
        charge_id,
    )
    return {row["kind"]: row["billing_period"] for row in rows}


async def active_among(conn: asyncpg.Connection, customer_ids: Collection[str]) -> set[str]:
    """Those of `customer_ids` that are active customers."""
    rows = await conn.fetch(
        "SELECT customer_id FROM customers WHERE customer_id = ANY($1::text[]) AND active",
        list(customer_ids),
    )
    return {row["customer_id"] for row in rows}


async def first_listers(
    conn: asyncpg.Connection, period: str, stripe_customer_ids: Collection[str]
) -> dict[str, str]:
    """For each of the Stripe customers, the id of ours whose listing counts its charges,
    among those reconciliation lists them under (customers_page): two of ours may share one
    (a renamed id). The least of those the period claimed, whose listing is never skipped,
    else the least. Indexed both ways (migrations/024)."""
    rows = await conn.fetch(
        f"""
        WITH ours AS (
            SELECT s, customer_id FROM unnest($2::text[]) AS s
            JOIN customers ON stripe_customer_id = s
            UNION
            SELECT s, customer_id FROM unnest($2::text[]) AS s
            JOIN billing_runs ON billing_period = $1 AND stripe_customer_id = s
        )
        SELECT DISTINCT ON (o.s) o.s, c.customer_id AS first
        FROM ours o
        JOIN customers c USING (customer_id)
        LEFT JOIN billing_runs r ON r.customer_id = c.customer_id AND r.billing_period = $1
        WHERE {_LISTED_UNDER} = o.s
        ORDER BY o.s, r.customer_id IS NULL, c.customer_id
        """,
        period,
        sorted(stripe_customer_ids),
    )
    return {row["s"]: row["first"] for row in rows}


async def ledger_entries(
    conn: asyncpg.Connection, period: str, customer_ids: Sequence[str]
) -> dict[str, LedgerEntry]:
    rows = await conn.fetch(
        """
        SELECT customer_id, status, charge_id, idempotency_key FROM billing_runs
        WHERE billing_period = $1 AND customer_id = ANY($2::text[])
        """,
        period,
        list(customer_ids),
    )
    return {row["customer_id"]: LedgerEntry(**dict(row)) for row in rows}

"""What a period bills: its plan and totals, the preview, the customers it holds, and the
pages of due customers a run walks."""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from billing.ledger.sql import DUE, DUE_WHERE, HELD_AS, OPEN, due_join
from billing.models import DueCustomer, DuePage, Listing, PeriodPlan, PreviewLine, StoredKey


async def plan_period(conn: asyncpg.Connection, period: str) -> PeriodPlan:
    rows = await conn.fetch(
        f"""
        SELECT coalesce(r.currency, c.currency) AS currency, count(*) AS due,
               count(*) FILTER (WHERE {OPEN}) AS to_charge,
               coalesce(sum(coalesce(r.amount_cents, c.amount_cents)) FILTER (WHERE {OPEN}), 0)
                   AS total
        {DUE}
        GROUP BY 1
        """,
        period,
    )
    totals = {row["currency"]: row["total"] for row in rows if row["total"]}
    return PeriodPlan(
        period=period,
        due=sum(row["due"] for row in rows),
        to_charge=sum(row["to_charge"] for row in rows),
        expected_total_cents=sum(totals.values()),
        totals_by_currency=totals,
    )


async def unsent_totals(conn: asyncpg.Connection, period: str) -> dict[str, int]:
    """Per currency, what a run would charge for claims no attempt of which went out through
    the period's current key (none yet, or only through keys it replaced): none of it is in
    that key's spend or reservations."""
    rows = await conn.fetch(
        f"""
        SELECT coalesce(r.currency, c.currency) AS currency,
               sum(coalesce(r.amount_cents, c.amount_cents))::bigint AS total
        {DUE} AND {OPEN} AND NOT EXISTS (
            SELECT 1 FROM period_vault_keys k
            WHERE k.billing_period = $1 AND k.currency = r.currency
                AND k.vault_key_id = ANY(r.sent_through))
        GROUP BY 1
        """,
        period,
    )
    return {row["currency"]: row["total"] for row in rows}


async def preview_lines(conn: asyncpg.Connection, period: str) -> list[PreviewLine]:
    """Every due customer with the amount a run would claim (or has claimed) and its row,
    and the customers it holds, read in one snapshot."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        return await _preview_lines(conn, period)


async def _preview_lines(conn: asyncpg.Connection, period: str) -> list[PreviewLine]:
    rows = await conn.fetch(
        f"""
        SELECT c.customer_id,
               coalesce(r.stripe_customer_id, c.stripe_customer_id) AS stripe_customer_id,
               coalesce(r.amount_cents, c.amount_cents) AS amount_cents,
               coalesce(r.currency, c.currency) AS currency, r.status, {OPEN} AS open,
               CASE WHEN r.status IS NULL THEN c.payment_method
                    ELSE r.payment_method END IS NOT NULL AS has_payment_method
        {DUE} ORDER BY c.customer_id
        """,
        period,
    )
    held = await held_customers(conn, period)
    lines = [PreviewLine(**dict(row)) for row in rows]
    return sorted([*lines, *held], key=lambda line: line.customer_id)


async def stored_keys(conn: asyncpg.Connection, period: str) -> list[StoredKey]:
    """The period's stored vault keys, by currency, each with whether this ledger's workers
    issued it (period_keys.issued_here) and what the ledger knows was charged through it."""
    rows = await conn.fetch(
        """
        SELECT k.currency, k.vault_key_id, k.cap_cents,
               i.vault_key_id IS NOT NULL AS issued_here,
               (SELECT coalesce(sum(r.amount_cents), 0)::bigint FROM billing_runs r
                WHERE r.billing_period = k.billing_period AND r.status = 'charged'
                    AND r.sent_through = ARRAY[k.vault_key_id]) AS charged_cents
        FROM period_vault_keys k LEFT JOIN issued_vault_keys i USING (vault_key_id)
        WHERE k.billing_period = $1 ORDER BY k.currency
        """,
        period,
    )
    return [StoredKey(**dict(row)) for row in rows]


async def held_customers(conn: asyncpg.Connection, period: str) -> list[PreviewLine]:
    """The active customers a run of the period holds rather than bills (see HELD_AS), each
    with the id its Stripe customer was billed under (`held_as`)."""
    rows = await conn.fetch(
        f"""
        SELECT * FROM (
            SELECT c.customer_id, c.stripe_customer_id, c.amount_cents, c.currency,
                   NULL AS status, false AS open,
                   c.payment_method IS NOT NULL AS has_payment_method, {HELD_AS} AS held_as
            {due_join()} WHERE c.active AND r.status IS NULL) held
        WHERE held_as IS NOT NULL ORDER BY customer_id
        """,
        period,
    )
    return [PreviewLine(**dict(row)) for row in rows]


async def due_page(
    conn: asyncpg.Connection,
    period: str,
    after: str | None,
    limit: int,
    *,
    without_row: bool = False,
) -> DuePage:
    """Due customers after the cursor, in id order; only those with no row if `without_row`
    (at a run's end: customers imported, or released from a hold, behind its listing, and
    those whose child ended before its claim)."""
    unrowed = " AND r.status IS NULL" if without_row else ""
    rows = await conn.fetch(
        f"""
        SELECT c.customer_id, r.status {due_join("$2")} {DUE_WHERE}{unrowed}
            AND c.customer_id > $2
        ORDER BY c.customer_id LIMIT $3
        """,
        period,
        after or "",
        limit,
    )
    return _page(rows, limit)


def _page(rows: list[asyncpg.Record], limit: int) -> DuePage:
    customers = [DueCustomer(customer_id=r["customer_id"], status=r["status"]) for r in rows]
    next_cursor = customers[-1].customer_id if len(customers) == limit else None
    return DuePage(customers=customers, next_cursor=next_cursor)


def _taken(run_id: str, listing: str) -> str:
    """SQL: customer `c` was taken by the run `run_id` in a listing whose number meets
    `listing` (a comparison). A mark of a later listing than the run's own is of a timeline a
    reset of the run undid: not a listing of this one."""
    return f"""EXISTS (
        SELECT 1 FROM period_listed l WHERE l.billing_period = $1
            AND l.customer_id = c.customer_id AND l.run_id = {run_id} AND l.listing {listing})"""


async def mark_taken(
    conn: asyncpg.Connection, period: str, listing: Listing, taken: Sequence[str]
) -> None:
    """Mark the customers the run took from `listing`'s pages (migrations/032); a mark keeps
    the lowest listing (one a reset undid cannot raise it)."""
    if not taken:
        return
    await conn.execute(
        """
        INSERT INTO period_listed (billing_period, run_id, customer_id, listing)
        SELECT $1, $2, customer_id, $3 FROM unnest($4::text[]) AS customer_id
        ON CONFLICT (billing_period, run_id, customer_id) DO UPDATE
        SET listing = least(period_listed.listing, EXCLUDED.listing)
        """,
        period,
        listing.run_id,
        listing.number,
        list(taken),
    )


async def listed_page(
    conn: asyncpg.Connection,
    period: str,
    after: str | None,
    limit: int,
    listing: Listing,
    taken: Sequence[str],
) -> DuePage:
    """Due customers after the cursor, in id order, that no earlier listing of the run took,
    once the customers it took since its last page are marked (mark_taken)."""
    await mark_taken(conn, period, listing, taken)
    rows = await conn.fetch(
        f"""
        SELECT c.customer_id, r.status {due_join("$2")} {DUE_WHERE}
            AND c.customer_id > $2 AND NOT {_taken("$4", "< $5")}
        ORDER BY c.customer_id LIMIT $3
        """,
        period,
        after or "",
        limit,
        listing.run_id,
        listing.number,
    )
    return _page(rows, limit)


async def unclaimed_due(conn: asyncpg.Connection, period: str) -> int:
    """How many due customers have no row of the period: no run claimed them."""
    count: int = await conn.fetchval(f"SELECT count(*) {DUE} AND r.status IS NULL", period)
    return count


async def unlisted_due(conn: asyncpg.Connection, period: str, listing: Listing) -> bool:
    """Whether a due customer is left that neither `listing` nor an earlier listing of its
    run took."""
    return bool(
        await conn.fetchval(
            f"""
            SELECT EXISTS (SELECT 1 {DUE} AND NOT {_taken("$2", "<= $3")})
            """,
            period,
            listing.run_id,
            listing.number,
        )
    )

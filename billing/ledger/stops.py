"""An operator's stop of customers: a skip, and a cancelled run's customers it never started."""

from __future__ import annotations

import asyncpg

from billing.errors import UnknownCustomerError
from billing.keys import idempotency_key
from billing.ledger.due import due_page
from billing.ledger.gate import SKIP_BEHIND_SAVED_ERROR_FOR
from billing.models import DuePage, SkipResult
from billing.periods import parse_period


async def request_skip(
    conn: asyncpg.Connection,
    customer_id: str,
    period: str,
    key: str,
    reason: str,
    operator: str,
    *,
    stop: bool = False,
) -> SkipResult:
    """Skip a customer this period, unless its charge has started or ended.

    A customer no run has claimed yet is written skipped at once: a run that lists it counts
    it so, and one whose cursor has passed it (or that does not list it, an inactive
    customer) leaves no claim open behind. An open claim keeps its status and stops at the
    gate as skipped. A customer a cancelled run never started is skipped too, so the next
    run does not reopen it. A charge held behind a 500 Stripe saved for its key ends skipped
    at its next try if Stripe still shows no charge (stop_behind_saved_error).

    A `stop` (a Temporal cancel of the customer's workflow, not an operator's skip) writes
    a new row only where a claim could be made, for an active customer while a run of the
    period is open: a stray workflow of a period no run has opened must not skip the
    customer for its run, nor one of a row a cancelled run left for the next, and an
    inactive customer's bill, running beside the stop, answers that it is not billed (a row
    written meanwhile would say skipped). It keeps an operator's earlier skip, who made it
    and why."""
    row = await conn.fetchrow(
        """
        INSERT INTO billing_runs (customer_id, billing_period, idempotency_key, amount_cents,
                                  currency, stripe_customer_id, payment_method, skip_reason,
                                  skip_by, status, reason, decided_by, completed_at)
        SELECT customer_id, $2, $3, amount_cents, currency, stripe_customer_id, payment_method,
               $4, $5, 'skipped', $4, $5, now()
        FROM customers WHERE customer_id = $1
            AND (NOT $7 OR (EXISTS (SELECT 1 FROM billing_periods p
                                    WHERE p.billing_period = $2 AND p.state = 'running')
                            AND (active OR EXISTS (SELECT 1 FROM billing_runs o
                                                   WHERE o.customer_id = $1
                                                   AND o.billing_period = $2))))
        ON CONFLICT (customer_id, billing_period) DO UPDATE
            SET skip_reason = CASE WHEN $7 THEN coalesce(billing_runs.skip_reason, $4)
                                   ELSE EXCLUDED.skip_reason END,
                skip_by = CASE WHEN $7 THEN coalesce(billing_runs.skip_by, $5)
                               ELSE EXCLUDED.skip_by END,
                status = CASE billing_runs.status WHEN 'cancelled' THEN 'skipped'
                              ELSE billing_runs.status END,
                reason = CASE billing_runs.status WHEN 'cancelled' THEN EXCLUDED.reason
                              ELSE billing_runs.reason END,
                decided_by = CASE billing_runs.status WHEN 'cancelled' THEN EXCLUDED.decided_by
                                  ELSE billing_runs.decided_by END,
                cancelled_before_start = false, updated_at = now()
            WHERE (billing_runs.status = 'claimed' AND billing_runs.charge_started_at IS NULL)
               OR (billing_runs.status = 'cancelled' AND billing_runs.cancelled_before_start
                   AND NOT $7)
               OR (billing_runs.status = 'claimed' AND billing_runs.saved_error_at IS NOT NULL
                   AND billing_runs.claimed_at > now() - $6::interval)
        RETURNING status, charge_started_at IS NOT NULL AS sent,
            (SELECT active FROM customers WHERE customer_id = $1) AS active
        """,
        customer_id,
        period,
        key,
        reason,
        operator,
        SKIP_BEHIND_SAVED_ERROR_FOR,
        stop,
    )
    if row is not None and row["sent"]:
        return SkipResult(
            customer_id=customer_id,
            skipped=True,
            detail="skip recorded: its charge is held behind a 500 Stripe saved for its key,"
            " and ends skipped at its next try (within 4 minutes) unless Stripe shows a charge"
            " then; if no worker tries it within the hour, it is charged once Stripe forgets"
            " the key",
        )
    if row is not None and not row["active"]:
        # Said, since the period's runs then count it as due and skipped.
        return SkipResult(
            customer_id=customer_id,
            skipped=True,
            detail="skip recorded, for a customer deactivated since: no run lists it, but the"
            " period's runs count it as due and skipped",
        )
    if row is not None:
        return SkipResult(customer_id=customer_id, skipped=True, detail="skip recorded")
    current = await conn.fetchrow(
        "SELECT status FROM billing_runs WHERE customer_id = $1 AND billing_period = $2",
        customer_id,
        period,
    )
    if current is None:
        raise UnknownCustomerError(f"customer {customer_id!r} is not in the ledger")
    if current["status"] == "skipped":
        # Asked again: what was asked for holds.
        return SkipResult(customer_id=customer_id, skipped=True, detail="already skipped")
    detail = (
        f"already {current['status']}"
        if current["status"] != "claimed"
        else "its charge has already been sent to Stripe"
    )
    return SkipResult(customer_id=customer_id, skipped=False, detail=f"cannot skip: {detail}")


# The row of customer `c` ($1), as it is now, that a cancelled run never started: for period
# $2 under key $3, with the cancel's reason and operator (SQL expressions).
def never_started_row(reason: str, operator: str) -> str:
    return f"""
        INSERT INTO billing_runs (customer_id, billing_period, idempotency_key, amount_cents,
                                  currency, stripe_customer_id, payment_method, status, reason,
                                  decided_by, completed_at, cancelled_before_start)
        SELECT c.customer_id, $2, $3, c.amount_cents, c.currency, c.stripe_customer_id,
               c.payment_method, 'cancelled', {reason}, {operator}, now(), true
        FROM customers c"""


async def cancel_customers(
    conn: asyncpg.Connection, period: str, keys: dict[str, str], reason: str, operator: str
) -> None:
    """Mark customers a cancelled run never started as cancelled (no child, no charge)."""
    await conn.executemany(
        f"""
        {never_started_row("$4", "$5")} WHERE c.customer_id = $1
        ON CONFLICT (customer_id, billing_period) DO UPDATE
            SET status = 'cancelled', reason = $4, decided_by = $5, completed_at = now(),
                -- A row a child claimed (one of a terminated run's, still running) keeps
                -- that child's ID, which a later run cannot start again: not reopened.
                cancelled_before_start = billing_runs.claimed_by_run IS NULL,
                updated_at = now()
            WHERE billing_runs.status = 'claimed' AND billing_runs.charge_started_at IS NULL
        """,
        [(customer_id, period, key, reason, operator) for customer_id, key in keys.items()],
    )


async def cancel_unstarted_page(
    conn: asyncpg.Connection,
    period: str,
    after: str | None,
    limit: int,
    key_namespace: str,
    reason: str,
    operator: str,
) -> tuple[DuePage, list[str]]:
    """A cancel's page: the period's due customers after the cursor, those not started (no
    row, or a claim with nothing sent) marked cancelled. Returns the page and their ids."""
    page = await due_page(conn, period, after, limit)
    unstarted = [c.customer_id for c in page.customers if c.status in (None, "claimed")]
    month = parse_period(period)
    keys = {c: idempotency_key(key_namespace, c, month) for c in unstarted}
    await cancel_customers(conn, period, keys, reason, operator)
    return page, unstarted

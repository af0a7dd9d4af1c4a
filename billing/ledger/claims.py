"""A customer's claim for a period, taken before any charge, and its outcome recorded once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import asyncpg

from billing.errors import (
    HeldCustomerError,
    LedgerConflictError,
    PeriodNotOpenError,
    UnknownCustomerError,
)
from billing.ledger.sql import (
    CLAIM_COLUMNS,
    HELD_AS,
    MAY_HAVE_CHARGED,
    NEVER_STARTED,
    due_join,
    held_as_sql,
)
from billing.ledger.stops import never_started_row, request_skip
from billing.models import (
    AUTOMATIC,
    ChargeApi,
    ChargeFailure,
    ChargeResult,
    Claim,
    CustomerOutcome,
    LedgerStatus,
    finished_outcome,
)

# What a claim of a row a cancelled run never started (NEVER_STARTED) takes afresh from the
# customer (the rest of the row is reset).
_REFRESHED = (
    "amount_cents",
    "currency",
    "stripe_customer_id",
    "payment_method",
    "claimed_at",
    "updated_at",
    "reason",
    "decided_by",
)
_REOPENED = (
    "CASE WHEN billing_runs.status = 'cancelled' THEN EXCLUDED.{c} ELSE billing_runs.{c} END"
)


# A new claim (or a cancelled run's unstarted row taken over) needs a run of the period
# open, and not cancelled: a CustomerChargeWorkflow started on its own (Temporal's CLI or Web
# UI) for a period no run opened, or one that completed, would charge outside any run, its
# pause and its cap; and a claim made once a run's cancel is recorded would stop at the gate
# for good, where the cancel leaves the customers it has not started to the next run (claim).
# FOR SHARE, as the gate's, and before any row (joined in the claim's SELECT): the
# statement's snapshot would read a period that a writer holding its row (a cancel, a close)
# has moved on as it was.
_PERIOD = """SELECT state = 'running' AS open, control, control_reason, control_by
             FROM billing_periods WHERE billing_period = {} FOR SHARE"""


_CLAIM = f"""
        WITH period AS ({_PERIOD.format("$2")})
        INSERT INTO billing_runs (customer_id, billing_period, idempotency_key, amount_cents,
                                  currency, stripe_customer_id, payment_method,
                                  claimed_by_run, charge_api)
        SELECT c.customer_id, $2, $3, c.amount_cents, c.currency, c.stripe_customer_id,
               c.payment_method, $4, $5
        FROM customers c LEFT JOIN period p ON true
        WHERE c.customer_id = $1 AND (
            (c.active AND {held_as_sql("$2")} IS NULL AND p.open AND p.control <> 'cancelled')
            -- An open claim is taken over whatever its customer is now: it is charged.
            OR EXISTS (SELECT 1 FROM billing_runs o WHERE o.customer_id = $1
                       AND o.billing_period = $2 AND o.status = 'claimed'))
        ON CONFLICT (customer_id, billing_period) DO UPDATE
        SET claimed_by_run = EXCLUDED.claimed_by_run,
            -- A row made before the API was recorded (or by a skip) takes this claim's,
            -- unless an attempt may have reached Stripe under a setting nobody recorded.
            charge_api = CASE WHEN billing_runs.status = 'cancelled' THEN EXCLUDED.charge_api
                              WHEN billing_runs.charge_started_at IS NULL
                              THEN coalesce(billing_runs.charge_api, EXCLUDED.charge_api)
                              ELSE billing_runs.charge_api END,
            -- A customer a cancelled run never started is claimed afresh, as it is now:
            -- nothing of that row reached Stripe.
            {", ".join(f"{c} = {_REOPENED.format(c=c)}" for c in _REFRESHED)},
            status = 'claimed', completed_at = NULL, cancelled_before_start = false
        WHERE EXCLUDED.claimed_by_run IS NOT NULL AND (
            billing_runs.status = 'claimed'
            -- ...by a run that bills (an open claim made never started while this claim
            -- waited on it is read as it is now).
            OR ({NEVER_STARTED.format(r="billing_runs")}
                AND (SELECT control FROM period) <> 'cancelled'))
        RETURNING {CLAIM_COLUMNS}
        """


# A customer found, after its run's cancel was recorded, as the cancel's pages leave those they
# reach: never started, for the next run. One statement, which reads the period again and
# changes no row: between the claim's statements the run may have closed and a rerun claimed
# the customer (a stale attempt of the bill, say), whose claim this must not cancel.
_LEFT_TO_THE_NEXT_RUN = f"""
        WITH period AS ({_PERIOD.format("$2")})
        {never_started_row("p.control_reason", "p.control_by")}
        JOIN period p ON p.open AND p.control = 'cancelled'
        WHERE c.customer_id = $1 AND c.active AND {held_as_sql("$2")} IS NULL
        ON CONFLICT (customer_id, billing_period) DO NOTHING
        """


async def claim(
    conn: asyncpg.Connection,
    customer_id: str,
    period: str,
    key: str,
    run_id: str | None = None,
    *,
    charge_api: ChargeApi,
) -> Claim:
    """Insert the claim, or return the one that exists: a retry charges the same row. A
    customer held (see HELD_AS) since its run listed it is not claimed (_refuse_held).
    `run_id` is the claiming workflow run's: the last run to claim an open row owns it, so a
    run whose workflow task is retried after its record knows the charge for its own.
    `charge_api` is fixed by the first claim that records one: every request of the claim
    goes to the same endpoint with the same key, whatever the setting says later.
    One statement when the row is new or open (the insert returns it), whatever the
    customer is now for an open one: it is charged all the same. Otherwise a held customer
    is dealt with (_refuse_held), one found after its run's cancel was recorded is written
    never started and returned so (_LEFT_TO_THE_NEXT_RUN), and a finished row, or a customer no
    longer active, is read by a further statement, with no transaction around them: the read
    sees the row as another hand has moved it on since, which is the claim to act on."""
    args = (customer_id, period, key, run_id, charge_api)
    row = await conn.fetchrow(_CLAIM, *args)
    if row is not None:
        return Claim(**dict(row))
    run = await conn.fetchrow(_PERIOD.format("$1"), period)
    period_open = run is not None and run["open"]
    if period_open and await _refuse_held(conn, customer_id, period, key):
        if run["control"] == "cancelled":
            await conn.execute(_LEFT_TO_THE_NEXT_RUN, customer_id, period, key)
        else:
            # Released between the two statements (the old id's claim failed): claimed now.
            row = await conn.fetchrow(_CLAIM, *args)
    if row is None:
        row = await conn.fetchrow(
            f"""SELECT {CLAIM_COLUMNS} FROM billing_runs
            WHERE customer_id = $1 AND billing_period = $2""",
            customer_id,
            period,
        )
    if row is not None:
        return Claim(**dict(row))
    if not period_open and await _is_active(conn, customer_id):
        raise PeriodNotOpenError(
            f"no run of {period} is open, so customer {customer_id!r} is not billed for it:"
            " a customer is billed by its period's run (`python starter.py run"
            f" {period}`), not by a CustomerChargeWorkflow started on its own; nothing was"
            " charged"
        )
    raise UnknownCustomerError(
        f"customer {customer_id!r} is not in the ledger or is inactive; nothing was charged"
    )


async def _is_active(conn: asyncpg.Connection, customer_id: str) -> bool:
    return bool(
        await conn.fetchval("SELECT active FROM customers WHERE customer_id = $1", customer_id)
    )


async def _refuse_held(conn: asyncpg.Connection, customer_id: str, period: str, key: str) -> bool:
    """For a customer held since its run listed it (see HELD_AS): while the Stripe
    customer's old id has a claim open, HeldCustomerError, to try again once it ends; once
    the old id is charged (or may be: MAY_HAVE_CHARGED), a skip, which the claim then finds.
    True for an active customer with no row that is not held (any more): the claim may be
    made now. A customer that is inactive or has a row of its own is left to the caller."""
    held = await conn.fetchrow(
        f"""
        SELECT {HELD_AS} AS held_as, {held_as_sql(charged=True)} AS charged_as
        {due_join()} WHERE c.customer_id = $2 AND c.active AND r.status IS NULL
        """,
        period,
        customer_id,
    )
    if held is None:
        return False
    if held["held_as"] is None:
        return True
    if held["charged_as"] is None:
        raise HeldCustomerError(
            f"customer {customer_id!r} is held: {period} has a claim open for its Stripe"
            f" customer as {held['held_as']!r}, inactive since (renamed?); it is claimed only"
            " if that claim does not charge",
            held["held_as"],
        )
    charged_as = held["charged_as"]
    doubt = await conn.fetchval(
        "SELECT failure_code FROM billing_runs WHERE customer_id = $1 AND billing_period = $2",
        charged_as,
        period,
    )
    charged = "may have charged" if doubt in MAY_HAVE_CHARGED else "charged"
    await request_skip(
        conn,
        customer_id,
        period,
        key,
        f"held: {period} {charged} its Stripe customer as {charged_as!r}, an id inactive"
        " since (renamed?); not charged twice",
        AUTOMATIC,
    )
    return False


async def _finish(
    conn: asyncpg.Connection, key: str, status: LedgerStatus, sets: str, *args: Any
) -> bool:
    """Move a claim to a terminal status once; repeating the same result is a no-op. True
    when this call moved it, False for a repeat."""
    updated = await conn.fetchval(
        f"""
        UPDATE billing_runs SET status = $2, updated_at = now(), completed_at = now(), {sets}
        WHERE idempotency_key = $1 AND status = 'claimed'
        RETURNING 1
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
    return updated is not None


async def record_charge(conn: asyncpg.Connection, key: str, result: ChargeResult) -> bool:
    """Record the claim's charge; False when this very charge was recorded already, by a
    concurrent attempt or by reconciliation."""
    return await _finish(
        conn,
        key,
        "charged",
        "charge_id = $3, payment_intent_id = $4",
        result.charge_id,
        result.payment_intent_id,
    )


async def record_unbilled(
    conn: asyncpg.Connection, key: str, status: LedgerStatus, failure: ChargeFailure
) -> None:
    """Finish a claim that was not charged: failed with Stripe's code, or skipped or
    cancelled with the operator's reason."""
    if status == "failed":
        await _finish(
            conn,
            key,
            status,
            "failure_code = $3, decline_code = $4, failure_message = $5, payment_intent_id = $6",
            failure.code,
            failure.decline_code,
            failure.message[:500],
            failure.payment_intent_id,
        )
        return
    await _finish(
        conn,
        key,
        status,
        """reason = coalesce(skip_reason, (SELECT control_reason FROM billing_periods p
                WHERE p.billing_period = billing_runs.billing_period)),
           decided_by = coalesce(skip_by, (SELECT control_by FROM billing_periods p
                WHERE p.billing_period = billing_runs.billing_period))""",
    )


async def outcomes(
    conn: asyncpg.Connection, period: str, customer_ids: Sequence[str], *, awaited: bool = False
) -> list[CustomerOutcome]:
    """Outcomes of customers finished in the ledger; customers without a finished row are
    left out. A charged row counts as already billed, unless `awaited`: the caller saw the
    customer in flight and waited for it (a child another run started), so it counts the
    charge as its own."""
    rows = await conn.fetch(
        f"""
        SELECT customer_id, status, amount_cents, currency, charge_id, failure_code
        FROM billing_runs
        WHERE billing_period = $1 AND customer_id = ANY($2::text[]) AND status <> 'claimed'
              -- An awaited child may yet take over a row a cancelled run never started.
              AND NOT ($3 AND {NEVER_STARTED.format(r="billing_runs")})
        """,
        period,
        list(customer_ids),
        awaited,
    )
    return [
        CustomerOutcome(
            customer_id=row["customer_id"],
            outcome="charged"
            if awaited and row["status"] == "charged"
            else finished_outcome(row["status"]),
            amount_cents=row["amount_cents"],
            currency=row["currency"],
            charge_id=row["charge_id"],
            failure_code=row["failure_code"],
        )
        for row in rows
    ]


async def without_rows(
    conn: asyncpg.Connection, period: str, customer_ids: Sequence[str]
) -> list[str]:
    """The customers with no row of the period their child claimed: none at all, or one a
    cancelled run wrote for a customer it never started."""
    missing: list[str] = await conn.fetchval(
        f"""
        SELECT coalesce(array_agg(c ORDER BY c), '{{}}') FROM unnest($2::text[]) AS c
        WHERE NOT EXISTS (
            SELECT 1 FROM billing_runs r WHERE r.billing_period = $1 AND r.customer_id = c
                AND NOT ({NEVER_STARTED.format(r="r")})
        )
        """,
        period,
        list(customer_ids),
    )
    return missing


# What an attempt sent without the vault names in a claim's sent_through (see begin_charge).
SENT_DIRECT = "direct"


async def vault_keys_sent_through(conn: asyncpg.Connection, key: str) -> list[str]:
    """The vault keys the claim's attempts were sent through (none without the vault)."""
    keys: list[str] | None = await conn.fetchval(
        "SELECT sent_through FROM billing_runs WHERE idempotency_key = $1", key
    )
    return [k for k in keys or [] if k != SENT_DIRECT]

"""The billing ledger in PostgreSQL: every query the activities and the CLI run against it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import asyncpg

from billing.errors import (
    ClaimClosedError,
    HeldCustomerError,
    LedgerBusyError,
    LedgerConflictError,
    PeriodNotOpenError,
    UnknownCustomerError,
)
from billing.models import (
    AUTOMATIC,
    ChargeApi,
    ChargeFailure,
    ChargeResult,
    Claim,
    Control,
    CustomerOutcome,
    DueCustomer,
    DuePage,
    Gate,
    LedgerStatus,
    PeriodPlan,
    PeriodRecord,
    PeriodSummary,
    PreviewLine,
    SkipResult,
    finished_outcome,
)
from billing.reconciliation import (
    CustomerToCheck,
    Finding,
    HandledMark,
    HandledRequest,
    HandledResult,
    LedgerEntry,
    OpenClaim,
    PeriodToRecheck,
)

# A row a cancelled run wrote for a customer it never started: nothing of it reached Stripe.
NEVER_STARTED = (
    "{r}.status = 'cancelled' AND {r}.cancelled_before_start AND {r}.charge_started_at IS NULL"
)
# What a claim of such a row takes afresh from the customer (the rest of the row is reset).
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


# The customer id, inactive now, under which the period charged the Stripe customer of
# customer `c`, or holds a claim for it that is not skipped before its charge was sent (to be
# charged, or in doubt: a skip of a sent claim holds only if Stripe shows nothing then). An
# active customer with the same Stripe customer is most likely that one renamed (the old id
# deactivated, the new one imported), with a key of its own: it is held, not due, for as long
# as this holds (an old claim that fails releases it). An index of inactive customers by
# Stripe customer (migrations/017) makes it one probe per customer.
def held_as_sql(period: str = "$1", *, charged: bool = False) -> str:
    """The SQL of the above for customer `c`, the period being `period` (a parameter or a
    column); only charged rows count if `charged`."""
    billed = "o.status = 'charged'"
    if not charged:
        billed = (
            f"({billed} OR (o.status = 'claimed'"
            " AND (o.skip_reason IS NULL OR o.charge_started_at IS NOT NULL)))"
        )
    return f"""(
    SELECT min(oc.customer_id) FROM customers oc
    JOIN billing_runs o ON o.customer_id = oc.customer_id AND o.billing_period = {period}
    WHERE NOT oc.active AND oc.stripe_customer_id = c.stripe_customer_id
        AND o.stripe_customer_id = c.stripe_customer_id AND oc.customer_id <> c.customer_id
        AND {billed})"""


_HELD_AS = held_as_sql()


# Customers a period bills: active ones not held, and any with a row for it (a claim is
# always finished). A customer a cancelled run never started counts as having no row: billed
# only while active, at its amount, currency and card of now (its claim takes the row over so).
def _due_join(past: str | None = None) -> str:
    """`past`, a cursor's parameter, joins only the period's rows after it: with the same
    bound on the customers (the caller's), a merge join starts at the cursor, not at the
    period's first row."""
    bound = f" AND r.customer_id > {past}" if past else ""
    return f"""
    FROM customers c
    LEFT JOIN billing_runs r ON r.customer_id = c.customer_id AND r.billing_period = $1
        AND NOT ({NEVER_STARTED.format(r="r")}){bound}
    """


_DUE_WHERE = f"WHERE (r.status IS NOT NULL OR (c.active AND {_HELD_AS} IS NULL))"
_DUE = _due_join() + _DUE_WHERE

# Rows a run would charge: no row yet, or an unfinished claim not skipped.
_OPEN = """(r.status IS NULL OR (r.status = 'claimed' AND r.skip_reason IS NULL))"""

_CLAIM_COLUMNS = """
    customer_id, billing_period AS period, idempotency_key, amount_cents, currency,
    stripe_customer_id, payment_method, status, claimed_at, payment_intent_id, charge_id,
    failure_code, claimed_by_run, charge_api, now() - claimed_at AS claimed_ago
"""


async def plan_period(conn: asyncpg.Connection, period: str) -> PeriodPlan:
    rows = await conn.fetch(
        f"""
        SELECT coalesce(r.currency, c.currency) AS currency, count(*) AS due,
               count(*) FILTER (WHERE {_OPEN}) AS to_charge,
               coalesce(sum(coalesce(r.amount_cents, c.amount_cents)) FILTER (WHERE {_OPEN}), 0)
                   AS total
        {_DUE}
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
               sum(coalesce(r.amount_cents, c.amount_cents)) AS total
        {_DUE} AND {_OPEN} AND NOT EXISTS (
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
               coalesce(r.currency, c.currency) AS currency, r.status, {_OPEN} AS open,
               CASE WHEN r.status IS NULL THEN c.payment_method
                    ELSE r.payment_method END IS NOT NULL AS has_payment_method
        {_DUE} ORDER BY c.customer_id
        """,
        period,
    )
    held = await held_customers(conn, period)
    lines = [PreviewLine(**dict(row)) for row in rows]
    return sorted([*lines, *held], key=lambda line: line.customer_id)


async def issued_caps(conn: asyncpg.Connection, period: str) -> dict[str, int]:
    """The caps of the period's stored vault keys, by currency."""
    rows = await conn.fetch(
        "SELECT currency, cap_cents FROM period_vault_keys WHERE billing_period = $1", period
    )
    return {row["currency"]: row["cap_cents"] for row in rows}


async def held_customers(conn: asyncpg.Connection, period: str) -> list[PreviewLine]:
    """The active customers a run of the period holds rather than bills (see _HELD_AS), each
    with the id its Stripe customer was billed under (`held_as`)."""
    rows = await conn.fetch(
        f"""
        SELECT * FROM (
            SELECT c.customer_id, c.stripe_customer_id, c.amount_cents, c.currency,
                   NULL AS status, false AS open,
                   c.payment_method IS NOT NULL AS has_payment_method, {_HELD_AS} AS held_as
            {_due_join()} WHERE c.active AND r.status IS NULL) held
        WHERE held_as IS NOT NULL ORDER BY customer_id
        """,
        period,
    )
    return [PreviewLine(**dict(row)) for row in rows]


async def due_page(conn: asyncpg.Connection, period: str, after: str | None, limit: int) -> DuePage:
    rows = await conn.fetch(
        f"""
        SELECT c.customer_id, r.status {_due_join("$2")} {_DUE_WHERE} AND c.customer_id > $2
        ORDER BY c.customer_id LIMIT $3
        """,
        period,
        after or "",
        limit,
    )
    customers = [DueCustomer(customer_id=r["customer_id"], status=r["status"]) for r in rows]
    next_cursor = customers[-1].customer_id if len(customers) == limit else None
    return DuePage(customers=customers, next_cursor=next_cursor)


# A new claim (or a cancelled run's unstarted row taken over) needs a run of the period
# open: a CustomerChargeWorkflow started on its own (Temporal's CLI or Web UI) for a period no
# run opened, or one that completed, would charge outside any run, its pause and its cap.
def _period_open(period: str) -> str:
    return f"""EXISTS (SELECT 1 FROM billing_periods p
                       WHERE p.billing_period = {period} AND p.state = 'running')"""


_CLAIM = f"""
        INSERT INTO billing_runs (customer_id, billing_period, idempotency_key, amount_cents,
                                  currency, stripe_customer_id, payment_method,
                                  claimed_by_run, charge_api)
        SELECT customer_id, $2, $3, amount_cents, currency, stripe_customer_id,
               payment_method, $4, $5
        FROM customers c WHERE customer_id = $1 AND (
            (active AND {held_as_sql("$2")} IS NULL AND {_period_open("$2")})
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
            billing_runs.status = 'claimed' OR ({NEVER_STARTED.format(r="billing_runs")}))
        RETURNING {_CLAIM_COLUMNS}
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
    customer held (see _HELD_AS) since its run listed it is not claimed (_refuse_held).
    `run_id` is the claiming workflow run's: the last run to claim an open row owns it, so a
    run whose workflow task is retried after its record knows the charge for its own.
    `charge_api` is fixed by the first claim that records one: every request of the claim
    goes to the same endpoint with the same key, whatever the setting says later.
    One statement when the row is new or open (the insert returns it), whatever the
    customer is now for an open one: it is charged all the same. Otherwise a held customer
    is dealt with (_refuse_held), and a finished row, or a customer no longer active, is
    read by a further statement, with no transaction around them: the read sees the row as
    another hand has moved it on since, which is the claim to act on."""
    args = (customer_id, period, key, run_id, charge_api)
    row = await conn.fetchrow(_CLAIM, *args)
    if row is not None:
        return Claim(**dict(row))
    period_open = await conn.fetchval(f"SELECT {_period_open('$1')}", period)
    if period_open and await _refuse_held(conn, customer_id, period, key):
        # Released between the two statements (the old id's claim failed): claimed now.
        row = await conn.fetchrow(_CLAIM, *args)
    if row is None:
        row = await conn.fetchrow(
            f"""SELECT {_CLAIM_COLUMNS} FROM billing_runs
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
    """For a customer held since its run listed it (see _HELD_AS): while the Stripe
    customer's old id has a claim open, HeldCustomerError, to try again once it ends; once
    the old id is charged, a skip, which the claim then finds. True for an active customer
    with no row that is not held (any more): the claim may be made now. A customer that is
    inactive or has a row of its own is left to the caller."""
    held = await conn.fetchrow(
        f"""
        SELECT {_HELD_AS} AS held_as, {held_as_sql(charged=True)} AS charged_as
        {_due_join()} WHERE c.customer_id = $2 AND c.active AND r.status IS NULL
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
    await request_skip(
        conn,
        customer_id,
        period,
        key,
        f"held: {period} charged its Stripe customer as {held['charged_as']!r}, an id inactive"
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


# Held by a run's opening and by a change to the customers (billing.customers: an import,
# a deactivation) for their transaction: either the plan counts the change, or the change sees
# the run open. An advisory lock, so that nothing else (a pause, a charge) waits for a change.
OPENING_LOCK = "SELECT pg_advisory_xact_lock(hashtext('billing: a run opening, or an import'))"
# How long a change to the customers waits for OPENING_LOCK: less than a statement may take
# (db.create_pool's command_timeout), so that it says why.
CHANGE_WAIT_SECONDS = 20.0


async def lock_for_change(conn: asyncpg.Connection, doing: str) -> None:
    """Take OPENING_LOCK for a change to the customers (`doing`, e.g. "the import"), in the
    caller's transaction; LedgerBusyError if it waits past CHANGE_WAIT_SECONDS."""
    # Outside one, the lock would be let go at once, and SET LOCAL only warns.
    assert conn.is_in_transaction(), "lock_for_change needs the caller's transaction"
    await conn.execute(f"SET LOCAL lock_timeout = '{int(CHANGE_WAIT_SECONDS * 1000)}ms'")
    try:
        await conn.execute(OPENING_LOCK)
    except asyncpg.LockNotAvailableError:
        raise LedgerBusyError(
            f"{doing} waited {CHANGE_WAIT_SECONDS:g} s for a run being opened or another change"
            " to the customers, and gave up; nothing was changed. Try again (a run opening"
            " may be waiting for the vault)"
        ) from None
    await conn.execute("SET LOCAL lock_timeout TO DEFAULT")


# What a run's opening checks before it is recorded: the plan, and what it has yet to send.
BeforeRecording = Callable[[PeriodPlan, dict[str, int]], Awaitable[object]]


async def open_period(
    conn: asyncpg.Connection,
    period: str,
    workflow_id: str,
    before_recording: BeforeRecording | None = None,
) -> PeriodPlan:
    """Plan the period and record its new run, as one step to a customer import. In between,
    under the same lock, `before_recording` gets the plan and `unsent_totals`: what it raises
    leaves the period's record as it was (a completed run's summary)."""
    async with conn.transaction():
        await conn.execute(OPENING_LOCK)
        plan = await plan_period(conn, period)
        if before_recording is not None:
            await before_recording(plan, await unsent_totals(conn, period))
        await start_period(conn, plan, workflow_id)
    return plan


async def start_period(conn: asyncpg.Connection, plan: PeriodPlan, workflow_id: str) -> None:
    """Record a new run of the period. Customers a cancelled run never started are due
    again (see migrations/005) while active: their claim takes the row over (see claim)."""
    await conn.execute(
        """
        INSERT INTO billing_periods (billing_period, workflow_id, state, due,
                                     expected_total_cents)
        VALUES ($1, $2, 'running', $3, $4)
        ON CONFLICT (billing_period) DO UPDATE SET
            workflow_id = EXCLUDED.workflow_id, state = 'running', due = EXCLUDED.due,
            expected_total_cents = EXCLUDED.expected_total_cents, started_at = now(),
            finished_at = NULL, summary = NULL, control = 'running', control_reason = NULL,
            control_by = NULL, control_at = now()
        """,
        plan.period,
        workflow_id,
        plan.due,
        plan.expected_total_cents,
    )


async def set_control(
    conn: asyncpg.Connection, period: str, control: Control, reason: str, operator: str
) -> None:
    await conn.execute(
        """
        UPDATE billing_periods
        SET control = $2, control_reason = $3, control_by = $4, control_at = now()
        WHERE billing_period = $1
        """,
        period,
        control,
        reason,
        operator,
    )


@dataclass(frozen=True, slots=True)
class Passage:
    """The gate's answer to one attempt of a claim."""

    gate: Gate
    # The attempt's number among all that passed the claim's gate, never reused (for one
    # stopped at the gate, the last one's). It goes to the vault with the request
    # (vault.endpoints.FENCE_HEADER), whose cap refusal then fences off every attempt below it,
    # and it names the attempt a reopen is for (see reopen_refused_charge).
    fencing_token: int


async def begin_charge(conn: asyncpg.Connection, claim: Claim, route: str | None) -> Passage:
    """Decide, atomically with pause, cancel and skip, whether this attempt may call Stripe:
    one call of billing_begin_charge (migrations/018_fencing_tokens.sql). An attempt that
    passes names its `route`, the vault key it sends through (SENT_DIRECT without the vault,
    None if it will send nothing); the claim keeps every route (see reopen_refused_charge).

    Once a first attempt has passed, every retry passes too: that charge may already be at
    Stripe, and only a retry with the same key can learn its outcome.
    """
    row = await conn.fetchrow(
        "SELECT gate, status, fencing_token FROM billing_begin_charge($1, $2, $3)",
        claim.idempotency_key,
        claim.period,
        route,
    )
    if row["gate"] == "closed":
        raise ClaimClosedError(
            row["status"],
            f"claim {claim.idempotency_key[:8]}... is no longer open ({row['status']});"
            " not charging",
        )
    return Passage(row["gate"], row["fencing_token"])


async def reopen_refused_charge(
    conn: asyncpg.Connection, key: str, fencing_token: int, *, fenced_by: str | None = None
) -> bool:
    """Undo begin_charge for the attempt `fencing_token`, refused before it reached Stripe
    (the vault's cap, a refused key, Stripe's rate limit), so the claim waits at the gate
    again. Only if no other attempt passed the gate since, and none can still reach Stripe:
    this was the only attempt since the claim was last reopened (`attempts` counts requests
    that may have reached Stripe), or the vault key `fenced_by` refused it on its cap and
    fenced off the attempts before it. The vault checks a key's earlier reservations before
    its cap, so that refusal proves that no attempt through that key is charged, in doubt or
    still to be sent: it reopens the claim if every attempt went through that key
    (`sent_through`), not through a key replaced since that a worker may still hold.
    Otherwise that key leaves `sent_through`, which then still names every key holding a part
    of the claim (see unsent_totals)."""
    async with conn.transaction():
        reopened = await conn.fetchval(
            """
            UPDATE billing_runs r
            SET charge_started_at = NULL, attempts = 0, sent_through = NULL, updated_at = now()
            WHERE r.idempotency_key = $1 AND r.status = 'claimed' AND r.gate_passes = $2
                AND (r.attempts = 1 OR r.sent_through = ARRAY[$3::text])
            RETURNING 1
            """,
            key,
            fencing_token,
            fenced_by,
        )
        if reopened is None and fenced_by is not None:
            await conn.execute(
                """
                UPDATE billing_runs SET sent_through = array_remove(sent_through, $3)
                WHERE idempotency_key = $1 AND status = 'claimed' AND gate_passes = $2
                """,
                key,
                fencing_token,
                fenced_by,
            )
    return reopened is not None


# Stripe forgets a key 24 hours after its first request, which came after the claim: until 22
# hours after the claim, a request with the key still on its way (a worker's, the vault's)
# can only meet the saved answer.
SAVED_ERROR_HOLDS_FOR = timedelta(hours=22)
# A skip of such a claim is accepted an hour less: its next try, minutes away, must come while
# the stop still can.
SKIP_BEHIND_SAVED_ERROR_FOR = SAVED_ERROR_HOLDS_FOR - timedelta(hours=1)


async def stop_behind_saved_error(
    conn: asyncpg.Connection, key: str, fencing_token: int, *, record: bool
) -> LedgerStatus | None:
    """After the claim's attempt `fencing_token` met a 500 Stripe saved for the key and found
    no charge made with it: note that (so that a skip may still reach the claim, see
    request_skip), and return the stop that applies, if the customer was skipped or the
    period's run cancelled; record it only if `record`. Stripe executes no request with the
    key until it forgets it a day later, so nothing of the charge is at Stripe or can still
    get there. Only for the claim's latest attempt, and only while the key is young enough
    (SAVED_ERROR_HOLDS_FOR)."""
    stopped: LedgerStatus | None = await conn.fetchval(
        """
        WITH held AS (
            SELECT r.idempotency_key,
                   CASE WHEN r.skip_reason IS NOT NULL THEN 'skipped'
                        WHEN p.control = 'cancelled' THEN 'cancelled' END AS stop,
                   coalesce(r.skip_reason, p.control_reason) AS why,
                   coalesce(r.skip_by, p.control_by) AS who
            FROM billing_runs r JOIN billing_periods p USING (billing_period)
            WHERE r.idempotency_key = $1 AND r.status = 'claimed' AND r.gate_passes = $2
                AND r.claimed_at > now() - $3::interval
            FOR UPDATE OF r
        ), recorded AS (
            SELECT *, CASE WHEN $4 THEN stop END AS status FROM held
        )
        UPDATE billing_runs r
        SET saved_error_at = now(), updated_at = now(), status = coalesce(h.status, r.status),
            reason = CASE WHEN h.status IS NULL THEN r.reason ELSE h.why END,
            decided_by = CASE WHEN h.status IS NULL THEN r.decided_by ELSE h.who END,
            completed_at = CASE WHEN h.status IS NULL THEN r.completed_at ELSE now() END
        FROM recorded h WHERE r.idempotency_key = h.idempotency_key
        RETURNING h.stop
        """,
        key,
        fencing_token,
        SAVED_ERROR_HOLDS_FOR,
        record,
    )
    return stopped


async def request_skip(
    conn: asyncpg.Connection, customer_id: str, period: str, key: str, reason: str, operator: str
) -> SkipResult:
    """Skip a customer this period, unless its charge has started or ended.

    A customer no run has claimed yet is written skipped at once: a run that lists it counts
    it so, and one whose cursor has passed it (or that does not list it, an inactive
    customer) leaves no claim open behind. An open claim keeps its status and stops at the
    gate as skipped. A customer a cancelled run never started is skipped too, so the next
    run does not reopen it. A charge held behind a 500 Stripe saved for its key ends skipped
    at its next try if Stripe still shows no charge (stop_behind_saved_error)."""
    row = await conn.fetchrow(
        """
        INSERT INTO billing_runs (customer_id, billing_period, idempotency_key, amount_cents,
                                  currency, stripe_customer_id, payment_method, skip_reason,
                                  skip_by, status, reason, decided_by, completed_at)
        SELECT customer_id, $2, $3, amount_cents, currency, stripe_customer_id, payment_method,
               $4, $5, 'skipped', $4, $5, now()
        FROM customers WHERE customer_id = $1
        ON CONFLICT (customer_id, billing_period) DO UPDATE
            SET skip_reason = EXCLUDED.skip_reason, skip_by = EXCLUDED.skip_by,
                status = CASE billing_runs.status WHEN 'cancelled' THEN 'skipped'
                              ELSE billing_runs.status END,
                reason = CASE billing_runs.status WHEN 'cancelled' THEN EXCLUDED.reason
                              ELSE billing_runs.reason END,
                decided_by = CASE billing_runs.status WHEN 'cancelled' THEN EXCLUDED.decided_by
                                  ELSE billing_runs.decided_by END,
                cancelled_before_start = false, updated_at = now()
            WHERE (billing_runs.status = 'claimed' AND billing_runs.charge_started_at IS NULL)
               OR (billing_runs.status = 'cancelled' AND billing_runs.cancelled_before_start)
               OR (billing_runs.status = 'claimed' AND billing_runs.saved_error_at IS NOT NULL
                   AND billing_runs.claimed_at > now() - $6::interval)
        RETURNING status, charge_started_at IS NOT NULL AS sent
        """,
        customer_id,
        period,
        key,
        reason,
        operator,
        SKIP_BEHIND_SAVED_ERROR_FOR,
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


async def cancel_customers(
    conn: asyncpg.Connection, period: str, keys: dict[str, str], reason: str, operator: str
) -> None:
    """Mark customers a cancelled run never started as cancelled (no child, no charge)."""
    await conn.executemany(
        """
        INSERT INTO billing_runs (customer_id, billing_period, idempotency_key, amount_cents,
                                  currency, stripe_customer_id, payment_method, status, reason,
                                  decided_by, completed_at, cancelled_before_start)
        SELECT customer_id, $2, $3, amount_cents, currency, stripe_customer_id, payment_method,
               'cancelled', $4, $5, now(), true
        FROM customers WHERE customer_id = $1
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


async def finish_period(conn: asyncpg.Connection, period: str, summary_json: str) -> None:
    """Record the run's summary. A pause left at the close is lifted: one accepted with the
    run's last outcome has nothing left to hold, and a claim charged after the run (a
    re-drive) would wait at the gate for a resume no run can give."""
    await conn.execute(
        """
        UPDATE billing_periods SET state = 'completed', summary = $2::jsonb, finished_at = now(),
            control = CASE WHEN control = 'paused' THEN 'running' ELSE control END
        WHERE billing_period = $1
        """,
        period,
        summary_json,
    )


async def period_record(conn: asyncpg.Connection, period: str) -> PeriodRecord | None:
    """What the ledger remembers of the period's last run; None if none was started."""
    row = await conn.fetchrow(
        "SELECT workflow_id, state, summary FROM billing_periods WHERE billing_period = $1",
        period,
    )
    if row is None:
        return None
    summary = row["summary"]
    return PeriodRecord(
        workflow_id=row["workflow_id"],
        state=row["state"],
        summary=None if summary is None else PeriodSummary.model_validate_json(summary),
    )


async def periods_run(conn: asyncpg.Connection, periods: list[str]) -> list[str]:
    """Those of `periods` a run was started for, whatever its state, in order."""
    rows = await conn.fetch(
        "SELECT billing_period FROM billing_periods WHERE billing_period = ANY($1::text[])"
        " ORDER BY billing_period",
        periods,
    )
    return [row["billing_period"] for row in rows]


async def completed_runs(conn: asyncpg.Connection, periods: list[str]) -> dict[str, bool]:
    """Those of `periods` whose last run completed, in order, each with whether it was
    cancelled (by an operator): a launch leaves either as it is, and only a run by hand bills
    a cancelled one again."""
    rows = await conn.fetch(
        "SELECT billing_period, control = 'cancelled' AS cancelled FROM billing_periods"
        " WHERE billing_period = ANY($1::text[]) AND state = 'completed'"
        " ORDER BY billing_period",
        periods,
    )
    return {row["billing_period"]: row["cancelled"] for row in rows}


async def latest_run_before(conn: asyncpg.Connection, period: str) -> str | None:
    """The latest period before `period` a run was started for, whatever its state."""
    value: str | None = await conn.fetchval(
        "SELECT max(billing_period) FROM billing_periods WHERE billing_period < $1", period
    )
    return value


async def latest_run(conn: asyncpg.Connection, periods: list[str]) -> str | None:
    """The latest of `periods` that a run was started for, whatever its state; None if none."""
    value: str | None = await conn.fetchval(
        "SELECT max(billing_period) FROM billing_periods WHERE billing_period = ANY($1::text[])",
        periods,
    )
    return value


async def record_reconciliation(
    conn: asyncpg.Connection, period: str, open_reason: str | None
) -> None:
    """Keep what the period's latest reconciliation left to look at again (None: nothing)."""
    await conn.execute(
        """
        INSERT INTO period_reconciliations (billing_period, open_reason) VALUES ($1, $2)
        ON CONFLICT (billing_period)
        DO UPDATE SET reconciled_at = now(), open_reason = EXCLUDED.open_reason
        """,
        period,
        open_reason,
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
        SELECT {_CLAIM_COLUMNS}, skip_reason, charge_started_at IS NOT NULL AS sent,
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
        f"SELECT {_CLAIM_COLUMNS} FROM billing_runs WHERE idempotency_key = $1", key
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
        SELECT customer_id, status, charge_id FROM billing_runs
        WHERE billing_period = $1 AND customer_id = ANY($2::text[])
        """,
        period,
        list(customer_ids),
    )
    return {row["customer_id"]: LedgerEntry(**dict(row)) for row in rows}

"""A period's runs: their opening under the lock shared with changes to the customers, their
control (pause, resume, cancel), their close, and what the ledger remembers of them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime

import asyncpg

from billing.errors import LedgerBusyError
from billing.ledger.due import plan_period, unsent_totals
from billing.models import (
    AUTOMATIC,
    Control,
    PeriodPlan,
    PeriodRecord,
    PeriodSummary,
    PeriodTotals,
    RunIdentity,
)

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
    run: RunIdentity | None = None,
) -> PeriodPlan:
    """Plan the period and record its new run, as one step to a customer import. In between,
    under the same lock, `before_recording` gets the plan and `unsent_totals`: what it raises
    leaves the period's record as it was (a completed run's summary)."""
    async with conn.transaction():
        await conn.execute(OPENING_LOCK)
        plan = await plan_period(conn, period)
        if before_recording is not None:
            await before_recording(plan, await unsent_totals(conn, period))
        await start_period(conn, plan, workflow_id, run)
    return plan


async def start_period(
    conn: asyncpg.Connection, plan: PeriodPlan, workflow_id: str, run: RunIdentity | None = None
) -> None:
    """Record a new run of the period (`run`: which one, see migrations/031). Customers a
    cancelled run never started are due again (see migrations/005) while active: their
    claim takes the row over (see claim)."""
    await conn.execute(
        """
        INSERT INTO billing_periods (billing_period, workflow_id, state, due,
                                     expected_total_cents, run_id, run_opened_in_temporal_at)
        VALUES ($1, $2, 'running', $3, $4, $5, $6)
        ON CONFLICT (billing_period) DO UPDATE SET
            workflow_id = EXCLUDED.workflow_id, state = 'running', due = EXCLUDED.due,
            expected_total_cents = EXCLUDED.expected_total_cents, started_at = now(),
            finished_at = NULL, summary = NULL, control = 'running', control_reason = NULL,
            control_by = NULL, control_at = now(), run_id = EXCLUDED.run_id,
            run_opened_in_temporal_at = EXCLUDED.run_opened_in_temporal_at
        """,
        plan.period,
        workflow_id,
        plan.due,
        plan.expected_total_cents,
        None if run is None else run.run_id,
        None if run is None else run.opened_at,
    )
    if run is not None:
        # Opened again by the same run (reset to before its opening): it lists from the start.
        await conn.execute(
            "DELETE FROM period_listed WHERE billing_period = $1 AND run_id = $2",
            plan.period,
            run.run_id,
        )


# How long a writer holding the period's row may leave its transaction idle (it asks
# Temporal whether it may still write): every charge's gate shares the row, so a writer
# frozen there would hold up the period's charges. Past it, Postgres ends the session, and
# the frozen write never lands.
ROW_HELD_IDLE = "30s"


async def lock_period(conn: asyncpg.Connection, period: str) -> None:
    """Hold the period's row for the caller's transaction: a writer of it checks, under the
    lock, that it may still write (a run's control or close), and no opening can land
    between that check and its write."""
    assert conn.is_in_transaction(), "lock_period needs the caller's transaction"
    await conn.execute(f"SET LOCAL idle_in_transaction_session_timeout = '{ROW_HELD_IDLE}'")
    await conn.execute("SELECT 1 FROM billing_periods WHERE billing_period = $1 FOR UPDATE", period)


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


async def finish_period(conn: asyncpg.Connection, period: str, summary_json: str) -> None:
    """Record the run's summary, and let go of the marks of its listings (migrations/032). A
    pause left at the close is lifted: one accepted with the run's last outcome has nothing
    left to hold, and a claim charged after the run (a re-drive) would wait at the gate for a
    resume no run can give."""
    await conn.execute(
        """
        UPDATE billing_periods SET state = 'completed', summary = $2::jsonb, finished_at = now(),
            control = CASE WHEN control = 'paused' THEN 'running' ELSE control END
        WHERE billing_period = $1
        """,
        period,
        summary_json,
    )
    await conn.execute("DELETE FROM period_listed WHERE billing_period = $1", period)


async def period_totals(conn: asyncpg.Connection, period: str) -> PeriodTotals:
    """The period's rows by status, and what they charged by currency, every run's together."""
    rows = await conn.fetch(
        """
        SELECT status, currency, count(*) AS count, sum(amount_cents) AS cents
        FROM billing_runs WHERE billing_period = $1 GROUP BY status, currency
        """,
        period,
    )
    counts: dict[str, int] = {}
    charged: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + row["count"]
        if row["status"] == "charged":
            charged[row["currency"]] = row["cents"]
    return PeriodTotals(**counts, charged_by_currency=charged)


async def self_pause_unrenewed(conn: asyncpg.Connection, period: str) -> str | None:
    """The reason the period's run paused itself for, while it is so paused and no key of the
    period was issued since (`renew-keys` issues them); None otherwise."""
    reason: str | None = await conn.fetchval(
        """
        SELECT p.control_reason FROM billing_periods p
        WHERE p.billing_period = $1 AND p.state = 'running' AND p.control = 'paused'
            AND p.control_by = $2
            AND NOT EXISTS (SELECT 1 FROM period_vault_keys k
                            WHERE k.billing_period = p.billing_period
                                AND k.created_at >= p.control_at)
        """,
        period,
        AUTOMATIC,
    )
    return reason


async def period_record(conn: asyncpg.Connection, period: str) -> PeriodRecord | None:
    """What the ledger remembers of the period's last run; None if none was started."""
    row = await conn.fetchrow(
        "SELECT workflow_id, run_id, state, summary FROM billing_periods WHERE billing_period = $1",
        period,
    )
    if row is None:
        return None
    summary = row["summary"]
    return PeriodRecord(
        workflow_id=row["workflow_id"],
        run_id=row["run_id"],
        state=row["state"],
        summary=None if summary is None else PeriodSummary.model_validate_json(summary),
    )


async def run_opened_at(
    conn: asyncpg.Connection, period: str, *, billing: bool = False
) -> datetime | None:
    """When the period's last run was opened, by Temporal's clock (by the database's for a
    row from before migrations/031); None if none was, or with `billing`, unless that run is
    open and not cancelled."""
    opened: datetime | None = await conn.fetchval(
        """
        SELECT coalesce(run_opened_in_temporal_at, started_at) FROM billing_periods
        WHERE billing_period = $1 AND (NOT $2 OR (state = 'running' AND control <> 'cancelled'))
        """,
        period,
        billing,
    )
    return opened


async def periods_run(conn: asyncpg.Connection, periods: list[str]) -> list[str]:
    """Those of `periods` a run was started for, whatever its state, in order."""
    rows = await conn.fetch(
        "SELECT billing_period FROM billing_periods WHERE billing_period = ANY($1::text[])"
        " ORDER BY billing_period",
        periods,
    )
    return [row["billing_period"] for row in rows]


async def open_runs(conn: asyncpg.Connection, periods: list[str]) -> dict[str, Control]:
    """Those of `periods` whose last run the ledger holds open, in order, each with its
    control: running, or ended without its close (terminated, failed), which only Temporal
    can tell apart."""
    rows = await conn.fetch(
        "SELECT billing_period, control FROM billing_periods"
        " WHERE billing_period = ANY($1::text[]) AND state = 'running' ORDER BY billing_period",
        periods,
    )
    return {row["billing_period"]: row["control"] for row in rows}


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

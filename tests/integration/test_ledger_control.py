"""The period's control word in the real ledger, as the gate of every charge reads it."""

from __future__ import annotations

import asyncio

import pytest

from billing import ledger, run_states
from billing.models import ChargeFailure, Control, Gate, PeriodPlan, PeriodSummary
from billing.periods import Period
from tests.integration.harness import Harness
from tests.integration.test_ledger_reopen import PERIOD, claimed, passed
from tests.waiting import eventually, waits_on_a_lock


@pytest.mark.parametrize(("left", "gate"), [("paused", "go"), ("cancelled", "cancelled")])
async def test_a_run_closing_lifts_a_pause_but_keeps_a_cancel(
    harness: Harness, left: Control, gate: Gate
) -> None:
    # A pause accepted with the run's last outcome reaches the ledger before the close; a
    # claim charged after the run (a re-drive) would otherwise wait for a resume forever.
    [claim] = await claimed(harness)
    async with harness.pool.acquire() as conn:
        plan = PeriodPlan(period=str(PERIOD), due=1, to_charge=1, expected_total_cents=0)
        await ledger.start_period(conn, plan, "billing-period-2026-12")
        await ledger.set_control(conn, str(PERIOD), left, "wrong prices", "ops")
        summary = PeriodSummary.empty(str(PERIOD), "billing-period-2026-12")
        await ledger.finish_period(conn, str(PERIOD), summary.model_dump_json())
        assert (await ledger.begin_charge(conn, claim, None)).gate == gate


async def test_a_run_bills_since_its_opening_until_its_cancel_or_close(harness: Harness) -> None:
    """What a run that awaits a child an earlier run started reads before starting it again
    (activities.period, _closed_without_row): never after the run is cancelled or closed."""
    async with harness.pool.acquire() as conn:
        assert await ledger.run_opened_at(conn, str(PERIOD), billing=True) is None
        plan = PeriodPlan(period=str(PERIOD), due=0, to_charge=0, expected_total_cents=0)
        await ledger.start_period(conn, plan, "billing-period-2026-12")
        opened = await ledger.run_opened_at(conn, str(PERIOD))
        assert opened is not None
        assert await ledger.run_opened_at(conn, str(PERIOD), billing=True) == opened
        await ledger.set_control(conn, str(PERIOD), "paused", "wrong prices", "ops")
        assert await ledger.run_opened_at(conn, str(PERIOD), billing=True) == opened
        await ledger.set_control(conn, str(PERIOD), "cancelled", "wrong prices", "ops")
        assert await ledger.run_opened_at(conn, str(PERIOD), billing=True) is None
        await ledger.set_control(conn, str(PERIOD), "running", "resumed", "ops")
        summary = PeriodSummary.empty(str(PERIOD), "billing-period-2026-12")
        await ledger.finish_period(conn, str(PERIOD), summary.model_dump_json())
        assert await ledger.run_opened_at(conn, str(PERIOD), billing=True) is None
        assert await ledger.run_opened_at(conn, str(PERIOD)) == opened


async def test_a_pause_stops_a_claim_not_yet_sent_but_not_a_retry_of_one_sent(
    harness: Harness,
) -> None:
    """A pause holds at the gate every claim whose charge has not gone out, until a resume;
    a retry of one already sent passes, since only a retry with its key learns whether it
    charged."""
    unsent, sent = await claimed(harness, 2)
    async with harness.pool.acquire() as conn:
        await passed(conn, sent, None)
        await ledger.set_control(conn, str(PERIOD), "paused", "wrong prices", "ops")
        assert (await ledger.begin_charge(conn, unsent, None)).gate == "paused"
        assert (await ledger.begin_charge(conn, sent, None)).gate == "go"
        await ledger.set_control(conn, str(PERIOD), "running", "resumed", "ops")
        assert (await ledger.begin_charge(conn, unsent, None)).gate == "go"


async def test_the_gate_waits_for_a_pause_being_written_and_stops_at_it(
    harness: Harness,
) -> None:
    """A pause's write holds the period's row (activities.period set_control) until it
    commits. An attempt reaching the gate meanwhile waits for it and stops; read from its
    snapshot, the period was still running, and the charge went out after the operator
    was told the run was paused."""
    [claim] = await claimed(harness)
    async with harness.pool.acquire() as pausing, harness.pool.acquire() as charging:
        async with pausing.transaction():
            await ledger.lock_period(pausing, str(PERIOD))
            await ledger.set_control(pausing, str(PERIOD), "paused", "wrong prices", "ops")
            gate = asyncio.create_task(ledger.begin_charge(charging, claim, None))
            await eventually(lambda: waits_on_a_lock(harness.pool, charging, gate))
        assert (await gate).gate == "paused"


async def test_the_gate_waits_for_a_skip_being_written_and_stops_at_it(
    harness: Harness,
) -> None:
    """A skip accepted for a claim not yet sent is kept at its gate: an attempt reaching the
    gate while the skip's write is uncommitted waits for it, then stops skipped. Read without
    the claim's row lock, the skip was not there yet, and the charge passed the gate after
    the operator was told it was skipped."""
    [claim] = await claimed(harness)
    async with harness.pool.acquire() as skipping, harness.pool.acquire() as charging:
        async with skipping.transaction():
            skip = await ledger.request_skip(
                skipping,
                claim.customer_id,
                claim.period,
                claim.idempotency_key,
                "disputed",
                "ops",
            )
            assert skip.skipped
            gate = asyncio.create_task(ledger.begin_charge(charging, claim, None))
            await eventually(lambda: waits_on_a_lock(harness.pool, charging, gate))
        assert (await gate).gate == "skipped"


async def test_a_claim_skipped_before_its_runs_cancel_ends_skipped_for_the_skips_reason(
    harness: Harness,
) -> None:
    """Skipped by one operator, then the run cancelled by another: the gate stops the claim
    skipped, and its record keeps who skipped it and why, not the cancel's words."""
    [claim] = await claimed(harness)
    async with harness.pool.acquire() as conn:
        await ledger.request_skip(
            conn, claim.customer_id, claim.period, claim.idempotency_key, "disputed", "alice"
        )
        await ledger.set_control(conn, str(PERIOD), "cancelled", "wrong prices", "bob")
        assert (await ledger.begin_charge(conn, claim, None)).gate == "skipped"
        stopped = ChargeFailure(code="skipped", message="skipped by an operator")
        await ledger.record_unbilled(conn, claim.idempotency_key, "skipped", stopped)
        [row] = await harness.ledger_rows(str(PERIOD))
    assert (row["status"], row["reason"], row["decided_by"]) == ("skipped", "disputed", "alice")


async def test_a_periods_pause_and_close_leave_another_periods_run_alone(
    harness: Harness,
) -> None:
    """Two months' runs open at once (a late month's rerun beside this one's): a pause, a
    cancel or a close is written to its own month's row only, and each is read as it is."""
    [claim] = await claimed(harness)
    other = str(PERIOD.next())
    await harness.open_period_by_hand(other)
    async with harness.pool.acquire() as conn:
        await ledger.set_control(conn, other, "paused", "wrong prices", "ops")
        assert (await ledger.begin_charge(conn, claim, None)).gate == "go"
        summary = PeriodSummary.empty(other, f"billing-period-{other}")
        await ledger.finish_period(conn, other, summary.model_dump_json())
        assert await ledger.open_runs(conn, [str(PERIOD), other]) == {str(PERIOD): "running"}
        # A launch leaves a completed month as it is, and joins (or restarts) an open one.
        assert await ledger.completed_runs(conn, [str(PERIOD), other]) == {other: False}


async def test_a_launch_is_told_how_each_month_it_leaves_alone_ended(harness: Harness) -> None:
    """A month billed, one cancelled and closed, one cancelled still closing: "completed" for
    the cancelled one would have an operator believe its customers were billed (helper-227's
    S08). A month still running is not left alone: a launch joins it."""
    billed, cancelled, closing, running = (str(Period(*PERIOD.later(n))) for n in range(4))
    for period in (billed, cancelled, closing, running):
        await harness.open_period_by_hand(period)
    async with harness.pool.acquire() as conn:
        for period in (cancelled, closing):
            await ledger.set_control(conn, period, "cancelled", "wrong prices", "ops")
        for period in (billed, cancelled):
            summary = PeriodSummary.empty(period, f"billing-period-{period}")
            await ledger.finish_period(conn, period, summary.model_dump_json())
        finished = await run_states.finished_runs(conn, [running, closing, cancelled, billed])
    assert finished == {billed: "completed", cancelled: "cancelled", closing: "cancelling"}


async def test_a_rerun_forgets_the_summary_of_the_run_before(harness: Harness) -> None:
    """A rerun's row carries no summary until its own close: `status` of a rerun Temporal no
    longer holds (terminated) would read the earlier run's summary as this one's outcome,
    not a run that never finished (billing.runs.status_from_ledger)."""
    async with harness.pool.acquire() as conn:
        plan = PeriodPlan(period=str(PERIOD), due=0, to_charge=0, expected_total_cents=0)
        await ledger.start_period(conn, plan, "billing-period-2026-12")
        summary = PeriodSummary.empty(str(PERIOD), "billing-period-2026-12")
        await ledger.finish_period(conn, str(PERIOD), summary.model_dump_json())
        await ledger.start_period(conn, plan, "billing-period-2026-12")
        record = await ledger.period_record(conn, str(PERIOD))
    assert record is not None
    assert (record.state, record.summary) == ("running", None)

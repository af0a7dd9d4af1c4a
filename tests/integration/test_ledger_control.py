"""The period's control word in the real ledger, as the gate of every charge reads it."""

from __future__ import annotations

import pytest

from billing import ledger
from billing.models import Control, Gate, PeriodPlan, PeriodSummary
from tests.integration.harness import Harness
from tests.integration.test_ledger_reopen import PERIOD, claimed


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

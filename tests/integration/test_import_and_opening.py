"""A customer import and a run's opening are one step to each other: either the run's plan
counts what the import wrote, or the import sees the run open and refuses (unless told
`--while-running`). Checked apart, a run opened between the import's check and its write
billed the new customers at prices its plan and its key's cap never counted. And what an import
refuses against the customers already there."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from billing import ledger
from billing.customers import CustomerRow, import_customers
from billing.errors import CustomerImportError
from billing.keys import idempotency_key
from billing.models import AUTOMATIC, PeriodPlan
from billing.periods import parse_period
from billing.preview import preview_period

PERIOD = "2026-12"
WORKFLOW_ID = "billing-period-2026-12"
NEW = CustomerRow(
    customer_id="c-2",
    stripe_customer_id="cus_B",
    payment_method="pm_2",
    amount_cents=250,
    currency="usd",
)


def _key(customer_id: str) -> str:
    return idempotency_key("test", customer_id, parse_period(PERIOD))


async def _a_customer(db: asyncpg.Pool) -> None:
    await db.execute(
        "INSERT INTO customers (customer_id, stripe_customer_id, payment_method, amount_cents,"
        " currency) VALUES ('c-1', 'cus_A', 'pm_1', 100, 'usd')"
    )


async def _is_waiting(task: asyncio.Future[Any]) -> bool:
    await asyncio.sleep(0.5)
    return not task.done()


async def test_an_import_waits_for_a_run_being_opened_then_sees_it_open(
    db: asyncpg.Pool,
) -> None:
    await _a_customer(db)
    async with db.acquire() as conn, conn.transaction():
        # A run's opening half done: planned, not yet recorded.
        await conn.execute(ledger.OPENING_LOCK)
        plan = await ledger.plan_period(conn, PERIOD)
        importing = asyncio.create_task(import_customers(db, [NEW], while_running=False))
        assert await _is_waiting(importing)
        await ledger.start_period(conn, plan, WORKFLOW_ID)
    changes = await importing
    assert [(c.customer_id, c.was, c.becomes) for c in changes] == [("c-2", "new", "250 usd")]
    assert await db.fetchval("SELECT count(*) FROM customers") == 1  # nothing written


async def test_a_run_being_opened_waits_for_an_import_and_counts_it(db: asyncpg.Pool) -> None:
    await _a_customer(db)
    async with db.acquire() as conn, conn.transaction():
        # An import half done: checked, one row written, not yet committed.
        await conn.execute(ledger.OPENING_LOCK)
        await conn.execute(
            "INSERT INTO customers (customer_id, stripe_customer_id, payment_method,"
            " amount_cents, currency) VALUES ('c-2', 'cus_B', 'pm_2', 250, 'usd')"
        )

        async def open_run() -> PeriodPlan:
            async with db.acquire() as other:
                plan, _ = await ledger.open_period(other, PERIOD, WORKFLOW_ID, _key)
                return plan

        opening = asyncio.create_task(open_run())
        assert await _is_waiting(opening)
    plan = await opening
    assert plan == PeriodPlan(
        period=PERIOD,
        due=2,
        to_charge=2,
        expected_total_cents=350,
        totals_by_currency={"usd": 350},
    )


async def test_a_pause_does_not_wait_for_an_import(db: asyncpg.Pool) -> None:
    # An operator's pause, or the vault's, must stop charges at once, however long an import.
    await _a_customer(db)
    async with db.acquire() as conn:
        await ledger.open_period(conn, PERIOD, WORKFLOW_ID, _key)
    async with db.acquire() as conn, conn.transaction():
        await conn.execute(ledger.OPENING_LOCK)  # an import under way

        async def pause() -> None:
            async with db.acquire() as other:
                await ledger.set_control(other, PERIOD, "paused", "wrong prices", "alice")

        await asyncio.wait_for(pause(), timeout=2)


async def test_an_active_customers_id_spelt_another_way_is_refused(db: asyncpg.Pool) -> None:
    """`C-1` for `c-1` with the same Stripe customer: a second id, each charged every period.
    Another Stripe customer makes it another customer (ids may be case-sensitive), and an
    inactive `c-1` may be renamed."""
    await _a_customer(db)
    respelt = NEW.model_copy(update={"customer_id": "C-1", "stripe_customer_id": "cus_A"})
    with pytest.raises(
        CustomerImportError,
        match=r"1 customer ids are those of active customers spelt another way, with the same"
        r" Stripe customer: 'C-1' for 'c-1' \(cus_A\)\. .* nothing was imported",
    ):
        await import_customers(db, [NEW, respelt], while_running=False)
    assert await db.fetchval("SELECT count(*) FROM customers") == 1
    other = respelt.model_copy(update={"stripe_customer_id": "cus_C"})
    assert await import_customers(db, [other], while_running=False) == []
    await db.execute("UPDATE customers SET active = false WHERE customer_id = 'c-1'")
    assert await import_customers(db, [respelt], while_running=False) == []
    active = await db.fetch("SELECT customer_id, stripe_customer_id FROM customers WHERE active")
    assert [tuple(r) for r in active] == [("C-1", "cus_A")]


async def _billed_then_renamed(db: asyncpg.Pool, old_status: str, old_active: bool) -> None:
    """c-1 (cus_A) has a row of the period in `old_status`; c-2 is cus_A under a new id."""
    await _a_customer(db)
    await db.execute(
        "INSERT INTO customers (customer_id, stripe_customer_id, payment_method, amount_cents,"
        " currency) VALUES ('c-2', 'cus_A', 'pm_1', 100, 'usd')"
    )
    await db.execute(
        """
        INSERT INTO billing_runs (customer_id, billing_period, idempotency_key, amount_cents,
                                  currency, stripe_customer_id, status, charge_started_at,
                                  charge_id, failure_code, completed_at)
        SELECT 'c-1', $1, $2, 100, 'usd', 'cus_A', $3, now(),
               CASE $3 WHEN 'charged' THEN 'ch_1' END,
               CASE $3 WHEN 'failed' THEN 'card_declined' END,
               CASE WHEN $3 <> 'claimed' THEN now() END
        """,
        PERIOD,
        _key("c-1"),
        old_status,
    )
    await db.execute("UPDATE customers SET active = $1 WHERE customer_id = 'c-1'", old_active)


@pytest.mark.parametrize(
    ("old_status", "old_active", "held"),
    [
        ("charged", False, True),
        # Sent, its outcome in doubt: it may have charged.
        ("claimed", False, True),
        # Still active: two accounts may share a Stripe customer (the preview warns).
        ("charged", True, False),
        # Nothing was charged under the old id.
        ("failed", False, False),
    ],
)
async def test_an_opening_holds_a_stripe_customer_the_period_charged_under_an_inactive_id(
    db: asyncpg.Pool, old_status: str, old_active: bool, held: bool
) -> None:
    await _billed_then_renamed(db, old_status, old_active)
    preview = await preview_period(db, PERIOD, 1.1)
    assert [line.held_as for line in preview.held] == (["c-1"] if held else [])
    async with db.acquire() as conn:
        plan, holds = await ledger.open_period(conn, PERIOD, WORKFLOW_ID, _key)
    assert [(h.customer_id, h.billed_as) for h in holds] == ([("c-2", "c-1")] if held else [])
    assert plan.to_charge == (0 if held else 1) + (old_status == "claimed")
    row = await db.fetchrow("SELECT * FROM billing_runs WHERE customer_id = 'c-2'")
    if held:
        assert (row["status"], row["decided_by"], row["idempotency_key"]) == (
            "skipped",
            AUTOMATIC,
            _key("c-2"),
        )
    else:
        assert row is None


async def test_an_opening_holds_an_open_claim_not_yet_sent_but_not_one_sent(
    db: asyncpg.Pool,
) -> None:
    await _billed_then_renamed(db, "charged", False)
    async with db.acquire() as conn:
        claim = await ledger.claim(
            conn, "c-2", PERIOD, _key("c-2"), "run-1", charge_api="payment_intents"
        )
        _, holds = await ledger.open_period(conn, PERIOD, WORKFLOW_ID, _key)
        assert [h.customer_id for h in holds] == ["c-2"]
        # Skipped at the gate: the claim stays open until its child reaches it.
        assert await ledger.begin_charge(conn, claim, None) == "skipped"
        await conn.execute("UPDATE billing_runs SET skip_reason = NULL WHERE customer_id = 'c-2'")
        assert await ledger.begin_charge(conn, claim, None) == "go"
        # Sent: only a retry with the same key learns what it did; it is not held.
        _, holds = await ledger.open_period(conn, PERIOD, WORKFLOW_ID, _key)
        assert holds == []

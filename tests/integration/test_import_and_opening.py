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

from billing import customers, ledger
from billing.customers import (
    CustomerRow,
    deactivate_customers,
    import_customers,
    upsert_customers,
)
from billing.errors import CustomerImportError, HeldCustomerError, LedgerBusyError
from billing.keys import idempotency_key
from billing.ledger import claims
from billing.ledger.sql import LOOKUP_REFUSED
from billing.models import AUTOMATIC, ChargeFailure, ChargeResult, Claim, PeriodPlan
from billing.periods import parse_period
from billing.preview import preview_period
from billing.reconciliation import INCOMPLETE_INTENT
from tests.integration.harness import open_period_by_hand
from tests.waiting import eventually, waits_on_a_lock

PERIOD = "2026-12"
WORKFLOW_ID = "billing-period-2026-12"
# The customer _a_customer writes, as an import names it (the old id of a rename).
OLD_ID = CustomerRow(
    customer_id="c-1",
    stripe_customer_id="cus_A",
    payment_method="pm_1",
    amount_cents=100,
    currency="usd",
)
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
    await upsert_customers(db, [OLD_ID])


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
        importing = asyncio.create_task(
            import_customers(db, [NEW], while_running=False, reactivate=True)
        )
        assert await _is_waiting(importing)
        await ledger.start_period(conn, plan, WORKFLOW_ID)
    changes = await importing
    assert [(c.customer_id, c.was, c.becomes) for c in changes] == [("c-2", "new", "usd 2.50")]
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
                return await ledger.open_period(other, PERIOD, WORKFLOW_ID)

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


async def test_an_import_kept_waiting_gives_up_saying_why(
    db: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past the pool's statement timeout it would fail with a bare TimeoutError.
    monkeypatch.setattr(ledger.runs, "CHANGE_WAIT_SECONDS", 0.5)
    async with db.acquire() as conn, conn.transaction():
        await conn.execute(ledger.OPENING_LOCK)  # a run being opened, waiting for the vault
        with pytest.raises(LedgerBusyError, match=r"the import waited 0\.5 s for a run being"):
            await import_customers(db, [NEW], while_running=False, reactivate=True)
    assert await db.fetchval("SELECT count(*) FROM customers") == 0
    # Once the opening is done, the same import goes through.
    await import_customers(db, [NEW], while_running=False, reactivate=True)
    assert await db.fetchval("SELECT count(*) FROM customers") == 1


async def test_a_pause_does_not_wait_for_an_import(db: asyncpg.Pool) -> None:
    # An operator's pause, or the vault's, must stop charges at once, however long an import.
    await _a_customer(db)
    async with db.acquire() as conn:
        await ledger.open_period(conn, PERIOD, WORKFLOW_ID)
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
        await import_customers(db, [NEW, respelt], while_running=False, reactivate=True)
    assert await db.fetchval("SELECT count(*) FROM customers") == 1
    other = respelt.model_copy(update={"stripe_customer_id": "cus_C"})
    assert await import_customers(db, [other], while_running=False, reactivate=True) == []
    await db.execute("UPDATE customers SET active = false WHERE customer_id = 'c-1'")
    assert await import_customers(db, [respelt], while_running=False, reactivate=True) == []
    active = await db.fetch("SELECT customer_id, stripe_customer_id FROM customers WHERE active")
    assert [tuple(r) for r in active] == [("C-1", "cus_A")]


async def _billed_then_renamed(
    db: asyncpg.Pool, old_status: str, *, old_active: bool = False, sent: bool = True
) -> None:
    """c-1 (cus_A) has a row of the period in `old_status` ('skip': claimed, then skipped);
    c-2 is cus_A under a new id."""
    await _a_customer(db)
    await db.execute(
        "INSERT INTO customers (customer_id, stripe_customer_id, payment_method, amount_cents,"
        " currency) VALUES ('c-2', 'cus_A', 'pm_1', 100, 'usd')"
    )
    await db.execute(
        """
        INSERT INTO billing_runs (customer_id, billing_period, idempotency_key, amount_cents,
                                  currency, stripe_customer_id, status, charge_started_at,
                                  charge_id, failure_code, completed_at, skip_reason)
        SELECT 'c-1', $1, $2, 100, 'usd', 'cus_A', CASE $3 WHEN 'skip' THEN 'claimed' ELSE $3 END,
               CASE WHEN $4 THEN now() END,
               CASE $3 WHEN 'charged' THEN 'ch_1' END,
               CASE $3 WHEN 'failed' THEN 'card_declined' END,
               CASE WHEN $3 NOT IN ('claimed', 'skip') THEN now() END,
               CASE $3 WHEN 'skip' THEN 'duplicate' END
        """,
        PERIOD,
        _key("c-1"),
        old_status,
        sent,
    )
    await db.execute("UPDATE customers SET active = $1 WHERE customer_id = 'c-1'", old_active)
    await open_period_by_hand(db, PERIOD)


async def _due(db: asyncpg.Pool) -> list[str]:
    async with db.acquire() as conn:
        page = await ledger.due_page(conn, PERIOD, None, 10)
    return [c.customer_id for c in page.customers]


@pytest.mark.parametrize(
    ("old_status", "sent", "old_active", "held"),
    [
        ("charged", True, False, True),
        # Sent, its outcome in doubt: it may have charged.
        ("claimed", True, False, True),
        # Not sent yet: the next run charges it, inactive or not.
        ("claimed", False, False, True),
        # Skipped by an operator while open: it will not be charged.
        ("skip", False, False, False),
        # Skipped once its charge was sent and held behind a saved 500: that skip holds only
        # if Stripe still shows nothing at the next try, so it may yet be charged.
        ("skip", True, False, True),
        # Still active: two accounts may share a Stripe customer (the preview warns).
        ("charged", True, True, False),
        # Nothing was charged under the old id.
        ("failed", True, False, False),
    ],
)
async def test_a_run_holds_a_stripe_customer_the_period_billed_under_an_inactive_id(
    db: asyncpg.Pool, old_status: str, sent: bool, old_active: bool, held: bool
) -> None:
    await _billed_then_renamed(db, old_status, old_active=old_active, sent=sent)
    preview = await preview_period(db, PERIOD, 1.1)
    assert [(x.customer_id, x.held_as) for x in preview.held] == ([("c-2", "c-1")] if held else [])
    assert ("c-2" in [x.customer_id for x in preview.to_charge]) is not held
    async with db.acquire() as conn:
        plan = await ledger.open_period(conn, PERIOD, WORKFLOW_ID)
    old_to_charge = old_status == "claimed"
    assert plan.to_charge == old_to_charge + (not held)
    assert ("c-2" in await _due(db)) is not held


async def test_a_hold_lasts_while_the_old_id_is_billed_and_inactive(db: asyncpg.Pool) -> None:
    """Reckoned as a run lists its customers, not once at its opening: a rename after a run
    opened holds the new id in that very run, and a charge in doubt that fails releases it."""
    await _billed_then_renamed(db, "claimed", old_active=True)
    async with db.acquire() as conn:
        await ledger.open_period(conn, PERIOD, WORKFLOW_ID)
    assert await _due(db) == ["c-1", "c-2"]
    # The old id deactivated while the run is open (it is claimed already, so no open-run
    # check stops that): the run no longer lists the new one.
    await db.execute("UPDATE customers SET active = false WHERE customer_id = 'c-1'")
    assert await _due(db) == ["c-1"]
    # The old id's charge, in doubt, fails: nothing was billed, and the new id is due again.
    async with db.acquire() as conn:
        failure = ChargeFailure(code="card_declined", message="declined")
        await ledger.record_unbilled(conn, _key("c-1"), "failed", failure)
    assert await _due(db) == ["c-1", "c-2"]


async def test_a_customer_held_after_its_run_listed_it_waits_for_the_old_claim(
    db: asyncpg.Pool,
) -> None:
    """Listed while its old id was active, then the old id was deactivated before the new
    one's child claimed it. While the old id's claim is open, the claim refuses, for a retry;
    once that claim charged, the new id is skipped, saying why (the child ends, and a later
    run counts it skipped, not due)."""
    await _billed_then_renamed(db, "claimed", sent=True)
    async with db.acquire() as conn:

        async def claim() -> Claim:
            return await ledger.claim(
                conn, "c-2", PERIOD, _key("c-2"), "run-1", charge_api="charges"
            )

        with pytest.raises(HeldCustomerError, match="has a claim open for its Stripe customer"):
            await claim()
        assert (
            await conn.fetchval("SELECT count(*) FROM billing_runs WHERE customer_id = 'c-2'") == 0
        )
        result = ChargeResult(
            charge_id="ch_1", payment_intent_id="pi_1", amount_cents=100, currency="usd"
        )
        await ledger.record_charge(conn, _key("c-1"), result)
        skipped = await claim()
        assert skipped.status == "skipped"
        row = await conn.fetchrow(
            "SELECT reason, decided_by FROM billing_runs WHERE customer_id = 'c-2'"
        )
    assert row["decided_by"] == AUTOMATIC
    assert "charged its Stripe customer as 'c-1', an id inactive since" in row["reason"]


@pytest.mark.parametrize(
    ("failure_code", "released"),
    [
        ("card_declined", True),
        # Its lookup refused for good: a charge may exist all the same.
        (LOOKUP_REFUSED, False),
        # A PaymentIntent Stripe left unconfirmed: it may yet complete it.
        (INCOMPLETE_INTENT, False),
    ],
)
async def test_a_claim_the_old_id_fails_releases_the_new_one_unless_in_doubt(
    db: asyncpg.Pool, failure_code: str, released: bool
) -> None:
    await _billed_then_renamed(db, "claimed", sent=True)
    async with db.acquire() as conn:
        failure = ChargeFailure(code=failure_code, message="refused")
        await ledger.record_unbilled(conn, _key("c-1"), "failed", failure)
        assert ("c-2" in await _due(db)) is released
        claim = await ledger.claim(conn, "c-2", PERIOD, _key("c-2"), "run-1", charge_api="charges")
        reason = await conn.fetchval("SELECT reason FROM billing_runs WHERE customer_id = 'c-2'")
    assert claim.status == ("claimed" if released else "skipped")
    if not released:
        assert "may have charged its Stripe customer as 'c-1'" in reason


async def test_a_customer_released_as_its_claim_looks_again_is_claimed(
    db: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim's insert finds c-2 held (c-1's claim open); before it looks again
    (_refuse_held), c-1's charge fails, releasing it. It is claimed then: reported unknown,
    its bill ended failed and no run of the period billed it."""
    await _billed_then_renamed(db, "claimed", sent=True)
    refuse_held = claims._refuse_held

    async def old_claim_fails_first(
        conn: asyncpg.Connection, customer_id: str, period: str, key: str
    ) -> bool:
        async with db.acquire() as other:
            failure = ChargeFailure(code="card_declined", message="declined")
            await ledger.record_unbilled(other, _key("c-1"), "failed", failure)
        return await refuse_held(conn, customer_id, period, key)

    monkeypatch.setattr(claims, "_refuse_held", old_claim_fails_first)
    async with db.acquire() as conn:
        claim = await ledger.claim(conn, "c-2", PERIOD, _key("c-2"), "run-1", charge_api="charges")
    assert (claim.status, claim.claimed_by_run) == ("claimed", "run-1")


async def test_an_open_claim_of_a_customer_inactive_since_is_taken_over_by_the_run(
    db: asyncpg.Pool,
) -> None:
    """A run that charges an open claim of a customer deactivated since owns it, as for any
    open claim: a retry of its workflow task after the record knows the charge for its own."""
    await _billed_then_renamed(db, "claimed", sent=True)
    async with db.acquire() as conn:
        claim = await ledger.claim(conn, "c-1", PERIOD, _key("c-1"), "run-2", charge_api="charges")
    assert (claim.status, claim.claimed_by_run) == ("claimed", "run-2")


async def test_a_held_customer_is_deactivated_without_being_named_as_one_a_run_bills(
    db: asyncpg.Pool,
) -> None:
    await _billed_then_renamed(db, "charged")
    async with db.acquire() as conn:
        await ledger.open_period(conn, PERIOD, WORKFLOW_ID)
    done = await deactivate_customers(db, ["c-2"], while_running=False)
    assert (done.deactivated, done.still_billable) == (["c-2"], [])


@pytest.mark.parametrize("charged_as", ["old-id-run-open", "new-id-run-completed"])
async def test_a_rename_undone_by_an_import_is_refused(db: asyncpg.Pool, charged_as: str) -> None:
    """c-1 (cus_A) renamed to c-2: an import making c-1 active again (a master file
    imported whole) released c-2's hold in an open run where c-1 had charged cus_A, or made
    c-1 due in a period c-2 had charged: cus_A charged twice in it, with nothing refused
    (helper-143's F1)."""
    if charged_as == "old-id-run-open":
        await _billed_then_renamed(db, "charged")
        async with db.acquire() as conn:
            await ledger.open_period(conn, PERIOD, WORKFLOW_ID)
    else:
        await _billed_then_renamed(db, "charged")
        await db.execute(
            "UPDATE billing_runs SET customer_id = 'c-2', idempotency_key = $1", _key("c-2")
        )
    with pytest.raises(CustomerImportError) as refused:
        await import_customers(db, [OLD_ID], while_running=True, reactivate=True)
    assert str(refused.value).startswith("1 inactive customer id would be made active")
    assert "'c-1' (cus_A, also c-2's)" in str(refused.value)
    assert "nothing was imported" in str(refused.value)
    # Given another Stripe customer, it still released the hold, which reads the old id's
    # Stripe customer as it is now (helper-144's F4).
    with pytest.raises(CustomerImportError, match="'c-1' \\(cus_A, also c-2's\\)"):
        await import_customers(
            db,
            [OLD_ID.model_copy(update={"stripe_customer_id": "cus_B"})],
            while_running=True,
            reactivate=True,
        )
    assert not await db.fetchval("SELECT active FROM customers WHERE customer_id = 'c-1'")
    # With c-2 deactivated, a file making c-1 active beside another id for cus_A is refused
    # as well: cus_A would be billed under each.
    await db.execute("UPDATE customers SET active = false WHERE customer_id = 'c-2'")
    other = OLD_ID.model_copy(update={"customer_id": "c-3"})
    with pytest.raises(CustomerImportError, match=r"'c-1' \(cus_A, also (c-2, )?c-3's\)"):
        await import_customers(db, [OLD_ID, other], while_running=True, reactivate=True)
    if charged_as == "new-id-run-completed":
        # c-2 charged cus_A in a period c-1 has no row of: c-1 would be due there, and
        # charge cus_A again, whatever c-2 is now.
        with pytest.raises(CustomerImportError, match="'c-1' \\(cus_A, also c-2's\\)"):
            await import_customers(db, [OLD_ID], while_running=True, reactivate=True)
        return
    await import_customers(db, [OLD_ID], while_running=True, reactivate=True)
    assert await db.fetchval("SELECT active FROM customers WHERE customer_id = 'c-1'")


async def test_a_price_changed_under_an_open_unsent_claim_is_named(db: asyncpg.Pool) -> None:
    """A claim keeps the price it was made with (each request with its key carries the
    same): an import repricing its customer while the claim waits (a paused run) was taken
    without a word, and the run charged the old price (helper-143's F3)."""
    await _a_customer(db)
    await open_period_by_hand(db, PERIOD)
    async with db.acquire() as conn:
        await ledger.claim(conn, "c-1", PERIOD, _key("c-1"), "run-1", charge_api="payment_intents")
    repriced = OLD_ID.model_copy(update={"amount_cents": 1000})
    [change] = await import_customers(db, [repriced], while_running=False, reactivate=True)
    assert (change.customer_id, change.was, change.becomes) == (
        "c-1",
        "claimed at usd 1.00, which the run charges unless skipped",
        "usd 10.00 from the next period",
    )
    assert await db.fetchval("SELECT amount_cents FROM customers") == 100
    # Imported all the same, the same file again changes nothing more to name (helper-144's
    # F5: it was refused as a change for as long as the claim waited).
    await import_customers(db, [repriced], while_running=True, reactivate=True)
    assert await import_customers(db, [repriced], while_running=False, reactivate=True) == []
    await db.execute("UPDATE customers SET amount_cents = 100")
    # Sent already, it is charged as it was sent: nothing for the operator to decide.
    await db.execute("UPDATE billing_runs SET charge_started_at = now()")
    assert await import_customers(db, [repriced], while_running=False, reactivate=True) == []
    assert await db.fetchval("SELECT amount_cents FROM customers") == 1000


async def test_deactivating_an_account_says_which_other_the_open_run_would_then_hold(
    db: asyncpg.Pool,
) -> None:
    """Two accounts on one Stripe customer, the first charged in the open run: deactivating
    it made the run take the second for it renamed and never bill it, without a word
    (helper-143's F4)."""
    await _billed_then_renamed(db, "charged", old_active=True)
    async with db.acquire() as conn:
        await ledger.open_period(conn, PERIOD, WORKFLOW_ID)
    refused = await deactivate_customers(db, ["c-1"], while_running=False)
    assert refused.deactivated == []
    assert [(h.period, h.customer_id, h.held_as) for h in refused.would_hold] == [
        (PERIOD, "c-2", "c-1")
    ]
    assert await _due(db) == ["c-1", "c-2"]
    done = await deactivate_customers(db, ["c-1"], while_running=True)
    assert done.deactivated == ["c-1"] and done.would_hold == refused.would_hold
    assert await _due(db) == ["c-1"]


@pytest.mark.parametrize("old_status", ["charged", "claimed"])
async def test_a_new_id_on_a_stripe_customer_the_run_billed_names_the_id_it_billed(
    db: asyncpg.Pool, old_status: str
) -> None:
    """A rename done in the wrong order (the new id imported while the old one, charged this
    period, is still active): the refusal named the new id as "new" only, and the warning
    that its Stripe customer has two ids came after the write (helper-143's F5)."""
    await _billed_then_renamed(db, old_status, old_active=True)
    await db.execute("DELETE FROM customers WHERE customer_id = 'c-2'")
    async with db.acquire() as conn:
        await ledger.open_period(conn, PERIOD, WORKFLOW_ID)
    renamed = OLD_ID.model_copy(update={"customer_id": "c-2"})
    [change] = await import_customers(db, [renamed], while_running=False, reactivate=True)
    assert change.was == (
        "new, on cus_A, which this run billed as c-1 (if renamed, deactivate c-1 first)"
    )
    assert await db.fetchval("SELECT count(*) FROM customers") == 1


@pytest.mark.parametrize("other", ["moved-in-the-same-file", "moved-then-deactivated"])
async def test_a_rename_undone_after_the_new_id_moved_is_refused(
    db: asyncpg.Pool, other: str
) -> None:
    """c-2 charged cus_A this period, then moved to cus_B (in the same file, or before, and
    deactivated since): c-1 brought back on cus_A was due with no row and held by nothing,
    cus_A charged twice (helper-145's F1, F2). The billed rows of a period that may still
    run count, not only what the other id is given now."""
    await _billed_then_renamed(db, "charged")
    await db.execute(
        "UPDATE billing_runs SET customer_id = 'c-2', idempotency_key = $1", _key("c-2")
    )
    async with db.acquire() as conn:
        await ledger.open_period(conn, PERIOD, WORKFLOW_ID)
    moved = OLD_ID.model_copy(update={"customer_id": "c-2", "stripe_customer_id": "cus_B"})
    if other == "moved-in-the-same-file":
        file = [OLD_ID, moved]
    else:
        await import_customers(db, [moved], while_running=True, reactivate=True)
        await db.execute("UPDATE customers SET active = false WHERE customer_id = 'c-2'")
        file = [OLD_ID]
    with pytest.raises(CustomerImportError, match="'c-1' \\(cus_A, also c-2's\\)"):
        await import_customers(db, file, while_running=True, reactivate=True)
    assert "c-1" not in await _due(db)


async def test_an_old_failed_row_does_not_refuse_bringing_an_id_back(db: asyncpg.Pool) -> None:
    """Only rows that charged or may charge count: a failed row of c-1's under a Stripe
    customer another id has now refused c-1 for good (helper-145's low finding)."""
    await _billed_then_renamed(db, "failed")
    await db.execute("DELETE FROM customers WHERE customer_id = 'c-2'")
    await db.execute("UPDATE customers SET stripe_customer_id = 'cus_C' WHERE customer_id = 'c-1'")
    await db.execute(
        "INSERT INTO customers (customer_id, stripe_customer_id, payment_method, amount_cents,"
        " currency) VALUES ('c-5', 'cus_A', 'pm_1', 100, 'usd')"
    )
    back = OLD_ID.model_copy(update={"stripe_customer_id": "cus_C"})
    await import_customers(db, [back], while_running=True, reactivate=True)
    assert await db.fetchval("SELECT active FROM customers WHERE customer_id = 'c-1'")


async def test_an_import_is_written_a_chunk_at_a_time_the_last_row_of_an_id_winning(
    db: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written row by row, a file of half a million customers outlasted the 30 s a call may
    take; each chunk is one statement now, in the one transaction."""
    monkeypatch.setattr(customers, "WRITE_CHUNK", 2)
    rows = [NEW.model_copy(update={"customer_id": f"c-{i}"}) for i in range(2, 7)]
    repriced = rows[0].model_copy(update={"amount_cents": 300})
    await import_customers(db, [*rows, repriced], while_running=False, reactivate=True)
    written = await db.fetch("SELECT customer_id, amount_cents FROM customers ORDER BY 1")
    assert [tuple(r) for r in written] == [
        ("c-2", 300),
        *((f"c-{i}", 250) for i in range(3, 7)),
    ]


async def test_an_import_writes_every_column_of_a_customer_already_there(db: asyncpg.Pool) -> None:
    """The run charges the Stripe customer, card, amount and currency the ledger holds: a
    column the update left as it was would charge the old card or in the old currency."""
    await _a_customer(db)
    moved = OLD_ID.model_copy(
        update={
            "stripe_customer_id": "cus_Z",
            "payment_method": "pm_9",
            "amount_cents": 300,
            "currency": "eur",
        }
    )
    assert await import_customers(db, [moved], while_running=False, reactivate=False) == []
    written = await db.fetchrow(
        "SELECT customer_id, stripe_customer_id, payment_method, amount_cents, currency, active"
        " FROM customers"
    )
    assert tuple(written) == ("c-1", "cus_Z", "pm_9", 300, "eur", True)


async def test_a_new_currency_at_the_same_amount_is_named_as_a_change_to_the_open_run(
    db: asyncpg.Pool,
) -> None:
    """A currency the run's plan did not count (no vault key for it) pauses the run: the
    same number of cents in another currency is a change, not the same price."""
    await _a_customer(db)
    await open_period_by_hand(db, PERIOD)
    in_eur = OLD_ID.model_copy(update={"currency": "eur"})
    [change] = await import_customers(db, [in_eur], while_running=False, reactivate=True)
    assert (change.customer_id, change.was, change.becomes) == ("c-1", "usd 1.00", "eur 1.00")
    assert await db.fetchval("SELECT currency FROM customers") == "usd"


@pytest.mark.parametrize(("started_days_ago", "refused"), [(1, True), (63, False)])
async def test_a_rename_undone_is_refused_while_the_period_the_new_id_billed_may_run_again(
    db: asyncpg.Pool, started_days_ago: int, refused: bool
) -> None:
    """c-2 (c-1 renamed) charged cus_A in a period whose run has ended: a rerun within
    RERUN_WINDOW would find c-1, brought back, due there with no row, and charge cus_A again."""
    await _billed_then_renamed(db, "charged")
    await db.execute(
        "UPDATE billing_runs SET customer_id = 'c-2', idempotency_key = $1", _key("c-2")
    )
    await db.execute("UPDATE customers SET active = false WHERE customer_id = 'c-2'")
    async with db.acquire() as conn:
        await ledger.finish_period(conn, PERIOD, "{}")
    await db.execute(
        "UPDATE billing_periods SET started_at = now() - make_interval(days => $1)",
        started_days_ago,
    )
    if refused:
        with pytest.raises(CustomerImportError, match="'c-1' \\(cus_A, also c-2's\\)"):
            await import_customers(db, [OLD_ID], while_running=False, reactivate=True)
    else:
        await import_customers(db, [OLD_ID], while_running=False, reactivate=True)
    assert (
        await db.fetchval("SELECT active FROM customers WHERE customer_id = 'c-1'") is not refused
    )


async def test_a_deactivation_waits_for_a_run_being_opened_then_sees_it_open(
    db: asyncpg.Pool,
) -> None:
    """One step to a run's opening, as an import is: checked apart, a deactivation would take
    a customer the run's plan (and its key's cap) had just counted, without a word, and the
    run would report it failed."""
    await _a_customer(db)
    async with db.acquire() as conn, conn.transaction():
        await conn.execute(ledger.OPENING_LOCK)
        plan = await ledger.plan_period(conn, PERIOD)
        deactivating = asyncio.create_task(deactivate_customers(db, ["c-1"], while_running=False))
        await eventually(lambda: waits_on_a_lock(db, None, deactivating))
        await ledger.start_period(conn, plan, WORKFLOW_ID)
    done = await deactivating
    assert (done.deactivated, [b.customer_id for b in done.still_billable]) == ([], ["c-1"])
    assert await db.fetchval("SELECT active FROM customers")

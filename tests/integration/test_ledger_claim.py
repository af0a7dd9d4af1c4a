"""`ledger.claim` on the real ledger: every path a retry, a second run or a deactivation takes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import timedelta

import asyncpg
import pytest

from billing import ledger
from billing.errors import LedgerConflictError, PeriodNotOpenError, UnknownCustomerError
from billing.keys import idempotency_key
from billing.ledger import claims
from billing.ledger.sql import LOOKUP_REFUSED
from billing.models import ChargeFailure, ChargeResult, Claim, SkipResult
from billing.periods import Period
from tests.integration.harness import Harness
from tests.waiting import eventually, waits_on_a_lock

PERIOD = "2026-12"


@pytest.fixture(autouse=True)
async def period_open(harness: Harness) -> None:
    """A claim is made only in a period a run has open (ledger.claim)."""
    await harness.open_period_by_hand(PERIOD)


def key(customer_id: str, namespace: str = "test") -> str:
    return idempotency_key(namespace, customer_id, Period(2026, 12))


async def record_charged(conn: asyncpg.Connection, claim: Claim, number: int = 1) -> None:
    """The claim's charge (ch_1, or ch_`number`) recorded: the claim is finished."""
    result = ChargeResult(
        charge_id=f"ch_{number}",
        payment_intent_id=f"pi_{number}",
        amount_cents=claim.amount_cents,
        currency=claim.currency,
    )
    await ledger.record_charge(conn, claim.idempotency_key, result)


async def test_a_claim_is_inserted_once_and_the_last_run_owns_it_while_open(
    harness: Harness,
) -> None:
    (customer,) = await harness.seed(1)
    first_key = key(customer.customer_id)
    async with harness.pool.acquire() as conn:
        first = await ledger.claim(
            conn, customer.customer_id, PERIOD, first_key, "run-1", charge_api="payment_intents"
        )
        # Another run's claim of the open row, even with another key (a namespace changed).
        other_key = key(customer.customer_id, "other")
        # A worker set to another API since: the claim keeps the one it was made with.
        second = await ledger.claim(
            conn, customer.customer_id, PERIOD, other_key, "run-2", charge_api="charges"
        )
        unowned = await ledger.claim(
            conn, customer.customer_id, PERIOD, first_key, charge_api="payment_intents"
        )
    assert (first.status, first.claimed_by_run) == ("claimed", "run-1")
    assert first.idempotency_key == first_key
    assert (first.amount_cents, first.currency) == (customer.amount_cents, customer.currency)
    assert (second.claimed_by_run, second.idempotency_key) == ("run-2", first_key)
    assert first.charge_api == second.charge_api == "payment_intents"
    assert second.claimed_at == first.claimed_at
    # No run given (a script, the baseline): the row is read, its owner kept.
    assert unowned.claimed_by_run == "run-2"
    assert len(await harness.ledger_rows(PERIOD)) == 1


async def test_a_claim_is_made_only_while_a_run_has_its_period_open(harness: Harness) -> None:
    """A new claim needs a run of its period open (not one never opened, nor one completed);
    a claim already open goes on to its charge whatever the period's run does since (a
    terminated child's claim that reconciliation re-drives after the run completed)."""
    first, second = (c.customer_id for c in await harness.seed(2))

    async def claim(customer_id: str, period: str, run: str) -> Claim:
        return await ledger.claim(
            conn, customer_id, period, key(customer_id), run, charge_api="payment_intents"
        )

    async with harness.pool.acquire() as conn:
        with pytest.raises(PeriodNotOpenError, match="no run of 2027-01 is open"):
            await claim(first, "2027-01", "run-1")
        opened = await claim(first, PERIOD, "run-1")
        await ledger.finish_period(conn, PERIOD, "{}")
        with pytest.raises(PeriodNotOpenError, match=f"no run of {PERIOD} is open"):
            await claim(second, PERIOD, "run-1")
        again = await claim(first, PERIOD, "run-2")
    assert (again.status, again.claimed_by_run) == ("claimed", "run-2")
    assert again.idempotency_key == opened.idempotency_key
    assert [r["customer_id"] for r in await harness.ledger_rows(PERIOD)] == [first]
    assert await harness.ledger_rows("2027-01") == []


async def test_a_finished_claim_is_returned_as_it_is(harness: Harness) -> None:
    (customer,) = await harness.seed(1)
    claim_key = key(customer.customer_id)
    async with harness.pool.acquire() as conn:
        claim = await ledger.claim(
            conn, customer.customer_id, PERIOD, claim_key, "run-1", charge_api="payment_intents"
        )
        await ledger.record_charge(
            conn,
            claim_key,
            ChargeResult(
                charge_id="ch_1",
                payment_intent_id="pi_1",
                amount_cents=claim.amount_cents,
                currency=claim.currency,
            ),
        )
        again = await ledger.claim(
            conn, customer.customer_id, PERIOD, claim_key, "run-2", charge_api="payment_intents"
        )
    assert (again.status, again.charge_id, again.claimed_by_run) == ("charged", "ch_1", "run-1")


async def test_a_customer_deactivated_after_its_claim_keeps_it(harness: Harness) -> None:
    kept_id, gone_id = (c.customer_id for c in await harness.seed(2))
    async with harness.pool.acquire() as conn:
        await ledger.claim(
            conn, kept_id, PERIOD, key(kept_id), "run-1", charge_api="payment_intents"
        )
        await conn.execute("UPDATE customers SET active = false")
        kept = await ledger.claim(
            conn, kept_id, PERIOD, key(kept_id), "run-2", charge_api="payment_intents"
        )
        with pytest.raises(UnknownCustomerError, match="inactive; nothing was charged"):
            await ledger.claim(
                conn, gone_id, PERIOD, key(gone_id), "run-2", charge_api="payment_intents"
            )
    # The open claim is charged all the same, so the run that charges it owns it: a retry of
    # its workflow task after the record counts the charge as its own, not already billed.
    assert (kept.status, kept.claimed_by_run) == ("claimed", "run-2")
    assert len(await harness.ledger_rows(PERIOD)) == 1


async def test_a_temporal_stop_writes_a_row_only_where_a_claim_could_be_made(
    harness: Harness,
) -> None:
    """A Temporal cancel's stop of a deactivated customer with no row writes nothing, as
    its claim makes nothing: it wrote the customer skipped, so a bill that had answered
    "not billed" a moment before ended failed beside a skipped row. An open claim of a
    customer deactivated since is still stopped at the gate, and an operator's skip still
    writes any customer skipped."""
    claimed_id, unclaimed_id, skipped_id = (c.customer_id for c in await harness.seed(3))
    async with harness.pool.acquire() as conn:
        await ledger.claim(
            conn, claimed_id, PERIOD, key(claimed_id), "run-1", charge_api="payment_intents"
        )
        await conn.execute("UPDATE customers SET active = false")

        def stop(customer_id: str, *, by_temporal: bool = True) -> Awaitable[SkipResult]:
            return ledger.request_skip(
                conn,
                customer_id,
                PERIOD,
                key(customer_id),
                "cancelled",
                "temporal",
                stop=by_temporal,
            )

        assert (await stop(claimed_id)).skipped
        with pytest.raises(UnknownCustomerError, match="not in the ledger"):
            await stop(unclaimed_id)
        assert (await stop(skipped_id, by_temporal=False)).skipped
    rows = {r["customer_id"]: r["status"] for r in await harness.ledger_rows(PERIOD)}
    # The claim stays open until its gate, which ends it skipped.
    assert rows == {claimed_id: "claimed", skipped_id: "skipped"}
    gated = await harness.pool.fetchval(
        "SELECT skip_reason FROM billing_runs WHERE customer_id = $1", claimed_id
    )
    assert gated == "cancelled"


async def test_a_row_without_an_api_takes_the_claims_unless_it_was_sent(harness: Harness) -> None:
    unsent, sent = await harness.seed(2)
    async with harness.pool.acquire() as conn:
        # Two rows claimed before the API was recorded, one of them sent.
        for customer in (unsent, sent):
            await ledger.claim(
                conn,
                customer.customer_id,
                PERIOD,
                key(customer.customer_id),
                "run-1",
                charge_api="charges",
            )
        await conn.execute("UPDATE billing_runs SET charge_api = NULL")
        await conn.execute(
            "UPDATE billing_runs SET charge_started_at = now() WHERE customer_id = $1",
            sent.customer_id,
        )
        taken = await ledger.claim(
            conn,
            unsent.customer_id,
            PERIOD,
            key(unsent.customer_id),
            "run-2",
            charge_api="payment_intents",
        )
        kept = await ledger.claim(
            conn,
            sent.customer_id,
            PERIOD,
            key(sent.customer_id),
            "run-2",
            charge_api="payment_intents",
        )
    assert taken.charge_api == "payment_intents"
    # It may have reached Stripe under a setting nobody recorded: the worker's setting decides.
    assert kept.charge_api is None


async def never_started(harness: Harness) -> str:
    """A customer a cancelled run never started: its row written cancelled by the cancel."""
    (customer,) = await harness.seed(1)
    customer_id = customer.customer_id
    async with harness.pool.acquire() as conn:
        await ledger.cancel_customers(conn, PERIOD, {customer_id: key(customer_id)}, "r", "alice")
    return customer_id


async def test_a_customer_a_cancelled_run_never_started_is_claimed_afresh_once_active(
    harness: Harness,
) -> None:
    customer_id = await never_started(harness)
    async with harness.pool.acquire() as conn:
        await conn.execute(
            "UPDATE customers SET active = false WHERE customer_id = $1", customer_id
        )
        # Inactive at the next run's start: not due, and its row stays cancelled.
        await ledger.start_period(conn, await ledger.plan_period(conn, PERIOD), "wf")
        assert (await ledger.plan_period(conn, PERIOD)).due == 0
        # Active again during that run, at a new price, in another currency, with another
        # card (on a Stripe customer made anew), a day after the cancel: listed as if it
        # had no row...
        await conn.execute(
            """UPDATE customers SET active = true, amount_cents = 4321, currency = 'eur',
               stripe_customer_id = 'cus_new', payment_method = 'pm_new'
               WHERE customer_id = $1""",
            customer_id,
        )
        await conn.execute("UPDATE billing_runs SET claimed_at = claimed_at - interval '1 day'")
        page = await ledger.due_page(conn, PERIOD, None, 10)
        assert [(c.customer_id, c.status) for c in page.customers] == [(customer_id, None)]
        # ...and its child's claim takes the row over, as the customer is now.
        claim = await ledger.claim(
            conn, customer_id, PERIOD, key(customer_id), "run-2", charge_api="charges"
        )
        assert (claim.status, claim.amount_cents, claim.claimed_by_run) == (
            "claimed",
            4321,
            "run-2",
        )
        # Charged as the customer is now, on its card of now; its key's age (what the bill
        # reckons Stripe's memory of it by) runs from this claim, not from the cancel.
        assert (claim.currency, claim.stripe_customer_id, claim.payment_method) == (
            "eur",
            "cus_new",
            "pm_new",
        )
        assert claim.claimed_ago is not None and claim.claimed_ago < timedelta(hours=1)
        assert claim.charge_api == "charges"
        assert (await ledger.begin_charge(conn, claim, None)).gate == "go"
    [row] = await harness.ledger_rows(PERIOD)
    assert (row["cancelled_before_start"], row["reason"], row["completed_at"]) == (
        False,
        None,
        None,
    )


async def test_a_run_awaiting_a_child_does_not_take_a_never_started_row_for_its_outcome(
    harness: Harness,
) -> None:
    customer_id = await never_started(harness)
    async with harness.pool.acquire() as conn:
        # A cancel page counts it cancelled; a run awaiting its child (started elsewhere, not
        # yet claimed) waits, since that child will take the row over.
        [cancelled] = await ledger.outcomes(conn, PERIOD, [customer_id])
        assert cancelled.outcome == "cancelled"
        assert await ledger.outcomes(conn, PERIOD, [customer_id], awaited=True) == []
        assert await ledger.without_rows(conn, PERIOD, [customer_id]) == [customer_id]
        claim = await ledger.claim(
            conn, customer_id, PERIOD, key(customer_id), "run-2", charge_api="payment_intents"
        )
        await ledger.record_charge(
            conn,
            claim.idempotency_key,
            ChargeResult(
                charge_id="ch_1", payment_intent_id="pi_1", amount_cents=1, currency="usd"
            ),
        )
        [charged] = await ledger.outcomes(conn, PERIOD, [customer_id], awaited=True)
        # A run that did not await the child counts the charge as billed already, not its
        # own: its summary would count one charge twice.
        [seen] = await ledger.outcomes(conn, PERIOD, [customer_id])
    assert charged.outcome == "charged"
    assert seen.outcome == "already_billed"


async def test_a_claim_waits_for_an_ended_runs_cancel_and_leaves_its_row_to_the_next_run(
    harness: Harness,
) -> None:
    """A child an ended run left running claims while an operator's cancel of that run
    (operations.cancel_ended_run) holds the period: it waits for the cancel, and finds the
    period closed. Read from the claim's snapshot, the period was open, and the claim took
    over the row the cancel wrote for the next run; the gate then stopped it cancelled, no
    longer never-started, and no later run billed the customer."""
    (customer,) = await harness.seed(1)
    customer_id = customer.customer_id

    async def claim(conn: asyncpg.Connection, run: str) -> Claim:
        return await ledger.claim(
            conn, customer_id, PERIOD, key(customer_id), run, charge_api="payment_intents"
        )

    async with harness.pool.acquire() as cancelling, harness.pool.acquire() as claiming:
        async with cancelling.transaction():
            await ledger.lock_period(cancelling, PERIOD)
            await ledger.set_control(cancelling, PERIOD, "cancelled", "ended", "alice")
            await ledger.cancel_customers(
                cancelling, PERIOD, {customer_id: key(customer_id)}, "ended", "alice"
            )
            await ledger.finish_period(cancelling, PERIOD, "{}")
            claimed = asyncio.create_task(claim(claiming, "run-1"))
            await eventually(lambda: waits_on_a_lock(harness.pool, claiming, claimed))
        stopped = await claimed
        [row] = await harness.ledger_rows(PERIOD)
        assert (stopped.status, row["cancelled_before_start"]) == ("cancelled", True)
        # The next run claims it afresh.
        await ledger.open_period(claiming, PERIOD, "wf-2")
        again = await claim(claiming, "run-2")
    assert (again.status, again.claimed_by_run) == ("claimed", "run-2")


@pytest.mark.parametrize("reached", [True, False], ids=["page-reached-it", "before-its-page"])
async def test_a_claim_after_a_runs_cancel_leaves_the_customer_to_the_next_run(
    harness: Harness, reached: bool
) -> None:
    """A run's cancel is recorded, then its pages write the customers past its cursor never
    started, the period open while its children finish. A child an earlier run left running
    (or one the run started again for it) claiming then took such a row over (helper-180), or,
    before the page reached its customer, made a new claim (helper-181); the gate stopped
    either cancelled for good, and no later run billed the customer. Its claim now leaves it
    never started, as the cancel's page does."""
    (customer,) = await harness.seed(1)
    customer_id = customer.customer_id
    async with harness.pool.acquire() as conn:
        await ledger.set_control(conn, PERIOD, "cancelled", "wrong prices", "alice")
        if reached:
            await ledger.cancel_customers(
                conn, PERIOD, {customer_id: key(customer_id)}, "wrong prices", "alice"
            )
        stopped = await ledger.claim(
            conn, customer_id, PERIOD, key(customer_id), "run-1", charge_api="payment_intents"
        )
        [row] = await harness.ledger_rows(PERIOD)
        assert (stopped.status, row["cancelled_before_start"]) == ("cancelled", True)
        assert (row["reason"], row["decided_by"]) == ("wrong prices", "alice")
        await ledger.finish_period(conn, PERIOD, "{}")
        await ledger.open_period(conn, PERIOD, "wf-2")
        again = await ledger.claim(
            conn, customer_id, PERIOD, key(customer_id), "run-2", charge_api="payment_intents"
        )
    assert (again.status, again.claimed_by_run) == ("claimed", "run-2")


async def test_a_claim_left_to_the_next_run_leaves_that_runs_own_claim_alone(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stale attempt of a bill reads its run cancelled; before it writes the customer never
    started, the run closes and a rerun claims the customer. Written so by a statement that
    updated an open claim, it cancelled the rerun's claim for good (helper-182)."""
    (customer,) = await harness.seed(1)
    customer_id = customer.customer_id
    refuse_held = claims._refuse_held

    async def rerun_claims_meanwhile(
        conn: asyncpg.Connection, customer_id: str, period: str, key: str
    ) -> bool:
        claimable = await refuse_held(conn, customer_id, period, key)
        async with harness.pool.acquire() as other:
            await ledger.finish_period(other, PERIOD, "{}")
            await ledger.open_period(other, PERIOD, "wf-2")
            await ledger.claim(other, customer_id, PERIOD, key, "run-2", charge_api="charges")
        return claimable

    async with harness.pool.acquire() as conn:
        await ledger.set_control(conn, PERIOD, "cancelled", "wrong prices", "alice")
        monkeypatch.setattr(claims, "_refuse_held", rerun_claims_meanwhile)
        stale = await ledger.claim(
            conn, customer_id, PERIOD, key(customer_id), "run-1", charge_api="charges"
        )
    [row] = await harness.ledger_rows(PERIOD)
    assert (row["status"], row["claimed_by_run"]) == ("claimed", "run-2")
    assert stale.status == "claimed"


@pytest.mark.parametrize(
    ("without_row", "listed"),
    [(False, [[0, 1], [2, 3], [4]]), (True, [[0, 3], [4]])],
    ids=["every-due", "without-row"],
)
async def test_pages_of_due_customers_carry_each_row_past_the_cursor(
    harness: Harness, without_row: bool, listed: list[list[int]]
) -> None:
    """`without_row`: what a run's close lists (customers no run has claimed), whose
    children it starts; one with a row is its child's already."""
    customers = sorted(c.customer_id for c in await harness.seed(5))
    async with harness.pool.acquire() as conn:
        for customer_id in customers[1:3]:
            await ledger.claim(
                conn, customer_id, PERIOD, key(customer_id), "run-1", charge_api="charges"
            )
        pages = []
        after = None
        while True:
            page = await ledger.due_page(conn, PERIOD, after, 2, without_row=without_row)
            pages.append([(c.customer_id, c.status) for c in page.customers])
            if page.next_cursor is None:
                break
            after = page.next_cursor
        # What a run ended before its close left to no run (activities.reconcile).
        assert await ledger.unclaimed_due(conn, PERIOD) == 3
    status = {c: "claimed" for c in customers[1:3]}
    assert pages == [[(customers[i], status.get(customers[i])) for i in ids] for ids in listed]


async def test_a_different_charge_is_never_recorded_over_a_claims_charge(
    harness: Harness,
) -> None:
    """The same charge recorded twice (a retry, reconciliation) is a no-op; another charge
    for the same claim (one Stripe made after it forgot the key) is refused loudly, not
    taken for a repeat: the customer was charged twice, and someone must refund one."""
    (customer,) = await harness.seed(1)
    claim_key = key(customer.customer_id)

    def charge(charge_id: str) -> ChargeResult:
        return ChargeResult(
            charge_id=charge_id,
            payment_intent_id=f"pi_{charge_id}",
            amount_cents=customer.amount_cents,
            currency=customer.currency,
        )

    async with harness.pool.acquire() as conn:
        await ledger.claim(
            conn, customer.customer_id, PERIOD, claim_key, "run-1", charge_api="payment_intents"
        )
        assert await ledger.record_charge(conn, claim_key, charge("ch_1"))
        assert not await ledger.record_charge(conn, claim_key, charge("ch_1"))
        with pytest.raises(LedgerConflictError, match="already charged"):
            await ledger.record_charge(conn, claim_key, charge("ch_2"))
        declined = ChargeFailure(code="card_declined", message="declined")
        with pytest.raises(LedgerConflictError, match="already charged"):
            await ledger.record_unbilled(conn, claim_key, "failed", declined)
    [row] = await harness.ledger_rows(PERIOD)
    assert (row["status"], row["charge_id"]) == ("charged", "ch_1")


@pytest.mark.parametrize("code", ["card_declined", LOOKUP_REFUSED])
async def test_a_failed_claim_is_returned_failed_not_claimed_again(
    harness: Harness, code: str
) -> None:
    """A later run's claim of a customer whose charge failed this period finds it failed and
    charges nothing: one recorded failed for a refused lookup may have charged, and a
    declined card is not retried by a rerun of the same period."""
    (customer,) = await harness.seed(1)
    claim_key = key(customer.customer_id)
    async with harness.pool.acquire() as conn:
        await ledger.claim(
            conn, customer.customer_id, PERIOD, claim_key, "run-1", charge_api="payment_intents"
        )
        failure = ChargeFailure(code=code, message="refused")
        await ledger.record_unbilled(conn, claim_key, "failed", failure)
        again = await ledger.claim(
            conn, customer.customer_id, PERIOD, claim_key, "run-2", charge_api="payment_intents"
        )
    assert (again.status, again.failure_code, again.claimed_by_run) == ("failed", code, "run-1")


async def test_a_customer_a_cancelled_run_never_started_is_not_claimed_while_inactive(
    harness: Harness,
) -> None:
    """Only an open claim is taken over whatever its customer is now: a row a cancelled run
    never started is left as it is while its customer is inactive (a stale child's claim),
    for a run that finds the customer active again."""
    customer_id = await never_started(harness)
    async with harness.pool.acquire() as conn:
        await conn.execute(
            "UPDATE customers SET active = false WHERE customer_id = $1", customer_id
        )
        found = await ledger.claim(
            conn, customer_id, PERIOD, key(customer_id), "run-2", charge_api="charges"
        )
    assert found.status == "cancelled"
    [row] = await harness.ledger_rows(PERIOD)
    assert (row["status"], row["cancelled_before_start"]) == ("cancelled", True)


async def test_an_inactive_customer_is_unknown_to_a_claim_once_its_run_has_closed(
    harness: Harness,
) -> None:
    """A stale child of a closed run, for a customer deactivated since, ends 'not billed'
    (UnknownCustomerError, an outcome), as while its run was open: PeriodNotOpenError, for
    a workflow started outside any run, would fail its workflow."""
    (customer,) = await harness.seed(1)
    customer_id = customer.customer_id
    async with harness.pool.acquire() as conn:
        await ledger.finish_period(conn, PERIOD, "{}")
        await conn.execute(
            "UPDATE customers SET active = false WHERE customer_id = $1", customer_id
        )
        with pytest.raises(UnknownCustomerError, match="inactive; nothing was charged"):
            await ledger.claim(
                conn, customer_id, PERIOD, key(customer_id), "run-1", charge_api="charges"
            )


async def test_a_claim_of_another_period_is_no_row_of_this_one(harness: Harness) -> None:
    """A run starts again the child of a customer without a row of its period
    (ledger.without_rows): last period's claim does not count, or no run bills it. Nor does
    it let a Temporal stop write the customer, deactivated since, skipped (helper-226's B06):
    the row would keep it unbilled once active again."""
    (customer,) = await harness.seed(1)
    customer_id = customer.customer_id
    await harness.open_period_by_hand("2026-11")
    async with harness.pool.acquire() as conn:
        last_key = idempotency_key("test", customer_id, Period(2026, 11))
        await ledger.claim(conn, customer_id, "2026-11", last_key, "run-0", charge_api="charges")
        assert await ledger.without_rows(conn, PERIOD, [customer_id]) == [customer_id]
        await conn.execute(
            "UPDATE customers SET active = false WHERE customer_id = $1", customer_id
        )
        with pytest.raises(UnknownCustomerError, match="not in the ledger"):
            await ledger.request_skip(
                conn, customer_id, PERIOD, key(customer_id), "cancelled", "temporal", stop=True
            )
    assert await harness.ledger_rows(PERIOD) == []


async def test_a_claim_waiting_on_a_cancels_page_leaves_the_row_it_writes_to_the_next_run(
    harness: Harness,
) -> None:
    """The run is cancelled; its page is writing an open claim no run owned never started
    (uncommitted) as a child claims it. The claim waits for that row, and reads it as it is
    now: never started, in a cancelled run, so left to the next run. Taken over, it stopped
    cancelled at the gate for good, and no later run billed the customer."""
    (customer,) = await harness.seed(1)
    customer_id = customer.customer_id
    async with harness.pool.acquire() as cancelling, harness.pool.acquire() as claiming:
        # Claimed by no run (a script's claim, one from before runs were recorded).
        await ledger.claim(
            claiming, customer_id, PERIOD, key(customer_id), charge_api="payment_intents"
        )
        await ledger.set_control(claiming, PERIOD, "cancelled", "wrong prices", "alice")
        async with cancelling.transaction():
            await ledger.cancel_customers(
                cancelling, PERIOD, {customer_id: key(customer_id)}, "wrong prices", "alice"
            )
            claimed = asyncio.create_task(
                ledger.claim(
                    claiming,
                    customer_id,
                    PERIOD,
                    key(customer_id),
                    "run-1",
                    charge_api="payment_intents",
                )
            )
            await eventually(lambda: waits_on_a_lock(harness.pool, claiming, claimed))
        stopped = await claimed
    [row] = await harness.ledger_rows(PERIOD)
    assert (stopped.status, row["cancelled_before_start"]) == ("cancelled", True)
    assert row["claimed_by_run"] is None


async def test_a_failed_charge_keeps_its_payment_intent(harness: Harness) -> None:
    """A PaymentIntent Stripe left unconfirmed may yet complete until someone cancels it:
    its failed row must name it, for reconciliation and support to find."""
    (customer,) = await harness.seed(1)
    claim_key = key(customer.customer_id)
    async with harness.pool.acquire() as conn:
        await ledger.claim(
            conn, customer.customer_id, PERIOD, claim_key, "run-1", charge_api="payment_intents"
        )
        failure = ChargeFailure(
            code="authentication_required",
            decline_code="authentication_required",
            message="needs 3DS",
            payment_intent_id="pi_open",
        )
        await ledger.record_unbilled(conn, claim_key, "failed", failure)
    [row] = await harness.ledger_rows(PERIOD)
    assert (row["status"], row["failure_code"], row["payment_intent_id"]) == (
        "failed",
        "authentication_required",
        "pi_open",
    )


async def test_the_periods_totals_count_rows_across_currencies_and_sum_only_charges(
    harness: Harness,
) -> None:
    """What the close of an ended run (operations.cancel_ended_run) writes as its summary:
    every row counted whatever its currency, and only charged rows in the money charged."""
    customers = [c.customer_id for c in await harness.seed(3)]
    async with harness.pool.acquire() as conn:
        for customer_id, currency in zip(customers, ["usd", "eur", "jpy"], strict=True):
            await conn.execute(
                "UPDATE customers SET currency = $2 WHERE customer_id = $1", customer_id, currency
            )
        usd, eur, declined = [
            await ledger.claim(
                conn, customer_id, PERIOD, key(customer_id), "run-1", charge_api="payment_intents"
            )
            for customer_id in customers
        ]
        for n, charged in enumerate([usd, eur], start=1):
            await record_charged(conn, charged, n)
        failure = ChargeFailure(code="card_declined", message="declined")
        await ledger.record_unbilled(conn, declined.idempotency_key, "failed", failure)
        totals = await ledger.period_totals(conn, PERIOD)
    assert (totals.charged, totals.failed, totals.claimed) == (2, 1, 0)
    assert totals.charged_by_currency == {"usd": usd.amount_cents, "eur": eur.amount_cents}


async def test_a_temporal_stop_after_the_runs_close_writes_no_row(harness: Harness) -> None:
    """A stray customer workflow cancelled once its period's run has closed must not write
    the customer skipped: the next run of the period would then leave it unbilled."""
    (customer,) = await harness.seed(1)
    async with harness.pool.acquire() as conn:
        await ledger.finish_period(conn, PERIOD, "{}")
        with pytest.raises(UnknownCustomerError, match="not in the ledger"):
            await ledger.request_skip(
                conn,
                customer.customer_id,
                PERIOD,
                key(customer.customer_id),
                "cancelled",
                "temporal",
                stop=True,
            )
    assert await harness.ledger_rows(PERIOD) == []


async def test_a_stop_keeps_an_operators_skip_and_a_later_operators_skip_replaces_it(
    harness: Harness,
) -> None:
    """Who skipped a claim and why is the operator's: a Temporal stop landing after it keeps
    it, and another operator's skip since is the one recorded."""
    (customer,) = await harness.seed(1)
    customer_id = customer.customer_id
    async with harness.pool.acquire() as conn:
        await ledger.claim(
            conn, customer_id, PERIOD, key(customer_id), "run-1", charge_api="payment_intents"
        )

        async def skip(reason: str, operator: str, *, stop: bool = False) -> tuple[str, str]:
            result = await ledger.request_skip(
                conn, customer_id, PERIOD, key(customer_id), reason, operator, stop=stop
            )
            assert result.skipped, result.detail
            row = await conn.fetchrow(
                "SELECT skip_reason, skip_by FROM billing_runs WHERE customer_id = $1",
                customer_id,
            )
            return row["skip_reason"], row["skip_by"]

        assert await skip("disputed", "alice") == ("disputed", "alice")
        assert await skip("cancelled", "temporal", stop=True) == ("disputed", "alice")
        assert await skip("duplicate account", "bob") == ("duplicate account", "bob")


@pytest.mark.parametrize(
    ("stop", "row"),
    [(False, ("skipped", "disputed", "carol", False)), (True, ("cancelled", "r", "alice", True))],
    ids=["operators-skip", "temporal-stop"],
)
async def test_a_customer_a_cancelled_run_never_started_is_skipped_by_an_operator_not_a_stop(
    harness: Harness, stop: bool, row: tuple[str, str, str, bool]
) -> None:
    """An operator's skip ends the row the cancel wrote skipped, for the skip's reason and
    operator, not the cancel's (an auditor reads them as why the customer was not billed). A
    Temporal stop (a stray workflow cancelled) leaves it to the next run, which claims it
    afresh: skipped, the customer would go unbilled."""
    customer_id = await never_started(harness)
    async with harness.pool.acquire() as conn:
        result = await ledger.request_skip(
            conn, customer_id, PERIOD, key(customer_id), "disputed", "carol", stop=stop
        )
    assert result.skipped is not stop, result.detail
    [written] = await harness.ledger_rows(PERIOD)
    columns = ("status", "reason", "decided_by", "cancelled_before_start")
    assert tuple(written[c] for c in columns) == row


async def test_a_cancel_of_a_claim_a_runs_child_made_leaves_it_to_that_child_not_the_next_run(
    harness: Harness,
) -> None:
    """The claim of a terminated run's child, still running, keeps that child's workflow ID,
    which a later run cannot start again: cancelled, its row is not one the next run bills
    afresh."""
    (customer,) = await harness.seed(1)
    customer_id = customer.customer_id
    async with harness.pool.acquire() as conn:
        await ledger.claim(
            conn, customer_id, PERIOD, key(customer_id), "run-1", charge_api="payment_intents"
        )
        await ledger.cancel_customers(conn, PERIOD, {customer_id: key(customer_id)}, "r", "alice")
        page = await ledger.due_page(conn, PERIOD, None, 10)
    assert [(c.customer_id, c.status) for c in page.customers] == [(customer_id, "cancelled")]


@pytest.mark.parametrize("since", ["sent", "skipped"])
async def test_a_cancel_leaves_alone_a_row_that_is_no_longer_unstarted(
    harness: Harness, since: str
) -> None:
    """A cancel's page lists the customers not started; one whose charge went out since (it
    may be in Stripe) or that an operator skipped since (a cancel reopening it for the next
    run would bill it) keeps its row as it is."""
    (customer,) = await harness.seed(1)
    customer_id = customer.customer_id
    async with harness.pool.acquire() as conn:
        if since == "sent":
            claim = await ledger.claim(
                conn, customer_id, PERIOD, key(customer_id), "run-1", charge_api="payment_intents"
            )
            assert (await ledger.begin_charge(conn, claim, ledger.SENT_DIRECT)).gate == "go"
        else:
            await ledger.request_skip(conn, customer_id, PERIOD, key(customer_id), "no", "carol")
        [before] = await harness.ledger_rows(PERIOD)
        await ledger.cancel_customers(conn, PERIOD, {customer_id: key(customer_id)}, "r", "alice")
    [after] = await harness.ledger_rows(PERIOD)
    assert dict(after) == dict(before)


async def test_a_cancels_page_cancels_every_customer_not_started_under_its_stable_key(
    harness: Harness,
) -> None:
    """The cancel of an ended run (operations.cancel_ended_run) leaves no claim open (I2), and
    the rows it writes carry each customer's one key of the period (I3), which the next run's
    claim keeps."""
    claimed_id, unrowed_id = sorted(c.customer_id for c in await harness.seed(2))
    async with harness.pool.acquire() as conn:
        await ledger.claim(
            conn, claimed_id, PERIOD, key(claimed_id), "run-1", charge_api="payment_intents"
        )
        _, unstarted = await ledger.cancel_unstarted_page(
            conn, PERIOD, None, 10, "test", "wrong prices", "alice"
        )
    assert unstarted == [claimed_id, unrowed_id]
    rows = {
        r["customer_id"]: (r["status"], r["idempotency_key"])
        for r in await harness.ledger_rows(PERIOD)
    }
    assert rows == {c: ("cancelled", key(c)) for c in unstarted}


async def test_a_plan_counts_an_open_claim_at_what_it_claimed_not_the_price_of_now(
    harness: Harness,
) -> None:
    """A claim fixes the amount and currency its attempts send: a rerun's plan, and the caps
    of the keys it issues from it, and the preview, show those, whatever the customer's price
    is now. A currency whose customers are all charged needs no key."""
    customer_id, charged_id = (c.customer_id for c in await harness.seed(2))
    async with harness.pool.acquire() as conn:
        await conn.execute(
            "UPDATE customers SET currency = 'jpy' WHERE customer_id = $1", charged_id
        )
        claim, charged = [
            await ledger.claim(conn, c, PERIOD, key(c), "run-1", charge_api="payment_intents")
            for c in (customer_id, charged_id)
        ]
        await record_charged(conn, charged)
        await conn.execute(
            "UPDATE customers SET amount_cents = amount_cents + 500, currency = 'eur',"
            " stripe_customer_id = 'cus_new' WHERE customer_id = $1",
            customer_id,
        )
        plan = await ledger.plan_period(conn, PERIOD)
        unsent = await ledger.unsent_totals(conn, PERIOD)
        preview = await ledger.preview_lines(conn, PERIOD)
    claimed = {claim.currency: claim.amount_cents}
    assert (plan.due, plan.to_charge, plan.totals_by_currency, unsent) == (2, 1, claimed, claimed)
    # The Stripe customer too: a preview naming the customer's new one, which its claim does
    # not charge, would hide a charge from whoever checks it.
    assert {
        line.customer_id: (line.amount_cents, line.currency, line.stripe_customer_id, line.open)
        for line in preview
    } == {
        c.customer_id: (c.amount_cents, c.currency, c.stripe_customer_id, c is claim)
        for c in (claim, charged)
    }

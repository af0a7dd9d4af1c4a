"""`customers show` and `failures`: what support reads, from the ledger a real run wrote."""

from __future__ import annotations

from billing import ledger
from billing.customer_history import CustomerHistory, PeriodWithoutRow
from billing.customers import CustomerRow, upsert_customers
from billing.failures import CUSTOMERS_NAMED, PeriodFailures, period_failures
from billing.keys import customer_workflow_id, idempotency_key
from billing.models import ChargeFailure, ChargeResult
from billing.money import describe_amount
from billing.periods import Period
from billing.runs import start_period
from tests.integration.harness import Harness
from tests.integration.test_billing_period import declines_third

PERIOD = Period(2026, 12)


async def test_a_customer_shows_each_period_charged_failed_or_skipped(harness: Harness) -> None:
    customers = await harness.seed(3, card_for=declines_third)
    paid, declined = customers[0], customers[2]
    # Recorded before its period's run: the row says who asked, and why.
    code, _, err = await harness.starter(
        "skip", str(PERIOD.next()), paid.customer_id, "--reason", "moved out", "--operator", "ann"
    )
    assert code == 0, err
    async with harness.running_worker():
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert (summary.charged, summary.failed) == (2, 1)
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}

    code, out, err = await harness.starter("customers", "show", paid.customer_id)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == (
        f"customer {paid.customer_id}: active, {describe_amount('usd', paid.amount_cents)} a"
        f" period, Stripe customer {paid.stripe_customer_id}, payment method"
        f" {paid.payment_method}"
    )
    # Newest first.
    assert lines[2].startswith(
        f"  {PERIOD.next()} skipped {describe_amount('usd', paid.amount_cents)} 20"
    )
    assert lines[2].endswith(" UTC by ann (moved out)")
    charge = rows[paid.customer_id]["charge_id"]
    assert lines[3].startswith(f"  {PERIOD} charged {describe_amount('usd', paid.amount_cents)} 20")
    assert f" UTC as {charge} (pi_" in lines[3]
    assert len(lines) == 4

    code, out, err = await harness.starter("customers", "show", declined.customer_id, "--json")
    history = CustomerHistory.model_validate_json(out)
    assert code == 0, err
    (failed,) = history.periods
    assert (failed.status, failed.failure_code, failed.charge_id) == (
        "failed",
        "card_declined",
        None,
    )
    assert failed.workflow_id == customer_workflow_id(PERIOD, declined.customer_id)
    code, out, _ = await harness.starter("customers", "show", declined.customer_id)
    assert f"  {PERIOD} failed {describe_amount('usd', declined.amount_cents)} 20" in out
    assert (
        " UTC after 1 attempt(s): card_declined (generic_decline): Your card was declined." in out
    )

    # Fewer periods than it has: how many more there are.
    code, out, _ = await harness.starter("customers", "show", paid.customer_id, "--limit", "1")
    assert out.splitlines()[2:] == [
        out.splitlines()[2],
        "  1 older period(s) not shown (--limit shows more)",
    ]
    assert str(PERIOD.next()) in out.splitlines()[2]


async def test_a_period_without_the_customers_row_says_where_its_run_is(harness: Harness) -> None:
    (early,) = await harness.seed(1)
    async with harness.running_worker():
        await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    # Added once the run had completed: that run never listed it.
    (late,) = await harness.seed(1, prefix="late")
    await upsert_customers(harness.pool, [late])
    code, out, err = await harness.starter(
        "customers", "show", late.customer_id, "--period", str(PERIOD)
    )
    assert code == 0, err
    assert out.splitlines()[2].startswith(
        f"  {PERIOD} nothing: its run completed without this customer, who was not active"
    )
    code, out, _ = await harness.starter(
        "customers", "show", early.customer_id, "--period", str(PERIOD.next())
    )
    assert out.splitlines()[2].startswith(f"  {PERIOD.next()} nothing: no run of it has started")
    code, out, _ = await harness.starter("customers", "show", late.customer_id)
    assert out.splitlines()[2] == "  no period has claimed it yet"
    # A claim nothing has finished (its workflow gone): where it is settled.
    later = PERIOD.next()
    namespace = harness.settings.billing_key_namespace
    await harness.open_period_by_hand(later)
    async with harness.pool.acquire() as conn:
        await ledger.claim(
            conn,
            late.customer_id,
            str(later),
            idempotency_key(namespace, late.customer_id, later),
            charge_api="payment_intents",
        )
    code, out, _ = await harness.starter("customers", "show", late.customer_id)
    assert out.splitlines()[2].startswith(
        f"  {later} claimed {describe_amount('usd', late.amount_cents)} 20"
    )
    assert out.splitlines()[2].endswith(
        " UTC, not finished after 0 attempt(s): its run's workflow ends it; if none runs,"
        f" `reconcile {later}` settles it"
    )


async def test_a_period_shows_what_its_claim_fixed_not_what_the_customer_is_billed_now(
    harness: Harness,
) -> None:
    """Support asks what a period charged (or will): the row's amount, currency, Stripe
    customer and payment method, fixed when claimed, not the customer's as changed since;
    each row with its own workflow; a skip asked for with who asked and why."""
    claimed = CustomerRow(
        customer_id="cust-a",
        stripe_customer_id="cus_then",
        payment_method="pm_then",
        amount_cents=1000,
        currency="usd",
    )
    unclaimed = claimed.model_copy(update={"customer_id": "cust-b"})
    await upsert_customers(harness.pool, [claimed, unclaimed])
    for period in (PERIOD, PERIOD.next()):
        await harness.open_period_by_hand(period)
        await harness.claim_by_hand(period, claimed.customer_id)
    namespace = harness.settings.billing_key_namespace
    async with harness.pool.acquire() as conn:
        key = idempotency_key(namespace, claimed.customer_id, PERIOD)
        await ledger.request_skip(conn, claimed.customer_id, str(PERIOD), key, "moved", "ann")
        key = idempotency_key(namespace, claimed.customer_id, PERIOD.next())
        stopped = ChargeFailure(code="cancelled", message="cancelled")
        await ledger.record_unbilled(conn, key, "cancelled", stopped)
        await conn.execute(
            "UPDATE customers SET active = false WHERE customer_id = $1", unclaimed.customer_id
        )
    now = claimed.model_copy(
        update={
            "stripe_customer_id": "cus_now",
            "payment_method": "pm_now",
            "amount_cents": 2500,
            "currency": "eur",
        }
    )
    await upsert_customers(harness.pool, [now])

    code, out, err = await harness.starter("customers", "show", claimed.customer_id, "--json")
    assert code == 0, err
    history = CustomerHistory.model_validate_json(out)
    assert (history.account.amount_cents, history.account.currency) == (2500, "eur")
    fixed = {
        (p.amount_cents, p.currency, p.stripe_customer_id, p.payment_method)
        for p in history.periods
    }
    assert fixed == {(1000, "usd", "cus_then", "pm_then")}
    assert [(p.period, p.status, p.skip_reason, p.skip_by) for p in history.periods] == [
        (str(PERIOD.next()), "cancelled", None, None),
        (str(PERIOD), "claimed", "moved", "ann"),
    ]
    assert [p.workflow_id for p in history.periods] == [
        customer_workflow_id(period, claimed.customer_id) for period in (PERIOD.next(), PERIOD)
    ]
    # One period asked about: its row, and nothing older than it.
    code, out, _ = await harness.starter(
        "customers", "show", claimed.customer_id, "--period", str(PERIOD), "--json"
    )
    history = CustomerHistory.model_validate_json(out)
    assert ([p.period for p in history.periods], history.older) == ([str(PERIOD)], 0)
    assert history.without_row is None
    # Inactive, and a run open that has not claimed it yet: not "completed without it".
    code, out, err = await harness.starter(
        "customers", "show", unclaimed.customer_id, "--period", str(PERIOD), "--json"
    )
    assert code == 0, err
    history = CustomerHistory.model_validate_json(out)
    assert not history.account.active
    assert history.without_row == PeriodWithoutRow(period=str(PERIOD), run_state="running")


async def test_an_unknown_customer_is_a_clear_error(harness: Harness) -> None:
    code, out, err = await harness.starter("customers", "show", "nobody")
    assert (code, out) == (2, "")
    assert "no customer 'nobody' in the ledger: `customers import` adds customers" in err
    assert "Traceback" not in err


async def test_a_periods_failures_are_grouped_by_stripes_code(harness: Harness) -> None:
    customers = await harness.seed(6, card_for=declines_third)
    async with harness.running_worker():
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert summary.failed == 1
    # The period's text points there.
    code, out, _ = await harness.starter("status", str(PERIOD))
    assert f"  failed customers by Stripe's code: python starter.py failures {PERIOD}" in out
    code, out, err = await harness.starter("failures", str(PERIOD))
    assert code == 0, err
    assert out.splitlines()[:2] == [
        f"1 failed in the ledger for {PERIOD}, by Stripe's code (`customers show ID` tells one"
        " customer's story):",
        '  card_declined (generic_decline) 1 "Your card was declined.":'
        f" {customers[2].customer_id}",
    ]
    assert f'BillingPeriod="{PERIOD}" AND BillingStatus="failed"' in out.splitlines()[2]

    # Another month, failed as Stripe fails cards the emulator cannot attach: largest first.
    later = PERIOD.next()
    failed = {
        customers[0].customer_id: ChargeFailure(code="expired_card", message="expired"),
        customers[1].customer_id: ChargeFailure(code="expired_card", message="expired"),
        customers[3].customer_id: ChargeFailure(
            code="card_declined", decline_code="insufficient_funds", message="no funds"
        ),
    }
    namespace = harness.settings.billing_key_namespace
    await harness.open_period_by_hand(later)
    async with harness.pool.acquire() as conn:
        for customer_id, failure in failed.items():
            key = idempotency_key(namespace, customer_id, later)
            await ledger.claim(conn, customer_id, str(later), key, charge_api="payment_intents")
            await ledger.record_unbilled(conn, key, "failed", failure)
    code, out, _ = await harness.starter("failures", str(later), "--json")
    failures = PeriodFailures.model_validate_json(out)
    assert failures.failed == 3
    assert [(g.failure_code, g.decline_code, g.count) for g in failures.groups] == [
        ("expired_card", None, 2),
        ("card_declined", "insufficient_funds", 1),
    ]
    assert failures.groups[0].customer_ids == sorted(failed)[:2]
    code, out, _ = await harness.starter("failures", str(later.next()))
    assert out.splitlines()[0] == f"no customer failed in the ledger for {later.next()}"


async def test_a_periods_failures_count_only_its_failed_rows_and_name_the_first_of_each_group(
    harness: Harness,
) -> None:
    """Read from the ledger alone: the period's failed rows, not its charged or cancelled ones;
    a group names its first CUSTOMERS_NAMED by id and counts its messages; groups of one size
    in code order, a decline without an issuer's reason first."""
    rows = [
        CustomerRow(
            customer_id=f"cust-{i:02}",
            stripe_customer_id=f"cus_{i:02}",
            payment_method="pm_card_visa",
            amount_cents=1000,
            currency="usd",
        )
        for i in range(CUSTOMERS_NAMED + 8)
    ]
    await upsert_customers(harness.pool, rows)
    await harness.open_period_by_hand(PERIOD)
    missing = [r.customer_id for r in rows[: CUSTOMERS_NAMED + 2]]
    failed = {
        # Claimed last id first: the names are by id, not as the rows were written.
        **{
            r.customer_id: ChargeFailure(
                code="resource_missing", message=f"No such customer: '{r.stripe_customer_id}'"
            )
            for r in reversed(rows[: len(missing)])
        },
        rows[-5].customer_id: ChargeFailure(code="expired_card", message="Your card has expired."),
        rows[-4].customer_id: ChargeFailure(code="expired_card", message="Your card has expired."),
        rows[-3].customer_id: ChargeFailure(
            code="card_declined", decline_code="insufficient_funds", message="No funds."
        ),
        rows[-2].customer_id: ChargeFailure(code="card_declined", message="Declined."),
    }
    charged, cancelled = rows[-1], rows[-6]
    namespace = harness.settings.billing_key_namespace
    for customer_id in [*failed, charged.customer_id, cancelled.customer_id]:
        await harness.claim_by_hand(PERIOD, customer_id)
    async with harness.pool.acquire() as conn:
        for customer_id, failure in failed.items():
            key = idempotency_key(namespace, customer_id, PERIOD)
            await ledger.record_unbilled(conn, key, "failed", failure)
        stopped = ChargeFailure(code="cancelled", message="cancelled")
        key = idempotency_key(namespace, cancelled.customer_id, PERIOD)
        await ledger.record_unbilled(conn, key, "cancelled", stopped)
        result = ChargeResult(
            charge_id="ch_1", payment_intent_id="pi_1", amount_cents=1000, currency="usd"
        )
        await ledger.record_charge(
            conn, idempotency_key(namespace, charged.customer_id, PERIOD), result
        )
        failures = await period_failures(conn, str(PERIOD))
    assert failures.failed == len(failed)
    assert [(g.failure_code, g.decline_code, g.count, g.messages) for g in failures.groups] == [
        ("resource_missing", None, len(missing), len(missing)),
        ("expired_card", None, 2, 1),
        ("card_declined", None, 1, 1),
        ("card_declined", "insufficient_funds", 1, 1),
    ]
    assert failures.groups[0].customer_ids == missing[:CUSTOMERS_NAMED]
    assert failures.groups[0].message == f"No such customer: '{rows[0].stripe_customer_id}'"

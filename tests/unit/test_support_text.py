"""How `failures` and `customers show` read: what Stripe said, on one line, never a key."""

from __future__ import annotations

from datetime import UTC, datetime

from billing.customer_history import BilledPeriod, CustomerAccount, CustomerHistory
from billing.failures import FailureGroup, PeriodFailures
from billing.reporting import describe_customer, describe_failures, failure_chain

AT = datetime(2026, 12, 1, 2, 0, tzinfo=UTC)


def test_a_large_failure_group_names_its_first_customers_and_counts_the_rest() -> None:
    group = FailureGroup(
        failure_code="card_declined",
        decline_code=None,
        count=25,
        customer_ids=[f"c{i}" for i in range(20)],
        # Stripe's words are shown as words: a line break or a key in them is not.
        message="Declined\nfor sk_live_" + "abcdefgh" * 3,
    )
    text = describe_failures(PeriodFailures(period="2026-12", failed=25, groups=[group]))
    line = text.splitlines()[1]
    assert line.startswith('  card_declined 25 "Declined for [redacted key]": c0, c1, ')
    assert line.endswith(", c19 and 5 more")


def test_a_group_whose_messages_differ_says_whose_message_it_shows() -> None:
    """One code, each customer's own object named: the first message is not all of theirs
    (helper-177 F5)."""
    group = FailureGroup(
        failure_code="resource_missing",
        decline_code=None,
        count=2,
        customer_ids=["acme-1", "acme-2"],
        message="No such customer: 'cus_AAA111'",
        messages=2,
    )
    text = describe_failures(PeriodFailures(period="2026-10", failed=2, groups=[group]))
    assert text.splitlines()[1] == (
        "  resource_missing 2 (2 messages; acme-1's: \"No such customer: 'cus_AAA111'\"):"
        " acme-1, acme-2"
    )


ACCOUNT = CustomerAccount(
    customer_id="acme",
    active=False,
    stripe_customer_id="cus_1",
    payment_method=None,
    amount_cents=2_500,
    currency="eur",
    created_at=AT,
    updated_at=AT,
)


def _claimed(**fields: object) -> BilledPeriod:
    row = dict(
        period="2026-12",
        workflow_id="billing-2026-12-acme",
        status="claimed",
        amount_cents=1_999,
        currency="eur",
        stripe_customer_id="cus_1",
        payment_method="pm_1",
        charge_id=None,
        payment_intent_id=None,
        failure_code=None,
        decline_code=None,
        failure_message=None,
        reason=None,
        decided_by=None,
        skip_reason=None,
        skip_by=None,
        attempts=2,
        claimed_at=AT,
        completed_at=None,
    )
    return BilledPeriod.model_validate(row | fields)


def test_an_open_claim_says_a_skip_asked_of_it_and_where_it_is_settled() -> None:
    history = CustomerHistory(
        account=ACCOUNT,
        periods=[_claimed(skip_reason="disputed", skip_by="ann")],
        older=0,
    )
    assert describe_customer(history).splitlines() == [
        "customer acme: inactive, eur 25.00 a period, Stripe customer cus_1, payment method"
        " none named",
        "  each period's workflow: billing-PERIOD-acme",
        "  2026-12 claimed eur 19.99 2026-12-01 02:00 UTC, not finished after 2 attempt(s); a"
        " skip is asked by ann (disputed): its run's workflow ends it; if none runs,"
        " `reconcile 2026-12` settles it",
    ]


def test_a_failed_periods_message_from_stripe_is_one_line_with_no_key() -> None:
    failed = _claimed(
        status="failed",
        completed_at=AT,
        failure_code="card_declined",
        decline_code="do_not_honor",
        # Split: no key-shaped text in the repository.
        failure_message="Declined\n  2026-11 charged for sk_" + "live_A1b2C3d4E5f6G7h8I9j0K1l2",
    )
    history = CustomerHistory(account=ACCOUNT, periods=[failed], older=0)
    assert describe_customer(history).splitlines()[2:] == [
        "  2026-12 failed eur 19.99 2026-12-01 02:00 UTC after 2 attempt(s): card_declined"
        " (do_not_honor): Declined   2026-11 charged for [redacted key]"
    ]


def test_a_failure_chain_is_one_line_with_no_key() -> None:
    """The CLI prints it after "error:": a terminate reason holds whatever an operator
    pasted."""
    # Split: no key-shaped text in the repository.
    error = RuntimeError("rotate sk_" + "live_A1b2C3d4E5f6G7h8I9j0K1l2\nnow")
    assert failure_chain(error) == "rotate [redacted key] now"

"""A period's counts: money is summed per currency, never across currencies."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st

from billing.models import (
    AUTOMATIC,
    Counts,
    CustomerOutcome,
    LedgerStatus,
    PeriodProgress,
    PeriodStatus,
    PeriodSummary,
    PeriodTotals,
    Preview,
    PreviewLine,
    ShortKey,
    finished_outcome,
)
from billing.money import describe_amount, describe_amounts, spend_cap, spend_caps
from billing.period_keys import KeyRenewal, RenewedKey
from billing.reporting import (
    describe,
    describe_preview,
    describe_renewal,
    describe_totals,
    resumed_unrenewed,
)
from billing.wording import listed
from vault.models import DAILY_CAP

OUTCOMES = st.builds(
    CustomerOutcome,
    customer_id=st.sampled_from(["a", "b", "c"]),
    outcome=st.sampled_from(["charged", "already_billed", "failed", "skipped", "cancelled"]),
    amount_cents=st.integers(min_value=1, max_value=99_999_999),
    currency=st.sampled_from(["usd", "eur", "jpy"]),
)


def _counted(outcomes: list[CustomerOutcome]) -> Counts:
    counts = Counts(due=len(outcomes))
    for outcome in outcomes:
        counts.add(outcome)
    return counts


@given(st.lists(OUTCOMES, max_size=30))
def test_charged_money_is_summed_per_currency(outcomes: list[CustomerOutcome]) -> None:
    counts = _counted(outcomes)
    charged = [o for o in outcomes if o.outcome == "charged"]
    assert counts.charged == len(charged)
    for currency in ("usd", "eur", "jpy"):
        in_currency = [o.amount_cents for o in charged if o.currency == currency]
        assert counts.charged_by_currency.get(currency) == (sum(in_currency) or None)
    assert sum(counts.charged_by_currency.values()) == counts.total_charged_cents


@given(st.lists(OUTCOMES, max_size=20), st.lists(OUTCOMES, max_size=20))
def test_merged_pages_count_as_one(
    first: list[CustomerOutcome], second: list[CustomerOutcome]
) -> None:
    merged = _counted(first)
    merged.merge(_counted(second))
    assert merged == _counted(first + second)


def test_a_finished_row_seen_again_counts_as_it_ended_and_a_charge_as_already_billed() -> None:
    # The model reads every status the ledger's rows can hold (migrations/001_ledger.sql).
    sql = (Path(__file__).resolve().parents[2] / "migrations" / "001_ledger.sql").read_text()
    [held] = re.findall(r"CHECK \(status IN \(([^)]*)\)\)", sql)
    assert get_args(LedgerStatus) == tuple(re.findall(r"'(\w+)'", held))
    finished = [status for status in get_args(LedgerStatus) if status != "claimed"]
    assert [finished_outcome(status) for status in finished] == [
        "already_billed",
        "failed",
        "skipped",
        "cancelled",
    ]
    with pytest.raises(ValueError, match="no outcome yet"):
        finished_outcome("claimed")


def test_amounts_are_shown_per_currency_in_its_unit_as_stripe_counts_it() -> None:
    """Not "usd 9,719" for $97.19, which reads as whole dollars (helper-169 F7)."""
    assert describe_amounts({}) == "nothing"
    assert describe_amounts({"usd": 123_456, "eur": 1_500, "jpy": 700}) == (
        "eur 15.00, jpy 700, usd 1,234.56"
    )
    assert describe_amount("kwd", 1_230) == "kwd 1.230"
    assert describe_amount("isk", 150_000) == "isk 1,500.00"  # two-decimal in Stripe's API
    assert describe_amount("krw", 1_234_567) == "krw 1,234,567"
    assert describe_amount("usd", 5) == "usd 0.05"
    assert describe_amount("usd", -1_999) == "usd -19.99"
    assert describe_amount("usd", 0) == "usd 0.00"


def test_a_summary_never_adds_currencies_together() -> None:
    counts = _counted(
        [
            CustomerOutcome(
                customer_id="a", outcome="charged", amount_cents=123_999, currency="usd"
            ),
            CustomerOutcome(customer_id="b", outcome="charged", amount_cents=1_000, currency="jpy"),
            CustomerOutcome(customer_id="c", outcome="charged", amount_cents=700, currency="jpy"),
        ]
    )
    # As the period workflow builds its summary.
    summary = PeriodSummary(
        period="2026-12", workflow_id="billing-period-2026-12", **counts.model_dump()
    )
    text = describe(summary)
    assert text.endswith("charged jpy 1,700, usd 1,239.99")
    assert "125,699" not in text and "1,256.99" not in text


def test_each_currency_has_its_own_cap() -> None:
    assert spend_caps({"usd": 99_510, "jpy": 1_001}, 1.10) == {
        "jpy": spend_cap(1_001, 1.10),
        "usd": spend_cap(99_510, 1.10),
    }


def preview_of(*lines: PreviewLine) -> Preview:
    return Preview(period="2026-12", to_charge=list(lines), already_billed=[], not_billable=[])


def line(
    customer_id: str,
    amount_cents: int,
    currency: str,
    *,
    method: bool = True,
    status: LedgerStatus | None = None,
) -> PreviewLine:
    return PreviewLine(
        customer_id=customer_id,
        stripe_customer_id=f"cus_{customer_id}",
        amount_cents=amount_cents,
        currency=currency,
        status=status,
        open=True,
        has_payment_method=method,
    )


def test_a_preview_shows_each_currencys_total_and_cap() -> None:
    text = describe_preview(preview_of(line("a", 1_999, "usd"), line("b", 1_700, "jpy")))
    assert "would charge 2 customers jpy 1,700, usd 19.99;" in text
    assert "new keys would be capped at jpy 1,870, usd 21.99, at BILLING_CAP_MULTIPLIER=1.1" in text
    assert "    a: usd 19.99\n    b: jpy 1,700\n" in text
    assert "3,699" not in text and "3699" not in text
    assert "warning" not in text and "issued so far" not in text


def test_a_previews_json_gives_one_total_only_for_one_currency() -> None:
    """A sum of amounts in different currencies is no amount: such a period's JSON gives
    its totals and caps per currency, and none overall."""
    mixed = preview_of(line("a", 1_999, "usd"), line("b", 1_700, "jpy"), line("c", 1, "usd"))
    read = json.loads(mixed.model_dump_json())
    assert (read["totals_by_currency"], read["caps_by_currency"]) == (
        {"jpy": 1_700, "usd": 2_000},
        {"jpy": 1_870, "usd": 2_200},
    )
    assert (read["expected_total_cents"], read["cap_cents"]) == (None, None)
    one = json.loads(preview_of(line("a", 1_999, "usd"), line("c", 1, "usd")).model_dump_json())
    assert (one["expected_total_cents"], one["cap_cents"]) == (2_000, 2_200)
    nothing = json.loads(preview_of().model_dump_json())
    assert (nothing["totals_by_currency"], nothing["expected_total_cents"]) == ({}, 0)
    assert (nothing["caps_by_currency"], nothing["cap_cents"]) == ({}, 0)
    # Read back, the figures are computed again from the lines.
    assert Preview.model_validate_json(mixed.model_dump_json()) == mixed


def test_a_preview_shows_the_caps_of_the_keys_issued() -> None:
    # The workers' BILLING_CAP_MULTIPLIER made them, which the operator's may not match.
    issued = preview_of(line("a", 1_999, "usd")).model_copy(
        update={"issued_caps_by_currency": {"usd": 4_000}}
    )
    assert "the period's keys issued so far are capped at usd 40.00" in describe_preview(issued)


def test_a_preview_warns_of_a_key_too_small_with_each_amount_in_its_place() -> None:
    short = ShortKey(
        currency="usd",
        vault_key_id="vk_1",
        cap_cents=10_000,
        charged_cents=9_000,
        unsent_cents=2_500,
    )
    text = describe_preview(
        preview_of(line("a", 2_500, "usd")).model_copy(update={"short_keys": [short]})
    )
    assert (
        "the period's usd key vk_1, not issued by this ledger's workers, has at most usd 10.00"
        " left of its cap of usd 100.00 (usd 90.00 charged through it), less than the usd 25.00"
        " a run has yet to charge" in text
    )


def test_a_preview_warns_of_customers_with_no_payment_method() -> None:
    lines = [line(f"c{i}", 100, "usd", method=i % 2 == 0) for i in range(50)]
    preview = preview_of(*lines)
    missing = [x.customer_id for x in preview.without_payment_method]
    assert missing == [f"c{i}" for i in range(1, 50, 2)]
    text = describe_preview(preview, shown=3)
    assert "warning: 25 of them have no payment method" in text
    assert "import them again with payment_method before the run: c1, c3, c5 and 22 more" in text
    assert "claimed" not in text


def test_a_preview_warns_of_amounts_stripe_refuses() -> None:
    # Imported before the import checked Stripe's minimums: 49 usd meant as $49.
    preview = preview_of(
        line("a", 49, "usd"),
        line("b", 4_900, "usd"),
        line("c", 1_050, "isk"),
        line("d", 30, "eur", status="claimed"),
    )
    assert [(x.customer_id, why) for x, why in preview.with_amounts_stripe_refuses] == [
        (
            "a",
            "amount 49 usd (usd 0.49) is below Stripe's minimum charge of usd 0.50 (amounts are"
            " in the currency's smallest unit: is it in cents?)",
        ),
        (
            "c",
            "amount 1050 isk must end in 00: Stripe charges isk in hundredths but only whole"
            " units (100 is 1 isk)",
        ),
        (
            "d",
            "amount 30 eur (eur 0.30) is below Stripe's minimum charge of eur 0.50 (amounts are"
            " in the currency's smallest unit: is it in cents?)",
        ),
    ]
    text = describe_preview(preview, shown=1)
    assert "warning: 2 of them have an amount Stripe refuses, so they would end failed" in text
    assert "before the run: a (amount 49 usd (usd 0.49) is below Stripe's minimum charge" in text
    assert "and 1 more" in text
    assert "1 of them were claimed with an amount Stripe refuses" in text
    assert "bill them by hand: d (amount 30 eur" in text


def test_a_preview_tells_claimed_customers_with_no_payment_method_apart() -> None:
    # A claim keeps what it was claimed with: importing again changes nothing it sends.
    preview = preview_of(line("a", 100, "usd", method=False, status="claimed"))
    text = describe_preview(preview)
    assert "1 of them were claimed with no payment method" in text
    assert "skip them if that is wrong: a" in text
    assert "import them again" not in text


def test_a_preview_warns_of_a_stripe_customer_charged_twice_and_names_those_held() -> None:
    def of(customer_id: str, stripe_id: str, **fields: Any) -> PreviewLine:
        return line(customer_id, 5_000, "usd", **fields).model_copy(
            update={"stripe_customer_id": stripe_id}
        )

    preview = preview_of(
        of("acme-1", "cus_acme"), of("ACME-1", "cus_acme"), of("z-2", "cus_z"), of("x-1", "cus_x")
    )
    preview = preview.model_copy(
        update={
            # Billed under one id, charged now under another; and one billed twice before,
            # which a run would not charge again.
            "already_billed": [
                of("z-1", "cus_z", status="charged"),
                of("y-1", "cus_y", status="charged"),
                of("y-2", "cus_y", status="charged"),
            ],
            "not_billable": [
                of("new-1", "cus_new").model_copy(update={"held_as": "old-1"}),
                of("gone-1", "cus_gone"),
            ],
        }
    )
    assert preview.sharing_a_stripe_customer == {
        "cus_acme": ["ACME-1", "acme-1"],
        "cus_z": ["z-1", "z-2"],
    }
    assert [x.customer_id for x in preview.held] == ["new-1"]
    twice, held = preview.warnings
    assert (twice.kind, twice.customer_ids, twice.entries) == (
        "stripe_customer_charged_twice",
        ["ACME-1", "acme-1", "z-1", "z-2"],
        ["cus_acme (ACME-1, acme-1)", "cus_z (z-1, z-2)"],
    )
    assert twice.message.startswith("2 Stripe customers would be charged more than once")
    assert (held.kind, held.customer_ids, held.entries) == ("held", ["new-1"], ["new-1 (as old-1)"])


def test_a_previews_json_carries_its_warnings_so_no_consumer_redoes_the_rules() -> None:
    preview = preview_of(
        line("a", 49, "usd"),
        line("b", 100, "usd", method=False, status="claimed"),
        line("c", 4_900, "usd"),
    )
    warnings = json.loads(preview.model_dump_json())["warnings"]
    assert [(w["kind"], w["customer_ids"]) for w in warnings] == [
        ("claimed_without_payment_method", ["b"]),
        ("amount_stripe_refuses", ["a"]),
    ]
    assert warnings[1]["message"].startswith("1 of them have an amount Stripe refuses")
    assert warnings[1]["entries"] == [
        "a (amount 49 usd (usd 0.49) is below Stripe's minimum charge of usd 0.50 (amounts are"
        " in the currency's smallest unit: is it in cents?))"
    ]
    # The text says the same, from the same warnings.
    assert f"warning: {warnings[1]['message']}: {warnings[1]['entries'][0]}" in describe_preview(
        preview
    )
    assert json.loads(preview_of(line("c", 4_900, "usd")).model_dump_json())["warnings"] == []


@given(st.lists(st.from_regex(r"[a-z]{1,3}", fullmatch=True), max_size=12))
def test_a_listing_names_five_and_counts_the_rest(items: list[str]) -> None:
    text = listed(items)
    assert text.split(" and ")[0].split(", ") == (items[:5] or [""])
    assert text.endswith(f" and {len(items) - 5} more") == (len(items) > 5)


def _nothing_counted(**fields: Any) -> dict[str, Any]:
    """A period's counts all nought, with `fields`: what a summary or progress needs."""
    counts = dict.fromkeys(
        ("due", "charged", "already_billed", "failed", "skipped", "cancelled"), 0
    )
    return {
        "period": "2026-12",
        "workflow_id": "billing-period-2026-12",
        "total_charged_cents": 0,
        **counts,
        **fields,
    }


def test_a_run_that_has_done_nothing_counts_nothing() -> None:
    empty = PeriodSummary.empty("2026-12", "billing-period-2026-12")
    assert empty == PeriodSummary(**_nothing_counted(held=0, charged_by_currency={}))
    # A run's counts start from Counts(): the same noughts.
    assert empty == PeriodSummary(**_nothing_counted(**Counts().model_dump()))


def test_a_run_that_paused_itself_says_how_to_bill_the_rest() -> None:
    paused = PeriodProgress(
        **_nothing_counted(
            state="paused",
            in_flight=3,
            operator=AUTOMATIC,
            reason="spend_cap_exceeded: 500 cents would pass this key's cap",
        )
    )
    text = describe(paused)
    assert f"paused by {AUTOMATIC}: spend_cap_exceeded" in text
    renew = "python starter.py renew-keys 2026-12 --reason ..."
    resume = "python starter.py resume 2026-12 --reason ..."
    assert f"{renew} (it says if no key needs it), then {resume}" in text
    by_hand = paused.model_copy(update={"operator": "alice", "reason": "prices look wrong"})
    assert "renew-keys" not in describe(by_hand)
    assert "paused by alice: prices look wrong" in describe(by_hand)
    assert f"to go on: {resume}" in describe(by_hand)
    # The kill switch: new keys only once the revoked key's row is deleted.
    revoked = paused.model_copy(update={"reason": "vault_key_revoked: the key was revoked"})
    assert f"delete its row in period_vault_keys, then {renew}" in describe(revoked)
    # Not the key's room or life: new keys would not mend it.
    refused = paused.model_copy(update={"reason": "permission_denied: not allowed"})
    assert f"to go on: mend what the reason says, then {resume}" in describe(refused)


def test_a_cancelled_run_says_who_cancelled_it_and_what_holds_it_up() -> None:
    cancelling = PeriodProgress(
        **_nothing_counted(state="cancelling", in_flight=1, operator="alice", reason="wrong prices")
    )
    assert "cancelling by alice: wrong prices" in describe(cancelling)
    assert "renew-keys" not in describe(cancelling)
    assert "waits for the vault" not in describe(cancelling)
    held = cancelling.model_copy(update={"refused_after_cancel": "vault_key_expired"})
    assert (
        "a charge sent before the cancel waits for the vault to take its key"
        " (vault_key_expired): to let it finish, python starter.py renew-keys 2026-12"
    ) in describe(held)
    summary = PeriodSummary(**_nothing_counted(cancelled_by="alice", cancel_reason="wrong prices"))
    assert "cancelled by alice: wrong prices" in describe(summary)


def test_customers_held_at_the_opening_are_named_apart_from_the_counts() -> None:
    summary = PeriodSummary(**_nothing_counted())
    assert "held" not in describe(summary)
    held = describe(summary.model_copy(update={"held": 2}))
    assert "held 2: not due" in held and "python starter.py preview 2026-12 lists them" in held


def test_a_run_paused_at_a_keys_daily_cap_says_it_frees_itself_at_midnight() -> None:
    """A key issued by hand may have a daily cap: a renewal keeps it (it has room for the
    run), so the advice is to resume once the UTC day is over, not to renew (helper-153 N1)."""
    paused = PeriodProgress(
        **_nothing_counted(
            state="paused",
            in_flight=1,
            operator=AUTOMATIC,
            reason=f"spend_cap_exceeded: 500 cents would pass this key's {DAILY_CAP}: 20 cents"
            " remain",
        )
    )
    text = describe(paused)
    assert (
        f"the key's {DAILY_CAP} frees a day's room at 00:00 UTC, then python starter.py resume"
        " 2026-12 --reason ..."
    ) in text
    assert "renew-keys" not in text


def test_a_runs_progress_says_what_it_has_listed_and_what_a_pause_holds() -> None:
    """`due` is what the run has listed so far, and those started when it paused wait at the
    gate: the text said `due 500` of a thousand, and `in flight` for minutes (helper-169 F6)."""
    running = PeriodProgress(**_nothing_counted(due=500, state="running", in_flight=7))
    running = running.model_copy(update={"expected_due": 1000})
    assert "due 500 listed so far, of 1000 expected: charged 0" in describe(running)
    assert "state running, in flight 7" in describe(running)
    listed_all = running.model_copy(update={"due": 1000})
    assert "  due 1000: charged 0" in describe(listed_all)
    # Still opening: it has listed nobody and knows no count to expect yet.
    opening = running.model_copy(update={"due": 0, "expected_due": None})
    assert "  due 0: charged 0" in describe(opening)
    paused = running.model_copy(update={"state": "paused", "operator": "alice", "reason": "x"})
    assert (
        "state paused, 7 started, held at the gate until the resume but for charges sent before"
        " the pause, which finish" in describe(paused)
    )


def test_claims_open_with_no_run_open_point_to_reconciliation() -> None:
    totals = PeriodTotals(charged=2, claimed=1, charged_by_currency={"usd": 3000})
    ended = PeriodStatus(**_nothing_counted(state="completed", in_flight=0, ledger=totals))
    settle = (
        "claims open 1 (no run is open: python starter.py reconcile 2026-12 settles those whose"
        " workflow has ended, and names any it must leave)"
    )
    assert settle in describe(ended)
    # A paused or cancelling run still owns its claims: reconcile would leave them.
    for state in ("running", "paused", "closing", "cancelling"):
        still_open = ended.model_copy(update={"state": state})
        assert describe(still_open).endswith("claims open 1"), state


def test_the_ledgers_totals_read_each_count_in_its_place() -> None:
    """No claim open, no word of reconciliation: a run that ended with none has nothing
    for it to settle."""
    totals = PeriodTotals(
        charged=1, failed=2, skipped=3, cancelled=4, charged_by_currency={"usd": 1_999}
    )
    assert describe_totals("2026-12", totals, run_open=False) == (
        "the period in the ledger, every run: charged 1 (usd 19.99), failed 2, skipped 3,"
        " cancelled 4, claims open 0"
    )
    # As the ledger reads a period holding only open claims: the counts of no row are nought.
    only_claims = PeriodTotals(claimed=2, charged_by_currency={})
    assert describe_totals("2026-12", only_claims, run_open=True) == (
        "the period in the ledger, every run: charged 0 (nothing), failed 0, skipped 0,"
        " cancelled 0, claims open 2"
    )
    assert not only_claims.empty and PeriodTotals(charged_by_currency={}).empty


@pytest.mark.parametrize(
    ("reason", "warned"),
    [
        ("spend_cap_exceeded: 500 cents would pass this key's cap", True),
        ("vault_key_revoked: the key was revoked", True),
        ("vault_key_expired: the key expired", True),
        ("no_period_key: the period has no key in usd", True),
        # The key's room frees itself at midnight; new keys would not mend the rest.
        (f"spend_cap_exceeded: 500 cents would pass this key's {DAILY_CAP}: 20 remain", False),
        ("permission_denied: not allowed", False),
    ],
)
def test_a_resume_without_new_keys_warns_only_where_new_keys_would_mend_the_pause(
    reason: str, warned: bool
) -> None:
    warning = resumed_unrenewed("2026-12", reason)
    assert (warning is not None) == warned
    if warning is not None:
        assert "python starter.py renew-keys 2026-12 --reason ..." in warning


def test_a_renewal_names_the_keys_it_issued_and_what_each_replaced() -> None:
    renewed = KeyRenewal(
        period="2026-12",
        keys=[
            RenewedKey(
                period="2026-12",
                currency="usd",
                vault_key_id="vk_new",
                cap_cents=5_000,
                replaced="vk_old",
            ),
            RenewedKey(
                period="2026-12",
                currency="eur",
                vault_key_id="vk_eur",
                cap_cents=700,
                replaced=None,
            ),
        ],
    )
    lines = describe_renewal(renewed).splitlines()
    assert lines[0] == "new vault keys for 2026-12:"
    assert lines[1].startswith("  vk_new, capped at usd 50.00, in place of vk_old (revoked:")
    assert lines[2] == "  vk_eur, capped at eur 7.00"
    assert "none was renewed" in describe_renewal(renewed.model_copy(update={"keys": []}))


def test_a_preview_lists_the_first_customers_and_counts_those_it_leaves_out() -> None:
    preview = preview_of(*(line(f"c{i}", 100, "usd") for i in range(4))).model_copy(
        update={
            "already_billed": [line("b1", 100, "usd", status="charged")],
            "not_billable": [
                line("f1", 100, "usd", status="failed"),
                line("h1", 100, "usd").model_copy(update={"held_as": "h0"}),
            ],
        }
    )
    text = describe_preview(preview, shown=3)
    assert "    c2: usd 1.00\n    ... and 1 more (--json lists all)\n" in text
    assert "c3:" not in text
    assert "\n  held: 1 customers a run would not bill" in text
    assert "\n  already billed: 1\n" in text
    assert text.endswith("(failed, skipped, cancelled or held): 2")
    assert "more (--json lists all)" not in describe_preview(preview, shown=4)


@pytest.mark.parametrize("state", ["running", "cancelling"])
def test_a_run_names_the_customers_it_awaits_in_the_ledger(state: str) -> None:
    progress = PeriodProgress(
        **_nothing_counted(
            state=state, in_flight=0, operator="alice", reason="r", awaited_in_ledger=["c-1"]
        )
    )
    assert "  awaited in the ledger: c-1 (started by an earlier run" in describe(progress)

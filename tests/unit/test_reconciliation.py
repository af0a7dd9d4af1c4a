"""Reconciliation's rules: which open claims it may touch, and how Stripe's charges compare
with the ledger."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ActivityError, RetryState

from billing import reconciliation
from billing.keys import reconcile_workflow_id
from billing.models import ChargeFailure, Control, RunOptions, ScheduledBillingInput
from billing.periods import Period
from billing.reconciliation import (
    INCOMPLETE_INTENT,
    RELEASE_AFTER,
    ChargesPage,
    ChargeState,
    ChildState,
    ClaimResolution,
    Comparison,
    Finding,
    FindingKind,
    LedgerEntry,
    OpenClaim,
    ReconcileReport,
    ReservationResolution,
    StripeCharge,
    classify,
    for_listing,
    left_alone,
    left_unknown_because,
    recorded_failure,
    release_wait,
    reservations_to_report,
)
from billing.reporting import describe_reconciliation
from billing.schedules import MonthlySchedule, build_schedule
from tests.unit.claims import CLAIM
from workflows.reconcile import _lookup_failed

NOW = datetime(2027, 1, 5, tzinfo=UTC)


def open_claim(*, sent: bool = True, control: Control | None = None) -> OpenClaim:
    return OpenClaim(claim=CLAIM, sent=sent, control=control)


def charge(
    charge_id: str,
    customer_id: str = "cust-1",
    amount: int = 1000,
    state: ChargeState = "made",
    billing_key: str = "abcdef0123456789" * 2,
) -> StripeCharge:
    return StripeCharge(
        charge_id=charge_id,
        state=state,
        failure_code="debit_not_authorized" if state == "failed" else None,
        payment_intent_id="pi_" + charge_id,
        amount_cents=amount,
        currency="usd",
        stripe_customer_id="cus_1",
        customer_id=customer_id,
        period="2026-12",
        billing_key=billing_key,
    )


def entry(
    charge_id: str | None, status: str = "charged", idempotency_key: str | None = None
) -> LedgerEntry:
    return LedgerEntry.model_validate(
        {
            "customer_id": "cust-1",
            "status": status,
            "charge_id": charge_id,
            "idempotency_key": idempotency_key,
        }
    )


@pytest.mark.parametrize(
    ("child", "period_running", "resolvable"),
    [
        ("running", False, False),
        ("running", True, False),
        # Closed under REJECT_DUPLICATE: the period never starts it again.
        ("closed", True, True),
        ("closed", False, True),
        # Never ran: only once no period run may still start it.
        ("absent", True, False),
        ("absent", False, True),
    ],
)
def test_a_claim_is_resolved_only_when_no_workflow_can_own_it(
    child: ChildState, period_running: bool, resolvable: bool
) -> None:
    alone = left_alone(child, period_running, open_claim(), NOW)
    assert (alone is None) == resolvable
    assert alone is None or not alone.needs_person


def test_an_unsent_charge_of_a_paused_period_waits_for_the_operator() -> None:
    paused = left_alone("closed", True, open_claim(sent=False, control="paused"), NOW)
    assert paused is not None and not paused.needs_person
    # Once sent, only the same key can learn its outcome, pause or not.
    assert left_alone("closed", False, open_claim(sent=True, control="paused"), NOW) is None
    assert left_alone("closed", False, open_claim(sent=False, control="cancelled"), NOW) is None


@pytest.mark.parametrize("child", ["closed", "running"])
def test_a_claim_of_a_run_that_ended_while_paused_is_left_for_a_person(
    child: ChildState,
) -> None:
    # Terminated while paused: no run is left to resume the charge, or its workflow.
    alone = left_alone(child, False, open_claim(sent=False, control="paused"), NOW)
    assert alone is not None and alone.needs_person
    assert alone.detail is not None and "python starter.py run 2026-12" in alone.detail
    # Sent, it passes the gate whatever the pause: its workflow ends it.
    sent = left_alone("running", False, open_claim(sent=True, control="paused"), NOW)
    assert sent is not None and not sent.needs_person


def test_the_ledgers_own_charge_is_no_finding() -> None:
    assert classify([charge("ch_1")], {"cust-1": entry("ch_1")}) == []


def test_a_second_charge_is_a_duplicate_with_its_id_and_amount() -> None:
    [finding] = classify([charge("ch_1"), charge("ch_2", amount=1000)], {"cust-1": entry("ch_1")})
    assert (finding.kind, finding.charge_id, finding.amount_cents) == ("duplicate", "ch_2", 1000)
    assert finding.ledger_charge_id == "ch_1"
    assert finding.key_prefix == "abcdef01"


def test_a_charge_without_a_row_is_an_orphan() -> None:
    [finding] = classify([charge("ch_9", customer_id="cust-9")], {})
    assert (finding.kind, finding.customer_id, finding.ledger_status) == ("orphan", "cust-9", None)


def test_a_charge_the_row_does_not_record_is_unrecorded() -> None:
    [finding] = classify([charge("ch_1")], {"cust-1": entry(None, "failed")})
    assert (finding.kind, finding.ledger_status) == ("unrecorded", "failed")


def test_an_open_claim_is_not_judged_yet() -> None:
    # Its workflow (or the next reconciliation) records the charge.
    assert classify([charge("ch_1")], {"cust-1": entry(None, "claimed")}) == []


def test_an_open_claims_second_charge_is_a_duplicate_whichever_it_records() -> None:
    # The claim may stay open for good (its key expired, its lookup fails): its customer's
    # extra charges must not wait for it to be reported.
    charges = [charge("ch_2"), charge("ch_1"), charge("ch_2")]
    [finding] = classify(charges, {"cust-1": entry(None, "claimed")})
    assert (finding.kind, finding.charge_id, finding.ledger_status) == (
        "duplicate",
        "ch_1",
        "claimed",
    )


def test_an_open_claims_own_charge_stands_over_a_newer_one_under_another_key() -> None:
    """The claim, resolved, records the charge made under its key: the newer one, under
    another key (a script, an old namespace), is the duplicate to refund, not the one the
    ledger is about to record (helper-151 F7)."""
    own = "k" * 32
    charges = [charge("ch_2", billing_key="other-" * 5), charge("ch_1", billing_key=own)]
    [finding] = classify(charges, {"cust-1": entry(None, "claimed", idempotency_key=own)})
    assert (finding.kind, finding.charge_id) == ("duplicate", "ch_2")


def test_of_two_charges_under_an_open_claims_key_the_newest_stands_as_its_lookup_finds() -> None:
    """Stripe forgot the key after a day, or a script reused it: the claim's lookup records
    the newest made under its key, so that one stands, before and after it is recorded; the
    report named the one about to be recorded as the duplicate, then flipped (helper-162 F2)."""
    own = "k" * 32
    charges = [charge("ch_new", billing_key=own), charge("ch_old", billing_key=own)]
    [before] = classify(charges, {"cust-1": entry(None, "claimed", idempotency_key=own)})
    [after] = classify(charges, {"cust-1": entry("ch_new")})
    assert (
        (before.kind, before.charge_id) == (after.kind, after.charge_id) == ("duplicate", "ch_old")
    )


def test_a_recorded_charge_that_failed_later_is_reported_with_stripes_code() -> None:
    # A bank debit recorded while pending, then returned: the customer has not paid.
    [finding] = classify([charge("ch_1", state="failed")], {"cust-1": entry("ch_1")})
    assert (finding.kind, finding.charge_id, finding.ledger_status) == (
        "failed_later",
        "ch_1",
        "charged",
    )
    assert finding.failure_code == "debit_not_authorized"


def test_once_recorded_failed_a_charge_that_failed_later_is_reported_no_more() -> None:
    assert classify([charge("ch_1", state="failed")], {"cust-1": entry("ch_1", "failed")}) == []


@pytest.mark.parametrize("state", ["refunded", "failed"])
def test_another_charge_stands_for_the_rows_when_that_is_no_longer_made(
    state: ChargeState,
) -> None:
    # A duplicate of which a person refunded the one the ledger records: paid once. Past
    # the oldest (Stripe lists the newest first), the others are still duplicates.
    charges = [charge("ch_3"), charge("ch_2"), charge("ch_1", state=state)]
    [finding] = classify(charges, {"cust-1": entry("ch_1")})
    assert (finding.kind, finding.charge_id, finding.ledger_charge_id) == (
        "duplicate",
        "ch_3",
        "ch_1",
    )
    assert classify(charges[1:], {"cust-1": entry("ch_1")}) == []


def test_a_refunded_charge_is_no_finding_and_a_failed_one_no_charge() -> None:
    # Refunded in full: a person settled it. Failed: the customer was never charged.
    refunded = charge("ch_1", state="refunded")
    assert classify([refunded], {"cust-1": entry("ch_1")}) == []
    assert classify([charge("ch_2", state="failed")], {"cust-1": entry(None, "failed")}) == []
    assert classify([charge("ch_9", customer_id="cust-9", state="refunded")], {}) == []


@given(st.lists(st.sampled_from(["ch_1", "ch_2", "ch_3"]), max_size=8))
def test_each_charge_is_reported_at_most_once_and_never_the_ledgers(ids: list[str]) -> None:
    findings = classify([charge(i) for i in ids], {"cust-1": entry("ch_1")})
    reported = [f.charge_id for f in findings]
    assert len(reported) == len(set(reported))
    assert set(reported) == set(ids) - {"ch_1"}


def test_the_report_reads_with_ids_and_amounts() -> None:
    report = ReconcileReport(
        period="2026-12",
        workflow_id="billing-reconcile-2026-12",
        claims=[
            ClaimResolution(
                customer_id="cust-1", action="recorded", outcome="charged", charge_id="ch_1"
            )
        ],
        more_claims=False,
        reservations=[],
        vault_checked=False,
        customers_checked=2,
        charges_checked=3,
        unchecked_customers=[],
        findings=classify(
            [charge("ch_1"), charge("ch_2"), charge("ch_3", customer_id="cust-3", amount=500)],
            {"cust-1": entry("ch_1")},
        ),
        finding_counts={"duplicate": 1, "orphan": 1},
        unchecked_count=0,
    )
    text = describe_reconciliation(report)
    assert "cust-1: recorded charged ch_1" in text
    assert "DUPLICATE ch_2 usd 10.00 for cust-1" in text
    assert "ORPHAN ch_3 usd 5.00 for cust-3 (no ledger row)" in text
    assert "1 duplicate, 1 orphan," in text
    assert [f.charge_id for f in report.findings if f.kind == "duplicate"] == ["ch_2"]


def finding(charge_id: str, kind: FindingKind = "duplicate") -> Finding:
    [found] = classify([charge(charge_id)], {"cust-1": entry("ch_ledger")})
    return found.model_copy(update={"kind": kind})


def test_a_comparison_counts_every_finding_once_and_lists_a_bounded_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Thousands of findings once passed Temporal's 2 MB limit on the report, and its
    # workflow never completed.
    monkeypatch.setattr(reconciliation, "MAX_LISTED", 3)
    compared = Comparison()
    first = [finding(f"ch_{i}") for i in range(4)] + [finding("ch_9", "orphan")]
    compared.add(
        ChargesPage(findings=first, customers=2, charges=6, unchecked=["a", "b"], next_cursor="x")
    )
    # A Stripe customer shared by two of ours: its charges come again on another page.
    again = [finding("ch_1"), finding("ch_5")]
    compared.add(
        ChargesPage(findings=again, customers=1, charges=2, unchecked=["c", "d"], next_cursor=None)
    )
    assert compared.finding_counts == {"duplicate": 5, "orphan": 1}
    assert [f.charge_id for f in compared.findings] == ["ch_0", "ch_1", "ch_2"]
    assert (compared.customers_checked, compared.charges_checked) == (3, 8)
    assert (compared.unchecked_customers, compared.unchecked_count) == (["a", "b", "c"], 4)


def page_of(*found: Finding, **fields: Any) -> ChargesPage:
    """A page of one customer whose charges gave these findings, other fields as given."""
    base: dict[str, Any] = {"customers": 1, "charges": 1, "unchecked": [], "next_cursor": None}
    return ChargesPage.model_validate({**base, "findings": list(found), **fields})


def test_findings_past_the_reports_room_are_counted_where_the_page_says() -> None:
    # Past the room a finding is only counted, and only by the page of the first customer
    # of ours listed under its Stripe customer: another's page lists the same charge again.
    found = [finding("ch_1"), finding("ch_2", "orphan"), finding("ch_3"), finding("ch_4")]
    in_full, counts = for_listing(found, 1, counted_here={"ch_1", "ch_2", "ch_4"})
    assert [f.charge_id for f in in_full] == ["ch_1"]
    assert counts == {"orphan": 1, "duplicate": 1}
    compared = Comparison()
    compared.add(page_of(*in_full, unlisted_counts=counts))
    assert compared.finding_counts == {"duplicate": 2, "orphan": 1}
    assert [f.charge_id for f in compared.findings] == ["ch_1"]
    # What a reconciliation carries when it continues as new stays small.
    assert compared.seen == {"ch_1"}


def test_no_room_is_left_once_as_many_findings_were_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A page listed in full a charge seen before (a shared Stripe customer's) and counted one
    # past its room: a later page given room could list that one again, and count it twice.
    monkeypatch.setattr(reconciliation, "MAX_LISTED", 2)
    compared = Comparison()
    compared.add(page_of(finding("ch_1")))
    compared.add(page_of(finding("ch_1"), unlisted_counts={"duplicate": 1}))
    assert len(compared.findings) == 1 and compared.room == 0


def test_findings_a_page_of_an_earlier_release_sent_by_charge_id_are_counted_once() -> None:
    compared = Comparison()
    for _ in range(2):
        compared.add(page_of(unlisted={"ch_3": "duplicate"}))
    assert compared.finding_counts == {"duplicate": 1}


def test_a_comparison_carried_over_continue_as_new_goes_on_where_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reconciliation, "MAX_LISTED", 2)
    compared = Comparison()
    compared.add(page_of(finding("ch_1"), unchecked=["a"]))
    payload = pydantic_data_converter.payload_converter.to_payloads([compared])
    [carried] = pydantic_data_converter.payload_converter.from_payloads(payload, [Comparison])
    assert carried == compared and carried.room == 1
    carried.add(page_of(finding("ch_1"), finding("ch_2"), finding("ch_3")))
    assert [f.charge_id for f in carried.findings] == ["ch_1", "ch_2"]
    assert carried.finding_counts == {"duplicate": 3} and carried.room == 0


def test_a_report_says_how_many_findings_it_does_not_list() -> None:
    listed = [finding("ch_1"), finding("ch_2")]
    report = ReconcileReport(
        period="2026-12",
        workflow_id="billing-reconcile-2026-12",
        claims=[],
        more_claims=False,
        reservations=[],
        vault_checked=False,
        customers_checked=5000,
        charges_checked=9000,
        unchecked_customers=["c-1"],
        findings=listed,
        finding_counts={"duplicate": 4000},
        unchecked_count=7,
    )
    text = describe_reconciliation(report)
    assert (
        "4000 duplicates, 0 orphans, 0 unrecorded, 0 failed later"
        " (the first 2 of 4000 listed here" in text
    )
    assert "c-1 (the first 1 of 7 listed here" in text


def quiet_report(**changes: object) -> ReconcileReport:
    report = ReconcileReport(
        period="2026-12",
        workflow_id="billing-reconcile-2026-12",
        claims=[ClaimResolution(customer_id="c-1", action="left", detail="its workflow runs")],
        more_claims=False,
        reservations=[
            ReservationResolution(
                vault_key_id="vkey_1", key_prefix="abcdef01", customer_id="c-2", state="unknown"
            )
        ],
        vault_checked=True,
        customers_checked=2,
        charges_checked=2,
        unchecked_customers=[],
        findings=[],
        finding_counts={},
        unchecked_count=0,
    )
    return report.model_copy(update=changes)


def test_a_report_needs_a_person_only_for_what_no_later_run_settles() -> None:
    # A claim its workflow owns, a reservation still in its wait: a later run settles them.
    assert not quiet_report().needs_a_person
    left = ClaimResolution(customer_id="c-3", action="left", detail="key", needs_person=True)
    stalled = ReservationResolution(
        vault_key_id="vkey_1",
        key_prefix="0123abcd",
        customer_id="c-4",
        state="unknown",
        detail="cancel pi_1",
        needs_person=True,
    )
    assert quiet_report(claims=[left]).needs_a_person
    assert quiet_report(reservations=[stalled]).needs_a_person
    assert quiet_report(finding_counts={"orphan": 1}).needs_a_person
    assert quiet_report(unchecked_count=1).needs_a_person


def test_a_report_counts_its_open_claims_by_what_it_did_and_says_when_more_remain() -> None:
    """A claim left for a person is counted with the rest, and a run that took only some
    of the period's claims says so: read as done, the rest would stay open."""
    claims = [
        ClaimResolution(customer_id="c-1", action="recorded", outcome="charged", charge_id="ch_1"),
        *(ClaimResolution(customer_id=f"c-{i}", action="left", detail="key") for i in (2, 3)),
    ]
    text = describe_reconciliation(quiet_report(claims=claims, more_claims=True))
    assert "  open claims: 3, recorded 1, left 2 (more remain: run it again)\n" in text
    assert "more remain" not in describe_reconciliation(quiet_report(claims=claims))


def test_a_reservation_settled_is_shown_in_its_own_currency() -> None:
    # 150,000 in yen is not $1,500: the line names the key's currency, never "cents".
    committed = ReservationResolution(
        vault_key_id="vkey_jp",
        key_prefix="abcd1234",
        customer_id="c-jp",
        state="committed",
        amount_cents=150_000,
        currency="jpy",
    )
    text = describe_reconciliation(quiet_report(reservations=[committed]))
    assert "vkey_jp key abcd1234...: committed jpy 150,000" in text
    assert "cents" not in text


def test_a_periods_reconciliation_has_one_workflow_id() -> None:
    assert reconcile_workflow_id(Period(2026, 12)) == "billing-reconcile-2026-12"


def test_a_reconcile_schedule_fires_daily_and_says_so_to_its_launcher() -> None:
    schedule = build_schedule(
        MonthlySchedule(schedule_id="reconcile", hour=6, action="reconcile"),
        "billing",
        RunOptions(),
    )
    [calendar] = schedule.spec.calendars
    assert [(r.start, r.end) for r in calendar.day_of_month] == [(1, 31)]
    assert calendar.comment == "every day at 06:00"
    # A payload written before `action` existed still means billing.
    assert ScheduledBillingInput.model_validate({"time_zone": "UTC"}).action == "bill"


def test_a_schedule_created_when_runs_drained_their_children_still_starts_runs() -> None:
    # A schedule keeps the input it was created with; runs then had a drain_seconds option.
    created = {"time_zone": "UTC", "options": {"max_in_flight": 300, "drain_seconds": 120.0}}
    scheduled = ScheduledBillingInput.model_validate(created)
    assert scheduled.options.max_in_flight == 300
    assert "drain_seconds" not in scheduled.options.model_dump()


DECLINED = ChargeFailure(code="card_declined", message="Your card was declined.")


def test_a_failure_stripe_answered_the_last_attempt_for_is_released_at_once() -> None:
    assert release_wait(DECLINED, 500) is None


@pytest.mark.parametrize(
    ("found", "upstream_status"),
    [
        (None, 500),  # nothing on Stripe: the wait as ever
        (DECLINED, None),  # no answer (a timeout, a drop, a settle cut off): may still commit
        (DECLINED, 409),  # the attempt did not run: an earlier one may still be running
        (DECLINED, 429),
        (DECLINED, 504),  # a gateway's answer, not Stripe's
    ],
)
def test_a_release_waits_unless_stripe_answered_and_shows_a_failure(
    found: ChargeFailure | None, upstream_status: int | None
) -> None:
    assert release_wait(found, upstream_status) == RELEASE_AFTER


def test_an_intent_left_unconfirmed_keeps_its_reservation_counted_until_cancelled() -> None:
    # Stripe may still complete it: its cap room stays counted whatever the reservation's age,
    # and the report says what a person must do. Cancelled, it is a failure like any other.
    stalled = ChargeFailure(
        code=INCOMPLETE_INTENT, message="cancel pi_1 on Stripe", payment_intent_id="pi_1"
    )
    assert left_unknown_because(stalled) == "cancel pi_1 on Stripe"
    assert left_unknown_because(DECLINED) is None
    assert left_unknown_because(None) is None
    # A claim recorded so is left for that person too, with or without a vault reservation.
    left = recorded_failure("c-1", stalled)
    assert (left.outcome, left.needs_person) == ("failed", True)
    assert left.detail == f"{INCOMPLETE_INTENT}: cancel pi_1 on Stripe"
    assert not recorded_failure("c-1", DECLINED).needs_person


@pytest.mark.parametrize(
    ("retry_state", "passing"),
    [
        (RetryState.MAXIMUM_ATTEMPTS_REACHED, True),  # e.g. a Stripe outage past 8 tries
        (RetryState.TIMEOUT, True),
        (RetryState.NON_RETRYABLE_FAILURE, False),  # e.g. a key no later run could use
    ],
)
def test_a_lookup_that_failed_is_left_for_a_person_saying_whether_it_may_pass(
    retry_state: RetryState, passing: bool
) -> None:
    # Left loudly either way: a failure that lasts would otherwise keep the claim open.
    err = ActivityError(
        "activity error",
        scheduled_event_id=5,
        started_event_id=6,
        identity="worker",
        activity_type="reconcile_settle_claim",
        activity_id="1",
        retry_state=retry_state,
    )
    left = _lookup_failed(CLAIM, err)
    assert (left.action, left.needs_person) == ("left", True)
    assert ("next reconciliation looks again" in (left.detail or "")) is passing


def test_a_report_says_what_is_left_to_look_at_again() -> None:
    # quiet_report leaves a claim its workflow owns and a reservation unknown.
    assert quiet_report().open_reason == "1 open claims, 1 vault reservations unknown"
    settled = ReservationResolution(
        vault_key_id="vkey_1", key_prefix="abcdef01", customer_id="c-2", state="committed"
    )
    recorded = ClaimResolution(customer_id="c-1", action="recorded", outcome="charged")
    done = quiet_report(claims=[recorded], reservations=[settled])
    assert done.open_reason is None
    assert done.model_copy(update={"more_claims": True}).open_reason == "0 open claims and more"
    assert done.model_copy(update={"pending_charges": 3}).open_reason == "3 bank debits pending"
    duplicate = done.model_copy(update={"finding_counts": {"duplicate": 1}})
    assert duplicate.open_reason == "something for a person"
    # A finding a person marked handled is not in the counts: nothing is left.
    assert done.model_copy(update={"handled_count": 2}).open_reason is None


def test_a_report_lists_the_reservations_for_a_person_first() -> None:
    """Past the report's room a reservation left for a person would not make it need one."""

    def reservation(key: str, state: str, *, needs_person: bool = False) -> ReservationResolution:
        return ReservationResolution.model_validate(
            {
                "vault_key_id": "vkey_1",
                "key_prefix": key,
                "customer_id": None,
                "state": state,
                "needs_person": needs_person,
            }
        )

    settled = reservation("00000001", "committed")
    waiting = [reservation(f"{i:08d}", "unknown") for i in range(2, 5)]
    stalled = reservation("00000009", "unknown", needs_person=True)
    listed = reservation_to_report_keys([settled, *waiting, stalled], 2)
    assert listed == ["00000009", "00000002"]
    assert reservation_to_report_keys([settled, *waiting], 10) == [
        "00000002",
        "00000003",
        "00000004",
        "00000001",
    ]


def reservation_to_report_keys(resolutions: list[ReservationResolution], room: int) -> list[str]:
    return [r.key_prefix for r in reservations_to_report(resolutions, room)]


def test_a_shared_stripe_customers_findings_are_counted_once_whatever_the_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two of ours (a renamed id) share a Stripe customer whose charges ch_x and ch_y are
    findings; the page of the one that does not count them comes first and fills the room."""
    monkeypatch.setattr(reconciliation, "MAX_LISTED", 2)
    compared = Comparison()
    for found, counted_here in (
        # Its own charge ch_a, and the shared ones, which the other's page counts.
        ([finding("ch_a"), finding("ch_x"), finding("ch_y")], {"ch_a"}),
        ([finding("ch_x"), finding("ch_y")], {"ch_x", "ch_y"}),
        # A third sharing it, counting nothing of it, after the room is gone.
        ([finding("ch_y")], set()),
    ):
        in_full, counts = for_listing(found, compared.room, counted_here)
        compared.add(page_of(*in_full, unlisted_counts=counts))
    assert compared.finding_counts == {"duplicate": 3}
    assert [f.charge_id for f in compared.findings] == ["ch_a", "ch_x"]


def test_a_page_counts_a_charge_listed_twice_on_it_once() -> None:
    in_full, counts = for_listing([finding("ch_1"), finding("ch_1"), finding("ch_2")], 0, {"ch_1"})
    assert (in_full, counts) == ([], {"duplicate": 1})


def test_a_run_that_ended_before_its_close_needs_a_person_and_a_recheck() -> None:
    # Due customers no run claimed have no claim or charge to find: only this count says
    # they went unbilled, and no later reconciliation bills them.
    recorded = ClaimResolution(customer_id="c-1", action="recorded", outcome="charged")
    ended = quiet_report(claims=[recorded], reservations=[], unclaimed_by_ended_run=2)
    assert ended.needs_a_person
    assert ended.open_reason == "something for a person"


def test_a_period_is_rechecked_for_whatever_needs_a_person_not_only_findings() -> None:
    # The daily reconciliation goes back to a period only while its open_reason says
    # something: customers nobody could list, or an intent a person must cancel (recorded
    # failed, so no claim is left open), must keep it coming back, as a finding does.
    recorded = ClaimResolution(customer_id="c-1", action="recorded", outcome="charged")
    done = quiet_report(claims=[recorded], reservations=[])
    assert done.open_reason is None
    stalled = recorded_failure(
        "c-1",
        ChargeFailure(
            code=INCOMPLETE_INTENT, message="cancel pi_1 on Stripe", payment_intent_id="pi_1"
        ),
    )
    for report in (
        done.model_copy(update={"unchecked_count": 1}),
        done.model_copy(update={"claims": [stalled]}),
    ):
        assert report.open_reason == "something for a person"


def test_a_finding_is_reported_in_its_charges_own_currency() -> None:
    # 150,000 in yen is not $1,500: a person refunds what the finding says.
    yen = charge("ch_2", amount=150_000).model_copy(update={"currency": "jpy"})
    [finding] = classify([charge("ch_1"), yen], {"cust-1": entry("ch_1")})
    assert (finding.charge_id, finding.amount_cents, finding.currency) == ("ch_2", 150_000, "jpy")

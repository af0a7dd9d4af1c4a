"""Reconciliation's rules: which open claims it may resolve, and how Stripe's charges compare
with the ledger. Pure functions over records; the I/O is in activities/reconcile.py."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import datetime, timedelta
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from billing.models import (
    ChargeFailure,
    Claim,
    Control,
    LedgerStatus,
    OperatorRequest,
    Outcome,
    Record,
    WorkflowInput,
)
from billing.periods import parse_period, run_command

# Where the customer's CustomerChargeWorkflow stands, as Temporal describes it.
ChildState = Literal["running", "closed", "absent"]
# orphan: no ledger row for the customer and period; duplicate: the row records another
# charge; unrecorded: the row ended without a charge (failed, skipped, cancelled);
# failed_later: the row's charge, recorded as made, that Stripe then failed (a bank debit
# returned), with no other charge made: the customer has not paid. The row is left as the
# worker recorded it (a failed row would release a renamed customer's new id, which a run
# would then charge), so it is reported every day, as a duplicate is until it is refunded.
FindingKind = Literal["orphan", "duplicate", "unrecorded", "failed_later"]
# A charge on Stripe: made (succeeded, or pending as a bank debit is for days), refunded in
# full (a person settled it), or failed.
ChargeState = Literal["made", "refunded", "failed"]
# The statuses of a Stripe Charge that was made.
MADE_STATUSES = frozenset({"succeeded", "pending"})
ClaimAction = Literal["recorded", "redriven", "left"]
# An unknown reservation with no charge on Stripe is released only once it has not changed
# for this long, by the vault's clock: Stripe may still commit a request the vault stopped
# waiting for.
RELEASE_AFTER = timedelta(minutes=10)
# What the vault records when Stripe itself answered an attempt with an error: the request ran
# and ended, whatever it did.
STRIPE_ERROR_ANSWER = 500
# The failure of a PaymentIntent Stripe left unconfirmed after an error
# (activities/stripe_gateway.py): not final until a person cancels it.
INCOMPLETE_INTENT = "payment_intent_incomplete"
# Earlier periods the daily reconciliation goes back to at one firing, those reconciled
# longest ago first: the rest wait for the next day's, so that a firing never starts a long
# list of reconciliations.
RECHECKS_PER_FIRING = 3
# A run started this recently, and since its period was last reconciled (if ever), has its
# period reconciled again; runs before were billed before reconciliations were kept.
RECHECK_RUNS_WITHIN = timedelta(days=62)


# A Stripe charge's id, as a person copies it from a report (card charges ch_, others py_).
CHARGE_ID_PATTERN = r"^(ch|py)_[A-Za-z0-9]{1,250}$"
ChargeId = Annotated[str, StringConstraints(pattern=CHARGE_ID_PATTERN)]


class HandledRequest(OperatorRequest):
    """A person has handled a finding (the customer agreed to a duplicate, a returned debit
    was collected another way): later reconciliations count it as handled instead of
    reporting it. `undo` takes a mark back."""

    period: str
    kind: FindingKind
    charge_id: ChargeId
    undo: bool = False


class PeriodToRecheck(Record):
    """An earlier period the daily reconciliation checks again, and why."""

    period: str
    why: str


class ReconcileVerdict(Record):
    """What a period's reconciliation left to look at again (ReconcileReport.open_reason)."""

    period: str
    open_reason: str | None
    # When the reconciliation that reached it began (its first run's start, Temporal's
    # clock): the ledger keeps the verdict of the latest to begin, not of the last attempt
    # to land (a worker frozen past its timeout writing days late). None from a release
    # before it: kept as of when it is recorded.
    began_at: datetime | None = None


class HandledResult(Record):
    charge_id: str
    kind: FindingKind
    # What the mark stands as now: recorded, there before (that record stands), taken back,
    # or none to take back.
    change: Literal["recorded", "already", "undone", "none"]
    period: str | None = None
    handled_by: str | None = None
    reason: str | None = None


class HandledMark(Record):
    """One mark made under a period, standing or taken back (who did it and why kept)."""

    charge_id: str
    kind: FindingKind
    reason: str
    handled_by: str
    handled_at: datetime
    undone_at: datetime | None = None
    undone_by: str | None = None
    undo_reason: str | None = None


class HandledMarks(Record):
    """`python starter.py handled PERIOD`: the marks made under the period, oldest first."""

    period: str
    marks: list[HandledMark]


class ReconcileInput(WorkflowInput):
    period: str
    # A re-driven charge still retrying after this long (a saved Stripe error, a refused
    # vault key) is stopped and left for the next run; its key stays, so stopping is safe.
    # At most a day: the next daily run takes it up again.
    redrive_timeout_seconds: int = Field(default=900, ge=1, le=24 * 3600)
    # Open claims looked up (and re-driven) at once.
    claims_at_once: int = Field(default=20, ge=1, le=100)
    # Customers compared with Stripe per activity.
    page_size: int = Field(default=200, ge=1, le=1000)
    # The comparison continues as new past this many events (or when Temporal suggests it):
    # each page costs about 6, so a period of a million customers takes a few runs.
    history_event_limit: int = Field(default=8000, ge=20, le=40000)
    # Set by the workflow itself when it continues as new: what it found before.
    carried: CarriedOver | None = None


class OpenClaim(Record):
    """A claim with no recorded outcome, and what the ledger says about its run."""

    claim: Claim
    # A request with its key may have reached Stripe (ledger.begin_charge passed).
    sent: bool
    control: Control | None


class ClaimResolution(Record):
    customer_id: str
    action: ClaimAction
    outcome: Outcome | None = None
    charge_id: str | None = None
    detail: str | None = None
    # Left for a person to act on, as `detail` says; not for a workflow that finishes it.
    needs_person: bool = False


class ClaimsToResolve(Record):
    resolve: list[Claim]
    left: list[ClaimResolution]
    # More open claims than one run takes; the next run continues.
    more: bool
    # As ReconcileReport's (0 in histories recorded before it was counted).
    unclaimed_by_ended_run: int = 0


class ReservationResolution(Record):
    vault_key_id: str
    key_prefix: str
    customer_id: str | None
    state: Literal["committed", "released", "unknown"]
    # In the smallest unit of `currency` (the key's).
    amount_cents: int | None = None
    currency: str | None = None
    detail: str | None = None
    # Left unknown until a person acts, as `detail` says; not one a later run settles.
    needs_person: bool = False


class CustomerToCheck(Record):
    customer_id: str
    stripe_customer_id: str
    currency: str
    # The period has a ledger row for it (claimed, finished or skipped).
    in_ledger: bool


class StripeCharge(Record):
    """A charge on Stripe that carries our metadata."""

    charge_id: str
    state: ChargeState
    # Stripe's, for a failed charge.
    failure_code: str | None = None
    # Made, by a bank debit the bank has yet to answer (Stripe's `pending`): it may still
    # come back failed.
    pending: bool = False
    payment_intent_id: str | None
    amount_cents: int
    currency: str
    stripe_customer_id: str | None
    customer_id: str
    period: str
    billing_key: str | None


class LedgerEntry(Record):
    customer_id: str
    status: LedgerStatus
    charge_id: str | None
    # The row's idempotency key: an open claim records the charge made under it.
    idempotency_key: str | None = None


class Finding(Record):
    """A Stripe charge of the period that the ledger does not account for."""

    kind: FindingKind
    charge_id: str
    payment_intent_id: str | None
    customer_id: str
    stripe_customer_id: str | None
    amount_cents: int
    currency: str
    key_prefix: str | None
    ledger_status: LedgerStatus | None
    ledger_charge_id: str | None
    # Stripe's, for a charge that failed later.
    failure_code: str | None = None


# The most findings (and unchecked customers) a report lists: past Temporal's 2 MB payload
# limit (about 6,000 findings) its workflow could never complete. Each finding is logged by
# the activity that found it (event reconcile_finding), and the report counts them all.
MAX_LISTED = 1000


class ChargesPageRequest(Record):
    period: str
    after: str | None
    limit: int = Field(ge=1, le=1000)
    # Findings the report can still list. The page only counts the others: each page's
    # answer stays in the workflow's history, which 150,000 findings in full (every customer
    # charged twice) would take past Temporal's 50 MB.
    listed_room: int = Field(default=MAX_LISTED, ge=0)


class ChargesPage(Record):
    findings: list[Finding]
    customers: int
    charges: int
    # Of `charges`, those still pending (StripeCharge.pending).
    pending: int = 0
    # Customers whose charges could not be listed: no key could read their currency while
    # the period has a ledger row for them, or Stripe refused the listing (e.g. the
    # customer was deleted there). A charge of theirs goes unseen.
    unchecked: list[str]
    next_cursor: str | None
    # Where pages of earlier releases (2a16b98 on) sent every finding past the report's room,
    # by charge id, to be counted once; still counted so, for a run they answered.
    unlisted: dict[str, FindingKind] = Field(default_factory=dict)
    # The page's findings past the report's room, counted by the page of the first customer
    # of ours listed under their Stripe customer (two may share one: a renamed id), so that
    # each is counted once and what the history keeps of a page stays bounded.
    unlisted_counts: dict[FindingKind, int] = Field(default_factory=dict)
    # Findings a person has marked handled: counted here only.
    handled: int = 0


def reservations_to_report(
    resolutions: list[ReservationResolution], room: int
) -> list[ReservationResolution]:
    """The reservations a report lists, as many as it has `room` for: those left for a
    person first (they alone make it need one, so none may fall past the room), then those
    still unknown, then those settled."""
    return sorted(resolutions, key=lambda r: (not r.needs_person, r.state != "unknown"))[:room]


def for_listing(
    findings: list[Finding], room: int, counted_here: Collection[str]
) -> tuple[list[Finding], dict[FindingKind, int]]:
    """Of the findings whose charges the page counts (`counted_here`: a Stripe customer two
    of ours share is counted under one of them alone), once each, those it sends in full (as
    many as the report has room for), and how many of each kind the others are. A page that
    listed another's charges in full as well could list one that the other page counted past
    its room, or count one the other listed, and the report would count it twice."""
    ours = list({f.charge_id: f for f in findings if f.charge_id in counted_here}.values())
    counts: dict[FindingKind, int] = {}
    for f in ours[room:]:
        counts[f.kind] = counts.get(f.kind, 0) + 1
    return ours[:room], counts


class Comparison(BaseModel):
    """Stripe's charges against the ledger, summed over the pages compared so far: the
    reconcile workflow's own state, carried over when it continues as new."""

    model_config = ConfigDict(extra="forbid")

    findings: list[Finding] = Field(default_factory=list)
    finding_counts: dict[FindingKind, int] = Field(default_factory=dict)
    customers_checked: int = 0
    charges_checked: int = 0
    pending_count: int = 0
    unchecked_customers: list[str] = Field(default_factory=list)
    unchecked_count: int = 0
    handled_count: int = 0
    # The charges of the findings listed: a Stripe customer shared by two of ours is listed
    # under each.
    seen: set[str] = Field(default_factory=set)

    @property
    def room(self) -> int:
        """Findings the report can still list: none once as many were counted, since a page
        that only counted some (past its room) may have counted a finding another page would
        list again."""
        return max(MAX_LISTED - sum(self.finding_counts.values()), 0)

    def add(self, page: ChargesPage) -> None:
        for finding in page.findings:
            room = self.room  # before this one is counted
            if self._first(finding.charge_id, finding.kind) and room:
                self.findings.append(finding)
        for charge_id, kind in page.unlisted.items():
            self._first(charge_id, kind)
        for kind, n in page.unlisted_counts.items():
            self.finding_counts[kind] = self.finding_counts.get(kind, 0) + n
        self.handled_count += page.handled
        self.customers_checked += page.customers
        self.charges_checked += page.charges
        self.pending_count += page.pending
        self.unchecked_count += len(page.unchecked)
        room = MAX_LISTED - len(self.unchecked_customers)
        self.unchecked_customers += page.unchecked[: max(room, 0)]

    def _first(self, charge_id: str, kind: FindingKind) -> bool:
        """Count a finding the first time its charge is seen; True then."""
        if charge_id in self.seen:
            return False
        self.seen.add(charge_id)
        self.finding_counts[kind] = self.finding_counts.get(kind, 0) + 1
        return True


class Settled(Record):
    """What a reconciliation settled before it compared: its report's first part."""

    claims: list[ClaimResolution]
    more_claims: bool
    reservations: list[ReservationResolution]
    vault_checked: bool  # as in ReconcileReport
    unclaimed_by_ended_run: int = 0  # as in ReconcileReport


class CarriedOver(Record):
    """A reconciliation continued as new mid-comparison: what it had, and where it was."""

    settled: Settled
    compared: Comparison
    cursor: str
    began_at: datetime | None = None  # as in ReconcileVerdict; None from a release before it


class ReconcileReport(Record):
    period: str
    workflow_id: str
    claims: list[ClaimResolution]
    more_claims: bool
    reservations: list[ReservationResolution]
    # False without a vault (workers charging Stripe directly): no reservations exist.
    vault_checked: bool
    customers_checked: int
    charges_checked: int
    # Of the charges checked, bank debits their bank has yet to answer: the ledger holds
    # them charged, and one the bank returns is reported then (failed_later).
    pending_charges: int = 0
    # The first MAX_LISTED of each; the counts cover all.
    unchecked_customers: list[str]
    findings: list[Finding]
    finding_counts: dict[FindingKind, int]
    unchecked_count: int
    # Findings a person marked handled (`python starter.py handled`), not in the above.
    handled_count: int = 0
    # Due customers no run claimed, the period's last run having ended before its close
    # (terminated, failed, timed out, gone from Temporal) with no cancel of an operator's
    # (or Temporal's Cancel): billed by no run, with no claim to reconcile. Counted here for
    # runs no schedule launched, which the daily check of the billing schedule's firings
    # does not see.
    unclaimed_by_ended_run: int = 0

    @property
    def needs_a_person(self) -> bool:
        """Money on Stripe the ledger does not account for, customers nobody could check
        (e.g. every listing refused to a key of the wrong account), a claim or reservation
        left for a person, or a run ended before its close."""
        return bool(
            self.finding_counts
            or self.unclaimed_by_ended_run
            or self.unchecked_count
            or any(c.needs_person for c in self.claims)
            or any(r.needs_person for r in self.reservations)
        )

    @property
    def open_reason(self) -> str | None:
        """What is left to look at again, in words, or None when nothing is: the daily
        reconciliation goes back to an earlier period for as long as its last report says
        something (`ledger.periods_to_recheck`), so that a debit its bank returns weeks later,
        or a finding nobody has handled, is still reported every day."""
        reasons = []
        left = sum(c.action == "left" for c in self.claims)
        if left or self.more_claims:
            reasons.append(f"{left} open claims" + (" and more" if self.more_claims else ""))
        if self.pending_charges:
            reasons.append(f"{self.pending_charges} bank debits pending")
        unknown = sum(r.state == "unknown" for r in self.reservations)
        if unknown:
            reasons.append(f"{unknown} vault reservations unknown")
        if self.needs_a_person:
            reasons.append("something for a person")
        return ", ".join(reasons) or None


def release_wait(found: ChargeFailure | None, upstream_status: int | None) -> timedelta | None:
    """How long an unknown reservation Stripe shows no charge for must have been left alone
    before it is released: not at all when Stripe answered its last attempt (a 500: that
    request ended) and shows the key's charge failed, so nothing of it is still in flight.
    Otherwise RELEASE_AFTER: with no answer (a timeout, a dropped connection, a settle cut
    off), the request may still commit; and a failure alone may be another request's (one
    with our metadata under another key, or the key's first use over 24 hours ago)."""
    if isinstance(found, ChargeFailure) and upstream_status == STRIPE_ERROR_ANSWER:
        return None
    return RELEASE_AFTER


def left_unknown_because(found: ChargeFailure | None) -> str | None:
    """Why an unknown reservation must stay counted whatever its age, or None: its intent was
    left unconfirmed, the lookup's key could not cancel it, and Stripe may still complete it.
    Once it is cancelled, the failure found is final and the reservation is released."""
    if isinstance(found, ChargeFailure) and found.code == INCOMPLETE_INTENT:
        return found.message
    return None


def recorded_failure(customer_id: str, found: ChargeFailure) -> ClaimResolution:
    """A claim recorded failed from what Stripe holds. One whose intent Stripe left
    unconfirmed is a person's to cancel on Stripe (left_unknown_because), vault or not."""
    stalled = left_unknown_because(found)
    return ClaimResolution(
        customer_id=customer_id,
        action="recorded",
        outcome="failed",
        charge_id=found.charge_id,
        detail=found.code if stalled is None else f"{found.code}: {stalled}",
        needs_person=stalled is not None,
    )


def left_alone(
    child: ChildState, period_running: bool, open_claim: OpenClaim, now: datetime
) -> ClaimResolution | None:
    """Why reconciliation must leave a claim alone, or None when it may resolve it.

    A running CustomerChargeWorkflow owns its claim. A period's run never starts a closed one
    again for a customer with a claim (REJECT_DUPLICATE; only one with no ledger row is
    started anew), so nothing else works on its claim. One that never ran
    may still be started by its period's run while that runs. A charge never sent while the
    period is paused waits for the operator, as the ledger's gate would make it. If the
    period's run ended while paused (terminated), nobody is left to resume it: the claim is
    left for a person, whom a new run or a skip serves.
    """
    if child == "running":
        reason = "its CustomerChargeWorkflow is running"
    elif child == "absent" and period_running:
        reason = "its period's run is running and may still start its workflow"
    elif not open_claim.sent and open_claim.control == "paused":
        reason = "the period is paused and this charge was never sent"
    else:
        return None
    claim = open_claim.claim
    # One sent goes on whatever the pause (the gate passes it), so its workflow ends it.
    stranded = not period_running and open_claim.control == "paused" and not open_claim.sent
    if stranded:
        reason += (
            ", and its period's run ended while paused (terminated?), so nothing resumes it:"
            f" run the period again ({run_command(parse_period(claim.period), now)}), which"
            " resumes it, or skip the customer"
        )
    return ClaimResolution(
        customer_id=claim.customer_id, action="left", detail=reason, needs_person=stranded
    )


def classify(charges: Iterable[StripeCharge], ledger: dict[str, LedgerEntry]) -> list[Finding]:
    """What of the period's charges on Stripe (as Stripe lists them, newest first) the ledger
    does not account for. `ledger` holds the period's rows by customer id.

    While a row is still claimed, the newest charge made under its key stands for it (its
    open claim's lookup records that one when it is resolved), else its customer's newest
    charge made: any other is a duplicate. When
    a row's own charge is no longer made (refunded by a person, or failed later), its oldest
    other charge made stands for it, so the one reported is the same from day to day. A
    row's charge that failed later with none other made is reported, and so is every charge
    made for a row that ended without one.
    """
    listed: dict[str, StripeCharge] = {}
    for charge in charges:
        listed.setdefault(charge.charge_id, charge)
    # Rows whose own charge Stripe shows refunded or failed: the customer has paid only if
    # another charge was made.
    unmade: dict[str, StripeCharge] = {}
    for customer_id, row in ledger.items():
        own = listed.get(row.charge_id or "")
        if row.status == "charged" and own is not None and own.state != "made":
            unmade[customer_id] = own
    stands: dict[str, str] = {}  # customer id: the charge that stands for its row
    by_key: set[str] = set()  # claimed customers whose charge under the row's key stands
    for charge in listed.values():
        if charge.state != "made":
            continue
        entry = ledger.get(charge.customer_id)
        if entry is not None and entry.status == "claimed":
            if charge.customer_id in by_key:
                continue
            if charge.billing_key is not None and charge.billing_key == entry.idempotency_key:
                # The newest under its key, as the claim's lookup finds it.
                by_key.add(charge.customer_id)
                stands[charge.customer_id] = charge.charge_id
            else:
                stands.setdefault(charge.customer_id, charge.charge_id)
        elif charge.customer_id in unmade:
            stands[charge.customer_id] = charge.charge_id
    findings: list[Finding] = []
    for charge in listed.values():
        entry = ledger.get(charge.customer_id)
        if charge.state != "made" or charge.charge_id == stands.get(charge.customer_id):
            continue
        if entry is not None and entry.charge_id == charge.charge_id:
            continue
        if entry is None:
            kind: FindingKind = "orphan"
        elif entry.charge_id is not None or entry.status == "claimed":
            kind = "duplicate"
        else:
            kind = "unrecorded"
        findings.append(_finding(kind, charge, entry))
    for customer_id, own in unmade.items():
        if own.state == "failed" and customer_id not in stands:
            findings.append(_finding("failed_later", own, ledger[customer_id]))
    return findings


def _finding(kind: FindingKind, charge: StripeCharge, entry: LedgerEntry | None) -> Finding:
    return Finding(
        kind=kind,
        charge_id=charge.charge_id,
        payment_intent_id=charge.payment_intent_id,
        customer_id=charge.customer_id,
        stripe_customer_id=charge.stripe_customer_id,
        amount_cents=charge.amount_cents,
        currency=charge.currency,
        key_prefix=charge.billing_key[:8] if charge.billing_key else None,
        ledger_status=entry.status if entry else None,
        ledger_charge_id=entry.charge_id if entry else None,
        failure_code=charge.failure_code if kind == "failed_later" else None,
    )


ReconcileInput.model_rebuild()  # `carried` names a model defined after it

"""Records that cross a boundary: workflow and activity inputs and outputs, CLI JSON."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, computed_field, field_validator

from billing.errors import InvalidAmountError
from billing.keys import validate_customer_id
from billing.money import spend_caps, validate_amount_in
from billing.redact import shown_line
from billing.wording import counted

# Who decides what billing decides by itself: a run that paused itself, a customer held.
AUTOMATIC = "billing (automatic)"
# The codes a run that paused itself gives first in its reason: its vault key was refused.
# Renewing the paused run's keys mends these three; a revoked key stays refused (the kill
# switch) until its row is deleted.
SPEND_CAP_EXCEEDED_CODE = "spend_cap_exceeded"
VAULT_KEY_EXPIRED_CODE = "vault_key_expired"
NO_PERIOD_KEY_CODE = "no_period_key"
VAULT_KEY_REVOKED_CODE = "vault_key_revoked"
RENEWABLE_PAUSES = frozenset({SPEND_CAP_EXCEEDED_CODE, VAULT_KEY_EXPIRED_CODE, NO_PERIOD_KEY_CODE})

LedgerStatus = Literal["claimed", "charged", "failed", "skipped", "cancelled"]
Outcome = Literal["charged", "already_billed", "failed", "skipped", "cancelled"]
# A customer's charge workflow's history grows only while it waits (a Stripe outage of hours,
# a pause of days); past this many events it continues as new with the same claim.
ChildHistoryLimit = Annotated[int, Field(ge=10, le=40000)]
CHILD_HISTORY_EVENTS = 2000
Control = Literal["running", "paused", "cancelled"]
# What the ledger says about one charge attempt, just before Stripe would be called.
Gate = Literal["go", "paused", "cancelled", "skipped"]
# Which Stripe API charges: PaymentIntents, or the legacy Charges API.
ChargeApi = Literal["payment_intents", "charges"]
# What a schedule's firing does with the period it resolves.
ScheduledAction = Literal["bill", "reconcile"]


def finished_outcome(status: LedgerStatus) -> Outcome:
    """A finished ledger row seen again: a charge made earlier counts as already billed."""
    if status == "claimed":
        raise ValueError("a claimed row has no outcome yet")
    return "already_billed" if status == "charged" else status


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WorkflowInput(Record):
    """A workflow's input: one its model refuses (started by hand with a wrong field) fails
    the workflow as it starts, saying why (billing.data_converter), rather than its first
    workflow task for ever, holding the workflow's ID."""


class Claim(Record):
    """A customer's row for one period: fixes the key, amount and currency of every attempt."""

    customer_id: str
    period: str
    idempotency_key: str
    amount_cents: int
    currency: str
    stripe_customer_id: str
    payment_method: str | None
    status: LedgerStatus
    claimed_at: datetime
    payment_intent_id: str | None = None
    charge_id: str | None = None
    failure_code: str | None = None
    skip_reason: str | None = None
    claimed_by_run: str | None = None
    # The API every request of the claim uses, fixed when claimed (same key, same endpoint);
    # None for a claim made before the API was recorded: the worker's setting.
    charge_api: ChargeApi | None = None
    # How long ago it was claimed, by the database's clock when read from the ledger (None
    # otherwise): a worker's own clock may be off. Not carried in workflow payloads.
    claimed_ago: timedelta | None = Field(default=None, exclude=True)


class ChargeResult(Record):
    """Stripe accepted the charge."""

    charge_id: str
    payment_intent_id: str | None
    amount_cents: int
    currency: str
    replayed: bool = False
    # A bank debit its bank has yet to answer (a Charge pending, its intent processing).
    pending: bool = False


class ChargeFailure(Record):
    """Stripe refused the charge for good (decline, authentication required)."""

    code: str
    decline_code: str | None = None
    message: str
    payment_intent_id: str | None = None
    charge_id: str | None = None


class CustomerChargeInput(WorkflowInput):
    period: str
    customer_id: str
    parent_workflow_id: str | None = None
    history_event_limit: ChildHistoryLimit = CHILD_HISTORY_EVENTS
    # A stop the run before this one was given (a Temporal cancel), carried across
    # continue-as-new.
    stop: OperatorRequest | None = None


class CustomerOutcome(Record):
    customer_id: str
    outcome: Outcome
    amount_cents: int = 0
    currency: str | None = None
    charge_id: str | None = None
    failure_code: str | None = None


class DueCustomer(Record):
    customer_id: str
    status: LedgerStatus | None


class DuePage(Record):
    customers: list[DueCustomer]
    next_cursor: str | None


class Listing(Record):
    """One listing of a period's run, under which the ledger marks each customer the run took
    from its pages (migrations/032): the run's id (RunIdentity.run_id, which opened the
    period) and which of its listings this is, 0 the first, one more for each listing of the
    unlisted."""

    run_id: str
    number: int = Field(ge=0)


class RunIdentity(Record):
    """Which run opened a period (migrations/031): the first run id of its workflow's chain
    of runs, and the time of its opening by Temporal's clock (when the opening's attempt
    that succeeded was scheduled)."""

    run_id: str
    opened_at: datetime


class PeriodPlan(Record):
    period: str
    due: int
    to_charge: int
    expected_total_cents: int
    totals_by_currency: dict[str, int] = Field(default_factory=dict)
    # Active customers not due because their Stripe customer is billed (or being billed)
    # this period under another id (renamed: see ledger.held_as_sql); `preview` lists them.
    held: int = 0


class Counts(BaseModel):
    """Outcomes counted so far; mutable because the period workflow accumulates them."""

    due: int = 0
    charged: int = 0
    already_billed: int = 0
    failed: int = 0
    skipped: int = 0
    cancelled: int = 0
    total_charged_cents: int = 0
    charged_by_currency: dict[str, int] = Field(default_factory=dict)

    def add(self, outcome: CustomerOutcome) -> None:
        setattr(self, outcome.outcome, getattr(self, outcome.outcome) + 1)
        if outcome.outcome == "charged":
            self.total_charged_cents += outcome.amount_cents
            if outcome.currency is not None:
                self._add_charged({outcome.currency: outcome.amount_cents})

    def merge(self, other: Counts) -> None:
        """Add another page's counts to these."""
        for field in ("due", *get_args(Outcome), "total_charged_cents"):
            setattr(self, field, getattr(self, field) + getattr(other, field))
        self._add_charged(other.charged_by_currency)

    def _add_charged(self, by_currency: dict[str, int]) -> None:
        for currency, cents in by_currency.items():
            self.charged_by_currency[currency] = self.charged_by_currency.get(currency, 0) + cents


class ControlState(BaseModel):
    """The operator's word on a run: running, paused or cancelled, by whom and why."""

    control: Control = "running"
    reason: str | None = None
    operator: str | None = None


class PeriodState(BaseModel):
    """Everything a period run carries over continue-as-new."""

    period: str
    control: ControlState = Field(default_factory=ControlState)
    plan: PeriodPlan | None = None
    cursor: str | None = None
    listing_done: bool = False
    # The listing is of due customers an earlier one did not reach (imported behind it): see
    # BillingPeriodWorkflow's LISTS_THE_UNLISTED.
    unlisted: bool = False
    # Customers whose child another run started, including the children still in flight
    # when the last run continued as new: the ledger says when they finish.
    started_elsewhere: list[str] = Field(default_factory=list)
    counts: Counts = Field(default_factory=Counts)
    runs: int = 1
    # A cancelled run still finishing: the code of the last vault refusal a child reported
    # (PeriodProgress.refused_after_cancel), until keys are renewed or the run ends. It may
    # be a charge never sent, refused and reopened, which the gate then cancels: the run
    # then ends at once.
    refused_after_cancel: str | None = None
    # Decided by the chain's first run (BillingPeriodWorkflow's RESTART_COMPLETED_UNCLAIMED),
    # which counts a customer in its own way; None from a run of before: then off throughout.
    restarts_completed: bool | None = None
    # Which listing of the run this is (Listing.number), under which the ledger marks the
    # customers the run took (BillingPeriodWorkflow's LISTINGS_MARKED); None for a run whose
    # first run began before: it tells the customers it has not reached by their rows and
    # children.
    listing: int | None = None
    # Customers taken from the listing's pages whose marks the ledger has yet to write: the
    # next page's request, or the close's, writes them.
    unmarked: list[str] = Field(default_factory=list)


class CancelPage(Record):
    """Customers a cancelled run will not start, marked cancelled in the ledger."""

    counts: Counts
    next_cursor: str | None
    # Claimed and sent to Stripe by a child of another run (one terminated, its children
    # left running): the cancel cannot stop them, so the run waits for their outcomes.
    sent: list[str] = Field(default_factory=list)


# The widest window a run may have: far below Temporal's 2,000 pending children per run, and
# below what a worker caches (worker.WORKFLOW_CACHE).
MAX_IN_FLIGHT = 1500


class RunOptions(Record):
    """How a period run fans out; defaults suit one worker on a small machine."""

    # Children running at once.
    max_in_flight: int = Field(default=500, ge=1, le=MAX_IN_FLIGHT)
    # Children started but not yet acknowledged, at most: the server starts each under the
    # period's own lock, and a burst of 500 held it for seconds (the period's next workflow
    # task then waited 10 s on the sticky queue, timed out and was replayed).
    max_starting: int = Field(default=50, ge=1, le=1500)
    page_size: int = Field(default=500, ge=1, le=5000)
    # Continue as new well before Temporal's 4,096-event suggestion and 51,200-event limit.
    history_event_limit: int = Field(default=8000, ge=200, le=40000)
    # Each child's own limit (CustomerChargeInput.history_event_limit).
    child_history_event_limit: ChildHistoryLimit = CHILD_HISTORY_EVENTS
    # A run due to continue as new first lets its children in flight finish, for up to
    # this long (they take about a second), then hands the rest to the next run; 0 hands
    # them over at once.
    hand_over_after_seconds: float = Field(default=5.0, ge=0, le=600)
    billing: Literal["arrears", "advance"] = "arrears"
    # No longer used (hand_over_after_seconds bounds the wait now), but accepted:
    # schedules created before keep it in the input they start each run with.
    drain_seconds: float | None = Field(default=None, exclude=True)


class BillingPeriodInput(WorkflowInput):
    period: str
    options: RunOptions = Field(default_factory=RunOptions)
    state: PeriodState | None = None


class ScheduledBillingInput(WorkflowInput):
    """What a schedule starts: the period comes from the firing's nominal time."""

    options: RunOptions = Field(default_factory=RunOptions)
    time_zone: str = "UTC"
    action: ScheduledAction = "bill"
    # A daily reconciliation's billing schedule: it bills the months reconciled (its billing
    # mode and zone are taken at each firing) and its firings of the last two months are
    # checked for a month left unbilled. None: the mode and zone above, nothing checked.
    billing_schedule_id: str | None = None


# The longest reason a pause, cancel or skip keeps.
REASON_MAX_LENGTH = 500


class OperatorRequest(Record):
    reason: str = Field(min_length=1, max_length=REASON_MAX_LENGTH)
    operator: str = Field(min_length=1, max_length=100)

    # Before the length check, which then counts the redacted text: the period rebuilds this
    # request from its state, and a text grown past the limit would fail its workflow task.
    @field_validator("reason", "operator", mode="before")
    @classmethod
    def _no_key(cls, value: object) -> object:
        # Kept in the ledger and the period's state, and sent redacted by the starter: a key
        # pasted by mistake goes no further than the request that carried it. Made one line,
        # not refused: a run started before this rule rebuilds its requests from its state.
        return shown_line(value) if isinstance(value, str) else value


class SkipRequest(OperatorRequest):
    customer_id: str

    @field_validator("customer_id")
    @classmethod
    def _customer_id(cls, value: str) -> str:
        return validate_customer_id(value)


class PeriodCounts(Record):
    """What a period's run has done: the counts `run --json` and `status --json` print."""

    period: str
    workflow_id: str
    due: int
    charged: int
    already_billed: int
    failed: int
    skipped: int
    cancelled: int
    # The sum over every currency: a figure only for a period in one currency.
    total_charged_cents: int
    # Money charged per currency, in each currency's smallest unit (cents, or yen).
    charged_by_currency: dict[str, int] = Field(default_factory=dict)
    # Held when the run opened (PeriodPlan.held): not due, so in none of the counts above.
    held: int = 0


class PeriodSummary(PeriodCounts):
    # RunIdentity.run_id of the run: where to find it in the Web UI. None from a run that
    # began before it was recorded.
    run_id: str | None = None
    # Set when an operator cancelled the run: the counts are what happened before the cancel.
    cancel_reason: str | None = None
    cancelled_by: str | None = None

    @classmethod
    def empty(cls, period: str, workflow_id: str) -> PeriodSummary:
        """A run that has done nothing (yet)."""
        return cls(
            period=period,
            workflow_id=workflow_id,
            due=0,
            charged=0,
            already_billed=0,
            failed=0,
            skipped=0,
            cancelled=0,
            total_charged_cents=0,
        )


class PeriodProgress(PeriodCounts):
    state: str
    in_flight: int
    expected_due: int | None = None
    reason: str | None = None
    operator: str | None = None
    # A cancelled run still finishing: the vault refused the key that a charge sent before
    # the cancel retries with (its code), so the run ends only once the key is renewed.
    refused_after_cancel: str | None = None
    # The first AWAITED_SHOWN customers whose outcome the run reads from the ledger: children
    # an earlier run started, or whose workflow ended without an outcome. One that stays is
    # a claim nothing runs (its workflow terminated), which `reconcile` settles.
    awaited_in_ledger: list[str] = Field(default_factory=list)


AWAITED_SHOWN = 20


class PeriodRecord(Record):
    """The ledger's row of a period's last run: the summary once it completed."""

    workflow_id: str
    # RunIdentity.run_id of the run that opened it; None for one opened before
    # migrations/031, or by a release from before it.
    run_id: str | None = None
    state: Literal["running", "completed"]
    summary: PeriodSummary | None


class OpenRun(Record):
    """A run started or joined that no worker answered for: how it stands is unknown."""

    period: str
    workflow_id: str
    state: Literal["no_worker"] = "no_worker"


class PeriodTotals(Record):
    """What the ledger holds of a period, every run's rows together: a rerun's own summary
    counts only what it did (`already billed` for what the runs before it charged)."""

    charged: int = 0
    failed: int = 0
    skipped: int = 0
    cancelled: int = 0
    # Claims not finished: a run's in flight, or left to reconciliation.
    claimed: int = 0
    charged_by_currency: dict[str, int] = Field(default_factory=dict)

    @property
    def empty(self) -> bool:
        """No row of the period: no run has billed it, nor has a skip been recorded."""
        return not self.model_dump(exclude_defaults=True)


class PeriodStatus(PeriodProgress):
    """`status`: how the period's latest run stands, and the ledger's totals of every run
    (None when the ledger holds no row of the period, or could not be read)."""

    ledger: PeriodTotals | None = None


class EndedRun(Record):
    """A run that ended without a summary: Temporal's status (failed, terminated, timed_out,
    canceled), or `unfinished` for the ledger's row of a run Temporal no longer holds."""

    period: str
    workflow_id: str
    state: str


class SkipResult(Record):
    customer_id: str
    skipped: bool
    detail: str


class PreviewLine(Record):
    customer_id: str
    stripe_customer_id: str
    amount_cents: int
    currency: str
    status: LedgerStatus | None
    # What a run started now would charge (see billing.ledger.sql.OPEN).
    open: bool
    # False for a row imported before a payment method was required: its charge would name
    # none, and Stripe would take the customer's legacy default source, or refuse.
    has_payment_method: bool
    # The inactive id under which the period billed this line's Stripe customer: a run holds
    # this line rather than bill it (billing.ledger.sql.HELD_AS).
    held_as: str | None = None


PreviewWarningKind = Literal[
    "no_payment_method",
    "claimed_without_payment_method",
    "amount_stripe_refuses",
    "claimed_with_amount_stripe_refuses",
    "stripe_customer_charged_twice",
    "held",
]


class StoredKey(Record):
    """A period's vault key as the ledger stores it."""

    currency: str
    vault_key_id: str
    cap_cents: int
    # Charged through this key alone, as the ledger records: at least that much of its cap
    # is spent (the vault also counts charges in doubt, and others' through it).
    charged_cents: int
    # Listed in issued_vault_keys: a run replaces such a key when it lacks room, and is
    # refused by any other (one issued with the admin token).
    issued_here: bool


class ShortKey(Record):
    """A stored key a run would be refused by (period_keys.kept_key): not the workers', with
    less room than the run has yet to charge in its currency, by the ledger's count alone."""

    currency: str
    vault_key_id: str
    cap_cents: int
    charged_cents: int
    unsent_cents: int


class PreviewWarning(Record):
    """Something a run of the period would do that an operator should look at first."""

    kind: PreviewWarningKind
    # What it is and what to do, to be followed by the entries.
    message: str
    customer_ids: list[str]
    # As a person reads them: a customer id, with why when there is more to say.
    entries: list[str]


def _only(by_currency: dict[str, int]) -> int | None:
    """The figure of the one currency there is (0 for none); None for several: a sum of
    amounts in different currencies is no amount."""
    return None if len(by_currency) > 1 else sum(by_currency.values())


class Preview(Record):
    """What a run of the period would do now, without doing it."""

    # Its JSON carries `warnings`, computed: read back, they are computed again.
    model_config = ConfigDict(frozen=True, extra="ignore")

    period: str
    to_charge: list[PreviewLine]
    already_billed: list[PreviewLine]
    not_billable: list[PreviewLine]
    # The BILLING_CAP_MULTIPLIER of whoever asked: the workers' own decides the caps of keys
    # they issue.
    cap_multiplier: float = 1.10
    # The caps of the keys the period's runs have issued, which a run keeps while they have
    # room for what it charges.
    issued_caps_by_currency: dict[str, int] = Field(default_factory=dict)
    # Read from the ledger alone: a key with a cap above what is left may still lack room
    # (its spend is the vault's to know), which the run itself says.
    short_keys: list[ShortKey] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def totals_by_currency(self) -> dict[str, int]:
        """What a run would charge, per currency: the run issues a key per currency."""
        totals: dict[str, int] = {}
        for line in self.to_charge:
            totals[line.currency] = totals.get(line.currency, 0) + line.amount_cents
        return dict(sorted(totals.items()))

    @computed_field  # type: ignore[prop-decorator]
    @property
    def caps_by_currency(self) -> dict[str, int]:
        """The cap each currency's new key would get, at `cap_multiplier`."""
        return spend_caps(self.totals_by_currency, self.cap_multiplier)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def expected_total_cents(self) -> int | None:
        """What a run would charge, where that is one currency's (or nothing): a sum over
        currencies is no amount, so a period in several has none (`totals_by_currency`)."""
        return _only(self.totals_by_currency)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def cap_cents(self) -> int | None:
        """The new key's cap, where the run would charge in one currency (or none)."""
        return _only(self.caps_by_currency)

    @property
    def without_payment_method(self) -> list[PreviewLine]:
        """Those a run would charge naming no payment method."""
        return [line for line in self.to_charge if not line.has_payment_method]

    @property
    def with_amounts_stripe_refuses(self) -> list[tuple[PreviewLine, str]]:
        """Those a run would charge an amount Stripe refuses (below its minimum charge, finer
        than the currency takes), each with why: rows imported before the import checked."""
        refused = []
        for line in self.to_charge:
            try:
                validate_amount_in(line.amount_cents, line.currency)
            except InvalidAmountError as exc:
                refused.append((line, str(exc)))
        return refused

    @property
    def held(self) -> list[PreviewLine]:
        """Those a run would hold rather than bill: the period billed their Stripe customer
        under another id, inactive since."""
        return [line for line in self.not_billable if line.held_as is not None]

    @property
    def sharing_a_stripe_customer(self) -> dict[str, list[str]]:
        """Stripe customers a run would charge under one customer id while another of theirs
        is charged or billed this period, with those ids: one customer imported twice under
        other ids (`acme-1`, `ACME-1`) is charged twice, as each id has its own key."""
        ids: dict[str, list[str]] = {}
        for line in [*self.already_billed, *self.to_charge]:
            ids.setdefault(line.stripe_customer_id, []).append(line.customer_id)
        charged_now = {line.stripe_customer_id for line in self.to_charge}
        return {
            stripe_id: sorted(customer_ids)
            for stripe_id, customer_ids in sorted(ids.items())
            if len(customer_ids) > 1 and stripe_id in charged_now
        }

    @computed_field  # type: ignore[prop-decorator]
    @property
    def warnings(self) -> list[PreviewWarning]:
        """Every warning, in the JSON too, so that no consumer redoes the rules."""
        found: list[PreviewWarning] = []

        def warn(kind: PreviewWarningKind, message: str, pairs: list[tuple[str, str]]) -> None:
            if pairs:
                found.append(
                    PreviewWarning(
                        kind=kind,
                        message=f"{len(pairs)} {message}",
                        customer_ids=[customer_id for customer_id, _ in pairs],
                        entries=[entry for _, entry in pairs],
                    )
                )

        missing = self.without_payment_method
        warn(
            "no_payment_method",
            "of them have no payment method, so Stripe would charge their legacy default"
            " source or refuse; import them again with payment_method before the run",
            [(x.customer_id, x.customer_id) for x in missing if x.status is None],
        )
        warn(
            "claimed_without_payment_method",
            "of them were claimed with no payment method, which no import changes now, so"
            " Stripe would charge their legacy default source or refuse; skip them if that is"
            " wrong",
            [(x.customer_id, x.customer_id) for x in missing if x.status is not None],
        )
        refused = self.with_amounts_stripe_refuses
        warn(
            "amount_stripe_refuses",
            "of them have an amount Stripe refuses, so they would end failed; import them"
            " again with the amount in the currency's smallest unit before the run",
            [(x.customer_id, f"{x.customer_id} ({why})") for x, why in refused if x.status is None],
        )
        warn(
            "claimed_with_amount_stripe_refuses",
            "of them were claimed with an amount Stripe refuses, which no import changes now,"
            " so they would end failed; bill them by hand",
            [
                (x.customer_id, f"{x.customer_id} ({why})")
                for x, why in refused
                if x.status is not None
            ],
        )
        shared = self.sharing_a_stripe_customer
        if shared:
            found.append(
                PreviewWarning(
                    kind="stripe_customer_charged_twice",
                    message=f"{counted(len(shared), 'Stripe customer')} would be charged more"
                    " than once this period, under different customer ids (one customer imported"
                    " twice under another spelling?); skip the extra ids if so",
                    customer_ids=sorted({c for ids in shared.values() for c in ids}),
                    entries=[
                        f"{stripe_id} ({', '.join(ids)})" for stripe_id, ids in shared.items()
                    ],
                )
            )
        warn(
            "held",
            "customers a run would not bill, as the period billed their Stripe customer under"
            " another id, inactive since (renamed?); one that is another account is billed"
            " once imported with a Stripe customer of its own, when the period is run again",
            [(x.customer_id, f"{x.customer_id} (as {x.held_as})") for x in self.held],
        )
        return found

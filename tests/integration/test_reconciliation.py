"""Reconciliation against the real stack: each kind of leftover a crash or a bug leaves, and a
clean period; Stripe is the emulator, Temporal and PostgreSQL are real."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import asyncpg
import pytest
import stripe
from aiohttp import web
from pydantic import SecretStr
from temporalio import activity
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import (
    ScheduleHandle,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowHistory,
)
from temporalio.exceptions import ActivityError, ApplicationError, RetryState
from temporalio.service import RPCError

from activities import reconcile as reconcile_activities
from activities import stripe_gateway
from activities.reconcile import ReconcileActivities
from activities.stripe_failures import reconciliation_failure
from activities.stripe_gateway import StripeGateway, charge_params
from billing import (
    ledger,
    operations,
    period_keys,
    reconciliation,
    schedules,
    search_attributes,
)
from billing.customers import CustomerRow, upsert_customers
from billing.keys import (
    customer_workflow_id,
    idempotency_key,
    period_workflow_id,
    reconcile_workflow_id,
)
from billing.models import (
    ChargeApi,
    ChargeFailure,
    ChargeResult,
    Claim,
    CustomerChargeInput,
    OperatorRequest,
    PeriodSummary,
    RunOptions,
    ScheduledBillingInput,
)
from billing.money import describe_amount
from billing.periods import Period, period_for
from billing.reconciliation import (
    INCOMPLETE_INTENT,
    MAX_LISTED,
    ChargesPage,
    ChargesPageRequest,
    Finding,
    FindingKind,
    HandledMarks,
    HandledRequest,
    ReconcileInput,
    ReconcileReport,
    ReconcileVerdict,
    StripeCharge,
    for_listing,
)
from billing.reporting import describe_reconciliation
from billing.runs import awaits_a_worker, period_status, start_period, start_reconcile
from billing.schedules import RECONCILE_SCHEDULE_ID
from billing.sealing import SecretBox, new_key
from cli import commands
from cli import reconcile as reconcile_command
from stripe_emulator.emulator import Emulator
from stripe_emulator.routing import Route
from tests.integration.harness import IDLE_QUEUE, Harness, at_least
from tests.integration.holds import hold_the_slots
from tests.integration.invariants import assert_billed_once
from tests.integration.replay import keep, replay
from tests.integration.test_operations import FailWorkflowTasks
from tests.prometheus import metric_value
from tests.waiting import eventually
from vault.client import (
    VaultAdmin,
    VaultAdminError,
    VaultForbidden,
    VaultInvalidRequest,
    VaultUnavailable,
)
from vault.endpoints import KEY_METADATA
from workflows.customer_charge import CustomerChargeWorkflow
from workflows.reconcile import ReconcileWorkflow

PERIOD = Period(2026, 12)


def gateway(harness: Harness) -> StripeGateway:
    return StripeGateway(harness.stripe, harness.settings.billing_charge_api)


async def stranded(
    harness: Harness,
    customer: CustomerRow,
    *,
    at_stripe: bool,
    terminate: bool = True,
    api: ChargeApi | None = "payment_intents",
) -> Claim:
    """What a worker lost mid-charge leaves: the claim taken and its charge begun (and, if
    `at_stripe`, committed by Stripe, its answer lost), under the customer's workflow, which
    an operator then terminated (or which still runs, owning the claim). With `api` None,
    claimed before claims recorded their API (migrations/012) and sent through Charges,
    while the workers now run with PaymentIntents: a lookup lists both."""
    key = idempotency_key(harness.settings.billing_key_namespace, customer.customer_id, PERIOD)
    await harness.open_period_by_hand(PERIOD)
    async with harness.pool.acquire() as conn:
        claim = await ledger.claim(
            conn, customer.customer_id, str(PERIOD), key, charge_api=api or "charges"
        )
        assert (await ledger.begin_charge(conn, claim, None)).gate == "go"
        if api is None:
            await conn.execute("UPDATE billing_runs SET charge_api = NULL")
    if at_stripe:
        await StripeGateway(harness.stripe, api or "charges").charge(claim)
    handle = await harness.idle_child(PERIOD, customer.customer_id)
    if terminate:
        await handle.terminate(reason="its worker was lost")
    return claim


def charged_cents() -> float:
    return metric_value("billing_charged_amount_cents_total", currency="usd")


async def reconciled_with(
    harness: Harness, request: ReconcileInput
) -> tuple[ReconcileReport, WorkflowHandle[ReconcileWorkflow, ReconcileReport]]:
    async with harness.running_worker():
        handle = await harness.client.start_workflow(
            ReconcileWorkflow.run,
            request,
            id=reconcile_workflow_id(PERIOD),
            task_queue=harness.task_queue,
        )
        return await handle.result(), handle


async def reconcile(harness: Harness) -> ReconcileReport:
    async with harness.running_worker():
        handle = await start_reconcile(harness.client, PERIOD, harness.task_queue)
        return await handle.result()


async def bill(harness: Harness) -> None:
    async with harness.running_worker():
        await (await start_period(harness.client, PERIOD, harness.task_queue)).result()


async def billed(harness: Harness, count: int) -> Claim:
    """`count` customers billed; the first one's claim, charged."""
    customers = await harness.seed(count)
    await bill(harness)
    key = idempotency_key(harness.settings.billing_key_namespace, customers[0].customer_id, PERIOD)
    async with harness.pool.acquire() as conn:
        claim = await ledger.claim_by_key(conn, key)
    assert claim is not None
    return claim


async def plant(harness: Harness, claim: Claim, key: str) -> str:
    """A charge made outside the orchestrator with our metadata (e.g. a retry that took a new
    idempotency key); returns its charge id."""
    api = harness.settings.billing_charge_api
    intent = await harness.stripe.v1.payment_intents.create_async(
        charge_params(claim, api),  # type: ignore[arg-type]
        {"idempotency_key": key},
    )
    assert intent.status == "succeeded" and isinstance(intent.latest_charge, str)
    return intent.latest_charge


@pytest.mark.parametrize("through", ["another key", "the other API"])
async def test_a_claim_stripe_already_charged_otherwise_is_not_charged_again(
    harness: Harness, through: str
) -> None:
    # The lost run's claim never reached Stripe, but its customer was charged for the period
    # under another key (an earlier BILLING_KEY_NAMESPACE, a script with our metadata) or
    # through the legacy Charges API: the key's lookup finds nothing, and a re-drive would
    # bill the customer twice.
    [customer] = await harness.seed(1)
    claim = await stranded(harness, customer, at_stripe=False)
    if through == "another key":
        other = idempotency_key("old-namespace", customer.customer_id, PERIOD)
        paid = await plant(harness, claim.model_copy(update={"idempotency_key": other}), other)
    else:
        made = await harness.stripe.v1.charges.create_async(
            charge_params(claim, "charges"),  # type: ignore[arg-type]
            {"idempotency_key": claim.idempotency_key + "-legacy"},
        )
        paid = made.id
    report = await reconcile(harness)
    assert await harness.succeeded() == 1
    [left] = report.claims
    assert (left.action, left.charge_id, left.needs_person) == ("left", paid, True)
    assert report.needs_a_person
    assert left.detail and "charging again would bill it twice" in left.detail


async def test_a_declined_attempt_under_another_key_does_not_hold_a_claim(
    harness: Harness,
) -> None:
    # Only a charge made holds a claim for a person: a decline under another key (a
    # script's try) charged nothing, so the claim is re-driven with its own key as usual.
    [customer] = await harness.seed(1, card_for=lambda _: "pm_card_chargeCustomerFail")
    claim = await stranded(harness, customer, at_stripe=False)
    other = idempotency_key("old-namespace", customer.customer_id, PERIOD)
    script = claim.model_copy(update={"idempotency_key": other})
    with pytest.raises(stripe.CardError):
        await harness.stripe.v1.payment_intents.create_async(
            charge_params(script, "payment_intents"),  # type: ignore[arg-type]
            {"idempotency_key": other},
        )
    report = await reconcile(harness)
    assert [(c.action, c.outcome, c.needs_person, c.detail) for c in report.claims] == [
        ("redriven", "failed", False, "card_declined")
    ]


@pytest.mark.parametrize("active", [False, True], ids=["renamed", "another-account"])
async def test_a_charge_of_its_stripe_customer_under_another_id_holds_a_claim_unless_active(
    harness: Harness, active: bool
) -> None:
    """A lost run's claim never reached Stripe; Stripe holds a charge of the period for the
    same Stripe customer under another of our ids. Not active now, that id is most likely the
    customer's old one (renamed): a re-drive would bill the Stripe customer twice, so the claim
    is left for a person (helper-151 F3). Active, it is another account of that Stripe
    customer, billed for its own: the claim is charged."""
    [customer] = await harness.seed(1)
    other = customer.model_copy(update={"customer_id": "other-1"})
    await upsert_customers(harness.pool, [other])
    await harness.pool.execute(
        "UPDATE customers SET active = $1 WHERE customer_id = 'other-1'", active
    )
    claim = await stranded(harness, customer, at_stripe=False)
    key = idempotency_key(harness.settings.billing_key_namespace, "other-1", PERIOD)
    paid = await plant(
        harness, claim.model_copy(update={"customer_id": "other-1", "idempotency_key": key}), key
    )
    report = await reconcile(harness)
    [resolution] = report.claims
    if active:
        assert resolution.action == "redriven" and await harness.succeeded() == 2
        return
    assert (resolution.action, resolution.charge_id, resolution.needs_person) == (
        "left",
        paid,
        True,
    )
    assert "under the id 'other-1', not an active customer now" in (resolution.detail or "")
    assert await harness.succeeded() == 1


async def test_the_report_lists_the_claims_for_a_person_first(harness: Harness) -> None:
    """Claims left alone (their workflow still runs) came before those resolved, some of
    which need a person (helper-151 F4)."""
    [running, charged_otherwise] = await harness.seed(2)
    await stranded(harness, running, at_stripe=False, terminate=False)
    claim = await stranded(harness, charged_otherwise, at_stripe=False)
    other = idempotency_key("old-namespace", charged_otherwise.customer_id, PERIOD)
    await plant(harness, claim.model_copy(update={"idempotency_key": other}), other)
    report = await reconcile(harness)
    assert [(c.customer_id, c.needs_person) for c in report.claims] == [
        (charged_otherwise.customer_id, True),
        (running.customer_id, False),
    ]


async def test_a_period_with_thousands_of_findings_still_gets_its_report(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # E.g. every customer charged a second time under a new key namespace: 8,000 findings of
    # about 330 bytes each once passed Temporal's 2 MB payload limit, and the workflow task
    # failed for ever. Stripe is stood in for by pages of findings. Past the report's room the
    # pages only count them, and the comparison continues as new as its history grows (each
    # page adds about 6 events: a million customers once passed the limit of 51,200).
    total, size = 8000, 200
    rooms: list[int] = []

    async def page(self: ReconcileActivities, request: ChargesPageRequest) -> ChargesPage:
        request = ChargesPageRequest.model_validate(request)  # undecoded: a bound method
        rooms.append(request.listed_room)
        start = int(request.after or 0)
        findings = [
            Finding(
                kind="duplicate",
                charge_id=f"ch_{start + i:024x}",
                payment_intent_id=f"pi_{start + i:024x}",
                customer_id=f"cust-{start + i:06d}",
                stripe_customer_id=f"cus_{start + i:024x}",
                amount_cents=1631,
                currency="usd",
                key_prefix="0e3f8694",
                ledger_status="charged",
                ledger_charge_id=f"ch_{10**6 + start + i:024x}",
            )
            for i in range(size)
        ]
        end = start + size
        every = {f.charge_id for f in findings}
        in_full, counts = for_listing(findings, request.listed_room, counted_here=every)
        return ChargesPage(
            findings=in_full,
            unlisted_counts=counts,
            customers=size,
            charges=2 * size,
            unchecked=[],
            next_cursor=str(end) if end < total else None,
        )

    monkeypatch.setattr(
        ReconcileActivities, "compare_charges", activity.defn(name="reconcile_charges_page")(page)
    )
    limit = 100
    request = ReconcileInput(period=str(PERIOD), history_event_limit=limit, page_size=size)
    report, handle = await asyncio.wait_for(reconciled_with(harness, request), timeout=120)
    assert report.finding_counts == {"duplicate": total}
    assert len(report.findings) == MAX_LISTED
    assert rooms == [MAX_LISTED - size * i for i in range(5)] + [0] * 35
    assert (report.customers_checked, report.charges_checked) == (total, 2 * total)
    assert len(await harness.chain_of_runs(handle.id, bound=limit + 10)) > 2


@pytest.mark.parametrize(("how", "customers"), [("renamed", 4), ("moved", 3)])
async def test_findings_past_the_reports_room_are_each_counted_once(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, how: str, customers: int
) -> None:
    # Past the report's room, a page counts its findings only if it is the first listed under
    # their Stripe customer. Two of ours share one when a customer was renamed (its old id
    # inactive), each listed on a page of its own; a customer given another Stripe customer
    # since it was billed is listed under the one its row charged.
    monkeypatch.setattr(reconciliation, "MAX_LISTED", 0)
    first = await billed(harness, 2)
    assert first.payment_method is not None
    for row in await harness.ledger_rows(str(PERIOD)):
        claim = first.model_copy(
            update={
                "customer_id": row["customer_id"],
                "stripe_customer_id": row["stripe_customer_id"],
                "payment_method": row["payment_method"],
                "idempotency_key": row["idempotency_key"] + "-retry",
            }
        )
        await plant(harness, claim, claim.idempotency_key)
    if how == "renamed":
        again = CustomerRow(
            customer_id=f"{first.customer_id}-again",
            stripe_customer_id=first.stripe_customer_id,
            payment_method=first.payment_method,
            amount_cents=first.amount_cents,
            currency=first.currency,
        )
        await upsert_customers(harness.pool, [again])
        await harness.pool.execute(
            "UPDATE customers SET active = false WHERE customer_id = $1", again.customer_id
        )
    else:
        await harness.pool.execute(
            "UPDATE customers SET stripe_customer_id = 'cus_since' WHERE customer_id = $1",
            first.customer_id,
        )
    # And a claim whose worker was lost after Stripe charged it: what the run settles before
    # it compares is carried to the end too.
    [late] = await harness.seed(1, prefix="late")
    charged = await stranded(harness, late, at_stripe=True)
    # Each run compares a page or two, then continues as new with what it found.
    request = ReconcileInput(period=str(PERIOD), page_size=1, history_event_limit=20)
    report, handle = await reconciled_with(harness, request)
    # Two charges for each customer billed and the late one's, each counted once: the renamed
    # one's are listed under both of its ids.
    assert report.customers_checked == customers
    assert report.charges_checked == 5
    assert report.findings == [] and report.finding_counts == {"duplicate": 2}
    [recorded] = report.claims
    assert (recorded.customer_id, recorded.action, recorded.outcome) == (
        charged.customer_id,
        "recorded",
        "charged",
    )
    runs = await harness.chain_of_runs(handle.id, bound=40)
    await replay(runs)
    # Kept as of the chain's start, carried through its runs.
    began = runs[0].events[0].event_time.ToDatetime(tzinfo=UTC)
    assert (
        await harness.pool.fetchval(
            "SELECT reconciled_at FROM period_reconciliations WHERE billing_period = $1",
            str(PERIOD),
        )
        == began
    )
    if how == "renamed":
        # I6 for a reconciliation continued as new, from a carried input too.
        assert len(runs) > 2
        keep(runs)


async def test_a_reconciliation_of_a_malformed_period_fails_at_once_saying_why(
    harness: Harness,
) -> None:
    """Started by hand (Temporal's CLI, the Web UI) for no period there is (I7): not a lookup
    retried to its limit, then an activity's failure."""
    request = ReconcileInput(period="2026-13")
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(reconciled_with(harness, request), timeout=30)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.non_retryable, cause
    assert "billing period month 13 is not 01-12" in cause.message


async def test_reconcile_exits_1_when_it_leaves_a_claim_for_a_person(vaulted: Harness) -> None:
    # No finding and every customer checked, but a claim only a person can settle: the
    # daily schedule and the operator must not read it as all clear.
    await billed(vaulted, 1)
    [late] = await vaulted.seed(1, prefix="late")
    await stranded(vaulted, late, at_stripe=False)
    await unusable(vaulted, "expired")
    async with vaulted.running_worker():
        code, out, _ = await vaulted.starter("reconcile", str(PERIOD))
    assert "delete the key's row" in out
    assert code == 1, out


async def test_reconcile_with_no_worker_says_so_and_runs_once_one_polls(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    await billed(harness, 2)
    harness.use_cli_env(monkeypatch)
    monkeypatch.setattr(reconcile_command, "NO_WORKER_SECONDS", 1.0)
    args = commands.parser().parse_args(["reconcile", str(PERIOD)])
    waiting = asyncio.create_task(reconcile_command.cmd_reconcile(args))
    seen = ""

    async def told() -> bool:
        nonlocal seen
        seen += capsys.readouterr().err
        return "its workflow task has waited 1 s for a worker" in seen

    await eventually(told)
    assert f"is a worker polling task queue {harness.task_queue}? Waiting" in seen
    async with harness.running_worker():
        assert await waiting == 0
    assert "reconciliation of" in capsys.readouterr().out


async def test_a_workflow_task_failing_on_its_workers_is_told_as_one_waiting_for_a_worker(
    harness: Harness,
) -> None:
    """`reconcile` warns of a workflow task that waits for a worker, or keeps failing on the
    workers there are (a release with a bug): that one is retried at once, never waits long,
    and is told by its attempt."""
    failing = FailWorkflowTasks(ReconcileWorkflow.__name__)
    async with harness.running_worker(interceptors=[failing]):
        handle = await start_reconcile(harness.client, PERIOD, harness.task_queue)
        try:
            await eventually(lambda: awaits_a_worker(handle, timedelta(hours=1)))
        finally:
            await handle.terminate(reason="test over")


async def test_a_charge_stripe_took_but_the_ledger_never_recorded_is_recorded(
    harness: Harness,
) -> None:
    customers = await harness.seed(3)
    claims = [await stranded(harness, c, at_stripe=True) for c in customers]
    sent = await harness.money_requests()
    money_before = charged_cents()
    report = await reconcile(harness)
    # Their money is counted now, when the ledger first records it.
    assert charged_cents() - money_before == sum(c.amount_cents for c in customers)
    by_customer = {c.customer_id: c for c in report.claims}
    recorded = {r["customer_id"]: r["charge_id"] for r in await harness.ledger_rows(str(PERIOD))}
    for claim in claims:
        resolution = by_customer[claim.customer_id]
        assert (resolution.action, resolution.outcome) == ("recorded", "charged")
        # The report names the charge Stripe took, as the ledger now records it.
        assert resolution.charge_id == recorded[claim.customer_id] is not None
    # Found by listing the customer's payments: not one request more to charge.
    assert await harness.money_requests() == sent
    assert report.findings == []
    await assert_billed_once(harness, str(PERIOD), customers)


class ArrivalTimes:
    """When each request reached Stripe (the emulator, which runs in the test's process), on
    the clock the database's rate slots are read on: the machine's."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.times: list[float] = []
        handle = Emulator.handle

        async def timed(emulator: Emulator, request: web.Request, route: Route) -> Any:
            self.times.append(time.time())
            return await handle(emulator, request, route)

        monkeypatch.setattr(Emulator, "handle", timed)


async def test_reconciliations_stripe_reads_keep_to_the_clusters_stripe_rate(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its lookups of claims and its listings of charges take turns of BILLING_STRIPE_RPS,
    the rate the charges share, a turn for each request: these lookups list both APIs (the
    claims recorded none). None goes before its slot, and the first slot is no earlier than
    the reconciliation's start: the k-th request Stripe sees comes at least k slots after
    it. A slow machine only sends them later."""
    customers = await harness.seed(3)
    for customer in customers:
        await stranded(harness, customer, at_stripe=True, api=None)
    rps = 2.0
    harness.settings = harness.settings.model_copy(update={"billing_stripe_rps": rps})
    arrivals = ArrivalTimes(monkeypatch)
    async with harness.running_worker():
        began = time.time()
        report = await (await start_reconcile(harness.client, PERIOD, harness.task_queue)).result()
    assert {(c.action, c.outcome) for c in report.claims} == {("recorded", "charged")}
    assert report.customers_checked == 3
    # A lookup of two listings and a listing of its charges per customer, at the least.
    times = sorted(t for t in arrivals.times if t >= began)
    assert len(times) >= 3 * len(customers), times
    # Clock readings (the database's, the worker's sleep, the test's) agree to well within this.
    slack = 0.05
    early = [k for k, t in enumerate(times) if t - began < k / rps - slack]
    assert not early, [round(t - began, 3) for t in times]


async def test_a_claim_that_never_reached_stripe_is_charged_once_with_its_key(
    harness: Harness,
) -> None:
    customers = await harness.seed(3)
    for customer in customers:
        await stranded(harness, customer, at_stripe=False)
    assert await harness.succeeded() == 0
    report = await reconcile(harness)
    assert {(c.action, c.outcome) for c in report.claims} == {("redriven", "charged")}
    rows = await harness.ledger_rows(str(PERIOD))
    assert sorted(str(c.charge_id) for c in report.claims) == sorted(r["charge_id"] for r in rows)
    assert len(report.claims) == 3
    assert report.findings == []
    # Charged once each, every request with the claim's key and parameters (I1-I3).
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_claim_stripe_could_not_be_asked_about_is_left_for_a_person_uncharged(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup that fails says nothing of what Stripe holds: charging again unseen could bill
    twice (past Stripe's idempotency window), so the claim is left for a person, with the
    cause, anything shaped like a key redacted (I5): in the report, and in the run's history,
    where the activity's failure is kept."""
    [customer] = await harness.seed(1)
    await stranded(harness, customer, at_stripe=False)
    secret = "sk_test_" + "51HqLyjWDarjtT1zdp7dc0123"

    async def refused(
        self: ReconcileActivities, claim: Claim, *, recheck: bool = False
    ) -> tuple[ChargeResult | ChargeFailure | None, bool]:
        raise ApplicationError(f"refused {secret}", type="KeyRefused", non_retryable=True)

    monkeypatch.setattr(ReconcileActivities, "_find", refused)
    report = await reconcile(harness)
    [left] = report.claims
    assert (left.action, left.needs_person) == ("left", True)
    assert left.detail == "lookup failed: KeyRefused: refused [redacted key]"
    assert report.needs_a_person
    assert await harness.money_requests() == 0
    run = harness.client.get_workflow_handle(reconcile_workflow_id(PERIOD))
    kept = (await run.fetch_history()).to_json()
    assert "refused [redacted key]" in kept and secret not in kept


async def test_a_lookup_stripe_turned_away_for_a_moment_is_tried_again_not_blamed_on_the_key(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 429 says nothing of the period's key: the lookup is tried again and the claim
    charged, not left for a person told to replace a key that works."""
    [customer] = await harness.seed(1)
    await stranded(harness, customer, at_stripe=False)
    find = StripeGateway.find
    turned_away: list[str] = []

    async def once_too_many(
        self: StripeGateway, claim: Claim
    ) -> ChargeResult | ChargeFailure | None:
        if not turned_away:
            turned_away.append(claim.customer_id)
            raise stripe.RateLimitError("Too many requests", http_status=429)
        return await find(self, claim)

    monkeypatch.setattr(StripeGateway, "find", once_too_many)
    report = await reconcile(harness)
    assert turned_away == [customer.customer_id]
    assert [(c.action, c.outcome, c.needs_person) for c in report.claims] == [
        ("redriven", "charged", False)
    ]
    await assert_billed_once(harness, str(PERIOD), [customer])


async def test_a_claim_whose_workflow_started_between_lookup_and_redrive_is_left_to_it(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temporal refuses the re-drive: that run owns the claim and records it, so no person is
    called for (the daily run would exit 1 for nothing)."""
    [customer] = await harness.seed(1)
    await stranded(harness, customer, at_stripe=False)
    find = ReconcileActivities._find

    async def a_run_starts_meanwhile(
        self: ReconcileActivities, claim: Claim, *, recheck: bool = False
    ) -> tuple[ChargeResult | ChargeFailure | None, bool]:
        found = await find(self, claim, recheck=recheck)
        await harness.idle_child(PERIOD, claim.customer_id)
        return found

    monkeypatch.setattr(ReconcileActivities, "_find", a_run_starts_meanwhile)
    report = await reconcile(harness)
    assert [(c.action, c.needs_person, c.detail) for c in report.claims] == [
        ("left", False, "a run of its workflow started meanwhile")
    ]
    assert not report.needs_a_person
    assert await harness.money_requests() == 0


async def test_a_claim_its_workflow_still_works_on_is_left_alone(harness: Harness) -> None:
    [customer] = await harness.seed(1)
    await stranded(harness, customer, at_stripe=True, terminate=False)
    report = await reconcile(harness)
    [left] = report.claims
    assert left.action == "left" and "running" in (left.detail or "")
    # Its charge at Stripe is its workflow's to record: not a finding, not touched.
    assert report.findings == []
    [row] = await harness.ledger_rows(str(PERIOD))
    assert row["status"] == "claimed"
    # Once that workflow is gone, the next run records the charge.
    workflow_id = customer_workflow_id(PERIOD, customer.customer_id)
    await harness.client.get_workflow_handle(workflow_id).terminate(reason="worker lost")
    report = await reconcile(harness)
    assert [(c.action, c.outcome) for c in report.claims] == [("recorded", "charged")]
    await assert_billed_once(harness, str(PERIOD), [customer])


async def test_a_running_period_run_keeps_its_claims_and_the_customers_it_has_yet_to_claim(
    harness: Harness,
) -> None:
    """Its run is running (on a task queue nobody polls here) and has claimed one customer
    without starting its workflow yet, and not claimed the other: both are that run's to
    bill. Charged beside it, the claim would be worked on twice at once; the other, reported
    as missed by a run that ended, would have an operator run the period again."""
    claimed, _ = await harness.seed(2)
    await harness.open_period_by_hand(PERIOD)
    await harness.claim_by_hand(PERIOD, claimed.customer_id)
    await start_period(harness.client, PERIOD, IDLE_QUEUE)
    report = await reconcile(harness)
    [left] = report.claims
    assert (left.customer_id, left.action, left.needs_person) == (
        claimed.customer_id,
        "left",
        False,
    )
    assert "may still start its workflow" in (left.detail or "")
    assert report.unclaimed_by_ended_run == 0 and not report.needs_a_person
    assert await harness.money_requests() == 0


async def test_a_period_whose_child_was_terminated_finishes_once_reconciled(
    harness: Harness,
) -> None:
    # The last child of the period is terminated by hand while Stripe fails: the period
    # cannot hear from it any more, so it asks the ledger until reconciliation has charged it.
    [customer] = await harness.seed(1)
    await harness.set_faults(error_before_commit=1.0)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await eventually(lambda: at_least(harness.money_requests(), 1))
        child = customer_workflow_id(PERIOD, customer.customer_id)
        await harness.client.get_workflow_handle(child).terminate(reason="stuck, by hand")
    # The terminated child's charge retries in the worker that ran it (a local activity
    # Temporal's terminate does not reach) until that worker stops: once Stripe answered,
    # it could record the charge before reconciliation looked.
    await harness.set_faults(error_before_commit=0.0)
    async with harness.running_worker():
        report = await (await start_reconcile(harness.client, PERIOD, harness.task_queue)).result()
        assert [(c.action, c.outcome) for c in report.claims] == [("redriven", "charged")]
        summary = await asyncio.wait_for(handle.result(), timeout=60)
    assert summary.charged + summary.already_billed == 1
    await assert_billed_once(harness, str(PERIOD), [customer])


async def test_status_names_the_customer_a_run_waits_for_in_the_ledger(harness: Harness) -> None:
    # A child terminated after its claim: the period waits on the ledger for it, and says
    # for whom and what settles it (Stripe fails throughout, so the charge the terminated
    # child left running in the worker cannot end meanwhile).
    [customer] = await harness.seed(1)
    await harness.set_faults(error_before_commit=1.0)
    async with harness.running_worker():
        await start_period(harness.client, PERIOD, harness.task_queue)
        await eventually(lambda: at_least(harness.money_requests(), 1))
        child = customer_workflow_id(PERIOD, customer.customer_id)
        await harness.client.get_workflow_handle(child).terminate(reason="stuck, by hand")

        async def named() -> bool:
            progress = await period_status(harness.client, PERIOD)
            return progress.awaited_in_ledger == [customer.customer_id]

        await eventually(named)
        _, out, err = await harness.starter("status", str(PERIOD))
    assert f"  awaited in the ledger: {customer.customer_id} (started by an" in out, err
    assert f"`reconcile {PERIOD}` settles a claim nothing runs" in out


async def test_claims_a_run_left_paused_when_terminated_are_left_for_a_person(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its children wait at the gate for a resume that no run is left to send: reconcile
    leaves their claims for a person, saying that a new run resumes them (exit 1 daily
    rather than "all clear"); that new run then bills each once."""
    customers = await harness.seed(4)
    # The first charge goes out; the other children claim, then wait for their Stripe slot
    # until the pause has landed, however slow the machine (a slot far off, made explicit).
    first: list[str] = []
    paused = asyncio.Event()

    async def after_the_pause(claim: Claim) -> None:
        if not first:
            first.append(claim.customer_id)
        elif claim.customer_id not in first:
            await asyncio.wait_for(paused.wait(), 60)

    hold_the_slots(monkeypatch, after_the_pause)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await eventually(lambda: at_least(harness.money_requests(), 1))

        async def all_claimed() -> bool:
            return len(await harness.ledger_rows(str(PERIOD))) == len(customers)

        # On a loaded machine some children claim later than the first charge goes out.
        await eventually(all_claimed)
        # The run has written the pause to the ledger once it answers: the gate stops the
        # three let go now.
        await operations.control(
            harness.client, PERIOD, "pause", OperatorRequest(reason="check", operator="alice")
        )
        paused.set()
        await handle.terminate(reason="lost while paused")
        rows = await harness.ledger_rows(str(PERIOD))
        unsent = sorted(r["customer_id"] for r in rows if r["charge_started_at"] is None)
        assert len(rows) == 4 and len(unsent) == 3 and first[0] not in unsent
        report = await (await start_reconcile(harness.client, PERIOD, harness.task_queue)).result()
        assert report.needs_a_person
        assert sorted(c.customer_id for c in report.claims if c.needs_person) == unsent
        assert all(
            f"python starter.py run {PERIOD}" in (c.detail or "")
            for c in report.claims
            if c.needs_person
        )
        rerun = await start_period(harness.client, PERIOD, harness.task_queue)
        await asyncio.wait_for(rerun.result(), timeout=120)
    assert await harness.money_requests() == 4
    await assert_billed_once(harness, str(PERIOD), customers)


async def charged_in_doubt_at_the_vault(vaulted: Harness) -> list[CustomerRow]:
    """Three customers billed while Stripe commits each charge and answers 500 (saved,
    replayed for the key): the worker finds each charge by listing, but the vault never
    learns the outcome, so their reservations stay unknown."""
    customers = await vaulted.seed(3)
    await vaulted.set_faults(error_after_commit=1.0)
    await bill(vaulted)
    await vaulted.set_faults(error_after_commit=0.0)
    return customers


async def test_unknown_reservations_of_charges_stripe_took_are_committed(
    vaulted: Harness,
) -> None:
    customers = await charged_in_doubt_at_the_vault(vaulted)
    assert vaulted.vault is not None
    admin = vaulted.vault.admin
    [key] = await admin.find_keys(period=str(PERIOD), label=period_keys.LABEL)
    assert len(await admin.unknown_reservations(key.id)) == 3
    report = await reconcile(vaulted)
    assert report.vault_checked
    assert sorted((r.state, r.amount_cents) for r in report.reservations) == sorted(
        ("committed", c.amount_cents) for c in customers
    )
    settled = await admin.get_key(key.id)
    assert (settled.spent_cents, settled.reserved_cents) == (
        sum(c.amount_cents for c in customers),
        0,
    )
    assert report.claims == [] and report.findings == []
    await assert_billed_once(vaulted, str(PERIOD), customers)


async def _renewed(vaulted: Harness, currency: str) -> period_keys.PeriodKey:
    """A new key stored in place of the period's, and the old one revoked, as renew-keys or
    a rerun's preparation does."""
    assert vaulted.vault is not None
    old = await period_keys.stored_key_id(vaulted.pool, str(PERIOD), currency)
    new = await period_keys.issue_key(
        vaulted.pool,
        vaulted.vault.worker,
        vaulted.settings.secret_box(),
        PERIOD,
        currency,
        100_000,
        timedelta(days=1),
        known_in=vaulted.pool,
    )
    assert old is not None
    await vaulted.vault.worker.revoke(old)
    return new


async def test_a_charge_retried_through_a_renewed_key_is_counted_under_one_key(
    vaulted: Harness,
) -> None:
    """A charge in doubt at the vault under the period's key, retried through the key a
    renewal stored since, in doubt there too (Stripe replays its 500): reconciliation finds
    the one charge for both reservations, and counts it under one key, not both."""
    assert vaulted.vault is not None
    admin = vaulted.vault.admin
    customers = await charged_in_doubt_at_the_vault(vaulted)
    [old] = await admin.find_keys(period=str(PERIOD), label=period_keys.LABEL)
    retried = customers[0]
    new = await _renewed(vaulted, retried.currency)
    key = idempotency_key(vaulted.settings.billing_key_namespace, retried.customer_id, PERIOD)
    async with vaulted.pool.acquire() as conn:
        claim = await ledger.claim_by_key(conn, key)
    assert claim is not None
    gateway = await vaulted.vault_access().gateway(str(PERIOD), retried.currency)
    with pytest.raises(stripe.APIError):
        await gateway.charge(claim)

    report = await reconcile(vaulted)
    # Both keys' reservations of the retried charge settled at once, in either order.
    assert {r.state for r in report.reservations} == {"committed"}
    mine = {r.vault_key_id: r for r in report.reservations if r.customer_id == retried.customer_id}
    assert set(mine) == {old.id, new.vault_key_id}
    [counted] = [r for r in mine.values() if r.detail is None]
    [replay] = [r for r in mine.values() if r.detail is not None]
    assert replay.detail == f"counted under vault key {counted.vault_key_id}"
    spent = {k: (await admin.get_key(k)).spent_cents for k in (old.id, new.vault_key_id)}
    assert sum(spent.values()) == sum(c.amount_cents for c in customers)
    assert spent[counted.vault_key_id] >= retried.amount_cents
    await assert_billed_once(vaulted, str(PERIOD), customers)


async def test_an_unknown_reservation_of_a_decline_stripe_recorded_is_released_at_once(
    vaulted: Harness,
) -> None:
    # Stripe commits the decline and answers 500, saved and replayed for the key: the
    # worker finds the failed charge by listing and records the decline, and the vault is
    # left with an unknown reservation it changed a moment ago. A key whose request Stripe
    # ran to a failure can charge nothing more, so there is no commit to wait for.
    customers = await vaulted.seed(
        2, card_for=lambda i: "pm_card_chargeCustomerFail" if i == 1 else "pm_card_visa"
    )
    await vaulted.set_faults(error_after_commit=1.0)
    await bill(vaulted)
    await vaulted.set_faults(error_after_commit=0.0)
    report = await reconcile(vaulted)
    by_customer = {r.customer_id: r for r in report.reservations}
    assert [by_customer[c.customer_id].state for c in customers] == ["released", "committed"]
    assert vaulted.vault is not None
    [key] = await vaulted.vault.admin.find_keys(period=str(PERIOD), label=period_keys.LABEL)
    settled = await vaulted.vault.admin.get_key(key.id)
    assert (settled.spent_cents, settled.reserved_cents) == (customers[1].amount_cents, 0)
    await assert_billed_once(
        vaulted, str(PERIOD), customers, declined=frozenset({customers[0].customer_id})
    )


async def test_unknown_reservations_past_the_time_given_wait_for_the_next_run(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    customers = await charged_in_doubt_at_the_vault(vaulted)
    assert vaulted.vault is not None
    [key] = await vaulted.vault.admin.find_keys(period=str(PERIOD), label=period_keys.LABEL)
    # No time at all: none is examined, and the rest of reconciliation still runs. Each is
    # reported unknown, so the period is kept to look at again (it read as nothing left).
    monkeypatch.setattr(reconcile_activities, "SETTLE_BUDGET_SECONDS", -1.0)
    first = await reconcile(vaulted)
    assert (first.vault_checked, first.findings, first.needs_a_person) == (True, [], False)
    assert [(r.state, r.detail) for r in first.reservations] == [
        ("unknown", "not examined in the time given: the next reconciliation of the period does")
    ] * 3
    assert await left_to_look_at(vaulted, PERIOD) == (True, "3 vault reservations unknown")
    assert len(await vaulted.vault.admin.unknown_reservations(key.id)) == 3
    monkeypatch.undo()
    second = await reconcile(vaulted)
    assert sorted(r.state for r in second.reservations) == ["committed"] * 3
    await assert_billed_once(vaulted, str(PERIOD), customers)


@pytest.mark.parametrize(
    ("trouble", "lasting"),
    [
        # Stripe's rate, met by the lookup: the next run reads again.
        (stripe.RateLimitError("Too many requests", http_status=429), False),
        # No key to read with (nor a lookup key the vault would issue): no later run reads
        # it either, a person must.
        (period_keys.NoPeriodKeyError("no key can read 2026-12 (usd)"), True),
        # A lookup key refused: the next read issues another.
        (ApplicationError("lookup key revoked", type="KeyRefused", non_retryable=True), False),
        # A URL Stripe does not know, refused as a key is: no later read gets past it.
        (
            reconciliation_failure(
                stripe.InvalidRequestError(  # type: ignore[no-untyped-call]
                    "Unrecognized request URL (GET: /v1/v1/payment_intents/search).",
                    None,
                    http_status=404,
                )
            ),
            True,
        ),
        # The vault refusing the settlement: no later run's token or amount is other.
        (VaultForbidden(403, "forbidden", "the worker token may not resolve this"), True),
        (VaultInvalidRequest(422, "invalid", "amount_cents is past the reservation"), True),
        # The vault away a moment: the next run settles it.
        (VaultUnavailable(503, None, "the vault is restarting"), False),
    ],
    ids=[
        "rate-limited",
        "no-key",
        "lookup-key-refused",
        "unknown-url",
        "vault-forbidden",
        "vault-invalid",
        "vault-away",
    ],
)
async def test_one_reservation_stripe_cannot_answer_for_is_left_and_the_rest_settled(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch, trouble: Exception, lasting: bool
) -> None:
    """A reservation whose lookup on Stripe or settlement at the vault fails is left unknown,
    for a person only where no later run settles it; the rest are settled all the same."""
    customers = await charged_in_doubt_at_the_vault(vaulted)
    unlucky = customers[0].customer_id
    find, lookup, resolve = ReconcileActivities._find, StripeGateway.find, VaultAdmin.resolve

    async def unanswered(
        self: ReconcileActivities, claim: Claim, *, recheck: bool = False
    ) -> tuple[ChargeResult | ChargeFailure | None, bool]:
        if claim.customer_id == unlucky:
            raise trouble
        return await find(self, claim, recheck=recheck)

    async def stripe_unanswered(
        self: StripeGateway, claim: Claim
    ) -> ChargeResult | ChargeFailure | None:
        if claim.customer_id == unlucky:
            raise trouble
        return await lookup(self, claim)

    unlucky_key = idempotency_key(vaulted.settings.billing_key_namespace, unlucky, PERIOD)

    async def refused(self: VaultAdmin, key_id: str, key: str, *args: Any, **kwargs: Any) -> Any:
        if key == unlucky_key:
            raise trouble
        return await resolve(self, key_id, key, *args, **kwargs)

    if isinstance(trouble, VaultAdminError):
        monkeypatch.setattr(VaultAdmin, "resolve", refused)
        said = trouble.message
    elif isinstance(trouble, ApplicationError):
        monkeypatch.setattr(ReconcileActivities, "_find", unanswered)
        said = trouble.message
    else:
        # Met where the lookup reads Stripe.
        monkeypatch.setattr(StripeGateway, "find", stripe_unanswered)
        said = (
            reconciliation_failure(trouble).message
            if isinstance(trouble, stripe.StripeError)
            else str(trouble)
        )
    report = await reconcile(vaulted)
    by_customer = {r.customer_id: r for r in report.reservations}
    left = by_customer[unlucky]
    assert (left.state, left.detail, left.needs_person) == ("unknown", said, lasting)
    assert report.needs_a_person == lasting
    assert sorted(r.state for r in report.reservations) == ["committed", "committed", "unknown"]
    assert report.findings == []


async def test_a_reservation_left_for_a_person_is_listed_past_the_reports_room(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More reservations than the report lists: the one for a person is listed, though
    settled last, or the report reads all clear while its cap room stays counted."""
    customers = await charged_in_doubt_at_the_vault(vaulted)
    unlucky = customers[0].customer_id
    unlucky_key = idempotency_key(vaulted.settings.billing_key_namespace, unlucky, PERIOD)
    find = ReconcileActivities._find

    async def no_key_for_one(
        self: ReconcileActivities, claim: Claim, *, recheck: bool = False
    ) -> tuple[ChargeResult | ChargeFailure | None, bool]:
        if claim.customer_id == unlucky:
            raise ApplicationError("no key to read with", type="NoPeriodKey", non_retryable=True)
        return await find(self, claim, recheck=recheck)

    def unlucky_last(todo: list[tuple[str, Any]]) -> None:
        todo.sort(key=lambda item: item[1].idempotency_key == unlucky_key)

    monkeypatch.setattr(ReconcileActivities, "_find", no_key_for_one)
    monkeypatch.setattr(reconcile_activities, "random", SimpleNamespace(shuffle=unlucky_last))
    monkeypatch.setattr(reconcile_activities, "MAX_SHOWN", 1)
    report = await reconcile(vaulted)
    assert [(r.customer_id, r.needs_person) for r in report.reservations] == [(unlucky, True)]
    assert report.needs_a_person


async def lost_in_doubt(
    vaulted: Harness, customers: list[CustomerRow], fault: str = "error_before_commit"
) -> VaultAdmin:
    """Every attempt fails before Stripe commits (a 500, or with `fault`
    error_saved_before_commit one Stripe saves for the key), so the vault keeps each
    reservation unknown; then the run is lost (workflows terminated), and the reservations
    have been unknown for longer than a slow request could still commit at Stripe."""
    await vaulted.set_faults(**{fault: 1.0})
    assert vaulted.vault is not None
    admin = vaulted.vault.admin
    async with vaulted.running_worker():
        await start_period(vaulted.client, PERIOD, vaulted.task_queue)

        async def all_unknown() -> bool:
            keys = await admin.find_keys(period=str(PERIOD), label=period_keys.LABEL)
            unknown = await admin.unknown_reservations(keys[0].id) if keys else []
            return len(unknown) == len(customers)

        await eventually(all_unknown)
    lost = [period_workflow_id(PERIOD)] + [
        customer_workflow_id(PERIOD, c.customer_id) for c in customers
    ]
    for workflow_id in lost:
        await vaulted.client.get_workflow_handle(workflow_id).terminate(reason="run lost")
    async with vaulted.pool.acquire() as conn:
        await conn.execute("UPDATE vault_reservations SET updated_at = now() - interval '1 hour'")
    await vaulted.set_faults(**{fault: 0.0})
    return admin


async def test_an_unknown_reservation_with_no_charge_is_released_and_its_claim_charged(
    vaulted: Harness,
) -> None:
    customers = await vaulted.seed(2)
    admin = await lost_in_doubt(vaulted, customers)
    report = await reconcile(vaulted)
    assert [r.state for r in report.reservations] == ["released", "released"]
    assert {(c.action, c.outcome) for c in report.claims} == {("redriven", "charged")}
    [key] = await admin.find_keys(period=str(PERIOD), label=period_keys.LABEL)
    settled = await admin.get_key(key.id)
    assert (settled.spent_cents, settled.reserved_cents) == (
        sum(c.amount_cents for c in customers),
        0,
    )
    await assert_billed_once(vaulted, str(PERIOD), customers)


async def test_an_unknown_reservation_of_an_intent_left_unconfirmed_stays_counted(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stripe may still complete an intent it left unconfirmed that the lookup's key could
    not cancel: its reservation stays unknown, its cap room counted, for a person, however
    long it was left alone. Released, it would free the room and invite a charge again."""
    [customer] = await vaulted.seed(1)
    admin = await lost_in_doubt(vaulted, [customer])
    stalled = ChargeFailure(
        code=INCOMPLETE_INTENT, message="cancel pi_1 on Stripe", payment_intent_id="pi_1"
    )

    async def unconfirmed(
        self: ReconcileActivities, claim: Claim, *, recheck: bool = False
    ) -> tuple[ChargeResult | ChargeFailure | None, bool]:
        return stalled, True

    monkeypatch.setattr(ReconcileActivities, "_find", unconfirmed)
    report = await reconcile(vaulted)
    [left] = report.reservations
    assert (left.state, left.detail, left.needs_person) == (
        "unknown",
        "cancel pi_1 on Stripe",
        True,
    )
    assert report.needs_a_person
    [key] = await admin.find_keys(period=str(PERIOD), label=period_keys.LABEL)
    assert len(await admin.unknown_reservations(key.id)) == 1


async def test_an_unknown_reservation_no_ledger_row_has_the_key_of_is_for_a_person(
    vaulted: Harness,
) -> None:
    # Nothing of ours looks it up: no later run settles it, so the report must need a
    # person (with the admin token), not read all clear while its cap room stays counted.
    [customer] = await vaulted.seed(1)
    await lost_in_doubt(vaulted, [customer])
    await vaulted.pool.execute(
        "UPDATE vault_reservations SET idempotency_key = 'by-a-script-0123456789abcdef'"
    )
    # Its room still counted, the claim's re-drive meets the cap: stopped soon, left.
    request = ReconcileInput(period=str(PERIOD), redrive_timeout_seconds=1)
    report, _ = await reconciled_with(vaulted, request)
    [left] = [r for r in report.reservations if r.customer_id is None]
    assert (left.state, left.detail, left.needs_person) == (
        "unknown",
        "no ledger row has this key",
        True,
    )
    assert report.needs_a_person


async def test_a_500_stripe_saved_for_a_lost_run_is_charged_once_stripe_forgets_the_key(
    vaulted: Harness,
) -> None:
    """Stripe saved a 500 for the key without charging, and the run was lost. A day later
    Stripe has forgotten the key, and the vault refuses to send it again (first sent 23 hours
    ago or more) while its reservation is in doubt: reconciliation finds nothing on Stripe,
    releases the reservation and charges the claim once, with its key."""
    [customer] = await vaulted.seed(1)
    admin = await lost_in_doubt(vaulted, [customer], fault="error_saved_before_commit")
    await vaulted.day_passes()
    report = await reconcile(vaulted)
    assert [r.state for r in report.reservations] == ["released"]
    assert {(c.action, c.outcome) for c in report.claims} == {("redriven", "charged")}
    [key] = await admin.find_keys(period=str(PERIOD), label=period_keys.LABEL)
    settled = await admin.get_key(key.id)
    assert (settled.spent_cents, settled.reserved_cents) == (customer.amount_cents, 0)
    await assert_billed_once(vaulted, str(PERIOD), [customer])
    faults = await vaulted.faults_injected()
    assert faults["error_saved_before_commit"] >= 1


async def test_a_redrive_still_retried_is_stopped_and_left_saying_why(vaulted: Harness) -> None:
    """A lost run's saved 500 within Stripe's day: the re-drive meets it again and is retried
    slowly. Past the re-drive's time it is stopped and its claim left open for a person,
    with the reason and where each try's error is logged; nothing is charged."""
    [customer] = await vaulted.seed(1)
    await lost_in_doubt(vaulted, [customer], fault="error_saved_before_commit")
    request = ReconcileInput(period=str(PERIOD), redrive_timeout_seconds=5)
    report, _ = await reconciled_with(vaulted, request)
    [claim] = report.claims
    assert (claim.action, claim.needs_person) == ("left", True)
    workflow_id = customer_workflow_id(PERIOD, customer.customer_id)
    assert (
        "re-drive stopped after 5 s, its charge still being retried, or waiting (at the gate"
        " while its period is paused, or for its turn in Stripe's rate); the worker's log has"
        f" each try's error (workflow_id {workflow_id})"
    ) in (claim.detail or "")
    assert report.needs_a_person
    assert await vaulted.succeeded() == 0
    [row] = await vaulted.ledger_rows(str(PERIOD))
    assert row["status"] == "claimed"


async def test_a_redrive_cut_short_is_left_for_a_person(harness: Harness) -> None:
    """Its run terminated (an operator, say) before it had an outcome: the claim is still
    open, and the report must not read all clear."""
    [customer] = await harness.seed(1)
    await stranded(harness, customer, at_stripe=False)
    await harness.set_faults(error_before_commit=1.0)
    async with harness.running_worker():
        handle = await start_reconcile(harness.client, PERIOD, harness.task_queue)
        await eventually(lambda: at_least(harness.money_requests(), 1))
        redrive = customer_workflow_id(PERIOD, customer.customer_id)
        await harness.client.get_workflow_handle(redrive).terminate(reason="by hand")
        report = await handle.result()
    [left] = report.claims
    assert (left.action, left.needs_person) == ("left", True)
    assert (left.detail or "").startswith("re-drive ended without an outcome")
    assert report.needs_a_person


async def test_a_redrive_still_retried_holds_one_place_and_the_claims_after_go_on(
    vaulted: Harness,
) -> None:
    """Claims are resolved two at a time here. The oldest one's re-drive meets a saved 500
    and is retried up to its time limit; meanwhile the claims after it are re-driven in the
    other place, not held until it stops."""
    [slow] = await vaulted.seed(1)
    await lost_in_doubt(vaulted, [slow], fault="error_saved_before_commit")
    quick = await vaulted.seed(2, prefix="later")
    for customer in quick:
        await stranded(vaulted, customer, at_stripe=False)
    # Customers added after the key was issued: its cap makes room for them.
    await vaulted.pool.execute(
        "UPDATE vault_keys SET cap_cents = cap_cents + $1",
        sum(c.amount_cents for c in quick),
    )
    request = ReconcileInput(period=str(PERIOD), redrive_timeout_seconds=10, claims_at_once=2)
    report, handle = await reconciled_with(vaulted, request)
    assert [(c.customer_id, c.action, c.outcome) for c in report.claims] == [
        (slow.customer_id, "left", None),
        *((c.customer_id, "redriven", "charged") for c in quick),
    ]
    history = await handle.fetch_history()
    events = history.events
    last_started = max(
        i
        for i, e in enumerate(events)
        if e.start_child_workflow_execution_initiated_event_attributes.workflow_id
        == customer_workflow_id(PERIOD, quick[-1].customer_id)
    )
    slow_stopped = min(
        i
        for i, e in enumerate(events)
        if e.HasField("child_workflow_execution_timed_out_event_attributes")
    )
    assert last_started < slow_stopped
    assert await vaulted.succeeded() == len(quick)
    # I6 with a claim waiting for a place: RECORD_HISTORIES=1 keeps the run.
    await replay([history])
    keep([history])


async def test_an_unknown_reservation_changed_lately_is_not_released_yet(
    vaulted: Harness,
) -> None:
    [customer] = await vaulted.seed(1)
    admin = await lost_in_doubt(vaulted, [customer])
    # Unknown a moment ago by the vault's clock, whatever the worker's clock says.
    await vaulted.pool.execute("UPDATE vault_reservations SET updated_at = now()")
    report = await reconcile(vaulted)
    [reservation] = report.reservations
    assert reservation.state == "unknown"
    assert "Stripe may still commit it" in (reservation.detail or "")
    # The claim is then charged again with its key (a takeover of that reservation): the
    # money counts once.
    [key] = await admin.find_keys(period=str(PERIOD), label=period_keys.LABEL)
    settled = await admin.get_key(key.id)
    assert settled.spent_cents + settled.reserved_cents == customer.amount_cents


async def test_a_failure_made_under_another_key_does_not_release_an_unanswered_one(
    vaulted: Harness,
) -> None:
    # The vault stopped waiting for the last attempt a moment ago (no answer recorded), and
    # Stripe shows a declined charge with the claim's metadata, made under another key (a
    # script's retry): it says nothing of the vault's request, which may still commit.
    [customer] = await vaulted.seed(1, card_for=lambda _: "pm_card_chargeCustomerFail")
    await lost_in_doubt(vaulted, [customer])
    await vaulted.pool.execute(
        "UPDATE vault_reservations SET upstream_status = NULL, updated_at = now()"
    )
    key = idempotency_key(vaulted.settings.billing_key_namespace, customer.customer_id, PERIOD)
    async with vaulted.pool.acquire() as conn:
        claim = await ledger.claim_by_key(conn, key)
    assert claim is not None
    with pytest.raises(stripe.CardError):
        await vaulted.stripe.v1.payment_intents.create_async(
            charge_params(claim, "payment_intents"),  # type: ignore[arg-type]
            {"idempotency_key": key + "-by-a-script"},
        )
    report = await reconcile(vaulted)
    [reservation] = report.reservations
    assert reservation.state == "unknown"
    assert "Stripe may still commit it" in (reservation.detail or "")


async def test_a_reservation_a_retry_took_over_after_the_lookup_is_not_released(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Unknown for an hour with nothing at Stripe: releasable. But between reconciliation's
    # lookup and its release, a retry with the same key takes the reservation over; Stripe
    # takes that charge and its answer is lost, so the reservation is unknown again.
    [customer] = await vaulted.seed(1)
    admin = await lost_in_doubt(vaulted, [customer])
    lookup = ReconcileActivities._find
    retried: list[bool] = []

    async def a_retry_lands_after_the_lookup(
        self: ReconcileActivities, claim: Claim, *, recheck: bool = False
    ) -> tuple[ChargeResult | ChargeFailure | None, bool]:
        found = await lookup(self, claim, recheck=recheck)
        if not retried:
            retried.append(True)
            await vaulted.set_faults(drop_after_commit=1.0)
            with pytest.raises(stripe.StripeError):
                await (await self._access.gateway_for(claim)).charge(claim)
            await vaulted.set_faults(drop_after_commit=0.0)
        return found

    monkeypatch.setattr(ReconcileActivities, "_find", a_retry_lands_after_the_lookup)
    report = await reconcile(vaulted)
    assert retried and await vaulted.succeeded() == 1
    [reservation] = report.reservations
    assert reservation.state == "unknown" and "retried since attempt" in (reservation.detail or "")
    # I4: the charge Stripe took still counts against the cap.
    [key] = await admin.find_keys(period=str(PERIOD), label=period_keys.LABEL)
    settled = await admin.get_key(key.id)
    assert settled.spent_cents + settled.reserved_cents == customer.amount_cents


async def test_a_duplicate_charge_is_reported_with_its_id_and_amount(harness: Harness) -> None:
    claim = await billed(harness, 3)
    duplicate = await plant(harness, claim, claim.idempotency_key + "-retry")
    async with harness.running_worker():
        code, out, err = await harness.starter("reconcile", str(PERIOD), "--json")
        # What the Web UI shows of the run.
        shown = await harness.client.get_workflow_handle(reconcile_workflow_id(PERIOD)).query(
            "__temporal_workflow_metadata", result_type=WorkflowMetadata
        )
    assert shown.current_details == "0 open claims, 1 duplicates, 0 orphans, 1 findings in all"
    assert code == 1, out
    assert "holds no row" not in err, err
    report = ReconcileReport.model_validate_json(out)
    [finding] = report.findings
    assert (finding.kind, finding.charge_id, finding.amount_cents) == (
        "duplicate",
        duplicate,
        claim.amount_cents,
    )
    assert finding.customer_id == claim.customer_id
    assert finding.ledger_charge_id == claim.charge_id != duplicate
    assert "orphan" not in report.finding_counts and report.claims == []


async def test_a_period_no_run_billed_is_reconciled_only_when_asked(harness: Harness) -> None:
    """Its report reads as zeros for every customer checked, as for a period billed clean
    (helper-169 F9), after looking up every customer's charges on Stripe: a mistyped month,
    most likely, which ran in full with a note (helper-187)."""
    await harness.seed(2)
    async with harness.running_worker():
        code, out, err = await harness.starter("reconcile", str(PERIOD))
        assert (code, out) == (2, ""), err
        assert err.startswith(
            f"error: the ledger holds no row of {PERIOD}: no run has billed it, so a"
            " reconciliation would look up every active customer's charges on Stripe"
        )
        assert "--unbilled reconciles it all the same. Nothing was started" in err
        with pytest.raises(RPCError, match="not found"):
            await harness.client.get_workflow_handle(reconcile_workflow_id(PERIOD)).describe()
        code, out, err = await harness.starter("reconcile", str(PERIOD), "--unbilled")
    assert code == 0, err
    assert "2 customers checked" in out, out


async def test_a_period_a_run_opened_is_reconciled_though_it_billed_nobody(
    harness: Harness,
) -> None:
    """The ledger holds a run of it and no customer's row (here, nobody was due; a run stuck
    before its first claim alike): no mistyped month, so no --unbilled (helper-189)."""
    async with harness.running_worker():
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
        assert summary.due == 0
        await harness.seed(2)
        code, out, err = await harness.starter("reconcile", str(PERIOD))
    assert code == 0, err
    assert "2 customers checked" in out, out


@pytest.mark.parametrize("for_good", [True, False], ids=["deleted", "rate-limited"])
async def test_a_customer_stripe_will_not_list_is_left_unchecked_and_the_rest_compared(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, for_good: bool
) -> None:
    # Stripe answers 400 resource_missing for the charges of a customer deleted since; that
    # refusal used to fail the whole page, and each daily run after it. A 429 is no refusal:
    # the page is listed again, and its customer checked.
    claim = await billed(harness, 3)
    duplicate = await plant(harness, claim, claim.idempotency_key + "-retry")
    async with harness.pool.acquire() as conn:
        gone = await conn.fetchrow(
            "SELECT customer_id, stripe_customer_id FROM customers WHERE customer_id <> $1"
            " ORDER BY customer_id LIMIT 1",
            claim.customer_id,
        )
    listing = StripeGateway.period_charges
    refusals: list[str] = []

    async def refused_for_one(
        self: StripeGateway, stripe_customer_id: str, period: str
    ) -> list[StripeCharge]:
        if stripe_customer_id == gone["stripe_customer_id"] and (for_good or not refusals):
            refusals.append(stripe_customer_id)
            if not for_good:
                raise stripe.RateLimitError("Too many requests", http_status=429)
            raise stripe.InvalidRequestError(  # type: ignore[no-untyped-call]
                f"No such customer: '{stripe_customer_id}'",
                "customer",
                code="resource_missing",
                http_status=400,
            )
        return await listing(self, stripe_customer_id, period)

    monkeypatch.setattr(StripeGateway, "period_charges", refused_for_one)
    async with harness.running_worker():
        code, out, _ = await harness.starter("reconcile", str(PERIOD), "--json")
    report = ReconcileReport.model_validate_json(out)
    assert refusals
    assert report.unchecked_customers == ([gone["customer_id"]] if for_good else [])
    assert [(f.kind, f.charge_id) for f in report.findings] == [("duplicate", duplicate)]
    assert code == 1


def no_key_can_read_eur(monkeypatch: pytest.MonkeyPatch) -> None:
    """No key can read the period's charges in euros (none issued, and the vault refuses a
    lookup key: a currency retired from its policy)."""
    reading = ReconcileActivities._reading

    async def no_key_for_eur(
        self: ReconcileActivities, period: str, currency: str, *args: Any, **kwargs: Any
    ) -> Any:
        if currency == "eur":
            raise period_keys.NoPeriodKeyError(f"no key can read {period} ({currency})")
        return await reading(self, period, currency, *args, **kwargs)

    monkeypatch.setattr(ReconcileActivities, "_reading", no_key_for_eur)


@pytest.mark.parametrize("in_ledger", [False, True], ids=["never-claimed", "claimed"])
async def test_a_customer_no_key_can_read_is_unchecked_only_if_the_period_claimed_it(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, in_ledger: bool
) -> None:
    """An inactive customer in a currency the period has no key for, nor the vault a lookup
    key (retired from its policy): nothing of ours can have charged it unless the period
    claimed it, so only then is it reported unchecked (exit 1 every day otherwise)."""
    await billed(harness, 2)
    [retired] = await harness.seed(1, prefix="old")
    async with harness.pool.acquire() as conn:
        await conn.execute(
            "UPDATE customers SET currency = 'eur', active = false WHERE customer_id = $1",
            retired.customer_id,
        )
        if in_ledger:
            key = idempotency_key(
                harness.settings.billing_key_namespace, retired.customer_id, PERIOD
            )
            await ledger.request_skip(
                conn, retired.customer_id, str(PERIOD), key, "moved away", "ops"
            )
    no_key_can_read_eur(monkeypatch)
    report = await reconcile(harness)
    assert report.customers_checked == 3 and report.findings == []
    assert report.unchecked_customers == ([retired.customer_id] if in_ledger else [])
    assert report.needs_a_person is in_ledger


@pytest.mark.parametrize("listed", [True, False], ids=["both-listed", "old-id-skipped"])
async def test_a_shared_stripe_customers_charges_count_once_under_a_customer_whose_listing_runs(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, listed: bool
) -> None:
    """A charge listed under two customers of ours on one page is counted once; not under
    one whose listing is skipped (inactive, unclaimed, in a currency no key can read), or
    under none."""
    first = await billed(harness, 1)
    old = CustomerRow(
        # Renamed since, to an id listed after it: the old id comes first.
        customer_id=f"a-{first.customer_id}",
        stripe_customer_id=first.stripe_customer_id,
        payment_method=first.payment_method,
        amount_cents=first.amount_cents,
        currency=first.currency if listed else "eur",
    )
    await upsert_customers(harness.pool, [old])
    await harness.pool.execute(
        "UPDATE customers SET active = false WHERE customer_id = $1", old.customer_id
    )
    no_key_can_read_eur(monkeypatch)
    report = await reconcile(harness)
    assert (report.customers_checked, report.unchecked_customers) == (2, [])
    assert report.findings == [] and report.charges_checked == 1


async def test_customers_left_unchecked_alone_make_the_reconcile_command_exit_1(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # E.g. a key of the wrong Stripe account: every listing refused, nothing found. That is
    # no clean bill of health.
    await billed(harness, 2)

    async def refused(self: StripeGateway, stripe_customer_id: str, period: str) -> None:
        raise stripe.InvalidRequestError(  # type: ignore[no-untyped-call]
            f"No such customer: '{stripe_customer_id}'; a similar object exists in live mode",
            "customer",
            code="resource_missing",
            http_status=400,
        )

    monkeypatch.setattr(StripeGateway, "period_charges", refused)
    async with harness.running_worker():
        code, out, _ = await harness.starter("reconcile", str(PERIOD))
    assert code == 1, out
    assert "not checked" in out and "Stripe refused to list their charges" in out


async def unusable(vaulted: Harness, how: str) -> None:
    """The period's key expired (its grace is over) or revoked (the kill switch), or revoked
    and its row deleted (an operator about to issue a new one)."""
    assert vaulted.vault is not None
    [key] = await vaulted.vault.admin.find_keys(period=str(PERIOD), label=period_keys.LABEL)
    if how in ("revoked", "deleted"):
        await vaulted.vault.admin.revoke(key.id)
        if how == "deleted":
            await vaulted.pool.execute("DELETE FROM period_vault_keys")
        return
    async with vaulted.pool.acquire() as conn:
        await conn.execute(
            "UPDATE vault_keys SET expires_at = now() - interval '1 second' WHERE id = $1", key.id
        )


@pytest.mark.parametrize("how", ["expired", "revoked", "deleted"])
async def test_a_period_whose_key_can_no_longer_be_used_is_still_reconciled(
    vaulted: Harness, how: str
) -> None:
    # Billed in arrears, a period is reconciled daily for weeks, past its key's grace.
    claim = await billed(vaulted, 3)
    duplicate = await plant(vaulted, claim, claim.idempotency_key + "-retry")
    # A claim whose charge never reached Stripe, its workflow gone.
    [late] = await vaulted.seed(1, prefix="late")
    await stranded(vaulted, late, at_stripe=False)
    await unusable(vaulted, how)
    report = await reconcile(vaulted)
    assert report.customers_checked == 4 and report.unchecked_customers == []
    assert [(f.kind, f.charge_id) for f in report.findings] == [("duplicate", duplicate)]
    # Nothing to charge it with: left at once, with what to do, not re-driven to a refusal.
    [left] = report.claims
    assert (left.customer_id, left.action, left.needs_person) == (late.customer_id, "left", True)
    assert left.detail is not None and "delete the key's row" in left.detail
    # It read with a key of its own that can move no money.
    assert vaulted.vault is not None
    [lookup] = await vaulted.vault.admin.find_keys(
        period=str(PERIOD), label=period_keys.LOOKUP_LABEL
    )
    assert all(entry.startswith("GET ") for entry in lookup.allowed_endpoints)
    assert lookup.expires_at - datetime.now(UTC) <= period_keys.LOOKUP_LIFETIME


async def test_a_claim_is_charged_through_the_key_that_replaced_the_one_a_worker_holds(
    vaulted: Harness,
) -> None:
    """`renew-keys` (or a rerun) stores a new key and revokes the old one, which the worker
    still caches: reconciliation reads through the new key, which can charge, and charges
    the claim, rather than leaving it for a person to replace a key that was already
    replaced."""
    assert vaulted.vault is not None
    customers = await vaulted.seed(2)
    async with vaulted.running_worker():
        await (await start_period(vaulted.client, PERIOD, vaulted.task_queue)).result()
        [late] = await vaulted.seed(1, prefix="late")
        claim = await stranded(vaulted, late, at_stripe=False)
        [old] = await vaulted.vault.admin.find_keys(period=str(PERIOD), label=period_keys.LABEL)
        await _renewed(vaulted, claim.currency)
        assert (await vaulted.vault.admin.get_key(old.id)).revoked
        handle = await start_reconcile(vaulted.client, PERIOD, vaulted.task_queue)
        report = await handle.result()
    assert [(c.customer_id, c.action, c.needs_person) for c in report.claims] == [
        (late.customer_id, "redriven", False)
    ]
    await assert_billed_once(vaulted, str(PERIOD), [*customers, late])


async def test_a_claim_left_for_a_revoked_key_is_charged_once_the_key_is_replaced(
    vaulted: Harness,
) -> None:
    """The report said the period's key was revoked; an operator replaced it and reconciles
    again, with a worker that saw the old key refused a moment ago (and reads through a
    lookup key for a while): the claim's lookup tries the period's key all the same, and the
    claim is charged, not left again for a key already replaced."""
    [paid] = await vaulted.seed(1)
    await bill(vaulted)
    [late] = await vaulted.seed(1, prefix="late")
    claim = await stranded(vaulted, late, at_stripe=False)
    await unusable(vaulted, "revoked")
    async with vaulted.running_worker():
        first = await (await start_reconcile(vaulted.client, PERIOD, vaulted.task_queue)).result()
        assert [(c.action, c.needs_person) for c in first.claims] == [("left", True)]
        await _renewed(vaulted, claim.currency)
        again = await (await start_reconcile(vaulted.client, PERIOD, vaulted.task_queue)).result()
    assert [(c.customer_id, c.action, c.outcome) for c in again.claims] == [
        (late.customer_id, "redriven", "charged")
    ]
    await assert_billed_once(vaulted, str(PERIOD), [paid, late])


async def test_a_lookup_key_revoked_is_replaced_on_the_next_read(vaulted: Harness) -> None:
    """Every key of the period revoked (an incident), the one reconciliation reads with too:
    the refused read drops it, and the next read issues another, rather than every read
    failing until the cached key expires an hour later."""
    claim = await billed(vaulted, 1)
    await unusable(vaulted, "revoked")
    assert vaulted.vault is not None
    settling = ReconcileActivities(
        vaulted.pool, vaulted.vault_access(), vaulted.settings, vaulted.vault.worker
    )
    found, can_charge = await settling._find(claim)
    assert isinstance(found, ChargeResult) and not can_charge
    [lookup] = await vaulted.vault.admin.find_keys(
        period=str(PERIOD), label=period_keys.LOOKUP_LABEL
    )
    await vaulted.vault.admin.revoke(lookup.id)
    with pytest.raises(ApplicationError) as refused:
        await settling._find(claim)
    assert refused.value.type == "KeyRefused" and not refused.value.non_retryable
    # Not the period key's advice: nothing there is for an operator to do.
    assert refused.value.message == (
        "vault_key_revoked: the vault key issued to read the period's charges was revoked,"
        " the kill switch (a retry issues another)"
    )
    found, _ = await settling._find(claim)
    assert isinstance(found, ChargeResult) and found.charge_id == claim.charge_id


async def test_a_vault_away_when_a_lookup_key_is_asked_for_is_waited_out(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vault not answering for a moment is not its refusal: the page is retried, rather
    than its customers reported unchecked and the charges of those never claimed skipped."""
    claim = await billed(vaulted, 2)
    duplicate = await plant(vaulted, claim, claim.idempotency_key + "-retry")
    await unusable(vaulted, "revoked")
    issue = VaultAdmin.issue_key
    unanswered: list[str] = []

    async def away_once(self: VaultAdmin, request: Any) -> Any:
        if request.label == period_keys.LOOKUP_LABEL and not unanswered:
            unanswered.append(request.currency)
            raise VaultUnavailable(0, None, "ClientConnectorError: the vault did not answer")
        return await issue(self, request)

    monkeypatch.setattr(VaultAdmin, "issue_key", away_once)
    report = await reconcile(vaulted)
    assert unanswered == [claim.currency]
    assert (report.customers_checked, report.unchecked_customers) == (2, [])
    assert [(f.kind, f.charge_id) for f in report.findings] == [("duplicate", duplicate)]


async def test_a_period_key_the_worker_cannot_decrypt_fails_reconciliation(
    vaulted: Harness,
) -> None:
    await billed(vaulted, 2)
    async with vaulted.pool.acquire() as conn:
        await conn.execute(
            "UPDATE period_vault_keys SET sealed_secret = $1",
            SecretBox(SecretStr(new_key())).seal(SecretStr("vk_sealed_elsewhere")),
        )
    with pytest.raises(WorkflowFailureError) as failed:
        await reconcile(vaulted)
    activity_failure = failed.value.cause
    assert isinstance(activity_failure, ActivityError)
    assert "cannot be decrypted with BILLING_KEY_ENCRYPTION_KEYS" in str(activity_failure.cause)
    # A setting to fix: failed at once, not retried for minutes first.
    assert activity_failure.retry_state == RetryState.NON_RETRYABLE_FAILURE


async def test_a_duplicate_is_found_through_its_claims_api_after_the_setting_changed(
    harness: Harness,
) -> None:
    harness.settings = harness.settings.model_copy(update={"billing_charge_api": "charges"})
    claim = await billed(harness, 2)
    assert claim.charge_api == "charges"
    duplicate = await harness.stripe.v1.charges.create_async(
        charge_params(claim, "charges"),  # type: ignore[arg-type]
        {"idempotency_key": claim.idempotency_key + "-retry"},
    )
    # Redeployed with PaymentIntents: the claims' charges are still listed where they are.
    harness.settings = harness.settings.model_copy(update={"billing_charge_api": "payment_intents"})
    report = await reconcile(harness)
    assert [(f.kind, f.charge_id) for f in report.findings] == [("duplicate", duplicate.id)]


async def test_a_duplicate_refunded_in_full_is_no_longer_reported(harness: Harness) -> None:
    claim = await billed(harness, 2)
    refunded = await plant(harness, claim, claim.idempotency_key + "-retry")
    partly = await plant(harness, claim, claim.idempotency_key + "-again")
    await harness.stripe.v1.refunds.create_async({"charge": refunded})
    await harness.stripe.v1.refunds.create_async({"charge": partly, "amount": 1})
    # The person refunded one duplicate in full; the other keeps all but a cent.
    report = await reconcile(harness)
    assert [(f.kind, f.charge_id) for f in report.findings] == [("duplicate", partly)]


async def test_a_duplicate_whose_ledger_charge_was_refunded_instead_is_not_reported(
    harness: Harness,
) -> None:
    # Of two charges, a person refunded the one the ledger records: the customer has paid
    # once, by the other, which was reported as a duplicate every day all the same.
    claim = await billed(harness, 2)
    [row] = [
        r for r in await harness.ledger_rows(str(PERIOD)) if r["customer_id"] == claim.customer_id
    ]
    await plant(harness, claim, claim.idempotency_key + "-retry")
    await harness.stripe.v1.refunds.create_async({"charge": row["charge_id"]})
    report = await reconcile(harness)
    assert report.findings == [] and not report.needs_a_person
    # A third charge is one too many again.
    third = await plant(harness, claim, claim.idempotency_key + "-again")
    report = await reconcile(harness)
    assert [(f.kind, f.charge_id) for f in report.findings] == [("duplicate", third)]


async def test_a_bank_debit_is_charged_at_once_and_reported_every_day_once_returned(
    harness: Harness,
) -> None:
    # A bank debit is recorded while pending (its intent processing): the period does not
    # wait days for the bank. The bank then returns one debit and settles the other.
    banks = {1: "pm_sepaDebit_fails", 2: "pm_sepaDebit_succeeds"}
    rows = await harness.seed(3, card_for=lambda i: banks.get(i, "pm_card_visa"))
    debtor, payer = (row.model_copy(update={"currency": "eur"}) for row in rows[:2])
    await upsert_customers(harness.pool, [debtor, payer])
    await bill(harness)
    # Each charged once, the pending debits among them.
    await assert_billed_once(harness, str(PERIOD), [debtor, payer, rows[2]])
    ledger_rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    pending = {c["id"] for c in await harness.charges() if c["status"] == "pending"}
    debits = {ledger_rows[r.customer_id]["charge_id"] for r in (debtor, payer)}
    assert pending == debits and len(debits) == 2
    # Still pending, both are charges made: nothing to report yet, but the report says how
    # many the banks have yet to answer.
    async with harness.running_worker():
        code, out, _ = await harness.starter("reconcile", str(PERIOD))
    assert code == 0, out
    assert "3 charges of 3 customers checked (2 of them bank debits still pending" in out
    report = await reconcile(harness)
    assert report.findings == [] and report.charges_checked == 3
    assert report.pending_charges == 2

    settled = {c["id"]: c["status"] for c in await harness.emulator.settle_debits()}
    returned = ledger_rows[debtor.customer_id]["charge_id"]
    assert settled == {returned: "failed", ledger_rows[payer.customer_id]["charge_id"]: "succeeded"}
    for _ in range(2):
        # Until a person acts: the ledger keeps what the worker recorded.
        async with harness.running_worker():
            code, out, _ = await harness.starter("reconcile", str(PERIOD))
        assert code == 1, out
        assert (
            f"FAILED_LATER {returned} {describe_amount(debtor.currency, debtor.amount_cents)}"
            in out
        )
        assert "1 failed later" in out and "0 duplicates" in out
    report = await reconcile(harness)
    [finding] = report.findings
    assert (finding.ledger_status, finding.failure_code) == ("charged", "insufficient_funds")
    # Only the charges made are counted as checked: the card's and the settled debit's.
    assert (report.charges_checked, report.pending_charges) == (2, 0)


async def test_a_finding_a_person_handled_is_counted_not_reported(harness: Harness) -> None:
    # A duplicate the customer agreed to: the daily run would otherwise exit 1 for it until
    # the period left its window.
    claim = await billed(harness, 2)
    duplicate = await plant(harness, claim, claim.idempotency_key + "-retry")
    async with harness.running_worker():
        code, out, _ = await harness.starter("reconcile", str(PERIOD))
        assert code == 1 and f"DUPLICATE {duplicate}" in out, out
        # Under another period: refused as a typo, then marked all the same, and a charge is
        # one charge whatever the period it was marked under.
        elsewhere = ("handled", "2026-11", "DUPLICATE", duplicate, "--reason", "agreed")
        code, out, err = await harness.starter(*elsewhere)
        assert code == 2 and f"under {PERIOD}, not 2026-11: mark it under {PERIOD}" in err, err
        code, out, _ = await harness.starter(*elsewhere, "--operator", "ann", "--force")
        assert code == 0 and f"DUPLICATE {duplicate}: recorded as handled" in out, out
        # Once: a second word does not replace the first.
        code, out, _ = await harness.starter(
            "handled", str(PERIOD), "duplicate", duplicate, "--reason", "again"
        )
        assert code == 0 and "handled before, by ann (agreed) for 2026-11" in out, out
        code, out, _ = await harness.starter("reconcile", str(PERIOD))
    assert code == 0, out
    assert "0 duplicates" in out and "1 handled by a person" in out
    assert duplicate not in out
    # The mark names the kind: were the ledger's own charge to fail later, that would show.
    report = await reconcile(harness)
    assert report.findings == [] and report.handled_count == 1
    another = await plant(harness, claim, claim.idempotency_key + "-again")
    report = await reconcile(harness)
    assert [f.charge_id for f in report.findings] == [another]
    # Taken back, it is reported again; taking back what is not marked says so.
    undo = ("handled", str(PERIOD), "duplicate", duplicate, "--undo", "--reason", "mistake")
    code, out, _ = await harness.starter(*undo)
    assert code == 0 and "taken back (it was marked by ann (agreed)" in out, out
    code, out, _ = await harness.starter(*undo)
    assert code == 2 and "nothing to take back" in out, out
    report = await reconcile(harness)
    assert sorted(f.charge_id for f in report.findings) == sorted([duplicate, another])
    # Listed under the period it was made under, taken back and all.
    code, out, _ = await harness.starter("handled", "2026-11")
    assert code == 0 and "0 finding(s) marked handled under 2026-11, 1 taken back" in out, out
    assert f"DUPLICATE {duplicate}: by ann" in out and "taken back by" in out, out
    code, out, _ = await harness.starter("handled", "2026-11", "--json")
    [mark] = HandledMarks.model_validate_json(out).marks
    assert (mark.charge_id, mark.reason, mark.undo_reason) == (duplicate, "agreed", "mistake")
    code, out, _ = await harness.starter("handled", str(PERIOD))
    assert code == 0 and "0 finding(s) marked handled under" in out, out


async def test_a_mark_for_a_finding_no_reconciliation_reported_is_refused(
    harness: Harness,
) -> None:
    """A mistyped charge id (or kind) was confirmed as handled while the real finding stayed
    open (helper-169 F5): a mark is only for a finding a reconciliation reported, unless
    --force says otherwise."""
    claim = await billed(harness, 2)
    duplicate = await plant(harness, claim, claim.idempotency_key + "-retry")
    mark = ("handled", str(PERIOD), "duplicate", "ch_nonexistent", "--reason", "refunded")
    code, out, err = await harness.starter(*mark)
    assert code == 2 and "no reconciliation has reported DUPLICATE for ch_nonexistent:" in err
    assert "Nothing was marked; --force marks it all the same" in err, err
    async with harness.running_worker():
        assert duplicate in (await harness.starter("reconcile", str(PERIOD)))[1]
    code, out, err = await harness.starter(
        "handled", str(PERIOD), "orphan", duplicate, "--reason", "refunded"
    )
    assert code == 2, out
    assert f"no reconciliation has reported ORPHAN for {duplicate}; it reported DUPLICATE" in err
    assert f"DUPLICATE under {PERIOD}: check the kind" in err, err
    code, out, err = await harness.starter(*mark, "--force")
    assert code == 0 and "DUPLICATE ch_nonexistent: recorded as handled" in out, err
    code, out, err = await harness.starter(
        "handled", str(PERIOD), "duplicate", duplicate, "--reason", "refunded"
    )
    assert code == 0 and f"DUPLICATE {duplicate}: recorded as handled" in out, err
    async with harness.pool.acquire() as conn:
        marks = await ledger.handled_marks(conn, str(PERIOD))
    assert sorted(m.charge_id for m in marks) == sorted(["ch_nonexistent", duplicate])
    # A mark made with --force is taken back without it: an undo marks nothing.
    undo = ("handled", str(PERIOD), "duplicate", "ch_nonexistent", "--undo", "--reason", "typo")
    code, out, err = await harness.starter(*undo)
    assert code == 0 and "DUPLICATE ch_nonexistent: taken back (it was marked by" in out, err


def finding(kind: FindingKind, charge_id: str, customer_id: str = "cust-1") -> Finding:
    return Finding(
        kind=kind,
        charge_id=charge_id,
        payment_intent_id=None,
        customer_id=customer_id,
        stripe_customer_id="cus_1",
        amount_cents=1000,
        currency="usd",
        key_prefix=None,
        ledger_status="charged",
        ledger_charge_id=None,
    )


async def test_a_mark_taken_back_and_made_again_stands_for_the_kind_it_names(
    db: asyncpg.Pool,
) -> None:
    """A person's last word counts: marked again after an undo, the finding is handled
    (not reported daily with "handled before" shown); and only the kind marked is, so the
    same charge failing later is still reported."""
    mark = HandledRequest(
        period=str(PERIOD), kind="duplicate", charge_id="ch_marked", reason="agreed", operator="ann"
    )
    found = [finding("duplicate", mark.charge_id), finding("failed_later", mark.charge_id)]
    async with db.acquire() as conn:
        assert (await ledger.mark_handled(conn, mark)).change == "recorded"
        undo = mark.model_copy(update={"undo": True, "reason": "mistake"})
        assert (await ledger.mark_handled(conn, undo)).change == "undone"
        assert await ledger.handled_among(conn, found) == {}
        again = mark.model_copy(update={"operator": "bob", "reason": "agreed after all"})
        result = await ledger.mark_handled(conn, again)
        assert (result.change, result.handled_by) == ("recorded", "bob")
        assert await ledger.handled_among(conn, found) == {(mark.charge_id, "duplicate"): "bob"}
        [standing] = await ledger.handled_marks(conn, str(PERIOD))
        assert (standing.handled_by, standing.undone_at) == ("bob", None)


async def test_a_finding_is_kept_reported_once_under_the_period_last_reporting_it(
    db: asyncpg.Pool,
) -> None:
    """What `handled` checks a charge id against. One page may find a charge twice (listed
    under two customers of ours sharing its Stripe customer): written twice in one
    statement, the page would fail on every retry."""
    async with db.acquire() as conn:
        await ledger.record_reported(conn, str(PERIOD.previous()), [finding("orphan", "ch_1")])
        twice = [finding("orphan", "ch_1", "cust-old"), finding("orphan", "ch_1", "cust-new")]
        await ledger.record_reported(conn, str(PERIOD), twice)
        assert await ledger.reported_kinds(conn, "ch_1") == {"orphan": str(PERIOD)}
        # A mistyped charge id: nothing reported, so `handled` refuses it.
        assert await ledger.reported_kinds(conn, "ch_2") == {}


async def test_a_period_is_compared_as_its_own_rows_fixed_it(db: asyncpg.Pool) -> None:
    """What reconciliation reads of a customer comes from its row of the period: listed once,
    under the Stripe customer and in the currency its claim fixed, whatever changed since or
    other periods hold, its charges counted under the customer listed under their Stripe
    customer, compared with this period's row, and its claim open only until it has an
    outcome."""
    moved = CustomerRow(
        customer_id="cust-1",
        stripe_customer_id="cus_billed",
        payment_method="pm_card_visa",
        amount_cents=1000,
        currency="usd",
    )
    unclaimed = moved.model_copy(update={"customer_id": "cust-2", "stripe_customer_id": "cus_2"})
    await upsert_customers(db, [moved, unclaimed])
    keys = {}
    async with db.acquire() as conn:
        # The month before claimed both; this one, `moved` alone.
        for period in (PERIOD.previous(), PERIOD):
            await ledger.open_period(conn, str(period), f"by-hand-{period}")
            for customer in (moved, unclaimed)[: 1 if period == PERIOD else 2]:
                keys[customer.customer_id, period] = key = idempotency_key(
                    "test", customer.customer_id, period
                )
                await ledger.claim(
                    conn, customer.customer_id, str(period), key, charge_api="payment_intents"
                )
        # Given the other's Stripe customer since it was claimed, and another currency.
        await conn.execute(
            "UPDATE customers SET stripe_customer_id = 'cus_2', currency = 'eur'"
            " WHERE customer_id = $1",
            moved.customer_id,
        )
        page = await ledger.customers_page(conn, str(PERIOD), None, 10)
        assert [(c.customer_id, c.stripe_customer_id, c.currency, c.in_ledger) for c in page] == [
            (moved.customer_id, "cus_billed", "usd", True),
            (unclaimed.customer_id, "cus_2", "usd", False),
        ]
        first = await ledger.first_listers(conn, str(PERIOD), {"cus_billed", "cus_2"})
        assert first == {"cus_billed": moved.customer_id, "cus_2": unclaimed.customer_id}
        entries = await ledger.ledger_entries(conn, str(PERIOD), ["cust-1", "cust-2"])
        assert {c: e.idempotency_key for c, e in entries.items()} == {
            moved.customer_id: keys[moved.customer_id, PERIOD]
        }
        failure = ChargeFailure(code="card_declined", message="declined")
        await ledger.record_unbilled(
            conn, keys[moved.customer_id, PERIOD.previous()], "failed", failure
        )
        still_open = await ledger.open_claims(conn, str(PERIOD.previous()), 10)
        assert [c.claim.customer_id for c in still_open] == [unclaimed.customer_id]


async def test_a_duplicate_made_through_the_other_api_is_reported(harness: Harness) -> None:
    claim = await billed(harness, 2)
    assert claim.charge_api == "payment_intents"
    # A second charge with our metadata through the legacy Charges API (a worker or a
    # script still on that setting).
    duplicate = await harness.stripe.v1.charges.create_async(
        charge_params(claim, "charges"),  # type: ignore[arg-type]
        {"idempotency_key": claim.idempotency_key + "-legacy"},
    )
    report = await reconcile(harness)
    assert [(f.kind, f.charge_id) for f in report.findings] == [("duplicate", duplicate.id)]


async def test_a_claim_from_before_its_api_was_recorded_is_found_through_either(
    harness: Harness,
) -> None:
    # Claimed before migration 012 (no API recorded) and charged through Charges, its answer
    # lost; the workers now run with PaymentIntents, which refuse the same key.
    [customer] = await harness.seed(1)
    await stranded(harness, customer, at_stripe=True, api=None)
    assert harness.settings.billing_charge_api == "payment_intents"
    [charged] = await harness.stripe.v1.charges.list_async(
        {"customer": customer.stripe_customer_id}
    )
    report = await reconcile(harness)
    [row] = await harness.ledger_rows(str(PERIOD))
    assert (row["status"], row["charge_id"]) == ("charged", charged.id), report.claims
    assert await harness.succeeded() == 1  # charged once, never again


async def test_an_orphan_charge_with_our_metadata_is_reported(harness: Harness) -> None:
    await harness.seed(2)
    await bill(harness)
    # A customer the period never billed, charged by someone else with our metadata.
    [late] = await harness.seed(1, prefix="late")
    key = idempotency_key(harness.settings.billing_key_namespace, late.customer_id, PERIOD)
    claim = Claim(
        customer_id=late.customer_id,
        period=str(PERIOD),
        idempotency_key=key,
        amount_cents=late.amount_cents,
        currency=late.currency,
        stripe_customer_id=late.stripe_customer_id,
        payment_method=late.payment_method,
        status="claimed",
        claimed_at=datetime.now(UTC),
    )
    orphan = await plant(harness, claim, key)
    async with harness.running_worker():
        code, out, _ = await harness.starter("reconcile", str(PERIOD))
    assert code == 1, out
    assert (
        f"ORPHAN {orphan} {describe_amount(late.currency, late.amount_cents)} for"
        f" {late.customer_id}"
        " (no ledger row)" in out
    )
    assert "0 duplicates, 1 orphan," in out


@pytest.mark.parametrize("page_size", [200, 3], ids=["one-page", "pages"])
async def test_a_clean_period_reports_nothing(harness: Harness, page_size: int) -> None:
    # Compared a page at a time, each customer is checked once.
    customers = await harness.seed(4)
    await bill(harness)
    request = ReconcileInput(period=str(PERIOD), page_size=page_size)
    report, _ = await reconciled_with(harness, request)
    assert report.claims == [] and report.findings == [] and report.reservations == []
    assert not report.vault_checked and not report.more_claims
    assert (report.customers_checked, report.charges_checked) == (4, 4)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_claim_resumed_after_stripes_idempotency_window_is_not_charged_twice(
    harness: Harness,
) -> None:
    # Stripe forgets a key after 24 hours (here: 1 second); claims older than
    # BILLING_LOOKUP_AFTER_SECONDS are looked up before anything is sent.
    await harness.set_faults(idempotency_ttl_seconds=1.0)
    harness.settings = harness.settings.model_copy(update={"billing_lookup_after_seconds": 0.5})
    customers = await harness.seed(2)
    resumed, reconciled = [await stranded(harness, c, at_stripe=True) for c in customers]
    await asyncio.sleep(1.5)
    async with harness.running_worker():
        # One claim resumes in a new run of its own workflow (its worker came back a day
        # late); the other is resolved by reconciliation.
        outcome = await harness.client.execute_workflow(
            CustomerChargeWorkflow.run,
            CustomerChargeInput(period=str(PERIOD), customer_id=resumed.customer_id),
            id=customer_workflow_id(PERIOD, resumed.customer_id),
            task_queue=harness.task_queue,
        )
        report = await (await start_reconcile(harness.client, PERIOD, harness.task_queue)).result()
    assert outcome.outcome == "charged"
    assert [(c.customer_id, c.action) for c in report.claims] == [
        (reconciled.customer_id, "recorded")
    ]
    assert await harness.money_requests() == 2
    await assert_billed_once(harness, str(PERIOD), customers)
    # The window had closed: the same request with the same key now charges again, which
    # only the lookup avoided; reconciliation reports that second charge.
    second = await gateway(harness).charge(reconciled)
    assert isinstance(second, ChargeResult) and not second.replayed
    report = await reconcile(harness)
    assert [(f.kind, f.charge_id) for f in report.findings] == [("duplicate", second.charge_id)]


async def daily_reconciliation(harness: Harness) -> ScheduleHandle:
    code, out, _ = await harness.starter(
        "schedule", "create", "--reconcile", "--paused", "--billed-by-hand"
    )
    assert code == 0 and "every day at 02:00" in out, out
    return harness.client.get_schedule_handle(RECONCILE_SCHEDULE_ID)


async def fire(harness: Harness, handle: ScheduleHandle, launches: int) -> WorkflowHistory:
    """Trigger the schedule's `launches`-th launch and wait for it to end."""
    # Temporal names a launch by its second: two triggers within one share it.
    await asyncio.sleep(1.1)
    await handle.trigger()

    async def launched() -> bool:
        return len((await handle.describe()).info.recent_actions) >= launches

    await eventually(launched)
    action = (await handle.describe()).info.recent_actions[-1].action
    launcher = harness.client.get_workflow_handle(action.workflow_id)  # type: ignore[attr-defined]
    await launcher.result()
    return await launcher.fetch_history()


def started(launch: WorkflowHistory) -> list[str]:
    """The workflows a launch started (or tried to), in order."""
    return [
        event.start_child_workflow_execution_initiated_event_attributes.workflow_id
        for event in launch.events
        if event.HasField("start_child_workflow_execution_initiated_event_attributes")
    ]


async def launch_details(harness: Harness, handle: ScheduleHandle) -> str:
    """The last launch's details, as the Web UI shows them (a worker answers the query)."""
    action = (await handle.describe()).info.recent_actions[-1].action
    launcher = harness.client.get_workflow_handle(action.workflow_id)  # type: ignore[attr-defined]
    metadata: WorkflowMetadata = await launcher.query(
        "__temporal_workflow_metadata", result_type=WorkflowMetadata
    )
    return metadata.current_details


async def reconciled(harness: Harness, checked: Period) -> ReconcileReport | None:
    reconciling: WorkflowHandle[ReconcileWorkflow, ReconcileReport]
    reconciling = harness.client.get_workflow_handle_for(
        ReconcileWorkflow.run, reconcile_workflow_id(checked)
    )
    try:
        return await reconciling.result()
    except RPCError:
        return None


async def run_started(harness: Harness, billed: Period) -> None:
    """A run of the period, opened and closed in the ledger as a run's workflow does."""
    async with harness.pool.acquire() as conn:
        plan = await ledger.plan_period(conn, str(billed))
        await ledger.start_period(conn, plan, "by-hand")
    await closed_by_hand(harness, billed)


async def closed_by_hand(harness: Harness, period: Period) -> None:
    """The period's run closed in the ledger, with no workflow: one the ledger held open with
    none would be reported ended before its close."""
    async with harness.pool.acquire() as conn:
        summary = PeriodSummary.empty(str(period), "by-hand")
        await ledger.finish_period(conn, str(period), summary.model_dump_json())


async def left_to_look_at(harness: Harness, period: Period) -> tuple[bool, str | None]:
    """Whether the period's reconciliation was kept, and what it left to look at again."""
    async with harness.pool.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT open_reason FROM period_reconciliations WHERE billing_period = $1",
            str(period),
        )
    return (False, None) if row is None else (True, row["open_reason"])


async def test_the_daily_schedule_reconciles_the_latest_period_billed(harness: Harness) -> None:
    """It checks the period a billing schedule would bill now once its run has started, else
    the one before (a schedule billing on the 28th bills November on December 28th), and
    nothing while neither has had a run."""
    handle = await daily_reconciliation(harness)
    description = await handle.describe()
    [request] = await harness.client.data_converter.decode(
        list(description.schedule.action.args),  # type: ignore[attr-defined]
        [ScheduledBillingInput],
    )
    assert request.action == "reconcile"
    period = period_for(datetime.now(UTC))

    async with harness.running_worker():
        nothing = await fire(harness, handle, 1)
        assert (
            await reconciled(harness, period),
            await reconciled(harness, period.previous()),
        ) == (
            None,
            None,
        )
        await run_started(harness, period.previous())
        await fire(harness, handle, 2)
        report = await reconciled(harness, period.previous())
        assert report is not None and report.findings == []
        assert await reconciled(harness, period) is None
        await run_started(harness, period)
        latest = await fire(harness, handle, 3)
        report = await reconciled(harness, period)
        assert report is not None and report.period == str(period) and report.findings == []
        # Listed in the Web UI under its period, as a reconciliation run by hand is.
        launched = await harness.client.get_workflow_handle(
            reconcile_workflow_id(period)
        ).describe()
        assert launched.typed_search_attributes.get(search_attributes.BILLING_PERIOD) == str(period)
        # The month before, reconciled since its run and left with nothing, is not again.
        assert started(latest) == [reconcile_workflow_id(period)]
    await handle.delete()
    # I6 for both new paths: RECORD_HISTORIES=1 keeps them in tests/histories.
    await replay([nothing, latest])
    keep([nothing, latest])


async def test_the_daily_schedule_goes_back_to_earlier_periods_until_nothing_is_left(
    harness: Harness,
) -> None:
    """Besides the latest period billed, a firing reconciles again an earlier one whose last
    reconciliation left something (a bank debit pending), and one run since it was last
    reconciled, if ever (a backfill); once their reconciliations leave nothing, it stops."""
    handle = await daily_reconciliation(harness)
    period = period_for(datetime.now(UTC))
    pending = period.previous().previous()
    backfilled = pending.previous()
    for billed in (backfilled, pending, period):
        await run_started(harness, billed)
    async with harness.pool.acquire() as conn:
        await ledger.record_reconciliation(conn, str(pending), "1 bank debits pending")
    async with harness.running_worker():
        first = await fire(harness, handle, 1)
        assert started(first) == [
            reconcile_workflow_id(backfilled),
            reconcile_workflow_id(pending),
            reconcile_workflow_id(period),
        ]
        assert await launch_details(harness, handle) == (
            f"started {reconcile_workflow_id(period)}; also reconciling again"
            f" {backfilled} (never reconciled), {pending} (1 bank debits pending)"
        )
        for checked in (backfilled, pending, period):
            report = await reconciled(harness, checked)
            assert report is not None and report.open_reason is None, report
            assert await left_to_look_at(harness, checked) == (True, None)
        second = await fire(harness, handle, 2)
        assert started(second) == [reconcile_workflow_id(period)]
        # Started again, not refused as run before: each firing finds what changed since.
        assert not any(
            e.HasField("start_child_workflow_execution_failed_event_attributes")
            for e in second.events
        )
    await handle.delete()
    await replay([first, second])
    keep([first])


async def test_a_firing_with_no_recent_period_billed_still_reconciles_earlier_ones_left_open(
    harness: Harness,
) -> None:
    """A pause in billing (neither this month nor the one before run) leaves nothing recent
    to reconcile, but an earlier period whose reconciliation left something (a bank debit
    pending) is still reconciled again: its doubts would otherwise wait for the next run."""
    handle = await daily_reconciliation(harness)
    pending = period_for(datetime.now(UTC)).previous().previous()
    await run_started(harness, pending)
    async with harness.pool.acquire() as conn:
        await ledger.record_reconciliation(conn, str(pending), "1 bank debits pending")
    async with harness.running_worker():
        launch = await fire(harness, handle, 1)
        assert started(launch) == [reconcile_workflow_id(pending)]
        recent = pending.next().next()
        assert await launch_details(harness, handle) == (
            f"neither {recent} nor the month before has been billed: nothing to reconcile;"
            f" also reconciling again {pending} (1 bank debits pending)"
        )
        report = await reconciled(harness, pending)
        assert report is not None and report.open_reason is None, report
    await handle.delete()


async def test_the_daily_schedule_fires_on_every_day_of_the_longest_month(
    harness: Harness,
) -> None:
    """Every day, the 29th to the 31st too: a month's last days are when its doubts pile up."""
    handle = await daily_reconciliation(harness)
    january = datetime(2027, 1, 1, tzinfo=UTC)
    fires = await schedules.matching_times(
        harness.client, handle.id, january, january + timedelta(days=31) - timedelta(seconds=1)
    )
    await handle.delete()
    assert [t.day for t in fires] == list(range(1, 32))


async def test_periods_left_open_for_good_take_turns_being_reconciled_again(
    harness: Harness,
) -> None:
    """Periods are taken reconciled longest ago (or never) first, so that a few left open for
    good (a duplicate nobody handles) do not keep the others waiting for ever."""
    for month in range(5, 11):
        await run_started(harness, Period(2026, month))
    open_for_good = "something for a person"
    async with harness.pool.acquire() as conn:

        async def reconciled_as(months: range, reason: str | None) -> None:
            for month in months:
                await ledger.record_reconciliation(conn, str(Period(2026, month)), reason)

        async def due() -> list[tuple[str, str]]:
            found = await ledger.periods_to_recheck(conn, "2026-11", timedelta(days=62), 3)
            return [(p.period, p.why) for p in found]

        await reconciled_as(range(6, 10), open_for_good)
        await reconciled_as(range(10, 11), None)
        assert await due() == [
            ("2026-05", "never reconciled"),
            ("2026-06", open_for_good),
            ("2026-07", open_for_good),
        ]
        await reconciled_as(range(5, 6), None)
        await reconciled_as(range(6, 8), open_for_good)
        assert await due() == [
            ("2026-08", open_for_good),
            ("2026-09", open_for_good),
            ("2026-06", open_for_good),
        ]
        await run_started(harness, Period(2026, 10))
        assert await due() == [
            ("2026-08", open_for_good),
            ("2026-09", open_for_good),
            ("2026-10", "run again since it was reconciled"),
        ]
        # The period a firing reconciles anyway is not named again.
        found = await ledger.periods_to_recheck(conn, "2026-08", timedelta(days=62), 1)
        assert [p.period for p in found] == ["2026-09"]


async def test_a_verdict_landing_after_a_later_reconciliations_is_dropped(
    harness: Harness,
) -> None:
    """A reconciliation's verdict is kept as of when it began: one landing late (its worker
    frozen past the activity's timeout while a later reconciliation of the period recorded
    its own) replaced the later one, and "nothing left" from it stopped the daily checks of
    what the later one had left open."""
    billed = str(Period(2026, 9))
    await run_started(harness, Period(2026, 9))
    began = datetime.now(UTC) - timedelta(hours=1)
    pending = "1 bank debits pending"
    async with harness.pool.acquire() as conn:
        await ledger.record_reconciliation(conn, billed, pending, began)
        await ledger.record_reconciliation(conn, billed, None, began - timedelta(days=1))
        assert await left_to_look_at(harness, Period(2026, 9)) == (True, pending)
        # The same reconciliation's verdict again (a retried attempt) stands.
        await ledger.record_reconciliation(conn, billed, None, began)
        assert await left_to_look_at(harness, Period(2026, 9)) == (True, None)
        # From a release before the start was sent: kept as of now.
        await ledger.record_reconciliation(conn, billed, pending, None)
        assert await left_to_look_at(harness, Period(2026, 9)) == (True, pending)


@pytest.mark.parametrize("cancelled", ["no", "before-the-end", "after-the-end"])
async def test_a_run_ended_before_its_close_is_reported(harness: Harness, cancelled: str) -> None:
    """A run started by hand and terminated midway left customers billed by no run, with no
    claim to reconcile: only a schedule's daily check of its own firings said so. The report
    does, unless an operator had cancelled the run (its customers stay unbilled as asked),
    which `cancel` records once the run has ended too (helper-176 F1)."""
    await harness.seed(4)
    await harness.set_faults(latency_ms=1000)
    request = OperatorRequest(reason="wrong prices", operator="alice")
    alerts_before = metric_value("billing_runs_ended_unclosed_total")
    async with harness.running_worker():
        handle = await start_period(
            harness.client, PERIOD, harness.task_queue, RunOptions(max_in_flight=1)
        )
        await eventually(lambda: at_least(harness.money_requests(), 1))
        if cancelled == "before-the-end":
            await operations.control(harness.client, PERIOD, "cancel", request)
        await handle.terminate(reason="looked stuck")
        await harness.set_faults(latency_ms=0)
        code, out, err = await harness.starter("reconcile", str(PERIOD))
        as_json = (await harness.starter("reconcile", str(PERIOD), "--json"))[1]
        cancel = ("cancel", str(PERIOD), "--reason", "wrong prices", "--operator", "alice")
        if cancelled == "before-the-end":
            # Its cancel recorded, but not its close: a `cancel` now closes the period.
            code, out, err = await harness.starter(*cancel)
            assert code == 0 and "the ledger records the cancel and closes" in out, (out, err)
            code, out, err = await harness.starter("reconcile", str(PERIOD))
        if cancelled == "after-the-end":
            assert code == 1, (out, err)
            code, out, err = await harness.starter(*cancel)
            assert code == 0 and "had ended before its close; the ledger records the" in out, err
            assert "\n  cancelled by alice: wrong prices\n" in out, out
            code, out, err = await harness.starter(*cancel)
            assert code == 2 and f"no run of {PERIOD} is running to cancel" in err, (out, err)
            assert "the ledger records it cancelled by alice: wrong prices" in err, err
            # Every command reads the run as over, its customers not started as cancelled
            # (helper-177 F1): before, as still open and about to bill them.
            code, out, err = await harness.starter("status", str(PERIOD))
            assert code == 0 and "state cancelled" in out, (out, err)
            assert "cancelled by alice: wrong prices" in out, out
            async with harness.pool.acquire() as conn:
                unstarted = await conn.fetchval(
                    "SELECT min(customer_id) FROM billing_runs WHERE billing_period = $1"
                    " AND status = 'cancelled' AND cancelled_before_start",
                    str(PERIOD),
                )
            code, out, err = await harness.starter(
                "customers", "show", unstarted, "--period", str(PERIOD)
            )
            assert code == 0 and "cancelled" in out and "nothing yet" not in out, (out, err)
            code, out, err = await harness.starter("customers", "deactivate", unstarted)
            assert code == 0, (out, err)
            code, out, err = await harness.starter("reconcile", str(PERIOD))
    warning = "no run claimed, and its last run ended before its close (terminated"
    if cancelled != "no":
        assert code == 0 and warning not in out, (out, err)
        if cancelled == "before-the-end":
            assert metric_value("billing_runs_ended_unclosed_total") == alerts_before
        assert await harness.succeeded() < 4
        return
    assert code == 1, (out, err)
    # Both reconciliations (the text and the JSON) counted it, for an alert.
    alerts = metric_value("billing_runs_ended_unclosed_total")
    assert alerts - alerts_before == 2
    report = ReconcileReport.model_validate_json(as_json)
    unclaimed = report.unclaimed_by_ended_run
    assert 0 < unclaimed < 4, report
    assert f"WARNING: {unclaimed} due customer" in out and warning in out, out
    assert f"Run it again to bill them (python starter.py run {PERIOD};" in out, out
    # Run again, as it says: every customer billed once, and nothing more to report.
    async with harness.running_worker():
        await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
        code, out, err = await harness.starter("reconcile", str(PERIOD))
    assert code == 0 and warning not in out, (out, err)
    assert await harness.succeeded() == 4


@pytest.mark.parametrize("in_doubt", [0, 1])
async def test_a_cancel_of_an_ended_run_names_the_charges_it_left_in_doubt(
    harness: Harness, in_doubt: int
) -> None:
    """A charge sent before the run ended may have been made: `cancel` closes the period,
    and must say reconciliation has that claim still to settle, or the operator takes the
    period for settled and the charge stays unrecorded (or is made again by hand)."""
    customer, _ = await harness.seed(2)
    if in_doubt:
        await stranded(harness, customer, at_stripe=True)
    else:
        await harness.open_period_by_hand(PERIOD)
    code, out, err = await harness.starter(
        "cancel", str(PERIOD), "--reason", "wrong prices", "--operator", "alice"
    )
    assert code == 0 and "had ended before its close; the ledger records the" in out, (out, err)
    said = (
        "; 1 claim whose charge was sent before it ended is left to reconciliation"
        f" (`python starter.py reconcile {PERIOD}`)"
    )
    assert (said in out) == bool(in_doubt), out
    assert ("left to reconciliation" in out) == bool(in_doubt), out


async def test_a_reconciliation_keeps_what_it_left_to_look_at_again(harness: Harness) -> None:
    """A claim its running workflow owns is left, and kept as left, until a later
    reconciliation finishes it."""
    [customer] = await harness.seed(1)
    await stranded(harness, customer, at_stripe=False, terminate=False)
    await closed_by_hand(harness, PERIOD)
    assert (await reconcile(harness)).open_reason == "1 open claims"
    assert await left_to_look_at(harness, PERIOD) == (True, "1 open claims")
    await harness.client.get_workflow_handle(
        customer_workflow_id(PERIOD, customer.customer_id)
    ).terminate(reason="its worker was lost")
    report = await reconcile(harness)
    assert [c.action for c in report.claims] == ["redriven"] and report.open_reason is None
    assert await left_to_look_at(harness, PERIOD) == (True, None)


async def test_a_verdict_the_ledger_cannot_take_costs_the_report_nothing(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next daily run records it: the report of what was found stands meanwhile."""
    claim = await billed(harness, 1)
    duplicate = await plant(harness, claim, claim.idempotency_key + "-retry")

    async def read_only(self: ReconcileActivities, verdict: ReconcileVerdict) -> None:
        raise ApplicationError("the ledger is read-only", non_retryable=True)

    monkeypatch.setattr(
        ReconcileActivities,
        "record_verdict",
        activity.defn(name="reconcile_record_verdict")(read_only),
    )
    report = await reconcile(harness)
    assert [f.charge_id for f in report.findings] == [duplicate]
    assert await left_to_look_at(harness, PERIOD) == (False, None)


@pytest.mark.parametrize("order", ["claimed last", "claimed first"])
async def test_claims_left_alone_do_not_hide_one_stranded_behind_them(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    """A page of claims whose workflows still run (a paused period's window) is read past, so
    a claim stranded behind it is recorded in the same run rather than never reached; the
    pages follow the claims' age, which the ids' order need not (`behind` is listed last)."""
    monkeypatch.setattr(reconcile_activities, "MAX_CLAIMS", 2)
    first, second, behind = await harness.seed(3)
    if order == "claimed first":
        await stranded(harness, behind, at_stripe=True)
    for running in (first, second):
        await stranded(harness, running, at_stripe=False, terminate=False)
    if order == "claimed last":
        await stranded(harness, behind, at_stripe=True)
    report = await reconcile(harness)
    assert sorted((c.customer_id, c.action) for c in report.claims) == [
        (first.customer_id, "left"),
        (second.customer_id, "left"),
        (behind.customer_id, "recorded"),
    ]
    assert not report.more_claims


async def test_claims_past_what_one_run_takes_are_kept_for_the_next_run(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report says more are open, and the ledger keeps the period to look at again:
    read as all clear, the daily reconciliation would never come back to the rest."""
    monkeypatch.setattr(reconcile_activities, "MAX_CLAIMS", 1)
    customers = await harness.seed(2)
    for customer in customers:
        await stranded(harness, customer, at_stripe=False)
    await closed_by_hand(harness, PERIOD)
    first = await reconcile(harness)
    assert first.more_claims and [c.action for c in first.claims] == ["redriven"]
    assert await left_to_look_at(harness, PERIOD) == (True, "0 open claims and more")
    second = await reconcile(harness)
    assert not second.more_claims and [c.action for c in second.claims] == ["redriven"]
    assert await left_to_look_at(harness, PERIOD) == (True, None)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_claim_left_for_a_person_is_listed_past_those_left_alone(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More claims left alone than the report lists: the one stranded for a person (never
    sent, its run ended while paused) is listed first, or the report would read all clear."""
    monkeypatch.setattr(reconcile_activities, "MAX_CLAIMS", 1)
    owned, paused = await harness.seed(2)
    await stranded(harness, owned, at_stripe=False, terminate=False)
    key = idempotency_key(harness.settings.billing_key_namespace, paused.customer_id, PERIOD)
    async with harness.pool.acquire() as conn:
        await ledger.claim(conn, paused.customer_id, str(PERIOD), key, charge_api="payment_intents")
        await conn.execute(
            "UPDATE billing_periods SET control = 'paused' WHERE billing_period = $1", str(PERIOD)
        )
    report = await reconcile(harness)
    assert [(c.customer_id, c.needs_person) for c in report.claims] == [(paused.customer_id, True)]
    assert report.needs_a_person


async def test_a_reconcile_history_replays(harness: Harness) -> None:
    """I6 for ReconcileWorkflow; RECORD_HISTORIES=1 keeps its history in tests/histories."""
    recorded, redriven = await harness.seed(2)
    await stranded(harness, recorded, at_stripe=True)
    await stranded(harness, redriven, at_stripe=False)
    report = await reconcile(harness)
    assert sorted(c.action for c in report.claims) == ["recorded", "redriven"]
    handle = harness.client.get_workflow_handle(reconcile_workflow_id(PERIOD))
    history: WorkflowHistory = await handle.fetch_history()
    await replay([history])
    keep([history])


async def test_an_intent_recorded_incomplete_still_holds_the_customer_renamed_since(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost run's claim whose PaymentIntent Stripe left unconfirmed, reconciled through a
    key that may not cancel it: the row is recorded failed (payment_intent_incomplete), yet
    Stripe may still complete that intent. The customer renamed since (its old id
    deactivated, its Stripe customer imported anew) stays held: a rerun charged it under the
    new id, and Stripe then completed the old intent (helper-151 F1)."""
    monkeypatch.setattr(stripe_gateway, "STALLED_AFTER_SECONDS", 0)
    [old] = await vaulted.seed(1)
    claim = await stranded(vaulted, old, at_stripe=False)
    stalled = await vaulted.stripe.v1.payment_intents.create_async(
        {
            "amount": claim.amount_cents,
            "currency": claim.currency,
            "customer": claim.stripe_customer_id,
            "payment_method": old.payment_method,
            "automatic_payment_methods": {"enabled": True, "allow_redirects": "never"},
            "metadata": {
                KEY_METADATA: claim.idempotency_key,
                "billing_period": str(PERIOD),
                "customer_id": old.customer_id,
            },
        }
    )
    assert stalled.status == "requires_confirmation"
    [resolution] = (await reconcile(vaulted)).claims
    assert resolution.needs_person and (resolution.detail or "").startswith(INCOMPLETE_INTENT)
    [row] = await vaulted.ledger_rows(str(PERIOD))
    assert (row["status"], row["failure_code"]) == ("failed", INCOMPLETE_INTENT)
    renamed = old.model_copy(update={"customer_id": "renamed-1"})
    await upsert_customers(vaulted.pool, [renamed])
    await vaulted.pool.execute(
        "UPDATE customers SET active = false WHERE customer_id = $1", old.customer_id
    )
    await bill(vaulted)
    await vaulted.stripe.v1.payment_intents.confirm_async(stalled.id, {})
    paid = [
        c
        for c in await vaulted.charges()
        if c["customer"] == old.stripe_customer_id and c["status"] == "succeeded"
    ]
    assert len(paid) == 1
    # Held: not due, so never claimed.
    assert [r["customer_id"] for r in await vaulted.ledger_rows(str(PERIOD))] == [old.customer_id]


async def test_an_orphans_metadata_cannot_forge_a_line_of_the_report(harness: Harness) -> None:
    """A charge made outside the orchestrator names its customer in Stripe's metadata, which
    anyone may write: the report shows it on its one line (helper-151 F2)."""
    claim = await billed(harness, 1)
    forged = "ghost\n  Stripe: 0 charges of 0 customers checked; all clear"
    await plant(
        harness, claim.model_copy(update={"customer_id": forged}), claim.idempotency_key + "-x"
    )
    report = await reconcile(harness)
    assert report.finding_counts == {"orphan": 1}
    lines = describe_reconciliation(report).splitlines()
    assert not any(line.startswith("  Stripe: 0 charges") for line in lines), lines
    assert any("ORPHAN" in line and "ghost" in line for line in lines)

"""A period on the real dev server, real Postgres and the emulator: every customer once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
import stripe
from temporalio import activity
from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.client import (
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowHistory,
)
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from activities.period import ENDED_WITHOUT_CLAIM, OutcomesRequest, PeriodActivities
from activities.stripe_gateway import StripeGateway
from billing import ledger, operations
from billing.customers import CustomerRow, upsert_customers
from billing.keys import customer_workflow_id, idempotency_key
from billing.models import (
    MAX_IN_FLIGHT,
    BillingPeriodInput,
    ChargeFailure,
    ChargeResult,
    CustomerChargeInput,
    CustomerOutcome,
    OperatorRequest,
    PeriodState,
    PeriodSummary,
    RunOptions,
    SkipRequest,
)
from billing.periods import Period
from billing.reporting import describe
from billing.runs import period_status, start_period, start_reconcile
from tests.integration.harness import Harness, at_least, single_batch_activations
from tests.integration.holds import ActivityHold, BillHold, HoldBillsAtTheHandOver
from tests.integration.invariants import assert_billed_once
from tests.integration.replay import keep, replay
from tests.waiting import eventually
from workflows.billing_period import BillingPeriodWorkflow
from workflows.customer_charge import (
    PERIOD_WAIT_FIRST,
    SETTLE,
    TEMPORAL_CANCEL,
    CustomerChargeWorkflow,
)
from workflows.identity import WRONG_WORKFLOW_ID

PERIOD = Period(2026, 12)
UNHANDLED_COMMAND = WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND


def declines_third(index: int) -> str:
    return "pm_card_chargeCustomerFail" if index == 3 else "pm_card_visa"


async def test_period_bills_every_customer_once(harness: Harness) -> None:
    customers = await harness.seed(40)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        summary = await handle.result()
    assert (summary.due, summary.charged, summary.failed) == (40, 40, 0)
    assert summary.total_charged_cents == sum(c.amount_cents for c in customers)
    assert summary.workflow_id == "billing-period-2026-12"
    await assert_billed_once(harness, str(PERIOD), customers)
    # Sent straight to Stripe, as each claim says (see ledger.reopen_refused_charge).
    rows = await harness.ledger_rows(str(PERIOD))
    assert {tuple(r["sent_through"]) for r in rows} == {(ledger.SENT_DIRECT,)}
    status = await period_status(harness.client, PERIOD)
    assert (status.state, status.charged, status.in_flight) == ("completed", 40, 0)


async def test_declined_card_fails_once_and_the_rest_are_charged(harness: Harness) -> None:
    customers = await harness.seed(10, card_for=declines_third)
    declined = customers[2]
    async with harness.running_worker():
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert (summary.charged, summary.failed) == (9, 1)
    await assert_billed_once(
        harness, str(PERIOD), customers, declined=frozenset({declined.customer_id})
    )
    row = next(
        r
        for r in await harness.ledger_rows(str(PERIOD))
        if r["customer_id"] == declined.customer_id
    )
    assert row["failure_code"] == "card_declined"
    # Not retried: Stripe saw exactly one request with the declined customer's key.
    sent = [r for r in await harness.requests() if r["idempotency_key"] == row["idempotency_key"]]
    assert len(sent) == 1


def asks_for_authentication_first(index: int) -> str:
    return "pm_card_authenticationRequired" if index == 1 else "pm_card_visa"


async def test_a_card_that_asks_for_authentication_fails_off_session_at_once(
    harness: Harness,
) -> None:
    """Nobody is at hand to authenticate a renewal: sent off session, Stripe declines it at
    once (authentication_required). Sent on session, it would wait for the customer to act,
    holding the period open for days."""
    customers = await harness.seed(2, card_for=asks_for_authentication_first)
    async with harness.running_worker(), asyncio.timeout(120):
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert (summary.charged, summary.failed) == (1, 1)
    row = next(
        r
        for r in await harness.ledger_rows(str(PERIOD))
        if r["customer_id"] == customers[0].customer_id
    )
    assert (row["status"], row["failure_code"]) == ("failed", "authentication_required")


# What Stripe answers a charge naming no payment method when the customer has no legacy
# default source, as the customers imported with PaymentMethods have none (docs/operations.md).
NO_METHOD_REFUSALS = {
    "payment_intents": (
        "payment_intent_unexpected_state",
        "You cannot confirm this PaymentIntent because it's missing a payment method.",
    ),
    "charges": ("missing", "Cannot charge a customer that has no active card"),
}


@pytest.mark.parametrize("api", sorted(NO_METHOD_REFUSALS))
async def test_a_customer_with_no_payment_method_fails_with_stripes_refusal(
    harness: Harness, api: str
) -> None:
    # A row imported before imports required a payment method: Stripe takes no saved card
    # of the customer's for it, not the one shown as the invoice default.
    customers = await harness.seed(2)
    legacy = customers[0]
    async with harness.pool.acquire() as conn:
        await conn.execute(
            "UPDATE customers SET payment_method = NULL WHERE customer_id = $1",
            legacy.customer_id,
        )
    harness.settings = harness.settings.model_copy(update={"billing_charge_api": api})
    async with harness.running_worker():
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert (summary.charged, summary.failed) == (1, 1)
    row = next(
        r for r in await harness.ledger_rows(str(PERIOD)) if r["customer_id"] == legacy.customer_id
    )
    code, message = NO_METHOD_REFUSALS[api]
    assert (row["status"], row["failure_code"], row["charge_id"]) == ("failed", code, None)
    assert row["failure_message"].startswith(message), dict(row)
    charged = {c["customer"] for c in await harness.charges()}
    assert charged == {customers[1].stripe_customer_id}


async def test_running_the_same_period_again_charges_nothing_new(harness: Harness) -> None:
    customers = await harness.seed(20)
    async with harness.running_worker():
        # Two starters at once share one run (same workflow ID, USE_EXISTING).
        first, second = await asyncio.gather(
            start_period(harness.client, PERIOD, harness.task_queue),
            start_period(harness.client, PERIOD, harness.task_queue),
        )
        assert first.result_run_id == second.result_run_id
        await first.result()
        # And after it finished: a new run finds everyone already billed.
        again = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert (again.charged, again.already_billed, again.total_charged_cents) == (0, 20, 0)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_ids_differing_only_in_case_are_two_customers_each_charged_once(
    harness: Harness,
) -> None:
    """The import takes acme-1 and ACME-1 as two customers with two Stripe customers: a key
    or a child workflow ID that folded the case would give the second the first's key (a
    refused or replayed charge) or the first's child (no charge at all)."""
    customers = [*await harness.seed(1, prefix="acme"), *await harness.seed(1, prefix="ACME")]
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        summary = await asyncio.wait_for(handle.result(), 30)
    assert (summary.due, summary.charged, summary.failed) == (2, 2, 0)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_renamed_customer_is_held_not_charged_again_by_a_rerun(harness: Harness) -> None:
    """A customer billed, then renamed: its id deactivated and its Stripe customer imported
    under a new id, which has a key of its own. A rerun of the period (for a customer added
    since) holds the new id rather than charge that Stripe customer twice."""
    first = await harness.seed(2)
    async with harness.running_worker():
        first_run = await start_period(harness.client, PERIOD, harness.task_queue)
        assert (await first_run.result()).charged == 2
        old = first[1]
        renamed = old.model_copy(update={"customer_id": "renamed-1"})
        added = await harness.seed(1, prefix="late")
        await upsert_customers(harness.pool, [renamed])
        await harness.pool.execute(
            "UPDATE customers SET active = false WHERE customer_id = $1", old.customer_id
        )
        rerun = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert (rerun.due, rerun.charged, rerun.already_billed) == (3, 1, 2)
    # Not due, so in no count: the summary says it was held, and where to see which.
    assert rerun.held == 1
    assert "held 1: not due, their Stripe customer billed (or being billed) this period" in (
        describe(rerun)
    )
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    assert "renamed-1" not in rows
    assert rows[added[0].customer_id]["status"] == "charged"
    paid = [
        c
        for c in await harness.charges()
        if c["customer"] == old.stripe_customer_id and c["status"] == "succeeded"
    ]
    assert len(paid) == 1


async def test_duplicate_child_start_races_with_the_period(harness: Harness) -> None:
    customers = await harness.seed(12)
    racer = customers[5]
    # Stripe answers late, so the period starts its children while the one started by hand
    # is still charging.
    await harness.set_faults(latency_ms=2000)
    # A run of the period opened it before (its workflow since terminated, say): a customer's
    # charge is only ever made for a period a run has open.
    await harness.open_period_by_hand(PERIOD)
    async with harness.running_worker():
        # Someone starts one customer's child by hand, with the deterministic ID, first.
        child = await harness.client.start_workflow(
            CustomerChargeWorkflow.run,
            CustomerChargeInput(period=str(PERIOD), customer_id=racer.customer_id),
            id=customer_workflow_id(PERIOD, racer.customer_id),
            task_queue=harness.task_queue,
        )
        period = await start_period(harness.client, PERIOD, harness.task_queue)
        summary = await period.result()
        await child.result()
        history = await period.fetch_history()
    # The period's start of that child found it running, and counted its outcome.
    [refused] = [
        e.start_child_workflow_execution_failed_event_attributes
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_FAILED
    ]
    assert refused.workflow_id == customer_workflow_id(PERIOD, racer.customer_id)
    assert summary.charged + summary.already_billed == 12
    await assert_billed_once(harness, str(PERIOD), customers)


async def _fails_by_hand(
    harness: Harness, request: CustomerChargeInput, workflow_id: str
) -> ApplicationError:
    """Start the customer's workflow on its own, as Temporal's CLI or Web UI would; its
    failure, which it must end in at once."""
    child = await harness.client.start_workflow(
        CustomerChargeWorkflow.run, request, id=workflow_id, task_queue=harness.task_queue
    )
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(child.result(), timeout=30)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.non_retryable, cause
    return cause


@pytest.mark.parametrize(
    ("period", "customer_id", "named"),
    [
        ("2026-13", "cust-00001", "billing period month 13 is not 01-12"),
        (str(PERIOD), "cust 1'; --", """customer id "cust 1'; --" must be 1-64 characters"""),
    ],
)
async def test_a_customer_workflow_started_by_hand_with_bad_input_fails_at_once(
    harness: Harness, period: str, customer_id: str, named: str
) -> None:
    """A period lists valid customers only; one started by hand (the CLI of Temporal) with
    a malformed period or id fails, saying which, instead of retrying for ever."""
    await harness.seed(1)
    async with harness.running_worker():
        cause = await _fails_by_hand(
            harness, CustomerChargeInput(period=period, customer_id=customer_id), "by-hand"
        )
    assert named in cause.message, cause
    assert await harness.money_requests() == 0
    async with harness.pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM billing_runs") == 0


@pytest.mark.parametrize("run_before", [False, True], ids=["never-opened", "completed"])
async def test_a_customer_workflow_started_by_hand_outside_a_run_charges_nothing(
    harness: Harness, run_before: bool
) -> None:
    """A CustomerChargeWorkflow started on its own, under the customer's own workflow ID, for
    a period no run has open (none ever, or its run completed before the customer was
    imported) would charge outside any run: no pause or cancel reaches it, no vault key
    caps it, and a worker without the vault charged it (helper-118's F2). It fails, saying
    so, and leaves no claim."""
    period = Period(2030, 1)
    billed = []
    if run_before:
        billed = [c.customer_id for c in await harness.seed(1, prefix="early")]
        async with harness.running_worker():
            summary = await (
                await start_period(harness.client, period, harness.task_queue)
            ).result()
        assert summary.charged == 1
    [customer] = await harness.seed(1)
    async with harness.running_worker():
        cause = await _fails_by_hand(
            harness,
            CustomerChargeInput(period=str(period), customer_id=customer.customer_id),
            customer_workflow_id(period, customer.customer_id),
        )
    assert cause.message == (
        f"no run of {period} is open, so customer {customer.customer_id!r} is not billed for"
        f" it: a customer is billed by its period's run (`python starter.py run {period}`),"
        " not by a CustomerChargeWorkflow started on its own; nothing was charged"
    )
    assert [r["customer_id"] for r in await harness.ledger_rows(str(period))] == billed
    assert await harness.money_requests() == len(billed)


async def test_a_customer_workflow_started_under_another_id_fails_before_it_claims(
    harness: Harness,
) -> None:
    """One charge of a customer at a time rests on its workflow ID, as one run of a period
    does on the period's: a second workflow for the same claim under an ID made up (the Web
    UI's start form) is refused before its first command."""
    [customer] = await harness.seed(1)
    await harness.open_period_by_hand(PERIOD)
    async with harness.running_worker():
        cause = await _fails_by_hand(
            harness,
            CustomerChargeInput(period=str(PERIOD), customer_id=customer.customer_id),
            "started-in-the-web-ui",
        )
    assert cause.type == WRONG_WORKFLOW_ID
    assert cause.message == (
        f"the charge of {customer.customer_id} for {PERIOD} must have the workflow ID"
        f" {customer_workflow_id(PERIOD, customer.customer_id)}, not 'started-in-the-web-ui':"
        f" its period's run starts it (`python starter.py run {PERIOD}`)"
    )
    assert await harness.ledger_rows(str(PERIOD)) == []
    assert await harness.money_requests() == 0


async def test_response_dropped_after_commit_is_recorded_not_repeated(harness: Harness) -> None:
    customers = await harness.seed(20)
    await harness.set_faults(drop_after_commit=0.5, seed=7)
    async with harness.running_worker():
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert summary.charged == 20
    assert (await harness.faults_injected())["drop_after_commit"] > 0
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_continue_as_new_lets_children_finish_and_counts(harness: Harness) -> None:
    customers = await harness.seed(60)
    # Pages larger than the window: customers listed but not yet started cross the
    # continue-as-new and must still be billed.
    options = RunOptions(
        max_in_flight=4, page_size=100, history_event_limit=200, hand_over_after_seconds=60
    )
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, options)
        summary = await handle.result()
    assert (summary.due, summary.charged) == (60, 60)
    # Bounded: the limit plus what one turn of the loop adds (starts, completions and their
    # workflow tasks for about a window of children).
    runs = await harness.chain_of_runs(handle.id, bound=200 + 15 * options.max_in_flight)
    # The run is told by its chain's first run id, which each run of the chain carries, and
    # the ledger's row is that run's.
    assert len(runs) > 1
    assert {
        h.events[0].workflow_execution_started_event_attributes.first_execution_run_id for h in runs
    } == {summary.run_id}
    async with harness.pool.acquire() as conn:
        record = await ledger.period_record(conn, str(PERIOD))
    assert record is not None and (record.run_id, record.summary) == (summary.run_id, summary)
    # Each run let its children finish before it continued as new, so none reported while
    # it did: the server refused no continue-as-new, and no run handed a child over.
    for history in runs:
        refused = [
            e
            for e in history.events
            if e.workflow_task_failed_event_attributes.cause == UNHANDLED_COMMAND
        ]
        assert refused == []
    assert not any(state.started_elsewhere for state in await handed_over(harness, runs))
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_few_child_starts_wait_for_the_server_at_once(harness: Harness) -> None:
    # The server starts each child under the period's own lock; a burst of 500 starts held it
    # for seconds. However large the window, at most `max_starting` wait for it.
    customers = await harness.seed(30)
    options = RunOptions(max_in_flight=20, max_starting=3)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, options)
        summary = await handle.result()
        history = await handle.fetch_history()
    assert (summary.due, summary.charged) == (30, 30)
    waiting = most = 0
    for event in history.events:
        if event.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
            waiting += 1
        elif event.event_type in (
            EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED,
            EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_FAILED,
        ):
            waiting -= 1
        most = max(most, waiting)
    assert most == options.max_starting
    await assert_billed_once(harness, str(PERIOD), customers)
    await replay([history])


async def test_the_worker_caches_the_widest_window_and_its_period(harness: Harness) -> None:
    # A child keeps its place in the worker's cache while its local activity runs: a cache
    # smaller than the window pushes the period out, to be replayed in full at every task
    # (with 1 or 2 places a period never finished). The SDK's default is 1,000.
    async with harness.running_worker() as worker:
        assert worker.config()["max_cached_workflows"] > MAX_IN_FLIGHT


async def test_children_in_flight_at_continue_as_new_are_handed_to_the_next_run(
    harness: Harness,
) -> None:
    # The bills of children in flight when their run reaches its history limit are held
    # until it has continued as new, however fast the machine: the run waits a second for
    # them, hands them over, and the next run learns of their outcomes from the ledger.
    customers = await harness.seed(60)
    options = RunOptions(max_in_flight=20, history_event_limit=200, hand_over_after_seconds=1)
    held = HoldBillsAtTheHandOver(harness.client, options.history_event_limit)
    async with harness.running_worker(interceptors=[held]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue, options)
        summary = await handle.result()
    assert (summary.due, summary.charged) == (60, 60)
    runs = await harness.chain_of_runs(handle.id, bound=200 + 15 * options.max_in_flight)
    states = await handed_over(harness, runs)
    assert any(state.started_elsewhere for state in states), (
        "every child finished before its run continued as new"
    )
    assert held.held, "no bill ended after its run reached its history limit"
    assert not held.gave_up, "a bill was held past its hold's limit"
    waited = [e for e in runs[0].events if e.event_type == EventType.EVENT_TYPE_TIMER_FIRED]
    assert waited, "the first run did not wait for its children before handing them over"
    await replay(runs)
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_rerun_over_billed_customers_continues_as_new_while_it_lists(
    harness: Harness,
) -> None:
    # Every customer is billed: a rerun lists them all and starts none, page after page, in
    # workflow tasks whose history length is read only at the next. It continues as new
    # by the pages it listed (a million billed customers once took one run past 50 MB).
    customers = await harness.seed(150)
    limit = 200
    options = RunOptions(max_in_flight=4, page_size=1, history_event_limit=limit)
    async with harness.running_worker():
        first = await start_period(harness.client, PERIOD, harness.task_queue)
        assert (await first.result()).charged == 150
        first_run = (await first.describe()).run_id
        rerun = await start_period(harness.client, PERIOD, harness.task_queue, options)
        summary = await rerun.result()
    assert (summary.due, summary.already_billed) == (150, 150)
    runs = await harness.chain_of_runs(rerun.id, bound=limit, after_run=first_run)
    # Each run hands over about a page of the customers it took and the ledger has yet to
    # mark (LISTINGS_MARKED), not every page one listing call took (helper-170 F1).
    carried = [len(state.unmarked) for state in await handed_over(harness, runs)]
    assert max(carried) <= 2 * options.page_size + options.max_in_flight, carried
    await replay(runs)
    keep(runs[:1])
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_cancel_continues_as_new_while_it_marks_the_rest_cancelled(
    harness: Harness,
) -> None:
    # An activity a page: cancelling a long list of customers not yet started continues as
    # new as the fan-out does, and the next run, still cancelled, pages on.
    customers = await harness.seed(120)
    await harness.set_faults(latency_ms=200)
    limit = 200
    options = RunOptions(max_in_flight=1, page_size=1, history_event_limit=limit)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, options)
        await eventually(lambda: at_least(harness.succeeded(), 1))
        await operations.control(
            harness.client, PERIOD, "cancel", OperatorRequest(reason="wrong list", operator="al")
        )
        summary = await asyncio.wait_for(handle.result(), 300)
    assert summary.cancelled > 100
    assert summary.charged + summary.cancelled == 120
    # Those marked cancelled were charged nothing, across the hand-overs too.
    rows = await harness.ledger_rows(str(PERIOD))
    cancelled = frozenset(r["customer_id"] for r in rows if r["status"] == "cancelled")
    assert len(cancelled) == summary.cancelled
    await assert_billed_once(harness, str(PERIOD), customers, cancelled=cancelled)
    assert await harness.succeeded() == summary.charged
    runs = await harness.chain_of_runs(handle.id, bound=limit + 15 * options.max_in_flight)
    await replay(runs)
    keep(runs[-2:])


async def test_a_key_refusal_reported_while_the_run_opens_does_not_pause_it(
    harness: Harness,
) -> None:
    # A child an earlier run left, refused its old key while this run issues the new one:
    # it tries again with the new key, and the run goes on rather than wait for an operator.
    customers = await harness.seed(3)
    # The opening held, as a slow vault would, until the refusal is in the run's history.
    opening = ActivityHold("prepare_period")
    async with harness.running_worker(interceptors=[opening]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await asyncio.wait_for(opening.reached.wait(), 60)
        await handle.signal(
            BillingPeriodWorkflow.period_blocked,
            ChargeFailure(code="vault_key_revoked", message="the key of the run before"),
        )
        opening.go.set()
        summary = await asyncio.wait_for(handle.result(), 60)
    assert (summary.charged, summary.cancelled) == (3, 0)
    await replay([await handle.fetch_history()])
    keep([await handle.fetch_history()])
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_pause_given_while_the_run_opens_is_in_the_ledger_once_it_has(
    harness: Harness,
) -> None:
    """The opening resets the ledger's word to running: a pause given meanwhile is written
    again after it, or a child an earlier run left would pass the ledger's gate and charge."""
    customers = await harness.seed(3)
    # The opening held, as a slow vault would, until the pause is taken.
    opening = ActivityHold("prepare_period")
    async with harness.running_worker(interceptors=[opening]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await asyncio.wait_for(opening.reached.wait(), 60)
        await operations.control(
            harness.client, PERIOD, "pause", OperatorRequest(reason="prices", operator="ann")
        )
        opening.go.set()

        async def opened_and_paused_in_the_ledger() -> bool:
            if (await period_status(harness.client, PERIOD)).expected_due is None:
                return False
            control, _, _ = await harness.period_control(PERIOD)
            return control == "paused"

        await eventually(opened_and_paused_in_the_ledger, timeout=30)
        assert await harness.succeeded() == 0
        await operations.control(
            harness.client, PERIOD, "resume", OperatorRequest(reason="checked", operator="ann")
        )
        summary = await asyncio.wait_for(handle.result(), 60)
    assert summary.charged == 3
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_child_waiting_long_continues_as_new_and_charges_once(harness: Harness) -> None:
    # A child's history grows while it waits at a paused period's gate; past its own limit
    # it continues as new with the same claim, and charges once when the period resumes.
    [customer] = await harness.seed(1)
    period = str(PERIOD)
    await harness.open_period_by_hand(PERIOD)
    async with harness.pool.acquire() as conn:
        await ledger.set_control(conn, period, "paused", "checking", "alice")
    workflow_id = customer_workflow_id(PERIOD, customer.customer_id)
    request = CustomerChargeInput(
        period=period, customer_id=customer.customer_id, history_event_limit=10
    )
    async with harness.running_worker():
        await harness.client.start_workflow(
            CustomerChargeWorkflow.run, request, id=workflow_id, task_queue=harness.task_queue
        )

        async def continued() -> bool:
            runs = harness.client.list_workflows(f'WorkflowId = "{workflow_id}"')
            return len([run async for run in runs]) >= 3

        await eventually(continued)
        assert await harness.money_requests() == 0, "a paused period's child reached Stripe"
        async with harness.pool.acquire() as conn:
            await ledger.set_control(conn, period, "running", "checked", "bob")
        latest: WorkflowHandle[CustomerChargeWorkflow, CustomerOutcome]
        latest = harness.client.get_workflow_handle_for(CustomerChargeWorkflow.run, workflow_id)
        await latest.signal(CustomerChargeWorkflow.period_control)
        outcome = await latest.result()
    assert outcome.outcome == "charged"
    runs = await harness.chain_of_runs(workflow_id, bound=10 + 10)
    # The child's wait at the gate, its timer, the period's signal and its continue-as-new.
    await replay(runs)
    keep(runs)
    await assert_billed_once(harness, period, [customer])


class RecordedByTheFirstRun(Interceptor):
    """Records the customer's charge in the ledger just before the first bill of a run after
    the child's first, as an attempt of that first run, in flight as it continued as new,
    would."""

    def __init__(self, harness: Harness, customer: CustomerRow) -> None:
        self.harness = harness
        self.customer = customer
        self.first_run: str | None = None
        self.recorded = False

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        holder = self

        class Recording(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                info = activity.info()
                if info.activity_type == "bill":
                    if holder.first_run is None:
                        holder.first_run = info.workflow_run_id
                    elif info.workflow_run_id != holder.first_run and not holder.recorded:
                        holder.recorded = True
                        await charged_by_hand(holder.harness, holder.customer, "ch_first_run")
                return await super().execute_activity(input)

        return Recording(next)


async def charged_by_hand(harness: Harness, customer: CustomerRow, charge_id: str) -> None:
    """The customer's charge of PERIOD (`charge_id`, its intent `pi_...`) recorded on its
    claim, as a worker records one."""
    key = idempotency_key(harness.settings.billing_key_namespace, customer.customer_id, PERIOD)
    result = ChargeResult(
        charge_id=charge_id,
        payment_intent_id=charge_id.replace("ch_", "pi_", 1),
        amount_cents=customer.amount_cents,
        currency=customer.currency,
    )
    async with harness.pool.acquire() as conn:
        await ledger.record_charge(conn, key, result)


async def test_a_charge_an_earlier_run_of_the_child_recorded_is_reported_charged(
    harness: Harness,
) -> None:
    """Every run of the child's chain claims as its first run: a charge the first run's
    attempt recorded after the child continued as new is the chain's own, reported to the
    period as charged with its charge id, not as already billed by someone else."""
    [customer] = await harness.seed(1)
    recorded = RecordedByTheFirstRun(harness, customer)
    async with harness.running_worker(interceptors=[recorded]):
        handle = await _paused_with_a_claim_waiting(
            harness, customer.customer_id, history_event_limit=10
        )
        outcome = await asyncio.wait_for(handle.result(), 60)
    assert recorded.recorded
    assert (outcome.outcome, outcome.charge_id) == ("charged", "ch_first_run")
    assert await harness.money_requests() == 0


async def _start_child(
    harness: Harness, customer_id: str, **options: Any
) -> WorkflowHandle[CustomerChargeWorkflow, CustomerOutcome]:
    """The customer's child for the period, started as its period's run starts it."""
    return await harness.client.start_workflow(
        CustomerChargeWorkflow.run,
        CustomerChargeInput(period=str(PERIOD), customer_id=customer_id, **options),
        id=customer_workflow_id(PERIOD, customer_id),
        task_queue=harness.task_queue,
    )


async def _paused_with_a_claim_waiting(
    harness: Harness, customer_id: str, **options: Any
) -> WorkflowHandle[CustomerChargeWorkflow, CustomerOutcome]:
    """The customer's child, started in a paused period, once it has claimed and waits at
    the gate for the period's word; the caller runs a worker."""
    period = str(PERIOD)
    await harness.open_period_by_hand(PERIOD)
    async with harness.pool.acquire() as conn:
        await ledger.set_control(conn, period, "paused", "checking", "alice")
    handle = await _start_child(harness, customer_id, **options)

    async def claimed() -> bool:
        rows = await harness.ledger_rows(period)
        return [row["status"] for row in rows] == ["claimed"]

    await eventually(claimed)
    return handle


async def _waiting_for_the_periods_word(
    handle: WorkflowHandle[CustomerChargeWorkflow, CustomerOutcome],
) -> None:
    """Until the child's workflow task that claimed has completed, its wait for the period's
    word begun (its timer started): a worker stopped before that leaves the task to time
    out, however long a loaded machine took to get there."""

    async def timer_started() -> bool:
        history = await handle.fetch_history()
        return any(e.event_type == EventType.EVENT_TYPE_TIMER_STARTED for e in history.events)

    await eventually(timer_started)


async def _resume_and_reconcile(harness: Harness) -> None:
    async with harness.pool.acquire() as conn:
        await ledger.set_control(conn, str(PERIOD), "running", "checked", "bob")
    await (await start_reconcile(harness.client, PERIOD, harness.task_queue)).result()


async def _assert_skipped_by_temporal(harness: Harness, outcome: CustomerOutcome) -> None:
    assert outcome.outcome == "skipped"
    [row] = await harness.ledger_rows(str(PERIOD))
    assert (row["status"], row["reason"], row["decided_by"]) == (
        "skipped",
        TEMPORAL_CANCEL.reason,
        TEMPORAL_CANCEL.operator,
    )
    assert await harness.money_requests() == 0


async def _assert_the_latest_run_skipped(harness: Harness, workflow_id: str) -> None:
    """With a worker, the latest run of the child ends skipped by Temporal's cancel, and
    nothing is charged when the period resumes and is reconciled."""
    async with harness.running_worker():
        latest: WorkflowHandle[CustomerChargeWorkflow, CustomerOutcome]
        latest = harness.client.get_workflow_handle_for(CustomerChargeWorkflow.run, workflow_id)
        # Bounded: a run that lost the cancel waits at the paused gate for ever.
        outcome = await asyncio.wait_for(latest.result(), 60)
        await _resume_and_reconcile(harness)
    await _assert_skipped_by_temporal(harness, outcome)


@pytest.mark.parametrize("single_batch", [False, True], ids=["sdk-default", "sdk-flag-2"])
async def test_a_child_cancelled_in_temporal_is_skipped_not_charged_later(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, single_batch: bool
) -> None:
    """Temporal's Cancel on a customer's workflow (the Web UI's button) is a skip: the child
    waiting at a paused period's gate ends skipped, so neither the period's resume nor
    reconciliation charges it. It used to end CANCELED with its claim open, which
    reconciliation then drove on and charged. Also under the activation rule the SDK means to
    make its default, which raises the cancel in the wait at the gate."""
    if single_batch:
        single_batch_activations(monkeypatch)
    [customer] = await harness.seed(1)
    async with harness.running_worker():
        handle = await _paused_with_a_claim_waiting(harness, customer.customer_id)
        await handle.cancel()
        outcome = await handle.result()
        await _resume_and_reconcile(harness)
    await _assert_skipped_by_temporal(harness, outcome)
    history = await handle.fetch_history()
    await replay([history])
    keep([history])


async def test_a_cancel_with_the_continue_as_new_it_arrives_with_is_carried_on(
    harness: Harness,
) -> None:
    """A cancel that reaches the child in the workflow task in which it continues as new (its
    wait's timer woke it, its history past its limit) is carried into the next run, which
    skips: a cancel request does not cross continue-as-new by itself."""
    [customer] = await harness.seed(1)
    async with harness.running_worker():
        handle = await _paused_with_a_claim_waiting(
            harness, customer.customer_id, history_event_limit=10
        )
        await _waiting_for_the_periods_word(handle)
    # No worker: its wait's first timer fires, and the cancel comes, in one workflow task.
    await asyncio.sleep(PERIOD_WAIT_FIRST.total_seconds() + 1)
    await handle.cancel()
    await _assert_the_latest_run_skipped(harness, handle.id)
    runs = await harness.chain_of_runs(handle.id, bound=10 + 10)
    assert len(runs) >= 2
    await replay(runs)
    keep(runs)


@pytest.mark.parametrize("long", [False, True], ids=["resumed", "continuing-as-new"])
async def test_a_cancel_sent_with_the_periods_signal_stops_the_charge_it_wakes(
    harness: Harness, long: bool
) -> None:
    """The period's signal (its resume) and an operator's Temporal cancel reach the child in
    one workflow task. The SDK runs the signal, and the workflow, before it applies the
    cancel: the child waits one short timer first, so its next bill carries the stop (and a
    child past its history limit carries it into its next run) and nothing is charged."""
    [customer] = await harness.seed(1)
    options = {"history_event_limit": 10} if long else {}
    async with harness.running_worker():
        handle = await _paused_with_a_claim_waiting(harness, customer.customer_id, **options)
        await _waiting_for_the_periods_word(handle)
    if not long:
        async with harness.pool.acquire() as conn:
            await ledger.set_control(conn, str(PERIOD), "running", "checked", "bob")
    # No worker: the signal and the cancel reach the workflow in one workflow task.
    await handle.signal(CustomerChargeWorkflow.period_control)
    await handle.cancel()
    await _assert_the_latest_run_skipped(harness, handle.id)
    runs = (
        await harness.chain_of_runs(handle.id, bound=10 + 20)
        if long
        else [await handle.fetch_history()]
    )
    await replay(runs)
    keep(runs)


async def test_a_cancel_stops_a_bill_retrying_after_stripe_refused_it(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stripe answers 429 (nothing charged, the claim back at the gate) and the bill retries
    with the request it began with, which carries no stop: the stop written as the cancel
    arrives meets its next try at the gate."""
    [customer] = await harness.seed(1)
    await harness.open_period_by_hand(PERIOD)
    real = StripeGateway.charge
    refused = 0

    async def rate_limited(self: StripeGateway, *args: Any, **kwargs: Any) -> Any:
        nonlocal refused
        if refused < 1000:
            refused += 1
            raise stripe.RateLimitError("Too many requests", http_status=429)
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(StripeGateway, "charge", rate_limited)
    async with harness.running_worker():
        handle = await _start_child(harness, customer.customer_id)

        async def retrying() -> bool:
            return refused >= 3

        await eventually(retrying, timeout=30)
        await handle.cancel()
        outcome = await asyncio.wait_for(handle.result(), 60)
    refused = 1000  # Stripe answers again: the next charge would go through
    await _assert_skipped_by_temporal(harness, outcome)


async def test_a_cancel_keeps_an_operators_earlier_skip(harness: Harness) -> None:
    """Skipped by an operator at the paused gate, then cancelled in Temporal: the row keeps
    who skipped it and why."""
    [customer] = await harness.seed(1)
    async with harness.running_worker():
        handle = await _paused_with_a_claim_waiting(harness, customer.customer_id)
        key = idempotency_key(harness.settings.billing_key_namespace, customer.customer_id, PERIOD)
        async with harness.pool.acquire() as conn:
            await ledger.request_skip(
                conn, customer.customer_id, str(PERIOD), key, "refund pending", "alice"
            )
        await handle.cancel()
        outcome = await handle.result()
    [row] = await harness.ledger_rows(str(PERIOD))
    assert (outcome.outcome, row["status"], row["reason"], row["decided_by"]) == (
        "skipped",
        "skipped",
        "refund pending",
        "alice",
    )


async def test_a_cancelled_stray_child_of_a_period_not_open_writes_nothing(
    harness: Harness,
) -> None:
    """A customer's workflow started by hand for a period no run has opened, cancelled: the
    stop writes no row, so the period's run bills the customer when it comes."""
    [customer] = await harness.seed(1)
    handle = await _start_child(harness, customer.customer_id)
    await handle.cancel()
    async with harness.running_worker():
        with contextlib.suppress(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), 60)
    assert await harness.ledger_rows(str(PERIOD)) == []
    assert await harness.money_requests() == 0


async def test_a_child_cancelled_before_its_first_task_is_skipped(harness: Harness) -> None:
    """Cancelled while its first workflow task waits for a worker (workers busy with a large
    fan-out): nothing was sent, and its first bill carries the stop."""
    [customer] = await harness.seed(1)
    await harness.open_period_by_hand(PERIOD)
    handle = await _start_child(harness, customer.customer_id)
    await handle.cancel()
    async with harness.running_worker():
        outcome = await handle.result()
    await _assert_skipped_by_temporal(harness, outcome)


async def test_a_run_continued_as_new_with_a_stop_in_its_input_skips_the_customer(
    harness: Harness,
) -> None:
    """A run that continued as new in its cancel's own turn, before `run` wrote the stop to
    the ledger, hands the stop on in the next run's input, the one place it is then kept:
    that run skips the customer, in a running period with no stop in the ledger, rather
    than charge it."""
    [customer] = await harness.seed(1)
    await harness.open_period_by_hand(PERIOD)
    async with harness.running_worker():
        handle = await _start_child(harness, customer.customer_id, stop=TEMPORAL_CANCEL)
        outcome = await asyncio.wait_for(handle.result(), 60)
    await _assert_skipped_by_temporal(harness, outcome)


def _timer_waits(history: WorkflowHistory) -> dict[int, timedelta]:
    """How long each timer in the history set out to wait, by its started event's id."""
    return {
        e.event_id: e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta()
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED
    }


async def _timers_fired_after(
    handle: WorkflowHandle[CustomerChargeWorkflow, CustomerOutcome], event_type: EventType.ValueType
) -> list[timedelta]:
    """How long each timer the child's history shows fired after its first `event_type`
    event had set out to wait."""
    history = await handle.fetch_history()
    events = list(history.events)
    since = [e.event_type for e in events].index(event_type)
    waits = _timer_waits(history)
    return [
        waits[e.timer_fired_event_attributes.started_event_id]
        for e in events[since:]
        if e.event_type == EventType.EVENT_TYPE_TIMER_FIRED
    ]


async def test_a_temporal_cancel_ends_the_wait_at_the_paused_gate_at_once(
    harness: Harness,
) -> None:
    """A Temporal cancel wakes a child waiting at a paused period's gate: its next bill
    carries the stop at once, rather than once its wait's timer fires, which is minutes
    away (PERIOD_WAIT_MAX) for a child that has waited long."""
    [customer] = await harness.seed(1)
    async with harness.running_worker():
        handle = await _paused_with_a_claim_waiting(harness, customer.customer_id)
        await _waiting_for_the_periods_word(handle)
        await handle.cancel()
        outcome = await asyncio.wait_for(handle.result(), 60)
    await _assert_skipped_by_temporal(harness, outcome)
    cancelled = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED
    assert await _timers_fired_after(handle, cancelled) == [], "the cancel waited for a timer"


async def test_the_periods_resume_signal_ends_the_wait_at_the_gate_at_once(
    harness: Harness,
) -> None:
    """The period's signal on its resume wakes a child waiting at the gate: it charges after
    the short settle only, not once its wait's timer fires, which is minutes away
    (PERIOD_WAIT_MAX) for a child that has waited long, for every child of the period."""
    [customer] = await harness.seed(1)
    async with harness.running_worker():
        handle = await _paused_with_a_claim_waiting(harness, customer.customer_id)
        await _waiting_for_the_periods_word(handle)
        async with harness.pool.acquire() as conn:
            await ledger.set_control(conn, str(PERIOD), "running", "checked", "bob")
        await handle.signal(CustomerChargeWorkflow.period_control)
        outcome = await asyncio.wait_for(handle.result(), 60)
    assert outcome.outcome == "charged"
    signalled = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
    assert await _timers_fired_after(handle, signalled) == [SETTLE], "it waited for its timer"
    await assert_billed_once(harness, str(PERIOD), [customer])


@pytest.mark.parametrize("customer_id", ["cust-999999", "cust-000001"], ids=["unknown", "inactive"])
async def test_a_cancelled_child_of_a_customer_not_billed_agrees_with_the_ledger(
    harness: Harness, customer_id: str
) -> None:
    """A customer removed or deactivated after its period listed it: cancelled, its child
    ends failed (unknown_customer) with no row, as its bill says, not failed on the stop. The
    stop wrote an inactive customer skipped, so a bill that answered before it ran ended
    failed beside a skipped row."""
    [customer] = await harness.seed(1)
    assert customer.customer_id == "cust-000001"
    await harness.pool.execute("UPDATE customers SET active = false")
    await harness.open_period_by_hand(PERIOD)
    handle = await _start_child(harness, customer_id)
    await handle.cancel()
    async with harness.running_worker():
        outcome = await handle.result()
    rows = await harness.ledger_rows(str(PERIOD))
    assert (outcome.outcome, outcome.failure_code, rows) == ("failed", "unknown_customer", [])
    assert await harness.money_requests() == 0


async def test_a_child_cancelled_in_temporal_with_its_charge_sent_records_it(
    harness: Harness,
) -> None:
    """A cancel cannot take back a charge already on its way to Stripe: the child finishes
    it and records it, once, instead of leaving it unrecorded for reconciliation."""
    [customer] = await harness.seed(1)
    await harness.open_period_by_hand(PERIOD)
    await harness.set_faults(latency_ms=2000)
    async with harness.running_worker():
        handle = await _start_child(harness, customer.customer_id)
        await eventually(lambda: at_least(harness.money_requests(), 1))
        await handle.cancel()
        outcome = await handle.result()
    assert outcome.outcome == "charged"
    await assert_billed_once(harness, str(PERIOD), [customer])
    await replay([await handle.fetch_history()])


async def test_a_child_closed_before_its_claim_does_not_hold_the_period(harness: Harness) -> None:
    # The customer's child ran, found no such customer and closed, before the customer was
    # imported. The ledger has no row for it, so nothing was claimed or charged: the period
    # starts it a new child (RESTART_COMPLETED_UNCLAIMED), which bills it, rather than wait.
    late = "late-000001"
    async with harness.running_worker():
        await harness.client.execute_workflow(
            CustomerChargeWorkflow.run,
            CustomerChargeInput(period=str(PERIOD), customer_id=late),
            id=customer_workflow_id(PERIOD, late),
            task_queue=harness.task_queue,
        )
        [imported] = await harness.seed(1, prefix="late")
        assert imported.customer_id == late
        others = await harness.seed(3)
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert (summary.due, summary.charged, summary.failed) == (4, 4, 0)
    await assert_billed_once(harness, str(PERIOD), [imported, *others])


async def test_a_child_the_run_awaits_terminated_after_its_charge_is_counted_charged(
    harness: Harness,
) -> None:
    """A child terminated by hand ends without an outcome: the run learns the customer's
    from the ledger, rather than wait for it for ever (and never close the period)."""
    [customer] = await harness.seed(1)
    hold = BillHold()
    async with harness.running_worker(interceptors=[hold]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await asyncio.wait_for(hold.reached.wait(), 60)
        child = harness.client.get_workflow_handle(
            customer_workflow_id(PERIOD, customer.customer_id)
        )
        await child.terminate(reason="stuck, by hand")
        hold.go.set()
        summary = await asyncio.wait_for(handle.result(), 60)
    assert (summary.due, summary.charged, summary.failed) == (1, 1, 0)
    await assert_billed_once(harness, str(PERIOD), [customer])


async def test_a_customer_claimed_by_a_child_that_ended_gets_no_new_child(
    harness: Harness,
) -> None:
    """A child that ended after its claim leaves that claim to reconciliation, which may
    send its charge again under the same workflow ID: the run starts no second child for the
    customer, and learns its outcome from the ledger."""
    claimed = (await harness.seed(2))[-1]
    await (await harness.idle_child(PERIOD, claimed.customer_id)).terminate("lost")
    await harness.open_period_by_hand(PERIOD)
    key = (await harness.claim_by_hand(PERIOD, claimed.customer_id)).idempotency_key
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue)

        async def waiting_on_the_claim() -> bool:
            status = await period_status(harness.client, PERIOD)
            return (status.charged, status.in_flight) == (1, 1)

        await eventually(waiting_on_the_claim)
        await charged_by_hand(harness, claimed, "ch_late")  # as reconciliation would
        summary = await asyncio.wait_for(handle.result(), 60)
    assert (summary.due, summary.charged) == (2, 2)
    children = harness.client.list_workflows(
        f'WorkflowId = "{customer_workflow_id(PERIOD, claimed.customer_id)}"'
    )
    assert len([run async for run in children]) == 1
    assert not [r for r in await harness.requests() if r["idempotency_key"] == key]


async def blocked_elsewhere(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, cancel: bool
) -> tuple[PeriodSummary, list[WorkflowHistory]]:
    """Three customers, one of whose child runs already (started by another run, on a task
    queue nobody polls): the period learns its outcome from the ledger, polled every 0.2 s
    here (LEDGER_WAIT in production), for as long as that child runs. Its history must not
    grow past its limit meanwhile, whether it waits at the end of its fan-out or after a
    cancel. Returns the summary and every run's history, once that child is terminated."""
    polled = PeriodActivities.await_outcomes

    @activity.defn(name="await_outcomes")
    async def quickly(self: PeriodActivities, request: OutcomesRequest) -> list[CustomerOutcome]:
        # Bound to the class by hand, it gets the payload undecoded.
        quick = OutcomesRequest.model_validate(request).model_copy(update={"wait_seconds": 0.2})
        return await polled(self, quick)

    monkeypatch.setattr(PeriodActivities, "await_outcomes", quickly)
    customers = await harness.seed(3)
    stuck = customers[-1].customer_id
    blocker = await harness.idle_child(PERIOD, stuck)
    limit = 200
    async with harness.running_worker():
        handle = await start_period(
            harness.client, PERIOD, harness.task_queue, RunOptions(history_event_limit=limit)
        )
        if cancel:
            # Once the others are charged, while it waits for the one started elsewhere.
            async def waiting() -> bool:
                status = await period_status(harness.client, PERIOD)
                return (status.charged, status.in_flight) == (2, 1)

            await eventually(waiting)
            await handle.execute_update(
                BillingPeriodWorkflow.cancel, OperatorRequest(reason="wrong prices", operator="ann")
            )

        async def continued() -> bool:
            runs = harness.client.list_workflows(f'WorkflowId = "{handle.id}"')
            return len([run async for run in runs]) >= 2

        await eventually(continued, timeout=120)
        await blocker.terminate(reason="the test is done with it")
        summary = await handle.result()
    runs = await harness.chain_of_runs(handle.id, bound=limit + 30)
    assert all(stuck in state.started_elsewhere for state in await handed_over(harness, runs))
    await replay(runs)
    return summary, runs


async def test_a_period_waiting_long_on_a_child_started_elsewhere_continues_as_new(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary, _ = await blocked_elsewhere(harness, monkeypatch, cancel=False)
    # The child terminated before its claim: the customer is reported, not billed.
    assert (summary.due, summary.charged, summary.failed) == (3, 2, 1)


async def test_a_cancelled_period_waiting_long_on_a_child_continues_as_new(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary, runs = await blocked_elsewhere(harness, monkeypatch, cancel=True)
    assert summary.cancelled_by == "ann" and summary.cancel_reason == "wrong prices"
    assert (summary.due, summary.charged, summary.failed) == (3, 2, 1)
    # A run that continued as new while cancelling, and the next one.
    keep(runs[:2])


async def test_a_customer_whose_child_ended_before_claiming_is_billed_by_the_next_run(
    harness: Harness,
) -> None:
    """A customer's child terminated before its claim (e.g. by an operator, while held) left
    no ledger row and charged nothing; its workflow ID used to refuse every later run until
    Temporal's retention dropped it, and each run counted it failed (ended_without_claim).
    A run now starts a new child for it. I6 too: RECORD_HISTORIES=1 keeps the run."""
    customers = await harness.seed(2)
    ended = customers[-1].customer_id
    await (await harness.idle_child(PERIOD, ended)).terminate(reason="stuck, by hand")
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        summary = await handle.result()
    assert (summary.due, summary.charged, summary.failed) == (2, 2, 0)
    await assert_billed_once(harness, str(PERIOD), customers)
    history = await handle.fetch_history()
    await replay([history])
    keep([history])


async def test_a_long_pause_continues_as_new_and_the_next_run_resumes(harness: Harness) -> None:
    """A paused run's history still grows (an operator's skips, children reporting a refused
    key) for as long as the pause lasts: it continues as new, still paused, handing over its
    children waiting at the gate, and the next run finishes the period once resumed."""
    customers = await harness.seed(40)
    disputed = customers[-1]
    await harness.set_faults(latency_ms=150)
    limit = 200
    bob = OperatorRequest(reason="checked", operator="bob")
    async with harness.running_worker():
        handle = await start_period(
            harness.client,
            PERIOD,
            harness.task_queue,
            RunOptions(max_in_flight=4, history_event_limit=limit),
        )
        await eventually(lambda: at_least(harness.succeeded(), 4))
        await operations.control(harness.client, PERIOD, "pause", bob)
        # Charges past the gate when it paused reach Stripe, however long that takes.
        await eventually(partial(harness.started_charges_sent, PERIOD))
        settled = await harness.money_requests()

        async def runs() -> int:
            return len(
                [r async for r in harness.client.list_workflows(f'WorkflowId = "{handle.id}"')]
            )

        before = await runs()
        skip = SkipRequest(customer_id=disputed.customer_id, reason="disputed", operator="carol")
        for _ in range(100):
            await operations.skip(
                harness.client, harness.settings, harness.database_url, PERIOD, skip
            )
            if await runs() > before:
                break
        assert await runs() > before, "the paused run never continued as new"
        assert (await period_status(harness.client, PERIOD)).state == "paused"
        assert await harness.money_requests() == settled, "Stripe was called while paused"
        await operations.control(harness.client, PERIOD, "resume", bob)
        summary = await handle.result()
    assert (summary.charged, summary.skipped) == (39, 1)
    charged = [c["customer"] for c in await harness.charges() if c["status"] == "succeeded"]
    assert sorted(charged) == sorted(c.stripe_customer_id for c in customers[:-1])
    chain = await harness.chain_of_runs(handle.id, bound=limit + 40)
    paused = [
        i
        for i, state in enumerate(await handed_over(harness, chain))
        if state.control.control == "paused"
    ]
    assert paused, "no run handed over while paused"
    await replay(chain)
    keep([chain[paused[0]]])  # the run that continued as new while paused


async def handed_over(harness: Harness, runs: list[WorkflowHistory]) -> list[PeriodState]:
    """What each run but the last handed to the next as it continued as new."""
    states: list[PeriodState] = []
    for history in runs[:-1]:
        ended = history.events[-1].workflow_execution_continued_as_new_event_attributes
        [next_input] = await harness.client.data_converter.decode(
            ended.input.payloads, [BillingPeriodInput]
        )
        assert next_input.state is not None
        states.append(next_input.state)
    return states


async def test_a_charged_customers_child_reports_the_charge_the_ledger_recorded(
    harness: Harness,
) -> None:
    """The child's result is the outcome its period counts (the amount into the total
    charged) and the charge a reconciliation's re-drive reports: the charge id, amount and
    currency are the ones the ledger recorded."""
    [customer] = await harness.seed(1)
    await harness.open_period_by_hand(PERIOD)
    async with harness.running_worker():
        handle = await _start_child(harness, customer.customer_id)
        outcome = await asyncio.wait_for(handle.result(), 60)
    [row] = await harness.ledger_rows(str(PERIOD))
    assert row["charge_id"] is not None
    assert outcome == CustomerOutcome(
        customer_id=customer.customer_id,
        outcome="charged",
        amount_cents=customer.amount_cents,
        currency=customer.currency,
        charge_id=row["charge_id"],
    )


async def test_a_customer_gone_before_its_claim_is_reported_not_stuck(harness: Harness) -> None:
    async with harness.running_worker():
        outcome = await harness.client.execute_workflow(
            CustomerChargeWorkflow.run,
            CustomerChargeInput(period=str(PERIOD), customer_id="never-imported"),
            id=customer_workflow_id(PERIOD, "never-imported"),
            task_queue=harness.task_queue,
        )
    assert (outcome.outcome, outcome.failure_code) == ("failed", "unknown_customer")
    assert not await harness.requests()


async def test_a_customer_held_behind_its_old_ids_open_claim_waits_then_is_skipped(
    harness: Harness,
) -> None:
    """The new id's child started before the old id was deactivated: it waits while the old
    id's claim is open (a charge of it may still go out), each wait twice the one before
    (a hold that lasts days adds a few events an hour to its history, not one every few
    seconds), and once that claim charged, it ends skipped with a row saying why, so that
    Stripe customer is charged once."""
    old = (await harness.seed(1))[0]
    renamed = old.model_copy(update={"customer_id": "renamed-1"})
    await upsert_customers(harness.pool, [renamed])
    old_key = idempotency_key(harness.settings.billing_key_namespace, old.customer_id, PERIOD)
    await harness.open_period_by_hand(PERIOD)
    async with harness.pool.acquire() as conn:
        await ledger.claim(
            conn, old.customer_id, str(PERIOD), old_key, "run-0", charge_api="charges"
        )
        await conn.execute(
            "UPDATE customers SET active = false WHERE customer_id = $1", old.customer_id
        )
    async with harness.running_worker():
        child = await harness.client.start_workflow(
            CustomerChargeWorkflow.run,
            CustomerChargeInput(period=str(PERIOD), customer_id="renamed-1"),
            id=customer_workflow_id(PERIOD, "renamed-1"),
            task_queue=harness.task_queue,
        )
        await eventually(lambda: _held_once(child))

        async def waited_twice() -> bool:
            return len(_timer_waits(await child.fetch_history())) >= 2

        await eventually(waited_twice)
        waits = list(_timer_waits(await child.fetch_history()).values())
        assert waits[:2] == [PERIOD_WAIT_FIRST, PERIOD_WAIT_FIRST * 2]
        await charged_by_hand(harness, old, "ch_old")
        outcome = await child.result()
    assert outcome.outcome == "skipped"
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    assert rows["renamed-1"]["status"] == "skipped"
    assert f"charged its Stripe customer as {old.customer_id!r}" in rows["renamed-1"]["reason"]
    assert await harness.money_requests() == 0


async def _held_once(handle: WorkflowHandle[Any, Any]) -> bool:
    """The child's bill has been refused as held at least once."""
    async for event in handle.fetch_history_events():
        if event.HasField("marker_recorded_event_attributes") and b"CustomerHeld" in (
            event.SerializeToString()
        ):
            return True
    return False


async def test_an_awaited_child_that_ended_counts_failed_only_if_it_never_claimed(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Awaited through the ledger, a child another run started that ended uncompleted is
    counted failed (ended_without_claim) only if it left no row: one that claimed just after
    the first read, then ended, holds an open claim whose charge may have gone out, and is
    not counted failed while it is open (I2). A child gone from Temporal (past the
    namespace's retention) counts as ended; one still running is awaited, not counted. One
    that completed with no row (its customer gone) reports its own outcome."""
    never, claimed, running, gone, found_gone = await harness.seed(5)
    await harness.pool.execute(
        "UPDATE customers SET active = false WHERE customer_id = $1", found_gone.customer_id
    )
    async with harness.running_worker():
        await harness.client.execute_workflow(
            CustomerChargeWorkflow.run,
            CustomerChargeInput(period=str(PERIOD), customer_id=found_gone.customer_id),
            id=customer_workflow_id(PERIOD, found_gone.customer_id),
            task_queue=harness.task_queue,
        )
    await harness.open_period_by_hand(PERIOD)
    for customer in (never, claimed):
        await (await harness.idle_child(PERIOD, customer.customer_id)).terminate("lost")
    await harness.idle_child(PERIOD, running.customer_id)
    read = ledger.without_rows

    async def claimed_after_the_first_read(
        conn: Any, period: str, customer_ids: Sequence[str]
    ) -> list[str]:
        missing = await read(conn, period, customer_ids)
        if claimed.customer_id in missing:
            await harness.claim_by_hand(PERIOD, claimed.customer_id)
        return missing

    monkeypatch.setattr(ledger, "without_rows", claimed_after_the_first_read)
    request = OutcomesRequest(
        period=str(PERIOD),
        customer_ids=[c.customer_id for c in (never, claimed, running, gone, found_gone)],
        enough=5,
        wait_seconds=0,
    )
    awaiting = PeriodActivities(harness.pool, harness.settings).await_outcomes
    outcomes = await ActivityEnvironment(client=harness.client).run(awaiting, request)
    assert [(o.customer_id, o.outcome, o.failure_code) for o in outcomes] == [
        (found_gone.customer_id, "failed", "unknown_customer"),
        (never.customer_id, "failed", ENDED_WITHOUT_CLAIM),
        (gone.customer_id, "failed", ENDED_WITHOUT_CLAIM),
    ]


async def test_awaiting_outcomes_answers_once_enough_are_found_not_at_the_end_of_its_wait(
    harness: Harness,
) -> None:
    """The run waits on children another run started by reading the ledger for up to its
    wait: it answers as soon as enough have an outcome, or the run sits idle for the whole
    wait with its customers long finished."""
    [customer] = await harness.seed(1)
    await harness.open_period_by_hand(PERIOD)
    await harness.claim_by_hand(PERIOD, customer.customer_id)
    await charged_by_hand(harness, customer, "ch_1")
    request = OutcomesRequest(
        period=str(PERIOD), customer_ids=[customer.customer_id], enough=1, wait_seconds=600
    )
    awaiting = PeriodActivities(harness.pool, harness.settings).await_outcomes
    outcomes = await asyncio.wait_for(
        ActivityEnvironment(client=harness.client).run(awaiting, request), 30
    )
    assert [(o.customer_id, o.outcome) for o in outcomes] == [(customer.customer_id, "charged")]

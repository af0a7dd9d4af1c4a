"""Customers a run's listing did not reach: imported behind it (it walks ids in order) while
the run bills. The run lists and bills them before it closes, and counts each once; an
operator's word given as it closes applies if it goes back to bill them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from temporalio import activity
from temporalio import workflow as wf
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    Worker,
)

import activities.period as period_activities
from activities.period import DuePageRequest, PeriodActivities
from activities.stripe_access import StripeAccess
from billing import ledger, operations
from billing.customers import CustomerRow, deactivate_customers, import_customers
from billing.keys import customer_workflow_id
from billing.models import (
    CustomerChargeInput,
    CustomerOutcome,
    OperatorRequest,
    PeriodSummary,
    RunOptions,
    SkipRequest,
)
from billing.periods import Period
from billing.runs import start_period
from billing.seeding import create_demo_customers
from billing.temporal_client import described
from tests.integration.harness import (
    Harness,
    accepted_updates,
    at_least,
    cancel_taken,
    update_taken,
)
from tests.integration.holds import ActivityHold, BillHold
from tests.integration.invariants import assert_billed_once
from tests.integration.replay import keep, replay
from tests.waiting import eventually
from worker import create_worker, direct_access
from workflows.billing_period import (
    LISTINGS_MARKED,
    RESTART_COMPLETED_UNCLAIMED,
    BillingPeriodWorkflow,
)
from workflows.customer_charge import CustomerChargeWorkflow

PERIOD = Period(2026, 12)
# Two at a time, Stripe answering slowly: the run is midway when the test imports.
NARROW = RunOptions(max_in_flight=2, max_starting=2)
ALICE = OperatorRequest(reason="wrong amounts", operator="alice")


def _counted(summary: PeriodSummary) -> int:
    return (
        summary.charged
        + summary.already_billed
        + summary.failed
        + summary.skipped
        + summary.cancelled
    )


async def _late(harness: Harness) -> list[CustomerRow]:
    """A customer whose id sorts before every seeded one ("cust-..."), imported while the run
    is open."""
    rows = await create_demo_customers(harness.stripe, 1, prefix="a-late")
    await import_customers(harness.pool, rows, while_running=True, reactivate=True)
    return rows


async def test_a_customer_imported_behind_the_listing_is_billed_before_the_close(
    harness: Harness,
) -> None:
    customers = await harness.seed(10)
    await harness.set_faults(latency_ms=300)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, NARROW)
        await eventually(lambda: at_least(harness.succeeded(), 4))
        late = await _late(harness)
        summary = await asyncio.wait_for(handle.result(), 60)
        history = await handle.fetch_history()
    assert (summary.due, summary.charged, _counted(summary)) == (11, 11, 11)
    await assert_billed_once(harness, str(PERIOD), [*customers, *late])
    await replay([history])
    keep([history])


async def test_a_customer_imported_behind_the_listing_and_skipped_is_counted_skipped(
    harness: Harness,
) -> None:
    """Skipped by an operator before the run reached it, the customer had a row: the listing
    of the unlisted took only customers with none, and the run's summary left it out of
    every count (helper-146 F4)."""
    customers = await harness.seed(10)
    await harness.set_faults(latency_ms=300)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, NARROW)
        await eventually(lambda: at_least(harness.succeeded(), 4))
        late = await _late(harness)
        skip = SkipRequest(customer_id=late[0].customer_id, reason="disputed", operator="carol")
        result = await operations.skip(
            harness.client, harness.settings, harness.database_url, PERIOD, skip
        )
        assert result.skipped, result
        summary = await asyncio.wait_for(handle.result(), 60)
        history = await handle.fetch_history()
    assert (summary.due, summary.charged, summary.skipped, _counted(summary)) == (11, 10, 1, 11)
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    assert rows[late[0].customer_id]["status"] == "skipped"
    charged = [c["customer"] for c in await harness.charges() if c["status"] == "succeeded"]
    assert sorted(charged) == sorted(c.stripe_customer_id for c in customers)
    await replay([history])
    keep([history])


class AtTheClose(Interceptor):
    """Runs `before_close` as the run's first close begins: after the listing has ended, before
    the ledger has the run closed."""

    def __init__(self) -> None:
        self.began = False

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        outer = self

        class Closing(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                if activity.info().activity_type.startswith("close_period") and not outer.began:
                    outer.began = True
                    await outer.before_close()
                return await super().execute_activity(input)

        return Closing(next)

    async def before_close(self) -> None:
        """What happens in the first close, before it begins."""


class ImportAtTheClose(AtTheClose):
    """Imports a customer behind the listing as the run's first close begins."""

    def __init__(self, harness: Harness) -> None:
        super().__init__()
        self.harness = harness
        self.late: list[CustomerRow] = []

    async def before_close(self) -> None:
        self.late = await _late(self.harness)
        await self.imported()

    async def imported(self) -> None:
        """What happens next, in the close, before it begins."""


async def test_a_customer_imported_as_the_run_closes_is_billed_by_it(harness: Harness) -> None:
    """The close checks for such customers as one step to an import: it leaves the run open
    while one is left, and the run bills it."""
    customers = await harness.seed(3)
    importing = ImportAtTheClose(harness)
    async with harness.running_worker(interceptors=[importing]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        summary = await asyncio.wait_for(handle.result(), 60)
        history = await handle.fetch_history()
    assert importing.late
    assert (summary.due, summary.charged, _counted(summary)) == (4, 4, 4)
    await assert_billed_once(harness, str(PERIOD), [*customers, *importing.late])
    await replay([history])
    keep([history])


async def test_a_cancel_leaves_a_customer_imported_behind_the_listing_unreached(
    harness: Harness,
) -> None:
    """The cancel marks the customers after its cursor, and counts each once; one imported
    behind it is not reached by the run: no row, no charge, in no count."""
    customers = await harness.seed(10)
    await harness.set_faults(latency_ms=1000)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, NARROW)
        await eventually(lambda: at_least(harness.money_requests(), 2))
        late = await _late(harness)
        await operations.control(harness.client, PERIOD, "cancel", ALICE)
        summary = await asyncio.wait_for(handle.result(), 60)
    assert summary.cancelled >= 1
    assert (summary.due, _counted(summary)) == (10, 10)
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    assert late[0].customer_id not in rows
    cancelled = frozenset(c for c, r in rows.items() if r["status"] == "cancelled")
    await assert_billed_once(harness, str(PERIOD), customers, cancelled=cancelled)


async def test_a_rerun_cancelled_counts_what_an_earlier_cancel_marked_once(
    harness: Harness,
) -> None:
    """A run cancelled midway marks the rest cancelled, rows a later run takes as none: a
    rerun cancelled at once counts each of them once."""
    customers = await harness.seed(8)
    await harness.set_faults(latency_ms=1000)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, NARROW)
        await eventually(lambda: at_least(harness.money_requests(), 2))
        await operations.control(harness.client, PERIOD, "cancel", ALICE)
        assert (await asyncio.wait_for(handle.result(), 60)).cancelled >= 1
        await harness.set_faults(latency_ms=0)
        handle = await start_period(harness.client, PERIOD, harness.task_queue, NARROW)
        await operations.control(harness.client, PERIOD, "cancel", ALICE)
        rerun = await asyncio.wait_for(handle.result(), 60)
    assert (rerun.due, _counted(rerun)) == (8, 8), rerun
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    cancelled = frozenset(c for c, r in rows.items() if r["status"] == "cancelled")
    await assert_billed_once(harness, str(PERIOD), customers, cancelled=cancelled)


@pytest.mark.parametrize("by", ["operator", "temporal"])
async def test_a_cancel_given_as_the_run_closes_applies_if_it_goes_back_to_billing(
    harness: Harness, by: str
) -> None:
    """Refused as the run closed ("closing"), or dropped (Temporal's cancel), the cancel
    left the run to bill, after it, the customers its close then found unreached."""
    customers = await harness.seed(3)
    importing, hold = ImportAtTheClose(harness), ActivityHold("close_period*")
    async with harness.running_worker(interceptors=[importing, hold]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await asyncio.wait_for(hold.reached.wait(), 60)
        if by == "temporal":
            await handle.cancel()
            await cancel_taken(handle)
            cancelling = None
        else:
            accepted = await accepted_updates(handle)
            cancelling = asyncio.create_task(
                operations.control(harness.client, PERIOD, "cancel", ALICE)
            )
            await update_taken(handle, cancelling, accepted)
        hold.go.set()
        summary = await asyncio.wait_for(handle.result(), 60)
        if cancelling is not None:
            assert (await cancelling).state == "cancelling"
        history = await handle.fetch_history()
    assert summary.cancelled_by == ("alice" if by == "operator" else "temporal")
    assert (summary.due, summary.charged, _counted(summary)) == (3, 3, 3)
    charged = {c["customer"] for c in await harness.charges()}
    assert importing.late[0].stripe_customer_id not in charged
    await assert_billed_once(harness, str(PERIOD), customers)
    await replay([history])
    keep([history])


async def _ended_without_a_row(harness: Harness, customers: list[CustomerRow]) -> None:
    """Each customer's child finds it inactive (failed, unknown_customer, no row); then it is
    made active again."""
    ids = [c.customer_id for c in customers]
    await harness.pool.execute(
        "UPDATE customers SET active = false WHERE customer_id = ANY($1::text[])", ids
    )
    for customer_id in ids:
        outcome = await harness.client.execute_workflow(
            CustomerChargeWorkflow.run,
            CustomerChargeInput(period=str(PERIOD), customer_id=customer_id),
            id=customer_workflow_id(PERIOD, customer_id),
            task_queue=harness.task_queue,
        )
        assert outcome.failure_code == "unknown_customer"
    await import_customers(harness.pool, customers, while_running=False, reactivate=True)


async def test_a_customer_active_again_since_its_child_found_it_gone_is_billed(
    harness: Harness,
) -> None:
    """A due customer with no row whose child of the period completed finding it inactive
    (unknown_customer), made active again since: no row means no claim, nothing charged, so
    a run of the period starts it a new child and bills it. Its old child's ID refused every
    later run of the period until Temporal's retention dropped it, each counting it failed."""
    customers = await harness.seed(3)
    returned = customers[1]
    async with harness.running_worker():
        await _ended_without_a_row(harness, [returned])
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        summary = await asyncio.wait_for(handle.result(), 60)
        history = await handle.fetch_history()
    assert (summary.due, summary.charged, summary.failed, _counted(summary)) == (3, 3, 0, 3)
    await assert_billed_once(harness, str(PERIOD), customers)
    await replay([history])
    keep([history])


class GoneOnceListed(ImportAtTheClose):
    """Also makes the `returned` customers inactive as soon as the run has listed them (their
    children find them gone: failed, unknown_customer, no row), and active again as the close
    begins: due, with no row, each with a child of this run."""

    def __init__(self, harness: Harness, returned: list[CustomerRow]) -> None:
        super().__init__(harness)
        self.returned = returned
        self.gone = False

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        outer = self

        class Deactivating(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                page = await super().execute_activity(input)
                if activity.info().activity_type == "due_customers" and not outer.gone:
                    outer.gone = True
                    await outer.harness.pool.execute(
                        "UPDATE customers SET active = false WHERE customer_id = ANY($1::text[])",
                        [c.customer_id for c in outer.returned],
                    )
                return page

        return Deactivating(super().intercept_activity(next))

    async def imported(self) -> None:
        await import_customers(
            self.harness.pool, self.returned, while_running=True, reactivate=True
        )


class GoneOnceListedThenPastRetention(GoneOnceListed):
    """GoneOnceListed, and as the close begins the `returned` customers' children (of this
    run, which counted each failed, unknown_customer) are gone from Temporal, as past the
    namespace's retention (a run paused over it): deleted here."""

    async def imported(self) -> None:
        client = self.harness.client
        for customer in self.returned:
            workflow_id = customer_workflow_id(PERIOD, customer.customer_id)
            await client.workflow_service.delete_workflow_execution(
                DeleteWorkflowExecutionRequest(
                    namespace=client.namespace,
                    workflow_execution=WorkflowExecution(workflow_id=workflow_id),
                )
            )

            async def gone(workflow_id: str = workflow_id) -> bool:
                return await described(client.get_workflow_handle(workflow_id)) is None

            await eventually(gone)
        await super().imported()


@pytest.mark.parametrize(
    "interceptor", [GoneOnceListed, GoneOnceListedThenPastRetention], ids=["kept", "gone"]
)
async def test_a_page_of_the_unlisted_left_whole_is_passed_over(
    harness: Harness, interceptor: type[GoneOnceListed]
) -> None:
    """Every customer of a page of the unlisted had a child: an empty page, after which the
    listing goes on (it listed the same page for ever). Those customers, counted failed,
    are not counted again when their children are gone from Temporal by the close (they
    were taken for unreached: listed again, started again, counted twice; helper-146 F6,
    helper-168 F1): the run took them."""
    returned = await harness.seed(2, prefix="a-a")
    customers = await harness.seed(2)
    importing = interceptor(harness, returned)
    async with harness.running_worker(interceptors=[importing]):
        handle = await start_period(
            harness.client, PERIOD, harness.task_queue, RunOptions(page_size=2)
        )
        summary = await asyncio.wait_for(handle.result(), 90)
    assert importing.gone
    assert (summary.due, summary.charged, summary.failed, _counted(summary)) == (5, 3, 2, 5)
    await assert_billed_once(harness, str(PERIOD), [*customers, *importing.late])


async def test_a_cancel_while_children_start_counts_each_customer_once(harness: Harness) -> None:
    """Cancelled while starts are still to be made by the server: each customer is counted
    once (a cancel that also paged the unlisted took such a child for none, counting twice)."""
    count = 200
    customers = await harness.seed(count)
    wide = RunOptions(max_in_flight=count, max_starting=count, page_size=count)
    async with harness.running_worker():
        handle = await start_period(harness.client, PERIOD, harness.task_queue, wide)

        async def starting() -> bool:
            return (await handle.query(BillingPeriodWorkflow.progress)).in_flight > 0

        await eventually(starting)
        await operations.control(harness.client, PERIOD, "cancel", ALICE)
        summary = await asyncio.wait_for(handle.result(), 120)
    assert (summary.due, _counted(summary)) == (count, count), summary
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    cancelled = frozenset(c for c, r in rows.items() if r["status"] == "cancelled")
    await assert_billed_once(harness, str(PERIOD), customers, cancelled=cancelled)


async def test_a_customer_an_earlier_run_left_unclaimed_imported_behind_is_billed(
    harness: Harness,
) -> None:
    """An earlier run's child of the customer ended before its claim (terminated): a listing
    starts such a one again, and so does the close, for one imported behind the listing (it
    took any workflow of the customer for this run's, and closed with it unbilled)."""
    customers = await harness.seed(3)
    (late,) = await create_demo_customers(harness.stripe, 1, prefix="a-late")
    earlier = await harness.client.start_workflow(
        CustomerChargeWorkflow.run,
        CustomerChargeInput(period=str(PERIOD), customer_id=late.customer_id),
        id=customer_workflow_id(PERIOD, late.customer_id),
        task_queue=f"{harness.task_queue}-nobody-polls",
    )
    await earlier.terminate("terminated by an operator before its claim")
    importing = ImportAtTheClose(harness)
    async with harness.running_worker(interceptors=[importing]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        summary = await asyncio.wait_for(handle.result(), 60)
    assert importing.late == [late]
    assert (summary.due, summary.charged, _counted(summary)) == (4, 4, 4), summary
    await assert_billed_once(harness, str(PERIOD), [*customers, late])


class CloseCommitsThenItsAnswerIsLost(ImportAtTheClose):
    """The first close commits; then a customer is imported behind the listing, and the
    attempt fails as a worker lost before it reported would: Temporal tries the close again."""

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        outer = self

        class Losing(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                result = await super().execute_activity(input)
                if activity.info().activity_type.startswith("close_period") and not outer.late:
                    outer.late = await _late(outer.harness)
                    raise ApplicationError("worker lost before the close was reported")
                return result

        return Losing(next)


async def test_a_close_tried_again_after_it_was_written_does_not_reopen_the_run(
    harness: Harness,
) -> None:
    """Tried again, the close looked for unlisted customers again, found one imported since
    the run was closed, and sent the run back to billing a period the ledger has completed
    (its children refused, counted failed), to write a second summary over the first."""
    customers = await harness.seed(3)
    losing = CloseCommitsThenItsAnswerIsLost(harness)
    async with harness.running_worker(interceptors=[losing]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        summary = await asyncio.wait_for(handle.result(), 90)
    assert losing.late
    written = PeriodSummary.model_validate_json(
        await harness.pool.fetchval(
            "SELECT summary FROM billing_periods WHERE billing_period = $1", str(PERIOD)
        )
    )
    assert (summary.due, summary.charged, summary.failed) == (3, 3, 0), summary
    assert written == summary
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_a_customer_active_again_behind_the_listing_is_billed_by_the_run(
    harness: Harness,
) -> None:
    """Its child of the period found it gone (completed, no row) before the run opened; made
    active again behind the run's listing, it was taken for reached by the close, and the run
    ended with it neither billed nor counted (helper-164 R2)."""
    customers = await harness.seed(3)
    # Sorts before every seeded customer: behind the listing once it has begun.
    returned = await create_demo_customers(harness.stripe, 1, prefix="a-ret")
    await import_customers(harness.pool, returned, while_running=False, reactivate=True)
    ids = [c.customer_id for c in returned]
    await harness.pool.execute(
        "UPDATE customers SET active = false WHERE customer_id = ANY($1::text[])", ids
    )
    async with harness.running_worker():
        # An earlier look at the period found it gone: completed, unknown_customer, no row.
        outcome = await harness.client.execute_workflow(
            CustomerChargeWorkflow.run,
            CustomerChargeInput(period=str(PERIOD), customer_id=ids[0]),
            id=customer_workflow_id(PERIOD, ids[0]),
            task_queue=harness.task_queue,
        )
        assert outcome.failure_code == "unknown_customer"

    class ReturnAtTheClose(ImportAtTheClose):
        async def imported(self) -> None:
            await import_customers(self.harness.pool, returned, while_running=True, reactivate=True)

    importing = ReturnAtTheClose(harness)
    async with harness.running_worker(interceptors=[importing]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        summary = await asyncio.wait_for(handle.result(), 60)
        history = await handle.fetch_history()
    # Billed by the run, as the customer imported at the close beside it.
    assert (summary.due, summary.charged) == (5, 5), summary
    await assert_billed_once(harness, str(PERIOD), [*customers, *importing.late, *returned])
    await replay([history])
    keep([history])


async def test_a_customer_due_again_behind_the_listing_whose_earlier_child_still_runs_is_counted(
    harness: Harness,
) -> None:
    """An earlier run's child of the customer is still RUNNING, before its claim, when this
    run opens (e.g. the earlier run was terminated; its child waits, held or for a worker);
    the customer is inactive as the listing passes it and active again at the close. The
    close (`_unreached`: a RUNNING child is 'reached') closes the run without the customer:
    not counted, not awaited, and then charged by that child after the run's summary was
    written (I2; helper-165 R2)."""
    await harness.seed(3)
    returned, earlier = await _inactive_with_an_earlier_child(harness)
    ids = [c.customer_id for c in returned]

    class ReturnAtTheClose(ImportAtTheClose):
        async def imported(self) -> None:
            await import_customers(self.harness.pool, returned, while_running=True, reactivate=True)
            closing.set()

    closing = asyncio.Event()
    importing = ReturnAtTheClose(harness)
    async with harness.running_worker(interceptors=[importing]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        await asyncio.wait_for(closing.wait(), 60)

        async def awaited() -> bool:
            pending = (await handle.describe()).raw_description.pending_activities
            return any(p.activity_type.name == "await_outcomes" for p in pending)

        # The close found it not reached: listed again, its start refused, it is awaited.
        await eventually(awaited, timeout=30)
        # The earlier child's worker comes back: it claims and charges the customer.
        other = _earlier_worker(harness)
        async with other:
            summary = await asyncio.wait_for(handle.result(), 90)
            outcome = await asyncio.wait_for(earlier.result(), 60)
    assert outcome.outcome == "charged", outcome
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    assert rows[ids[0]]["status"] == "charged"
    # Due at the close and charged for the period: the run's summary should count it.
    assert (summary.due, _counted(summary)) == (5, 5), summary


async def test_a_customer_due_again_behind_the_listing_charged_by_an_earlier_child_is_counted(
    harness: Harness,
) -> None:
    """As above, but the earlier run's child claims and charges the customer before the run
    closes: with a row, it was not listed again, and the run closed with it in no count
    (the ledger right, the summary one short)."""
    await harness.seed(3)
    returned, earlier = await _inactive_with_an_earlier_child(harness)
    ids = [c.customer_id for c in returned]

    class ChargedAtTheClose(ImportAtTheClose):
        async def imported(self) -> None:
            await import_customers(self.harness.pool, returned, while_running=True, reactivate=True)
            # The earlier child's worker comes back and charges it, before the close looks.
            other = _earlier_worker(self.harness)
            async with other:
                outcome = await asyncio.wait_for(earlier.result(), 60)
            assert outcome.outcome == "charged", outcome

    importing = ChargedAtTheClose(harness)
    async with harness.running_worker(interceptors=[importing]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        summary = await asyncio.wait_for(handle.result(), 90)
        history = await handle.fetch_history()
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    assert rows[ids[0]]["status"] == "charged"
    # Charged once, by the earlier child; this run counts it already billed.
    assert (summary.due, summary.already_billed, _counted(summary)) == (5, 1, 5), summary
    await replay([history])
    keep([history])


class RowGivenAtTheClose(AtTheClose):
    """Gives the inactive customer `gone` a row of the period as the run's first close begins:
    an operator's skip, or, with `earlier` (its child an earlier run left), a charge: the
    customer made active for it and inactive again once charged (it left after paying)."""

    def __init__(
        self,
        harness: Harness,
        gone: CustomerRow,
        earlier: WorkflowHandle[CustomerChargeWorkflow, CustomerOutcome] | None,
    ) -> None:
        super().__init__()
        self.harness, self.gone, self.earlier = harness, gone, earlier

    async def before_close(self) -> None:
        harness, customer_id = self.harness, self.gone.customer_id
        if self.earlier is None:
            skip = SkipRequest(customer_id=customer_id, reason="left", operator="carol")
            result = await operations.skip(
                harness.client, harness.settings, harness.database_url, PERIOD, skip
            )
            assert result.skipped, result
            return
        await import_customers(harness.pool, [self.gone], while_running=True, reactivate=True)
        async with _earlier_worker(harness):
            outcome = await asyncio.wait_for(self.earlier.result(), 60)
        assert outcome.outcome == "charged", outcome
        deactivation = await deactivate_customers(harness.pool, [customer_id], while_running=False)
        assert deactivation.deactivated == [customer_id], deactivation


@pytest.mark.parametrize("given", ["skipped", "charged"])
async def test_an_inactive_customer_given_a_row_behind_the_listing_is_counted_once(
    harness: Harness, given: str
) -> None:
    """An inactive customer with no row is not due: no listing takes it. Given a row as the
    run closes (skipped by an operator, which the ledger writes for an inactive customer too;
    or charged by a child an earlier run left, and deactivated since), it is due by its row
    alone, and no listing of the run took it: the close leaves the run open, which lists it
    and counts it from its row. A close that looked only at active customers closed the run
    with it in no count, one short of the ledger's due customers (I2)."""
    customers = await harness.seed(3)
    if given == "skipped":
        [gone], earlier = await _inactive(harness), None
    else:
        [gone], earlier = await _inactive_with_an_earlier_child(harness)
    giving = RowGivenAtTheClose(harness, gone, earlier)
    async with harness.running_worker(interceptors=[giving]):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        summary = await asyncio.wait_for(handle.result(), 90)
        history = await handle.fetch_history()
    assert giving.began
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    assert rows[gone.customer_id]["status"] == given
    counted = summary.skipped if given == "skipped" else summary.already_billed
    assert (summary.due, summary.charged, counted, _counted(summary)) == (4, 3, 1, 4), summary
    charged = customers if given == "skipped" else [*customers, gone]
    made = [c["customer"] for c in await harness.charges() if c["status"] == "succeeded"]
    assert sorted(made) == sorted(c.stripe_customer_id for c in charged)
    await replay([history])
    keep([history])


async def _inactive(harness: Harness) -> list[CustomerRow]:
    """A customer, sorting before every seeded one, imported and then deactivated."""
    returned = await create_demo_customers(harness.stripe, 1, prefix="a-ret")
    await import_customers(harness.pool, returned, while_running=False, reactivate=True)
    await harness.pool.execute(
        "UPDATE customers SET active = false WHERE customer_id = $1", returned[0].customer_id
    )
    return returned


def _earlier_tasks(harness: Harness) -> str:
    return f"{harness.task_queue}-earlier"


async def _inactive_with_an_earlier_child(
    harness: Harness,
) -> tuple[list[CustomerRow], WorkflowHandle[CustomerChargeWorkflow, CustomerOutcome]]:
    """A customer, sorting before every seeded one, inactive, with a child of the period an
    earlier run started: not yet claimed, as its worker (_earlier_worker) is not polling."""
    returned = await _inactive(harness)
    earlier = await harness.client.start_workflow(
        CustomerChargeWorkflow.run,
        CustomerChargeInput(period=str(PERIOD), customer_id=returned[0].customer_id),
        id=customer_workflow_id(PERIOD, returned[0].customer_id),
        task_queue=_earlier_tasks(harness),
    )
    return returned, earlier


def _earlier_worker(harness: Harness, interceptors: Sequence[Interceptor] = ()) -> Worker:
    """The worker of the earlier run's child, come back."""
    return create_worker(
        harness.client,
        _earlier_tasks(harness),
        harness.pool,
        _access(harness),
        harness.settings,
        None,
        sandbox_all=True,
        interceptors=interceptors,
    )


@pytest.mark.parametrize("cancelled", [False, True], ids=["billing", "cancelled-meanwhile"])
async def test_a_rerun_bills_a_customer_whose_earlier_child_stopped_at_an_ended_runs_cancel(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, cancelled: bool
) -> None:
    """A run terminated while it awaited a child an earlier run started, not yet claimed; its
    `cancel` (operations.cancel_ended_run) writes the customer never started, for the next run.
    The child claims while the period is closed, and ends cancelled just as a rerun, finding it
    still running, awaits it: the rerun took that outcome for its own and billed nobody (the
    customer left to a third run; helper-179 F2). It starts the customer's workflow again.
    Cancelled just after it read that it bills, the rerun still starts it: that workflow's
    claim leaves the row to the next run (helper-180)."""
    [customer] = await harness.seed(1)
    earlier = await harness.client.start_workflow(
        CustomerChargeWorkflow.run,
        CustomerChargeInput(period=str(PERIOD), customer_id=customer.customer_id),
        id=customer_workflow_id(PERIOD, customer.customer_id),
        task_queue=_earlier_tasks(harness),
    )
    opened_at = ledger.run_opened_at

    async def read_then_cancelled(conn: Any, period: str, *, billing: bool = False) -> Any:
        opened = await opened_at(conn, period, billing=billing)
        if billing and opened is not None:
            await operations.control(harness.client, PERIOD, "cancel", ALICE)
        return opened

    if cancelled:
        monkeypatch.setattr(ledger, "run_opened_at", read_then_cancelled)

    async def awaits(handle: WorkflowHandle[Any, Any]) -> bool:
        pending = (await handle.describe()).raw_description.pending_activities
        return any(p.activity_type.name == "await_outcomes" for p in pending)

    hold = BillHold()
    async with harness.running_worker():
        ended = await start_period(harness.client, PERIOD, harness.task_queue)
        await eventually(lambda: awaits(ended), timeout=30)
        await ended.terminate(reason="looked stuck")
        async with harness.pool.acquire() as conn:
            cancel = await operations.cancel_ended_run(
                harness.client, conn, harness.settings.billing_key_namespace, PERIOD, ALICE
            )
        assert cancel is not None
        async with _earlier_worker(harness, [hold]):
            await asyncio.wait_for(hold.reached.wait(), 30)
            rerun = await start_period(harness.client, PERIOD, harness.task_queue)
            await eventually(lambda: awaits(rerun), timeout=30)
            hold.go.set()
            assert (await earlier.result()).outcome == "cancelled"
            summary = await asyncio.wait_for(rerun.result(), 60)
    if cancelled:
        assert (summary.due, summary.charged, summary.cancelled) == (1, 0, 1), summary
        [row] = await harness.ledger_rows(str(PERIOD))
        assert (row["status"], row["cancelled_before_start"]) == ("cancelled", True)
        return
    assert (summary.due, summary.charged, summary.cancelled) == (1, 1, 0), summary
    await assert_billed_once(harness, str(PERIOD), [customer])


def _access(harness: Harness) -> StripeAccess:
    if harness.vault is None:
        return direct_access(harness.stripe, harness.settings)
    return harness.vault_access()


async def test_a_run_continued_from_one_before_the_patch_counts_a_returned_customer_once(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run begun by a worker of before RESTART_COMPLETED_UNCLAIMED (no marker at its start:
    here its first run is told the patch is absent, as replay tells it) lists a customer with
    no row whose child completed before the run opened: ALLOW_DUPLICATE_FAILED_ONLY refuses
    the start, the run awaits it in the ledger and counts it failed (unknown_customer). The
    run hands over (its history's length), and the next run, under the patch,
    closes through close_period_if_all_reached, which takes that child for unreached: the
    customer was listed again, started again, charged, and counted a second time (I2;
    helper-165 R1): the chain's first run decides for it."""
    real = wf.patched

    def patched(patch_id: str) -> bool:
        if (
            patch_id in (RESTART_COMPLETED_UNCLAIMED, LISTINGS_MARKED)
            and wf.info().continued_run_id is None
        ):
            return False  # the run's first run began on a worker of before the patches
        return real(patch_id)

    monkeypatch.setattr(wf, "patched", patched)
    customers = await harness.seed(40)
    returned = await create_demo_customers(harness.stripe, 1, prefix="a-ret")
    await import_customers(harness.pool, returned, while_running=False, reactivate=True)
    # Two at a time and a short history: the run continues as new midway.
    options = RunOptions(max_in_flight=2, max_starting=2, history_event_limit=200)
    await harness.set_faults(latency_ms=200)
    async with harness.running_worker():
        await _ended_without_a_row(harness, returned)
        handle = await start_period(harness.client, PERIOD, harness.task_queue, options)
        summary = await asyncio.wait_for(handle.result(), 120)
        latest = await harness.client.get_workflow_handle(handle.id).describe()
    assert latest.run_id != handle.result_run_id, "the run never continued as new"
    rows = {r["customer_id"]: r for r in await harness.ledger_rows(str(PERIOD))}
    assert set(rows) <= {c.customer_id for c in [*customers, *returned]}
    # 41 customers; each counted once.
    assert (summary.due, _counted(summary)) == (41, 41), summary


async def _unlisted_of(harness: Harness, *, restarts_completed: bool) -> set[str]:
    """The ids of the due customers a listing of the unlisted takes, for a run from before
    LISTINGS_MARKED (those PeriodActivities._unreached leaves, which the close looks for)."""
    listing = DuePageRequest(
        period=str(PERIOD),
        after=None,
        limit=10,
        unlisted=True,
        restarts_completed=restarts_completed,
    )
    due_customers = PeriodActivities(harness.pool, harness.settings).due_customers
    page = await ActivityEnvironment(client=harness.client).run(due_customers, listing)
    return {c.customer_id for c in page.customers}


async def test_a_customer_with_no_row_is_unreached_unless_a_child_may_have_ended_for_this_run(
    harness: Harness,
) -> None:
    """A due customer with no row is left to bill (unreached) when no child of this run can
    have ended before its claim: none ran, one still runs (an earlier run's), or one ended
    uncompleted (terminated, or failed: started by hand with an input its model refuses)
    before the run opened (completed too, for a run that restarts completed children). One
    whose child ended since the run opened was this run's, counted already.
    Taken for reached, a customer is never billed; taken for unreached, it is billed and
    counted twice (I2)."""
    none, running, ended_before, failed_before, ended_after = await harness.seed(5)
    [completed] = await create_demo_customers(harness.stripe, 1, prefix="gone")
    await import_customers(harness.pool, [completed], while_running=False, reactivate=True)
    await harness.pool.execute(
        "UPDATE customers SET active = false WHERE customer_id = $1", completed.customer_id
    )
    async with harness.running_worker():
        # Found gone before the run opened: completed, with no row.
        outcome = await harness.client.execute_workflow(
            CustomerChargeWorkflow.run,
            CustomerChargeInput(period=str(PERIOD), customer_id=completed.customer_id),
            id=customer_workflow_id(PERIOD, completed.customer_id),
            task_queue=harness.task_queue,
        )
        refused = await harness.client.start_workflow(
            "CustomerChargeWorkflow",
            {"period": str(PERIOD), "customer_id": failed_before.customer_id, "amount_cents": 1},
            id=customer_workflow_id(PERIOD, failed_before.customer_id),
            task_queue=harness.task_queue,
        )
        with pytest.raises(WorkflowFailureError):
            await refused.result()
    assert outcome.failure_code == "unknown_customer"
    await import_customers(harness.pool, [completed], while_running=False, reactivate=True)
    await harness.idle_child(PERIOD, running.customer_id)
    await (await harness.idle_child(PERIOD, ended_before.customer_id)).terminate("before")
    await harness.open_period_by_hand(PERIOD)
    await (await harness.idle_child(PERIOD, ended_after.customer_id)).terminate("after")
    left = {c.customer_id for c in (none, running, ended_before, failed_before)}
    assert await _unlisted_of(harness, restarts_completed=False) == left
    assert await _unlisted_of(harness, restarts_completed=True) == {*left, completed.customer_id}


async def test_the_close_finds_an_unreached_customer_on_any_page(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The close of a run from before LISTINGS_MARKED reads the due customers with no row a
    page at a time: one unreached on a later page than the first keeps the run open to bill
    it, not only one on the first page."""
    monkeypatch.setattr(period_activities, "UNLISTED_PAGE", 1)
    reached, unreached = await harness.seed(2)
    await harness.open_period_by_hand(PERIOD)
    # This run's child, ended before its claim: reached.
    await (await harness.idle_child(PERIOD, reached.customer_id)).terminate("ended")
    activities = PeriodActivities(harness.pool, harness.settings)

    async def reached_without_row() -> frozenset[str] | None:
        async with harness.pool.acquire() as conn:
            return await activities._reached_without_row(conn, str(PERIOD), frozenset(), False)

    environment = ActivityEnvironment(client=harness.client)
    assert await environment.run(reached_without_row) is None
    # Gone from the ledger's due customers: every one left was reached.
    await harness.pool.execute(
        "UPDATE customers SET active = false WHERE customer_id = $1", unreached.customer_id
    )
    assert await environment.run(reached_without_row) == frozenset({reached.customer_id})


async def test_a_customer_imported_as_the_close_waits_for_the_lock_keeps_the_run_open(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The close of a run from before LISTINGS_MARKED looks for unreached customers first
    without the import's lock, then again under it for those imported since: one imported
    in between would be left unbilled by a run closed over it."""
    await harness.open_period_by_hand(PERIOD)
    lock_for_change = ledger.lock_for_change
    late: list[CustomerRow] = []

    async def imported_first(conn: Any, doing: str) -> None:
        late.extend(await harness.seed(1, prefix="a-late"))
        await lock_for_change(conn, doing)

    monkeypatch.setattr(ledger, "lock_for_change", imported_first)
    closing = PeriodActivities(harness.pool, harness.settings).close_if_all_listed
    summary = PeriodSummary.empty(str(PERIOD), "by-hand")
    assert not await ActivityEnvironment(client=harness.client).run(closing, summary)
    assert late
    async with harness.pool.acquire() as conn:
        record = await ledger.period_record(conn, str(PERIOD))
    assert record is not None and record.state == "running"


async def test_a_page_of_the_unlisted_hands_on_its_cursor(harness: Harness) -> None:
    """A listing of the unlisted (a run from before LISTINGS_MARKED) walks the due customers
    with no row a page at a time: a page with no cursor would end it there, and those after
    it would be left to the close to find."""
    customers = await harness.seed(2)
    await harness.open_period_by_hand(PERIOD)
    listing = DuePageRequest(period=str(PERIOD), after=None, limit=1, unlisted=True)
    due_customers = PeriodActivities(harness.pool, harness.settings).due_customers
    page = await ActivityEnvironment(client=harness.client).run(due_customers, listing)
    assert [c.customer_id for c in page.customers] == [customers[0].customer_id]
    assert page.next_cursor is not None

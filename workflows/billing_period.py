"""One billing period: fan out a child per due customer, in a bounded window, and sum up.

Children are started in batches within one workflow task (a serial await per start caps the
rate at a few per second), survive continue-as-new (ParentClosePolicy.ABANDON) and report
their outcome by signal, so a run that continued as new still hears from them.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import (
    SearchAttributeKey,
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from activities.period import (
        DuePageRequest,
        OutcomesRequest,
        PeriodActivities,
        PrepareRequest,
    )
    from billing import search_attributes
    from billing.errors import InvalidPeriodError
    from billing.keys import customer_workflow_id
    from billing.models import (
        BillingPeriodInput,
        CustomerChargeInput,
        CustomerOutcome,
        DueCustomer,
        PeriodProgress,
        PeriodState,
        PeriodSummary,
        RunOptions,
        finished_outcome,
    )
    from billing.periods import parse_period, period_for
    from workflows.customer_charge import CustomerChargeWorkflow
    from workflows.signals import CHILD_FINISHED

ACTIVITY_TIMEOUT = timedelta(seconds=60)
SCHEDULED_START = SearchAttributeKey.for_datetime("TemporalScheduledStartTime")
# How long the run waits without news before asking the ledger about adopted children.
ADOPTED_RECHECK = timedelta(minutes=5)


@workflow.defn(name="BillingPeriodWorkflow")
class BillingPeriodWorkflow:
    @workflow.init
    def __init__(self, request: BillingPeriodInput) -> None:
        self._options: RunOptions = request.options
        # The period is resolved in run(): an error here would fail the task, not the run.
        self._state = request.state or PeriodState(period="")
        self._in_flight: set[str] = set(self._state.in_flight)
        # Customers whose child existed before this run tried to start it.
        self._adopted: set[str] = set()
        self._buffer: list[DueCustomer] = []

    @workflow.run
    async def run(self, request: BillingPeriodInput) -> PeriodSummary:
        state = self._state
        if not state.period:
            state.period = _resolve_period(request)
        period = state.period
        if state.plan is None:
            state.plan = await workflow.execute_activity_method(
                PeriodActivities.prepare,
                PrepareRequest(period=period, workflow_id=workflow.info().workflow_id),
                start_to_close_timeout=ACTIVITY_TIMEOUT,
                summary=f"plan {period}: count due customers and the expected total",
            )
        workflow.upsert_search_attributes([search_attributes.BILLING_PERIOD.value_set(period)])
        self._describe()
        while True:
            await self._fill_window()
            if not self._in_flight and state.listing_done and not self._buffer:
                break
            await self._wait_for_room()
            if self._should_continue_as_new():
                await workflow.wait_condition(workflow.all_handlers_finished)
                state.in_flight = sorted(self._in_flight)
                state.runs += 1
                workflow.continue_as_new(
                    BillingPeriodInput(period=period, options=self._options, state=state)
                )
        summary = PeriodSummary(
            period=period, workflow_id=workflow.info().workflow_id, **state.counts.model_dump()
        )
        await workflow.execute_activity_method(
            PeriodActivities.close,
            summary,
            start_to_close_timeout=ACTIVITY_TIMEOUT,
            summary=f"close {period}",
        )
        workflow.set_current_details(
            f"Finished: {summary.charged} charged, {summary.already_billed} already billed,"
            f" {summary.failed} failed of {summary.due} due"
        )
        return summary

    @workflow.signal(name=CHILD_FINISHED)
    def child_finished(self, outcome: CustomerOutcome) -> None:
        self._settle(outcome)

    @workflow.query
    def progress(self) -> PeriodProgress:
        counts = self._state.counts
        return PeriodProgress(
            period=self._state.period,
            workflow_id=workflow.info().workflow_id,
            state="running",
            in_flight=len(self._in_flight),
            expected_due=self._state.plan.due if self._state.plan else None,
            **counts.model_dump(),
        )

    def _settle(self, outcome: CustomerOutcome) -> None:
        # Duplicate reports (a child's signal after the ledger already told us) count once.
        if outcome.customer_id in self._in_flight:
            self._in_flight.discard(outcome.customer_id)
            self._adopted.discard(outcome.customer_id)
            self._state.counts.add(outcome)

    async def _next_batch(self, room: int) -> list[str]:
        """Up to `room` customers to start; customers finished in the ledger are counted."""
        state = self._state
        batch: list[str] = []
        while len(batch) < room:
            if not self._buffer:
                if state.listing_done:
                    break
                page = await workflow.execute_activity_method(
                    PeriodActivities.due_customers,
                    DuePageRequest(
                        period=state.period, after=state.cursor, limit=self._options.page_size
                    ),
                    start_to_close_timeout=ACTIVITY_TIMEOUT,
                    summary="list due customers",
                )
                self._buffer = page.customers
                state.listing_done = page.next_cursor is None
                if not self._buffer:
                    break
            customer = self._buffer.pop(0)
            state.cursor = customer.customer_id
            state.counts.due += 1
            if customer.status is not None and customer.status != "claimed":
                state.counts.add(
                    CustomerOutcome(
                        customer_id=customer.customer_id,
                        outcome=finished_outcome(customer.status),
                    )
                )
            else:
                batch.append(customer.customer_id)
        return batch

    async def _fill_window(self) -> None:
        room = self._options.max_in_flight - len(self._in_flight)
        if room <= 0:
            return
        batch = await self._next_batch(room)
        if not batch:
            return
        self._in_flight.update(batch)
        started = await asyncio.gather(*(self._start_child(c) for c in batch))
        existing = [c for c, ok in zip(batch, started, strict=True) if not ok]
        if existing:
            self._adopted.update(existing)
            await self._settle_from_ledger(existing)
        self._describe()

    async def _start_child(self, customer_id: str) -> bool:
        """Start the customer's child; False when a child with its ID already exists."""
        period = self._state.period
        try:
            await workflow.start_child_workflow(
                CustomerChargeWorkflow.run,
                CustomerChargeInput(
                    period=period,
                    customer_id=customer_id,
                    parent_workflow_id=workflow.info().workflow_id,
                ),
                id=customer_workflow_id(parse_period(period), customer_id),
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                static_summary=f"Charge customer {customer_id} for {period}",
                search_attributes=TypedSearchAttributes(
                    [
                        SearchAttributePair(search_attributes.BILLING_PERIOD, period),
                        SearchAttributePair(search_attributes.CUSTOMER_ID, customer_id),
                    ]
                ),
            )
        except WorkflowAlreadyStartedError:
            return False
        return True

    async def _settle_from_ledger(self, customer_ids: list[str]) -> None:
        """Count customers whose existing child already finished; the rest report by signal."""
        outcomes = await workflow.execute_activity_method(
            PeriodActivities.ledger_outcomes,
            OutcomesRequest(period=self._state.period, customer_ids=customer_ids),
            start_to_close_timeout=ACTIVITY_TIMEOUT,
            summary=f"read {len(customer_ids)} outcomes of children started elsewhere",
        )
        for outcome in outcomes:
            self._settle(outcome)

    async def _wait_for_room(self) -> None:
        # Refill when a tenth of the window is free: batches stay large, starts stay cheap.
        low_water = self._options.max_in_flight - max(1, self._options.max_in_flight // 10)
        exhausted = self._state.listing_done and not self._buffer
        try:
            await workflow.wait_condition(
                lambda: len(self._in_flight) <= (0 if exhausted else low_water),
                timeout=ADOPTED_RECHECK,
            )
        except TimeoutError:
            if self._adopted:
                await self._settle_from_ledger(sorted(self._adopted))

    def _should_continue_as_new(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self._options.history_event_limit
        )

    def _describe(self) -> None:
        counts = self._state.counts
        workflow.set_current_details(
            f"Running: {counts.due} of {self._state.plan.due if self._state.plan else '?'} due"
            f" customers reached, {len(self._in_flight)} in flight, {counts.charged} charged,"
            f" {counts.already_billed} already billed, {counts.failed} failed"
        )


def _resolve_period(request: BillingPeriodInput) -> str:
    """The period argument, or the month a schedule's nominal start time bills."""
    try:
        if request.period is not None:
            return str(parse_period(request.period))
        scheduled = workflow.info().typed_search_attributes.get(SCHEDULED_START)
        if scheduled is None:
            raise InvalidPeriodError("no billing period given and not started by a schedule")
        return str(period_for(scheduled, request.options.billing))
    except InvalidPeriodError as exc:
        raise ApplicationError(str(exc), type="InvalidPeriod", non_retryable=True) from exc

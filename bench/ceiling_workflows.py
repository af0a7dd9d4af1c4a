"""Temporal's own ceiling for bench/throughput.py: the period workflow's fan-out, minus the work.

`FanOutWorkflow` starts `count` children of one `ChildKind` the way BillingPeriodWorkflow
does (a window of `max_in_flight`, refilled at a tenth free, at most `max_starting` starts
unacknowledged, each child started and awaited by a task of its own, REJECT_DUPLICATE IDs,
ParentClosePolicy.ABANDON, a static summary and two search attributes per child, both
outside the sandbox as the billing worker runs them). `NoopChildWorkflow` only returns (the
ceiling); `ShapedChildWorkflow` has the billing child's shape without its work (the shaped
ceiling): the bill as a local activity with the same options, answering at once with a
charged customer's outcome, then the BillingStatus upsert, and that outcome as result. Like the
period, it lets its children finish before it continues as new (at the same history length),
though for as long as they take: the period hands over those still running after
`RunOptions.hand_over_after_seconds`.
Run on the benchmark's own task queue, never on the billing worker.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from typing import Any

from pydantic import BaseModel
from temporalio import activity, workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy

with workflow.unsafe.imports_passed_through():
    from billing import search_attributes
    from billing.models import CustomerOutcome
    from workflows.customer_charge import (
        BILL_RETRY,
        BILL_ROUND,
        BILL_TIMEOUT,
        LOCAL_RETRY_THRESHOLD,
    )


class ChildKind(StrEnum):
    """A child's workflow type, which the fan-out starts by name."""

    NOOP = "BenchNoopChild"
    SHAPED = "BenchShapedChild"


class NoopChildInput(BaseModel):
    index: int


class FanOutInput(BaseModel):
    prefix: str
    count: int
    max_in_flight: int
    max_starting: int
    history_event_limit: int
    next_index: int = 0
    finished: int = 0
    runs: int = 1
    child: ChildKind = ChildKind.NOOP


class FanOutResult(BaseModel):
    finished: int
    runs: int


@workflow.defn(name=ChildKind.NOOP, sandboxed=False)
class NoopChildWorkflow:
    @workflow.run
    async def run(self, request: NoopChildInput) -> int:
        return request.index


@activity.defn(name="BenchShapedBill")
async def shaped_bill(request: NoopChildInput) -> CustomerOutcome:
    """What the bill of a charged customer returns, at once."""
    return CustomerOutcome(
        customer_id=f"bench-{request.index:06d}",
        outcome="charged",
        amount_cents=4_999,
        currency="usd",
        charge_id=f"pi_bench{request.index:020d}",
    )


@workflow.defn(name=ChildKind.SHAPED, sandboxed=False)
class ShapedChildWorkflow:
    @workflow.run
    async def run(self, request: NoopChildInput) -> CustomerOutcome:
        outcome = await workflow.execute_local_activity(
            shaped_bill,
            request,
            start_to_close_timeout=BILL_TIMEOUT,
            schedule_to_close_timeout=BILL_ROUND,
            retry_policy=BILL_RETRY,
            local_retry_threshold=LOCAL_RETRY_THRESHOLD,
            summary=f"bill child {request.index}",
        )
        workflow.upsert_search_attributes(
            [search_attributes.BILLING_STATUS.value_set(outcome.outcome)]
        )
        return outcome


@workflow.defn(name="BenchFanOut", sandboxed=False)
class FanOutWorkflow:
    @workflow.init
    def __init__(self, request: FanOutInput) -> None:
        self._state = request
        self._in_flight: set[asyncio.Task[None]] = set()
        self._starting = 0

    @workflow.run
    async def run(self, request: FanOutInput) -> FanOutResult:
        state = self._state
        low_water = state.max_in_flight - max(1, state.max_in_flight // 10)
        while True:
            room = min(
                state.max_in_flight - len(self._in_flight), state.max_starting - self._starting
            )
            if room > 0 and state.next_index < state.count:
                batch = range(state.next_index, min(state.count, state.next_index + room))
                state.next_index += len(batch)
                for index in batch:
                    task = asyncio.create_task(self._run_child(index))
                    self._in_flight.add(task)
                    task.add_done_callback(self._in_flight.discard)
            exhausted = state.next_index >= state.count
            if exhausted and not self._in_flight:
                return FanOutResult(finished=state.finished, runs=state.runs)
            await workflow.wait_condition(partial(self._settled_to, 0 if exhausted else low_water))
            info = workflow.info()
            if (
                info.is_continue_as_new_suggested()
                or info.get_current_history_length() >= state.history_event_limit
            ):
                await workflow.wait_condition(partial(self._settled_to, 0))
                state.runs += 1
                workflow.continue_as_new(state)

    def _settled_to(self, target: int) -> bool:
        return len(self._in_flight) <= target and self._starting < self._state.max_starting

    async def _run_child(self, index: int) -> None:
        self._starting += 1
        try:
            handle = await self._start(index)
        finally:
            self._starting -= 1
        await handle
        self._state.finished += 1

    async def _start(self, index: int) -> workflow.ChildWorkflowHandle[Any, Any]:
        child_id = f"{self._state.prefix}-{index:06d}"
        return await workflow.start_child_workflow(
            self._state.child,
            NoopChildInput(index=index),
            id=child_id,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            static_summary=f"Benchmark child {index}",
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(search_attributes.BILLING_PERIOD, self._state.prefix),
                    SearchAttributePair(search_attributes.CUSTOMER_ID, child_id),
                ]
            ),
        )


@dataclass(frozen=True)
class CeilingChild:
    """What a worker needs to run one kind of child, and its name in the benchmark's output."""

    name: str
    workflow: type
    activities: tuple[Any, ...] = ()


CEILING_CHILDREN = {
    ChildKind.NOOP: CeilingChild("no-op", NoopChildWorkflow),
    ChildKind.SHAPED: CeilingChild("shaped", ShapedChildWorkflow, (shaped_bill,)),
}

"""Temporal's own ceiling for bench/throughput.py: the period workflow's fan-out, minus the work.

`FanOutWorkflow` starts `count` `NoopChildWorkflow` children the way BillingPeriodWorkflow
does (a window of `max_in_flight`, refilled at a tenth free with one `asyncio.gather` of
starts, REJECT_DUPLICATE IDs, ParentClosePolicy.ABANDON, a static summary and two search
attributes per child, continue-as-new at the same history length); each child only signals
the parent and returns. Run on the benchmark's own task queue, never on the billing worker.
"""

from __future__ import annotations

import asyncio
from functools import partial

from pydantic import BaseModel, Field
from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy

with workflow.unsafe.imports_passed_through():
    from billing import search_attributes

CHILD_DONE = "noop_child_done"


class NoopChildInput(BaseModel):
    parent_workflow_id: str
    index: int


class FanOutInput(BaseModel):
    prefix: str
    count: int
    max_in_flight: int
    history_event_limit: int
    next_index: int = 0
    in_flight: list[int] = Field(default_factory=list)
    finished: int = 0
    runs: int = 1


class FanOutResult(BaseModel):
    finished: int
    runs: int


@workflow.defn(name="BenchNoopChild")
class NoopChildWorkflow:
    @workflow.run
    async def run(self, request: NoopChildInput) -> None:
        parent = workflow.get_external_workflow_handle(request.parent_workflow_id)
        await parent.signal(CHILD_DONE, request.index)


@workflow.defn(name="BenchFanOut")
class FanOutWorkflow:
    @workflow.init
    def __init__(self, request: FanOutInput) -> None:
        self._state = request
        self._in_flight: set[int] = set(request.in_flight)

    @workflow.signal(name=CHILD_DONE)
    def child_done(self, index: int) -> None:
        if index in self._in_flight:
            self._in_flight.discard(index)
            self._state.finished += 1

    @workflow.run
    async def run(self, request: FanOutInput) -> FanOutResult:
        state = self._state
        low_water = state.max_in_flight - max(1, state.max_in_flight // 10)
        while True:
            room = state.max_in_flight - len(self._in_flight)
            if room > 0 and state.next_index < state.count:
                batch = list(range(state.next_index, min(state.count, state.next_index + room)))
                state.next_index += len(batch)
                self._in_flight.update(batch)
                await asyncio.gather(*(self._start(i) for i in batch))
            exhausted = state.next_index >= state.count
            if exhausted and not self._in_flight:
                return FanOutResult(finished=state.finished, runs=state.runs)
            await workflow.wait_condition(partial(self._settled_to, 0 if exhausted else low_water))
            info = workflow.info()
            if (
                info.is_continue_as_new_suggested()
                or info.get_current_history_length() >= state.history_event_limit
            ):
                await workflow.wait_condition(workflow.all_handlers_finished)
                state.in_flight = sorted(self._in_flight)
                state.runs += 1
                workflow.continue_as_new(state)

    def _settled_to(self, target: int) -> bool:
        return len(self._in_flight) <= target

    async def _start(self, index: int) -> None:
        child_id = f"{self._state.prefix}-{index:06d}"
        await workflow.start_child_workflow(
            NoopChildWorkflow.run,
            NoopChildInput(parent_workflow_id=workflow.info().workflow_id, index=index),
            id=child_id,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            static_summary=f"Benchmark no-op child {index}",
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(search_attributes.BILLING_PERIOD, self._state.prefix),
                    SearchAttributePair(search_attributes.CUSTOMER_ID, child_id),
                ]
            ),
        )

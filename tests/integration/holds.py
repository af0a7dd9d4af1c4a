"""Holds on a customer's bill, so that a test waits for what it checks rather than betting
on how fast the machine is: worker interceptors that hold a bill once it has run (its claim
made, its outcome not yet in the workflow's history), and a hold before its Stripe slot."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from activities.charging import ChargingActivities
from billing.models import Claim
from workflows.customer_charge import BILL_TIMEOUT

# Past this, a hold lets the bill go and says so (`gave_up`): the test is stuck, not slow.
# Raising instead would fail the bill, whose retry is held again, until pytest's timeout.
# Within the bill's own timeout, which would otherwise cancel the hold first, unsaid.
HOLD_SECONDS = BILL_TIMEOUT.total_seconds() - 10


class BillHold(Interceptor):
    """Runs `hold` after each bill, before its outcome goes back to the workflow."""

    gave_up = False

    async def hold(self) -> None:
        raise NotImplementedError

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        holder = self

        class Held(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                outcome = await super().execute_activity(input)
                if activity.info().activity_type == "bill":
                    try:
                        await asyncio.wait_for(holder.hold(), HOLD_SECONDS)
                    except TimeoutError:
                        holder.gave_up = True
                return outcome

        return Held(next)


class HoldTheBillsEnd(BillHold):
    """Holds every bill until let go (`go_on`); `billed` is set once one has run."""

    def __init__(self) -> None:
        self.billed = asyncio.Event()
        self.go_on = asyncio.Event()

    async def hold(self) -> None:
        self.billed.set()
        await self.go_on.wait()


class HoldBillsAtTheHandOver(BillHold):
    """Holds a bill while the period run that started it is past `limit` events and still
    running: the child is in flight when that run continues as new. `held` counts them.

    The run decides by the history it read at its last workflow task, which the one it
    completes makes longer: read at `limit` events, a run still below it may wait for these
    very children. A run whose history has not grown for `idle_seconds` lets them go."""

    def __init__(self, client: Client, limit: int, idle_seconds: float = 10) -> None:
        self.client = client
        self.limit = limit
        self.idle_seconds = idle_seconds
        self.held = 0

    async def hold(self) -> None:
        child_id = activity.info().workflow_id
        assert child_id is not None
        child = await self.client.get_workflow_handle(child_id).describe()
        assert child.parent_id is not None
        parent = self.client.get_workflow_handle(child.parent_id, run_id=child.parent_run_id)
        counted = False
        length, since = 0, time.monotonic()
        while True:
            run = await parent.describe()
            if run.status != WorkflowExecutionStatus.RUNNING or run.history_length < self.limit:
                return
            if run.history_length != length:
                length, since = run.history_length, time.monotonic()
            elif time.monotonic() - since > self.idle_seconds:
                return
            if not counted:
                counted, self.held = True, self.held + 1
            await asyncio.sleep(0.1)


def hold_the_slots(
    monkeypatch: pytest.MonkeyPatch, until: Callable[[Claim], Awaitable[None]]
) -> None:
    """Each bill, its claim made, waits for `until(claim)` before it takes its Stripe slot
    and meets the ledger's gate: as long a wait as a slot far off, made explicit."""
    wait_for_slot = ChargingActivities._wait_for_slot

    async def held(charging: ChargingActivities, claim: Claim, reserved: datetime | None) -> None:
        await until(claim)
        await wait_for_slot(charging, claim, reserved)

    monkeypatch.setattr(ChargingActivities, "_wait_for_slot", held)

"""Holds on activities, so that a test waits for what it checks rather than betting on how
fast the machine is: a worker interceptor that holds an activity, before it runs or once it
has run, until the test lets it go; holds on a customer's bill; and a hold before a bill's
Stripe slot."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from fnmatch import fnmatchcase
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from activities.charging import ChargingActivities
from billing.models import Claim
from workflows.customer_charge import BILL_TIMEOUT


class ActivityHold(Interceptor):
    """Holds each activity (local ones too) that `match` accepts, a pattern of its type
    ("bill", "close_period*") or a test of its info: before it runs, or with `after` once it
    has run, its outcome not yet back in the workflow (one that failed is not held). A held
    activity waits for `hold`, by default until the test lets it go (`go`), `reached` set;
    past `timeout` seconds it fails (TimeoutError): the test is stuck, not slow."""

    def __init__(
        self,
        match: str | Callable[[activity.Info], bool],
        *,
        after: bool = False,
        timeout: float = 60,
    ) -> None:
        self.match = match
        self.after = after
        self.timeout = timeout
        self.reached = asyncio.Event()
        self.go = asyncio.Event()

    async def hold(self) -> None:
        self.reached.set()
        await self.go.wait()

    def _matches(self, info: activity.Info) -> bool:
        if isinstance(self.match, str):
            return fnmatchcase(info.activity_type, self.match)
        return self.match(info)

    async def _held(self) -> None:
        await asyncio.wait_for(self.hold(), self.timeout)

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        holder = self

        class Held(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                held = holder._matches(activity.info())
                if held and not holder.after:
                    await holder._held()
                outcome = await super().execute_activity(input)
                if held and holder.after:
                    await holder._held()
                return outcome

        return Held(next)


class BillHold(ActivityHold):
    """Holds each bill once it has run (its claim made, its outcome not yet in the workflow's
    history): until let go, or as long as a subclass's `hold` says.

    Past its limit it lets the bill go and says so (`gave_up`): raising instead would fail
    the bill, whose retry is held again, until pytest's timeout. The limit is within the
    bill's own timeout, which would otherwise cancel the hold first, unsaid."""

    gave_up = False

    def __init__(self) -> None:
        super().__init__("bill", after=True, timeout=BILL_TIMEOUT.total_seconds() - 10)

    async def _held(self) -> None:
        try:
            await super()._held()
        except TimeoutError:
            self.gave_up = True


class HoldBillsAtTheHandOver(BillHold):
    """Holds a bill while the period run that started it is past `limit` events and still
    running: the child is in flight when that run continues as new. `held` counts them.

    The run decides by the history it read at its last workflow task, which the one it
    completes makes longer: read at `limit` events, a run still below it may wait for these
    very children. A run whose history has not grown for `idle_seconds` lets them go."""

    def __init__(self, client: Client, limit: int, idle_seconds: float = 10) -> None:
        super().__init__()
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

"""Temporal Schedules that bill a period every month, or reconcile it every day (client side:
create, backfill, ...)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field, field_validator
from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleBackfill,
    ScheduleCalendarSpec,
    ScheduleDescription,
    ScheduleHandle,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleRange,
    ScheduleSpec,
    ScheduleState,
)

from billing.errors import InvalidInputError
from billing.models import Record, RunOptions, ScheduledAction, ScheduledBillingInput
from billing.periods import Billing, Period, period_range
from workflows.scheduled_billing import ScheduledBillingWorkflow

Overlap = Literal[
    "skip", "buffer_one", "buffer_all", "cancel_other", "terminate_other", "allow_all"
]
DEFAULT_SCHEDULE_ID = "billing-monthly"
RECONCILE_SCHEDULE_ID = "billing-reconcile-daily"


def validate_time_zone(name: str) -> str:
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidInputError(
            f"time zone {name!r} is not an IANA name such as 'UTC' or 'Europe/Berlin'"
        ) from None
    return name


class MonthlySchedule(Record):
    """When the monthly run fires, and what it does when runs overlap or were missed."""

    schedule_id: str = Field(default=DEFAULT_SCHEDULE_ID, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    # Up to 28 so that every month has the day.
    day_of_month: int = Field(default=1, ge=1, le=28)
    hour: int = Field(default=2, ge=0, le=23)
    minute: int = Field(default=0, ge=0, le=59)
    time_zone: str = "UTC"
    billing: Billing = "arrears"
    overlap: Overlap = "skip"
    catchup_window: timedelta = timedelta(days=1)
    paused: bool = False
    # "reconcile" fires every day at hour:minute (day_of_month unused) and reconciles the
    # period a billing schedule with the same settings bills at that time.
    action: ScheduledAction = "bill"

    @field_validator("time_zone")
    @classmethod
    def _zone(cls, value: str) -> str:
        return validate_time_zone(value)


def build_schedule(config: MonthlySchedule, task_queue: str, options: RunOptions) -> Schedule:
    daily = config.action == "reconcile"
    at = f"{config.hour:02d}:{config.minute:02d}"
    return Schedule(
        action=ScheduleActionStartWorkflow(
            ScheduledBillingWorkflow.run,
            ScheduledBillingInput(
                options=options.model_copy(update={"billing": config.billing}),
                time_zone=config.time_zone,
                action=config.action,
            ),
            id=f"{config.schedule_id}-run",
            task_queue=task_queue,
            static_summary=(
                f"Daily reconciliation ({config.billing}) from {config.schedule_id}"
                if daily
                else f"Monthly billing ({config.billing}) from {config.schedule_id}"
            ),
        ),
        spec=ScheduleSpec(
            calendars=[
                ScheduleCalendarSpec(
                    day_of_month=[
                        ScheduleRange(1, 31) if daily else ScheduleRange(config.day_of_month)
                    ],
                    hour=[ScheduleRange(config.hour)],
                    minute=[ScheduleRange(config.minute)],
                    comment=f"every day at {at}" if daily else f"day {config.day_of_month} at {at}",
                )
            ],
            time_zone_name=config.time_zone,
        ),
        policy=SchedulePolicy(
            overlap=ScheduleOverlapPolicy[config.overlap.upper()],
            catchup_window=config.catchup_window,
        ),
        state=ScheduleState(paused=config.paused, note="created paused" if config.paused else None),
    )


async def create_schedule(
    client: Client, config: MonthlySchedule, task_queue: str, options: RunOptions | None = None
) -> ScheduleHandle:
    return await client.create_schedule(
        config.schedule_id, build_schedule(config, task_queue, options or RunOptions())
    )


def backfill_window(
    first: Period, last: Period, billing: Billing, time_zone: str
) -> tuple[datetime, datetime]:
    """The nominal times whose runs bill `first`..`last`: the month after each (arrears) or
    the month itself (advance), in the schedule's zone."""
    if last < first:
        raise InvalidInputError(f"backfill ends ({last}) before it starts ({first})")
    start, end = (
        (first.next(), last.next().next()) if billing == "arrears" else (first, last.next())
    )
    zone = ZoneInfo(time_zone)
    return (
        datetime(start.year, start.month, 1, tzinfo=zone),
        datetime(end.year, end.month, 1, tzinfo=zone) - timedelta(seconds=1),
    )


async def backfill(client: Client, schedule_id: str, first: Period, last: Period) -> int:
    """Run the schedule for each period from `first` to `last`; returns how many periods."""
    handle = client.get_schedule_handle(schedule_id)
    description = await handle.describe()
    action = description.schedule.action
    assert isinstance(action, ScheduleActionStartWorkflow)
    # A described schedule carries its action's arguments still encoded.
    [request] = await client.data_converter.decode(
        list(action.args),
        [ScheduledBillingInput],
    )
    start, end = backfill_window(first, last, request.options.billing, request.time_zone)
    # Each period is its own workflow: backfilled months run side by side.
    await handle.backfill(
        ScheduleBackfill(start_at=start, end_at=end, overlap=ScheduleOverlapPolicy.ALLOW_ALL)
    )
    return len(period_range(first, last))


def describe(description: ScheduleDescription) -> str:
    """The schedule as an operator reads it: when, paused or not, next and recent runs."""
    schedule = description.schedule
    spec = schedule.spec
    lines = [
        f"schedule {description.id}",
        f"  {'PAUSED' if schedule.state.paused else 'active'}"
        + (f" ({schedule.state.note})" if schedule.state.note else ""),
        "  fires: "
        + "; ".join(c.comment or str(c) for c in spec.calendars)
        + f" ({spec.time_zone_name or 'UTC'})",
        f"  overlap {schedule.policy.overlap.name.lower()},"
        f" catch-up window {schedule.policy.catchup_window}",
        "  next: " + ", ".join(t.isoformat() for t in description.info.next_action_times[:3]),
    ]
    for action in description.info.recent_actions[-5:]:
        lines.append(
            f"  ran {action.scheduled_at.isoformat()}: {getattr(action.action, 'workflow_id', '')}"
        )
    return "\n".join(lines)

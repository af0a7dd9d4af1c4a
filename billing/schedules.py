"""Temporal Schedules that bill a period every month, or reconcile it every day (client side:
create, backfill, ...)."""

from __future__ import annotations

import re
from collections import Counter
from datetime import UTC, date, datetime, timedelta
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import asyncpg
from google.protobuf.timestamp_pb2 import Timestamp
from pydantic import Field, field_validator, model_validator
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import ListScheduleMatchingTimesRequest
from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionExecutionStartWorkflow,
    ScheduleActionResult,
    ScheduleActionStartWorkflow,
    ScheduleBackfill,
    ScheduleCalendarSpec,
    ScheduleDescription,
    ScheduleHandle,
    ScheduleListActionStartWorkflow,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleRange,
    ScheduleSpec,
    ScheduleState,
    WorkflowHandle,
)
from temporalio.service import RPCError, RPCStatusCode

from billing import ledger
from billing.data_converter import RefusedWorkflowInputError
from billing.errors import (
    ForeignScheduleError,
    InvalidInputError,
    UnknownScheduleError,
    shown,
)
from billing.keys import period_workflow_id
from billing.models import Record, RunOptions, ScheduledAction, ScheduledBillingInput
from billing.periods import (
    Billing,
    Period,
    check_run_by_hand,
    parse_period,
    period_for,
    period_range,
    run_command,
)
from billing.redact import SECRET_RE, shown_cut
from billing.run_states import Finished, describe_finished, ended_unfinished, finished_runs
from billing.temporal_client import ENDED_UNCOMPLETED, workflow_status

Overlap = Literal[
    "skip", "buffer_one", "buffer_all", "cancel_other", "terminate_other", "allow_all"
]
DEFAULT_SCHEDULE_ID = "billing-monthly"
RECONCILE_SCHEDULE_ID = "billing-reconcile-daily"
# What our schedules start (workflows.scheduled_billing), named rather than imported: the
# worker's activities read schedules too, and the workflow module imports them.
LAUNCHER = "ScheduledBillingWorkflow"


# Names the tz database holds that stand for no place: "localtime" is whatever zone the host
# reading it runs in (the CLI's, the server's and the worker's may differ), and a launch near
# midnight on the 1st would bill another month on another host.
_NO_PLACE = frozenset({"localtime", "posixrules", "Factory"})
# Copies of the whole tree some systems add (right/ counts leap seconds), which the tzdata
# package a worker falls back on does not hold.
_COPIES = ("posix/", "right/")


def validate_time_zone(name: str) -> str:
    try:
        if name in _NO_PLACE or name.startswith(_COPIES):
            raise ValueError(name)
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        # OSError: a folder of the database ("America") read from the tzdata package.
        raise InvalidInputError(
            f"time zone {shown(name)} is not an IANA name such as 'UTC' or 'Europe/Berlin'"
        ) from None
    return name


# Its launches' workflow IDs add LAUNCH_SUFFIX, then "-" and a firing's time (21 characters)
# to it, and Temporal takes up to 1,000: it refuses a schedule with a longer id, naming a
# "WorkflowId" rather than --id (earlier releases checked no length).
LAUNCH_SUFFIX = "-run"
SCHEDULE_ID_MAX = 1000 - len(LAUNCH_SUFFIX) - 21
_SCHEDULE_ID_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{SCHEDULE_ID_MAX - 1}}}")


def validate_schedule_id(schedule_id: str) -> str:
    if _SCHEDULE_ID_RE.fullmatch(schedule_id) is None:
        raise InvalidInputError(
            f"schedule id {shown(schedule_id, 70)} must be 1-{SCHEDULE_ID_MAX} characters of"
            " letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    # Temporal keeps the id, names each launch after it and shows it in the Web UI.
    if SECRET_RE.search(schedule_id):
        raise InvalidInputError(
            "a schedule id must not contain what looks like a Stripe or vault key"
            " (sk_live_..., rk_test_..., vk_...)"
        )
    return schedule_id


MIN_CATCHUP_WINDOW = timedelta(seconds=10)


class MonthlySchedule(Record):
    """When the monthly run fires, and what it does when runs overlap or were missed."""

    schedule_id: str = DEFAULT_SCHEDULE_ID
    day_of_month: int = Field(default=1, ge=1)
    hour: int = Field(default=2, ge=0, le=23)
    minute: int = Field(default=0, ge=0, le=59)
    time_zone: str = "UTC"
    billing: Billing = "arrears"
    # Temporal starts only the first of the firings it catches up at once under `skip` (the
    # rest count as overlapping it): an outage over two firings would lose the second.
    # Buffered, each starts once the launch before it ends, within seconds.
    overlap: Overlap = "buffer_all"
    # Wide: Temporal drops a firing it could not make within the window for good, and a late
    # launch is harmless (it leaves a period whose run completed as it is, and joins a running
    # one).
    catchup_window: timedelta = timedelta(days=7)
    paused: bool = False
    # "reconcile" fires every day at hour:minute (day_of_month unused) and reconciles the
    # latest period billed: the one a billing schedule with the same settings bills at that
    # time once its run has started, else the month before.
    action: ScheduledAction = "bill"
    # Reconcile only: the billing schedule followed (ScheduledBillingInput), and the zone its
    # months are read in (that schedule's) when it fires in another.
    billing_schedule_id: str | None = None
    months_time_zone: str | None = None

    @field_validator("schedule_id", "billing_schedule_id")
    @classmethod
    def _schedule_id(cls, value: str | None) -> str | None:
        return None if value is None else validate_schedule_id(value)

    @field_validator("day_of_month")
    @classmethod
    def _in_every_month(cls, value: int) -> int:
        if value > 28:
            raise ValueError(
                f"must be 28 or less: day {value} is missing from some months (February has"
                " 28 days), which would go unbilled"
            )
        return value

    @field_validator("catchup_window")
    @classmethod
    def _catchup(cls, value: timedelta) -> timedelta:
        # Temporal raises a shorter window to this without a word.
        if value < MIN_CATCHUP_WINDOW:
            raise ValueError(
                f"must be at least {MIN_CATCHUP_WINDOW.total_seconds():g} seconds"
                f" ({MIN_CATCHUP_WINDOW / timedelta(hours=1):.4f} hours), Temporal's least"
            )
        return value

    @field_validator("time_zone", "months_time_zone")
    @classmethod
    def _zone(cls, value: str | None) -> str | None:
        return None if value is None else validate_time_zone(value)

    @model_validator(mode="after")
    def _fires_every_month(self) -> MonthlySchedule:
        if self.action == "bill" and (
            self.billing_schedule_id is not None or self.months_time_zone is not None
        ):
            raise ValueError("a billing schedule follows no other; only a reconciliation does")
        if self.action == "bill":
            gap = first_skipped(self.day_of_month, self.hour, self.minute, self.time_zone)
            if gap is not None:
                raise ValueError(
                    f"day {self.day_of_month} at {self.hour:02d}:{self.minute:02d} does not"
                    f" exist in {self.time_zone} on {gap} (the clocks skip it), so that month"
                    " would not be billed: choose another hour or day"
                )
        return self


# Zones change their rules rarely, and announce them: a schedule is checked this far ahead.
_YEARS_CHECKED = 20


def first_skipped(day: int, hour: int, minute: int, time_zone: str) -> date | None:
    """The first day, in the coming years, on which `day` at hour:minute does not exist in the
    zone because the clocks jump over it: Temporal fires nothing that month."""
    zone = ZoneInfo(time_zone)
    today = datetime.now(zone).date()
    for year in range(today.year, today.year + _YEARS_CHECKED):
        for month in range(1, 13):
            local = datetime(year, month, day, hour, minute)
            if local.date() < today:
                continue
            there_and_back = local.replace(tzinfo=zone).astimezone(UTC).astimezone(zone)
            if there_and_back.replace(tzinfo=None) != local:
                return local.date()
    return None


def build_schedule(config: MonthlySchedule, task_queue: str, options: RunOptions) -> Schedule:
    daily = config.action == "reconcile"
    at = f"{config.hour:02d}:{config.minute:02d}"
    return Schedule(
        action=ScheduleActionStartWorkflow(
            LAUNCHER,
            ScheduledBillingInput(
                options=options.model_copy(update={"billing": config.billing}),
                time_zone=config.months_time_zone or config.time_zone,
                action=config.action,
                billing_schedule_id=config.billing_schedule_id,
            ),
            id=f"{config.schedule_id}{LAUNCH_SUFFIX}",
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


class Unbilled(Record):
    """Months a new billing schedule would leave with no run: after the ledger's latest run,
    before the month its first firing bills (its billing mode changed, or billing stopped)."""

    first_firing: datetime
    first_period: Period
    latest_run: Period
    periods: list[Period]

    def describe(self, schedule_id: str, now: datetime) -> str:
        periods = ", ".join(map(str, self.periods))
        return (
            f"the ledger's latest run before {self.first_period} is of {self.latest_run}, and"
            f" {schedule_id} would first fire at {self.first_firing.isoformat()}, billing"
            f" {self.first_period}: {periods} would be billed by nothing. Bill them by hand"
            f" first ({run_by_hand(self.periods, now)}), or pass"
            " --leave-unbilled; nothing was created"
        )


def first_firing(config: MonthlySchedule, now: datetime) -> datetime:
    """When a monthly schedule created now first fires, in its zone."""
    zone = ZoneInfo(config.time_zone)
    month = Period(now.astimezone(zone).year, now.astimezone(zone).month)
    while True:
        fires = datetime(
            month.year, month.month, config.day_of_month, config.hour, config.minute, tzinfo=zone
        )
        if fires > now:
            return fires
        month = month.next()


async def unbilled_before(
    conn: asyncpg.Connection, config: MonthlySchedule, now: datetime
) -> Unbilled | None:
    """The months between the ledger's latest run and the first a new billing schedule bills,
    which it never bills; None if there are none, or the ledger has no run before."""
    at = first_firing(config, now)
    first = period_for(at, config.billing)
    latest = await ledger.latest_run_before(conn, str(first))
    if latest is None or parse_period(latest) >= first.previous():
        return None
    gap = period_range(parse_period(latest).next(), first.previous())
    return Unbilled(
        first_firing=at, first_period=first, latest_run=parse_period(latest), periods=gap
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
    billed_after = 1 if billing == "arrears" else 0
    zone = ZoneInfo(time_zone)
    # Unchecked months: the run that bills 2999-12 in arrears is in 3000.
    return (
        datetime(*first.later(billed_after), 1, tzinfo=zone),
        datetime(*last.later(billed_after + 1), 1, tzinfo=zone) - timedelta(seconds=1),
    )


class Backfill(Record):
    """What a backfill launched, and the periods in its range a launch leaves as they are."""

    launches: list[datetime]
    finished: dict[str, Finished] = Field(
        description="periods whose run completed or was cancelled: billed again by hand"
    )


async def backfill(
    client: Client,
    conn: asyncpg.Connection,
    schedule_id: str,
    first: Period,
    last: Period,
    *,
    late: bool = False,
    while_paused: bool = False,
) -> Backfill:
    """Run the schedule for each period from `first` to `last`, all now. Refused if one is
    still ahead, or none falls in the window, or (unless `late`) one is long past, as
    `run` refuses it, or every period in it has a completed run: the launches would start
    nothing; and, unless `while_paused`, while the schedule is paused. A reconciliation's
    schedule is refused: it bills nothing."""
    description, request = await launcher_of(client, schedule_id)
    if request.action != "bill":
        # Each of its daily firings reconciles the latest period billed: a backfill would
        # start one launch a day of the window, all reconciling the same period.
        raise InvalidInputError(
            f"the schedule {schedule_id} reconciles, and bills nothing to backfill: reconcile"
            f" a period by hand with `python starter.py reconcile {first}`. Nothing was"
            " backfilled"
        )
    _check_not_paused(description, "backfill", while_paused=while_paused)
    # Later periods are refused below, by their launch times.
    check_run_by_hand(first, datetime.now(UTC), ahead=True, late=late)
    periods = [str(p) for p in period_range(first, last)]
    finished = await finished_runs(conn, periods)
    if list(finished) == periods:
        raise InvalidInputError(
            f"a launch leaves every period from {first} to {last} as it is:"
            f" {describe_finished(finished)}. Nothing was backfilled."
            f" {_again_by_hand(finished)}"
        )
    start, end = backfill_window(first, last, request.options.billing, request.time_zone)
    launches = await matching_times(client, schedule_id, start, end)
    if not launches:
        raise InvalidInputError(
            f"the schedule {schedule_id} fires at no time that bills {first} to {last}"
        )
    ahead = [t for t in launches if t > datetime.now(UTC)]
    if ahead:
        # A backfill starts every launch at once, now: a later one would bill before its time.
        raise InvalidInputError(
            f"{_not_yet(ahead[0], request)}: backfill only periods whose launch is past"
        )
    # Each period is its own workflow: backfilled months run side by side.
    await client.get_schedule_handle(schedule_id).backfill(
        ScheduleBackfill(start_at=start, end_at=end, overlap=ScheduleOverlapPolicy.ALLOW_ALL)
    )
    return Backfill(launches=launches, finished=finished)


async def trigger(
    client: Client,
    conn: asyncpg.Connection,
    schedule_id: str,
    *,
    early: bool = False,
    while_paused: bool = False,
) -> Period | None:
    """Fire the schedule now; returns the period it bills (None for a reconciliation).
    Never dropped by its overlap policy, as a firing is while an earlier launch is still open:
    a launch starts (or joins) its period's one workflow, so two at once bill each customer
    once. Refused when that period's run has completed: the launch would start nothing;
    unless `early`, when the schedule's first firing for that period is still ahead; and
    unless `while_paused`, while the schedule is paused."""
    description, request = await launcher_of(client, schedule_id)
    _check_not_paused(description, "trigger", while_paused=while_paused)
    period = None
    if request.action == "bill":
        now = datetime.now(UTC)
        period = _billed_at(now, request)
        if not early and _billed_at(now + _CLOCKS_APART, request) != _billed_at(
            now - _CLOCKS_APART, request
        ):
            # Temporal bills the month of its own clock's trigger time, not of this one's.
            raise InvalidInputError(
                f"the month turns within {_CLOCKS_APART.seconds // 60} minutes in"
                f" {request.time_zone}, so a trigger now may bill {period} or the month next"
                " to it: trigger it once the month has turned, or pass --early. Nothing was"
                " triggered"
            )
        finished = await finished_runs(conn, [str(period)])
        if finished:
            raise InvalidInputError(
                f"the schedule {schedule_id} bills {period} now, and"
                f" {describe_finished(finished)}: a launch would start nothing, so none was"
                f" triggered. {_again_by_hand(finished)}"
            )
        start, end = backfill_window(period, period, request.options.billing, request.time_zone)
        fires = await matching_times(client, schedule_id, start, end)
        # No firing bills that month (a spec edited with Temporal's tools): no time to be
        # early for, so the trigger stands for the firing the month lacks.
        if fires and fires[0] > now and not early:
            # A trigger bills the month of now, not of the firing an operator means to make up.
            raise InvalidInputError(
                f"{_not_yet(fires[0], request)}: a trigger now would bill it early, its"
                " customers as they are today. To make up a firing the schedule missed,"
                f" `schedule describe --id {schedule_id}` names it and `schedule backfill`"
                f" bills its month; to bill {period} now all the same, pass --early. Nothing"
                " was triggered"
            )
    await client.get_schedule_handle(schedule_id).trigger(overlap=ScheduleOverlapPolicy.ALLOW_ALL)
    return period


# How far this host's clock and Temporal's may be apart, and a trigger take to reach it.
_CLOCKS_APART = timedelta(minutes=10)


def _check_not_paused(description: ScheduleDescription, launch: str, *, while_paused: bool) -> None:
    """Refuse a trigger or backfill of a paused schedule unless told: Temporal runs either
    whatever the pause, and the operator who paused it gave a reason (its note)."""
    state = description.schedule.state
    if state.paused and not while_paused:
        note = f" ({shown_note(state.note)})" if state.note else ""
        raise InvalidInputError(
            f"the schedule {description.id} is paused{note}, and Temporal runs a {launch}"
            f" whatever the pause: unpause it first, or pass --while-paused to {launch} it all"
            " the same. Nothing was started"
        )


def _not_yet(launch: datetime, request: ScheduledBillingInput) -> str:
    at = launch.astimezone(ZoneInfo(request.time_zone)).isoformat()
    return f"the schedule bills {_billed_at(launch, request)} on {at}, not yet"


# A note set with Temporal's own tools skips `_note`'s redaction, and may be of any length.
_NOTE_SHOWN = 200


def shown_note(note: str) -> str:
    """A schedule's note as it may be shown."""
    return shown_cut(note, _NOTE_SHOWN)


def _again_by_hand(finished: dict[str, Finished]) -> str:
    # A cancelled run still finishing its charges refuses a run until it has ended.
    once = ", once its run has ended" if "cancelling" in finished.values() else ""
    return (
        "To bill the customers added since, for a month before they joined too, run it again"
        f" by hand{once}: " + run_by_hand([parse_period(p) for p in finished], datetime.now(UTC))
    )


# A gap of years would list a command per month: the ends and the count say as much.
_COMMANDS_LISTED = 6


def run_by_hand(periods: list[Period], now: datetime) -> str:
    """The `run` commands that bill these months, `--late` where `run` asks for it (a run
    bills the customers as they are now, those who joined since too)."""
    commands = [run_command(p, now) for p in periods]
    if len(commands) > _COMMANDS_LISTED:
        commands = [*commands[:3], f"... ({len(commands)} months in all)", *commands[-2:]]
    return "; ".join(commands)


async def our_schedule(client: Client, schedule_id: str) -> ScheduleDescription:
    """The schedule, refused if it does not exist or starts something other than our
    launcher. Its arguments are left encoded: a pause must work whatever they hold."""
    try:
        description = await client.get_schedule_handle(schedule_id).describe()
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:
            raise
        raise UnknownScheduleError(
            f"no schedule {shown(schedule_id)}: `starter.py schedule create` makes one"
        ) from None
    action = description.schedule.action
    if not isinstance(action, ScheduleActionStartWorkflow) or action.workflow != LAUNCHER:
        started = getattr(action, "workflow", type(action).__name__)
        raise ForeignScheduleError(
            f"the schedule {shown(schedule_id)} starts {shown(started)}, not this project's"
            f" {LAUNCHER}: manage it with Temporal's own tools"
        )
    return description


async def launch_input(client: Client, description: ScheduleDescription) -> ScheduledBillingInput:
    """What one of our schedules gives its launches (our_schedule)."""
    action = description.schedule.action
    assert isinstance(action, ScheduleActionStartWorkflow)
    try:
        # A described schedule carries its action's arguments still encoded.
        [request] = await client.data_converter.decode(list(action.args), [ScheduledBillingInput])
    except RefusedWorkflowInputError:
        raise InvalidInputError(
            f"the schedule {shown(description.id)} holds arguments this release cannot read"
            " (written by another release?): pause, unpause and delete still work; upgrade"
            " starter.py to match the workers"
        ) from None
    assert isinstance(request, ScheduledBillingInput)
    return request


async def launcher_of(
    client: Client, schedule_id: str
) -> tuple[ScheduleDescription, ScheduledBillingInput]:
    """One of our schedules and what its launches are given."""
    description = await our_schedule(client, schedule_id)
    return description, await launch_input(client, description)


async def followers(client: Client, schedule_id: str) -> list[str]:
    """The daily reconciliations that follow the billing schedule `schedule_id`, by id: with
    it gone, each firing of theirs checks no month it left unbilled, and alerts."""
    found = []
    async for listed in await client.list_schedules():
        action = None if listed.schedule is None else listed.schedule.action
        if isinstance(action, ScheduleListActionStartWorkflow) and action.workflow != LAUNCHER:
            continue
        try:
            _, request = await launcher_of(client, listed.id)
        except (UnknownScheduleError, InvalidInputError):
            continue  # deleted meanwhile, or written by a release this one cannot read
        if request.action == "reconcile" and request.billing_schedule_id == schedule_id:
            found.append(listed.id)
    return sorted(found)


def describe_followers(schedule_id: str, found: list[str]) -> str:
    """What becomes of the daily reconciliations following a billing schedule that is gone."""
    them = ", ".join(found)
    return (
        f"{them} {'follows' if len(found) == 1 else 'follow'} the billing schedule"
        f" {schedule_id}, which is gone or does not bill: until one of that id bills, each firing"
        " checks no month it fired for and alerts (`followed_schedule_gone`). Create the"
        " billing schedule again, or, where periods are now billed by hand, delete the"
        " reconciliation and create it with --billed-by-hand"
    )


# A firing's launch starts its period's run within seconds; an hour covers a worker restart.
FIRING_GRACE = timedelta(hours=1)
# Far enough back to hold a monthly schedule's two latest firings: a month missed stays
# flagged through the next month's firing.
_LOOKED_BACK = timedelta(days=62)


class UnbilledFiring(Record):
    """Months a billing schedule fired for, FIRING_GRACE or more ago, that have no run: the
    latest such firing, and the months of any earlier ones."""

    schedule_id: str
    at: datetime
    period: Period
    paused: bool = Field(description="whether the schedule is paused now")
    earlier: list[Period] = Field(
        default=[], description="earlier months fired for that have no run, oldest first"
    )
    ended_unfinished: list[Period] = Field(
        default=[],
        description="those of the months whose run ended (terminated, failed) before its close",
    )

    def describe(self) -> str:
        months = [*self.earlier, self.period]
        why = (
            "the schedule is paused"
            if self.paused
            else "a launch that ended early starts nothing, Temporal skips for good a"
            " firing it could not make within the schedule's catch-up window, and a run held"
            " at its start (the vault or the database away) has not reached the ledger yet"
        )
        if self.ended_unfinished:
            why += (
                f"; the run of {', '.join(map(str, self.ended_unfinished))} ended (terminated,"
                " failed) before it finished, leaving the customers it had not claimed (one"
                " paused then starts again running)"
            )
        it = "it" if len(months) == 1 else "them"
        return (
            f"no run bills {', '.join(map(str, months))}, though the billing schedule"
            f" {self.schedule_id} fired for {it}, last at {self.at.isoformat()} ({why})."
            f" Bill {it} with: python starter.py schedule backfill --id {self.schedule_id}"
            f" --start {months[0]} --end {self.period}{while_paused(self.paused)}"
        )


def while_paused(paused: bool) -> str:
    """What a backfill command given for a paused schedule needs, as `backfill` refuses one."""
    return " (it is paused: unpause it first, or add --while-paused)" if paused else ""


class BillingFirings(Record):
    """What a daily reconciliation learns from the billing schedule it follows: the month a
    firing bills, and the months its recent firings left unbilled."""

    billing: Billing
    time_zone: str
    unbilled: UnbilledFiring | None


async def billing_firings(
    client: Client, conn: asyncpg.Connection, schedule_id: str, now: datetime
) -> BillingFirings:
    """The billing schedule's settings, and its firings since its creation (two months at
    most), up to FIRING_GRACE before `now`, that left their month with no run (paused, missed
    in an outage, a launch terminated): Temporal makes none of those up, and nothing else
    says so."""
    description, request = await launcher_of(client, schedule_id)
    if request.action != "bill":
        raise ForeignScheduleError(
            f"the schedule {shown(schedule_id)} reconciles: it bills nothing to follow"
        )
    since = max(now - _LOOKED_BACK, description.info.created_at)
    until = now - FIRING_GRACE
    fired = await matching_times(client, schedule_id, since, until) if since < until else []
    # Each month by its latest firing: a later firing for the same month may have billed it.
    latest = {_billed_at(at, request): at for at in fired}
    run = await ledger.periods_run(conn, [str(p) for p in latest])
    unfinished = await ended_unfinished(client, conn, list(latest))
    missing = sorted(p for p in latest if str(p) not in run or p in unfinished)
    unbilled = None
    if missing:
        unbilled = UnbilledFiring(
            schedule_id=schedule_id,
            at=latest[missing[-1]],
            period=missing[-1],
            paused=description.schedule.state.paused,
            earlier=missing[:-1],
            ended_unfinished=unfinished,
        )
    return BillingFirings(
        billing=request.options.billing, time_zone=request.time_zone, unbilled=unbilled
    )


async def launched_unfinished(
    client: Client, conn: asyncpg.Connection, schedule_id: str
) -> list[Period]:
    """The months the billing schedule's listed launches bill whose run ended before its
    close (ended_unfinished): each launch started it, so missed_launches names none."""
    description, request = await launcher_of(client, schedule_id)
    if request.action != "bill":
        return []
    actions = description.info.recent_actions
    return await ended_unfinished(
        client, conn, list({_billed_at(a.scheduled_at, request) for a in actions})
    )


class Missed(Record):
    """A launch the schedule did not make (Temporal skips those due while it is paused)."""

    at: datetime
    period: Period | None = Field(description="the period it would have billed")
    # Temporal holds firings for a launch still open, and this may be one of them (it starts
    # once that launch ends): _held_or_maybe.
    maybe_waiting: bool = False


# How many of its latest actions Temporal keeps in a schedule's description.
_RECENT_ACTIONS_KEPT = 10


async def missed_launches(client: Client, schedule_id: str) -> list[Missed]:
    """The schedule's times that launched nothing, since its creation (or the oldest action
    Temporal still lists): a paused schedule skips its times for good, even once unpaused
    within the catch-up window, and a launch that ended before starting its period's run
    (terminated, failed) leaves its time unbilled too. Only a billing schedule's name a
    period."""
    description, request = await launcher_of(client, schedule_id)
    info = description.info
    launched = {a.scheduled_at for a in info.recent_actions if await _launched(client, a, request)}
    # A listed launch that ended early is missed whenever its time: the window below may
    # start after it (it is the oldest listed) or it may be a backfill's, long before.
    listed = {a.scheduled_at for a in info.recent_actions}
    since = info.created_at
    if len(info.recent_actions) >= _RECENT_ACTIONS_KEPT:
        # Older actions are dropped from the list: only times since the oldest listed was
        # taken are known. By when it was taken, not its time: a backfilled action's time
        # is long before, and firings since then may have been dropped.
        since = max(since, min(a.started_at for a in info.recent_actions))
    now = datetime.now(UTC)
    window = await matching_times(client, schedule_id, since, now) if since < now else []
    due = sorted(listed.union(window) - launched)
    held, maybe = _held_or_maybe(description, due)
    bills = request.action == "bill"
    return [
        Missed(at=t, period=_billed_at(t, request) if bills else None, maybe_waiting=t in maybe)
        for t in due
        if t not in held
    ]


def _held_or_maybe(
    description: ScheduleDescription, due: list[datetime]
) -> tuple[set[datetime], set[datetime]]:
    """Of `due` (times that launched nothing), those Temporal holds in the schedule's buffer
    to start once the launch still open ends, and those that may be. Temporal gives only
    their count; every one is due after the open launch's time, as are firings it dropped
    (skipped while paused, past the catch-up window): held only when the count is exactly
    that of the times after it, else each of those may be."""
    held = waiting_firings(description)
    if not held:
        return set(), set()
    info = description.info
    running = {getattr(a, "workflow_id", None) for a in info.running_actions}
    opened = [
        a.scheduled_at
        for a in info.recent_actions
        if getattr(a.action, "workflow_id", None) in running
    ]
    after = {t for t in due if not opened or t > min(opened)}
    return (after, set()) if len(after) == held else (set(), after)


def waiting_firings(description: ScheduleDescription) -> int:
    """How many firings Temporal holds for the launch still open to end."""
    return description.raw_description.info.buffer_size


# A child start refused is one already running: the launch joins it (_run_or_join).
_STARTED_OR_JOINED = frozenset(
    {
        EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED,
        EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_FAILED,
    }
)


async def _launched(
    client: Client, action: ScheduleActionResult, request: ScheduledBillingInput
) -> bool:
    """Whether a launch the schedule made started its run, or left its period with one
    started by hand; one Temporal no longer holds is taken as launched."""
    execution = action.action
    if not isinstance(execution, ScheduleActionExecutionStartWorkflow):
        return True
    first = execution.first_execution_run_id
    if await _run_launched(client.get_workflow_handle(execution.workflow_id, run_id=first)):
        return True
    # An operator may have reset it: the latest run of its ID is then another.
    latest = client.get_workflow_handle(execution.workflow_id)
    if (await latest.describe()).run_id != first and await _run_launched(latest):
        return True
    if request.action != "bill":
        return False
    period = _billed_at(action.scheduled_at, request)
    return await workflow_status(client.get_workflow_handle(period_workflow_id(period))) is not None


async def _run_launched(launcher: WorkflowHandle[Any, Any]) -> bool:
    """Whether this run of a launcher is open, or ended after starting its period's run or
    finding it running: a reconciliation's ID is reused daily, so only the launcher's own
    history tells."""
    # A launcher ends early (uncompleted) by an operator's terminate, a firing whose zone
    # the worker cannot read, `--overlap terminate_other` at the next firing.
    if await workflow_status(launcher) not in ENDED_UNCOMPLETED:
        return True
    async for event in launcher.fetch_history_events():
        if event.event_type in _STARTED_OR_JOINED:
            return True
    return False


def _billed_at(moment: datetime, request: ScheduledBillingInput) -> Period:
    """The period a launch at `moment` bills, by the schedule's own zone and mode."""
    return period_for(moment.astimezone(ZoneInfo(request.time_zone)), request.options.billing)


async def matching_times(
    client: Client, schedule_id: str, start: datetime, end: datetime
) -> list[datetime]:
    """When the schedule fires (its nominal times) from `start` to `end`, both included, as
    Temporal says."""
    found = await client.workflow_service.list_schedule_matching_times(
        ListScheduleMatchingTimesRequest(
            namespace=client.namespace,
            schedule_id=schedule_id,
            # Temporal leaves out a time equal to the start; a backfill includes it.
            start_time=_timestamp(start - timedelta(seconds=1)),
            end_time=_timestamp(end),
        )
    )
    times = (t.ToDatetime(tzinfo=UTC) for t in found.start_time)
    return [t for t in times if start <= t <= end]


def _timestamp(moment: datetime) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(moment.astimezone(UTC))
    return stamp


def describe(description: ScheduleDescription, request: ScheduledBillingInput) -> str:
    """The schedule as an operator reads it: what it does, when, paused or not, next and
    recent runs."""
    schedule = description.schedule
    spec = schedule.spec
    # Times in the zone it fires in, as "fires" reads, with their offset.
    zone = ZoneInfo(spec.time_zone_name or "UTC")
    lines = [
        f"schedule {description.id}",
        f"  {_does(request)}",
        f"  {'PAUSED' if schedule.state.paused else 'active'}"
        + (f" ({shown_note(schedule.state.note)})" if schedule.state.note else ""),
        "  fires: "
        # Intervals too: a schedule edited with Temporal's own tools may have them.
        + "; ".join(
            [c.comment or str(c) for c in spec.calendars]
            + [f"every {interval.every}" for interval in spec.intervals]
        )
        + f" ({spec.time_zone_name or 'UTC'})",
        f"  overlap {schedule.policy.overlap.name.lower()},"
        f" catch-up window {_hours(schedule.policy.catchup_window)}",
        "  next: "
        + ", ".join(t.astimezone(zone).isoformat() for t in description.info.next_action_times[:3]),
    ]
    # Two backfills of a month launch it twice, under one workflow id: one line each.
    launches = Counter(
        (action.scheduled_at, getattr(action.action, "workflow_id", ""))
        for action in description.info.recent_actions[-5:]
    )
    for (at, workflow_id), times in launches.items():
        bills = f" (bills {_billed_at(at, request)})" if request.action == "bill" else ""
        twice = f", launched {times} times" if times > 1 else ""
        lines.append(f"  ran {at.astimezone(zone).isoformat()}{bills}: {workflow_id}{twice}")
    waiting = waiting_firings(description)
    if waiting:
        lines.append(f"  waiting: {waiting} firings, held by Temporal until the open launch ends")
    return "\n".join(lines)


def _hours(window: timedelta | None) -> str:
    """A window as `--catchup-hours` gives it."""
    return "Temporal's default" if window is None else f"{window.total_seconds() / 3600:g} hours"


def _does(request: ScheduledBillingInput) -> str:
    """What each launch does, as `schedule create` was told."""
    billing = request.options.billing
    month = "the month before each firing" if billing == "arrears" else "each firing's month"
    zone = request.time_zone
    if request.action == "bill":
        return f"bills {month} ({billing}, months in {zone})"
    if request.billing_schedule_id is None:
        return (
            f"reconciles the latest period billed ({billing}, months in {zone});"
            " follows no billing schedule"
        )
    return (
        "reconciles the latest period billed, following the billing schedule"
        f" {request.billing_schedule_id} (its mode and zone at each firing; {billing} in"
        f" {zone} if it cannot be read), and flags every month it fired for in the last two"
        " months that has no run"
    )

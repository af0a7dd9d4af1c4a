"""Operator's command line: run, watch and steer billing periods, schedules and customers.

python starter.py run 2026-12 --wait
python starter.py status 2026-12 --json
python starter.py watch 2026-12
python starter.py pause 2026-12 --reason "amounts look wrong"
python starter.py skip 2026-12 cust-42 --reason "disputed"
python starter.py preview 2026-12
python starter.py reconcile 2026-12
python starter.py handled 2026-12 duplicate ch_3Nx --reason "customer agreed"
python starter.py schedule create --day 1 --hour 2 --time-zone Europe/Berlin
python starter.py customers import customers.csv
python starter.py demo --customers 1000 --keep-running
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import math
import os
import re
import select
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar, get_args

import asyncpg
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from temporalio.client import (
    Client,
    ScheduleAlreadyRunningError,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
)
from temporalio.service import RPCError

from billing import customer_history, ledger, logs, operations, schedules, search_attributes
from billing.config import (
    BillingSettings,
    CapSettings,
    DatabaseRolesSettings,
    DatabaseSettings,
    OperatorSettings,
    TemporalSettings,
    load_settings,
)
from billing.customers import (
    Billable,
    deactivate_customers,
    import_customers,
    read_customers_csv,
    sharing_a_stripe_customer,
)
from billing.db import CONNECTION_ERRORS, create_pool
from billing.errors import (
    BillingError,
    ForeignScheduleError,
    InvalidInputError,
    InvalidPeriodError,
    NoWorkerError,
    RunEndedError,
    ServiceUnavailableError,
    UnknownScheduleError,
    shown,
)
from billing.failures import period_failures
from billing.keys import validate_customer_id
from billing.migrations import migrate
from billing.models import (
    EndedRun,
    OpenRun,
    OperatorRequest,
    PeriodProgress,
    PeriodSummary,
    SkipRequest,
)
from billing.periods import (
    LATE_MONTHS,
    Period,
    check_run_by_hand,
    is_late,
    parse_period,
    period_range,
)
from billing.preview import preview_period
from billing.reconciliation import (
    CHARGE_ID_PATTERN,
    FindingKind,
    HandledMarks,
    HandledRequest,
    ReconcileReport,
)
from billing.redact import redact, shown_line
from billing.reporting import (
    describe,
    describe_customer,
    describe_failures,
    describe_handled,
    describe_handled_marks,
    describe_preview,
    describe_reconciliation,
    describe_renewal,
    failure_chain,
    listed,
    next_step,
    ui_link,
)
from billing.runs import (
    TEMPORAL_AWAY,
    awaits_a_worker,
    ended_as,
    period_status,
    result_across_outages,
    run_ended,
    start_period,
    start_reconcile,
    status_from_ledger,
)
from billing.seeding import MAX_DEMO_CUSTOMERS, seed_demo
from billing.temporal_client import connect

T = TypeVar("T")


def _argument(check: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from one of billing's checks: its refusal is argparse's error."""

    def checked(text: str) -> T:
        try:
            return check(text)
        except BillingError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return checked


_period = _argument(parse_period)
_schedule_id = _argument(schedules.validate_schedule_id)


def _reason(text: str) -> str:
    """An argparse type: why an operator acts, kept with the run; blank says nothing."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected words saying why, got a blank reason")
    return text


def _charge_id(text: str) -> str:
    if re.fullmatch(CHARGE_ID_PATTERN, text) is None:
        raise argparse.ArgumentTypeError(
            f"expected a Stripe charge id as a report names it (ch_... or py_...), got"
            f" {shown(text)}"
        )
    return text


def _positive(text: str) -> int:
    # isascii: "²" and other Unicode digits pass isdigit() but not int().
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def _positive_up_to(high: int, things: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        count = _positive(text)
        if count > high:
            raise argparse.ArgumentTypeError(f"at most {high:,} {things}, got {count:,}")
        return count

    return parse


_demo_count = _positive_up_to(MAX_DEMO_CUSTOMERS, "demo customers")


def _number(high: float, *, least: float | None = None) -> Callable[[str], float]:
    """An argparse type: a number above 0 (or at least `least`) and at most `high` (so no
    nan, inf or overflow)."""
    wanted = f"above 0 and at most {high:g}" if least is None else f"from {least:g} to {high:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        # nan fails every comparison.
        if not (0 < value <= high and (least is None or value >= least)):
            raise argparse.ArgumentTypeError(f"expected a number {wanted}, got {text!r}")
        return value

    return parse


# How often `run --wait` asks whether the run it waits for has paused.
PAUSE_CHECK_SECONDS = 30.0
# How long `reconcile` waits before it says that no worker has taken its workflow up.
NO_WORKER_SECONDS = 15.0
# While Temporal is away, how often a waiting command says it still is.
OUTAGE_REMINDER = timedelta(minutes=5)


def _emit(model: BaseModel, as_json: bool, text: str) -> None:
    print(model.model_dump_json() if as_json else text)


async def cmd_run(args: argparse.Namespace) -> int:
    check_run_by_hand(args.period, datetime.now(UTC), ahead=args.ahead, late=args.late)
    temporal = load_settings(TemporalSettings)
    client = await connect(temporal)
    handle = await start_period(client, args.period, temporal.task_queue)
    outage = _OutageNotice(f"the run of {args.period}")
    try:
        progress = await period_status(client, args.period)
    except (NoWorkerError, RPCError) as exc:
        # Started (or joined), but how it stands is unknown for now.
        if isinstance(exc, NoWorkerError):
            print(f"warning: {exc}", file=sys.stderr)
        elif exc.status not in TEMPORAL_AWAY:
            raise
        elif args.wait:
            outage(exc)
        else:
            raise ServiceUnavailableError(
                f"the run of {args.period} is open as {handle.id}, but Temporal could not be"
                f" reached to say how it stands ({exc.status.name}: {exc.message}): it goes on"
                f" there; `python starter.py status {args.period}` once Temporal is back"
            ) from None
        if args.wait:
            return await _wait_and_report(client, handle, args, temporal, outage=outage)
        _emit(
            OpenRun(period=str(args.period), workflow_id=handle.id),
            args.json,
            f"period {args.period} open as {handle.id}\n  {ui_link(temporal, handle.id)}",
        )
        return 0
    if progress.state in ("cancelling", "cancelled"):
        # Joined, not started (a new run is cancelled only by an operator, later): its
        # summary would read as this run's. It may have ended since it was joined.
        where = (
            "is still finishing the charges it had sent"
            if progress.state == "cancelling"
            else "ended as this command joined it"
        )
        raise BillingError(
            f"the run of {args.period} was cancelled by {progress.operator} and {where}:"
            " nothing new was started. Run it again once it has ended"
            f" (`python starter.py status {args.period}`)"
        )
    concern = _concern(progress)
    if concern is not None:
        # Joined a paused run: it charges nothing until resumed, and --wait waits for that.
        print(f"warning: {concern}", file=sys.stderr)
    if not args.wait:
        _emit(
            progress,
            args.json,
            f"period {args.period} {progress.state} as {handle.id}\n"
            f"  {ui_link(temporal, handle.id)}",
        )
        return 0
    return await _wait_and_report(client, handle, args, temporal, told=concern)


def _concern(progress: PeriodProgress) -> str | None:
    """What a person waiting for the run must hear: it is paused, or its cancel is held up."""
    step = next_step(progress)
    if progress.state == "paused":
        return (
            f"the run of {progress.period} is paused by {progress.operator} ({progress.reason}):"
            f" nothing is charged until it is resumed; {step}"
        )
    if step is not None:
        return f"the cancelled run of {progress.period} has not ended: {step}"
    return None


class _OutageNotice:
    """Tells that Temporal cannot be reached while a command waits on a run (again every
    OUTAGE_REMINDER while it lasts), and that it can again (`back()`, from any call that got
    through)."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._away_since: float | None = None
        self._told_at = 0.0

    def __call__(self, exc: RPCError) -> None:
        now = time.monotonic()
        if self._away_since is None:
            self._away_since = now
            print(
                f"warning: Temporal cannot be reached ({exc.status.name}: {exc.message}):"
                f" {self._what} goes on there, its workers reconnect; waiting for Temporal to"
                " come back",
                file=sys.stderr,
            )
        elif now - self._told_at >= OUTAGE_REMINDER.total_seconds():
            print(
                f"warning: Temporal still cannot be reached after"
                f" {(now - self._away_since) / 60:.0f} min ({exc.status.name}: {exc.message});"
                " waiting",
                file=sys.stderr,
            )
        else:
            return
        self._told_at = now

    def back(self) -> None:
        if self._away_since is not None:
            print("note: Temporal is reachable again; waiting as before", file=sys.stderr)
        self._away_since = None


async def _wait_and_report(
    client: Client,
    handle: WorkflowHandle[Any, PeriodSummary],
    args: argparse.Namespace,
    temporal: TemporalSettings,
    *,
    outage: _OutageNotice | None = None,
    told: str | None = None,
) -> int:
    """Wait for the run's summary, saying once each time it waits for a person (it may
    pause itself, e.g. at its key's cap) rather than wait without a word; `outage` may
    have told already that Temporal is away."""
    outage = outage or _OutageNotice(f"the run of {args.period}")
    result = asyncio.ensure_future(
        result_across_outages(client, handle, PeriodSummary, outage, outage.back)
    )
    while not (await asyncio.wait({result}, timeout=PAUSE_CHECK_SECONDS))[0]:
        try:
            concern = _concern(await period_status(client, args.period))
        except (NoWorkerError, RunEndedError, RPCError, WorkflowQueryFailedError):
            continue  # the result says how it ended; a worker or the server may come back
        outage.back()
        if concern is not None and concern != told:
            print(f"warning: {concern}", file=sys.stderr)
        told = concern
    try:
        summary = result.result()
    except WorkflowFailureError as exc:
        # Told as `status` tells it: how the run waited on ended, as JSON too with --json.
        raise run_ended(args.period, handle.id, ended_as(exc), exc) from None
    _emit(summary, args.json, describe(summary) + f"\n  {ui_link(temporal, handle.id)}")
    return 0


async def cmd_status(args: argparse.Namespace) -> int:
    client = await connect(load_settings(TemporalSettings))
    progress = await _period_status(client, args.period)
    _emit(progress, args.json, describe(progress))
    return 0


async def _period_status(client: Client, period: Period) -> PeriodProgress:
    """The period's status, from the ledger when Temporal holds no run of it."""
    progress = await period_status(client, period)
    if progress.state != "not_started":
        return progress
    # "not_started" is only true if the ledger, which remembers runs Temporal no longer
    # keeps, has none either: unreadable, it is an error, not a guess.
    async with _ledger() as conn:
        record = await ledger.period_record(conn, str(period))
    return status_from_ledger(period, record, progress)


def _operator(args: argparse.Namespace) -> str:
    # A --operator given empty is refused with the request, never replaced by a default.
    if args.operator is not None:
        given: str = args.operator
        return given
    named = load_settings(OperatorSettings).billing_operator
    if named is not None:
        return named
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name: a container's uid without a passwd entry
        raise InvalidInputError(
            "no operator name to record: pass --operator or set BILLING_OPERATOR"
        ) from None


async def cmd_control(args: argparse.Namespace) -> int:
    # Bad input is refused before anything is contacted.
    request = OperatorRequest(reason=args.reason, operator=_operator(args))
    client = await connect(load_settings(TemporalSettings))
    progress = await operations.control(client, args.period, args.command, request)
    _emit(progress, args.json, describe(progress))
    return 0


async def cmd_renew_keys(args: argparse.Namespace) -> int:
    request = OperatorRequest(reason=args.reason, operator=_operator(args))
    client = await connect(load_settings(TemporalSettings))
    renewal = await operations.renew_keys(client, args.period, request)
    _emit(renewal, args.json, describe_renewal(renewal))
    return 0


async def cmd_skip(args: argparse.Namespace) -> int:
    request = SkipRequest(customer_id=args.customer, reason=args.reason, operator=_operator(args))
    client = await connect(load_settings(TemporalSettings))
    result = await operations.skip(
        client,
        load_settings(BillingSettings),
        load_settings(DatabaseSettings).database_url,
        args.period,
        request,
        ahead=args.ahead,
        late=args.late,
    )
    said = f"{result.customer_id} in {args.period}: {result.detail}"
    if result.skipped or args.json:
        _emit(result, args.json, said)
    else:
        # Refused (its charge was sent, or it ended otherwise), said as other refusals are.
        print(f"error: {said}", file=sys.stderr)
    # 1 is reconciliation's findings.
    return 0 if result.skipped else 2


async def cmd_watch(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    client = await connect(load_settings(TemporalSettings))
    progress: PeriodProgress = await _period_status(client, args.period)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[counts]}"),
    ) as bar:
        task = bar.add_task(str(args.period), total=None, counts="")
        waiting = ""
        outage = _OutageNotice(f"the run of {args.period}")
        while True:
            done = progress.due - progress.in_flight
            bar.update(
                task,
                description=f"{args.period} {progress.state}",
                total=progress.expected_due or progress.due or None,
                completed=done,
                counts=f"charged {progress.charged}, failed {progress.failed},"
                f" in flight {progress.in_flight}{waiting}",
            )
            if progress.state not in ("running", "paused", "closing", "cancelling"):
                break
            await asyncio.sleep(args.interval)
            # A worker restarting (a deploy), or Temporal away: the run goes on, and so does
            # the watch, showing the last counts it had.
            try:
                progress = await period_status(client, args.period)
                waiting = ""
            except NoWorkerError:
                waiting = " (no worker answered: waiting for one)"
            except RPCError as exc:
                if exc.status not in TEMPORAL_AWAY:
                    raise
                outage(exc)
                continue
            outage.back()
    print(describe(progress))
    return 0


async def cmd_preview(args: argparse.Namespace) -> int:
    pool = await create_pool(load_settings(DatabaseSettings).database_url, max_size=1)
    try:
        preview = await preview_period(
            pool, str(args.period), load_settings(CapSettings).billing_cap_multiplier
        )
    finally:
        await pool.close()
    _emit(preview, args.json, describe_preview(preview))
    try:
        check_run_by_hand(args.period, datetime.now(UTC))
    except InvalidPeriodError as exc:
        # A preview charges nothing, but the run it previews would be refused as asked.
        print(f"note: `run {args.period}` would be refused: {exc}", file=sys.stderr)
    return 0


async def cmd_reconcile(args: argparse.Namespace) -> int:
    temporal = load_settings(TemporalSettings)
    client = await connect(temporal)
    handle = await start_reconcile(client, args.period, temporal.task_queue)
    outage = _OutageNotice(f"the reconciliation of {args.period}")
    result = asyncio.ensure_future(
        result_across_outages(client, handle, ReconcileReport, outage, outage.back)
    )
    waited = (await asyncio.wait({result}, timeout=NO_WORKER_SECONDS))[0]
    try:
        stalled = not waited and await awaits_a_worker(handle, timedelta(seconds=NO_WORKER_SECONDS))
    except RPCError as exc:
        if exc.status not in TEMPORAL_AWAY:
            raise
        outage(exc)
        stalled = False
    if stalled:
        print(
            f"warning: reconciliation of {args.period} is open as {handle.id}, but its"
            f" workflow task has waited {NO_WORKER_SECONDS:.0f} s for a worker to take it (or"
            f" keeps failing: see it in the Web UI): is a worker polling task queue"
            f" {temporal.task_queue}? Waiting; it runs once one does",
            file=sys.stderr,
        )
    report = await result
    _emit(
        report, args.json, describe_reconciliation(report) + f"\n  {ui_link(temporal, handle.id)}"
    )
    return 1 if report.needs_a_person else 0


async def cmd_handled(args: argparse.Namespace) -> int:
    if args.kind is None:
        return await _list_handled(args)
    if args.charge_id is None or args.reason is None:
        raise InvalidInputError(
            "to mark a finding handled (or take a mark back with --undo), give its kind, its"
            " charge id and --reason; give only the period to list the marks made under it"
        )
    request = HandledRequest(
        period=str(args.period),
        kind=args.kind,
        charge_id=args.charge_id,
        reason=args.reason,
        operator=_operator(args),
        undo=args.undo,
    )
    async with _ledger() as conn:
        result = await ledger.mark_handled(conn, request)
    _emit(result, args.json, describe_handled(result))
    return 2 if result.change == "none" else 0


async def _list_handled(args: argparse.Namespace) -> int:
    if args.reason is not None or args.undo:
        raise InvalidInputError(
            "--reason and --undo go with a finding's kind and charge id: without them,"
            " handled only lists the marks made under the period"
        )
    period = str(args.period)
    async with _ledger() as conn:
        listed = HandledMarks(period=period, marks=await ledger.handled_marks(conn, period))
    _emit(listed, args.json, describe_handled_marks(listed))
    return 0


@contextlib.asynccontextmanager
async def _ledger() -> AsyncIterator[asyncpg.Connection]:
    """One connection to the ledger, for a command that reads or changes a row or two."""
    pool = await create_pool(load_settings(DatabaseSettings).database_url, max_size=1)
    try:
        async with pool.acquire() as conn:
            yield conn
    finally:
        await pool.close()


async def cmd_setup(_: argparse.Namespace) -> int:
    client = await connect(load_settings(TemporalSettings))
    added = await search_attributes.register(client)
    print(f"registered {', '.join(added)}" if added else "search attributes already registered")
    return 0


async def cmd_schedule(args: argparse.Namespace) -> int:
    temporal = load_settings(TemporalSettings)
    # Bad input is refused before anything is contacted.
    reconcile = args.schedule_command == "create" and args.reconcile
    if args.schedule_command == "create":
        _check_create_flags(args)
    defaults = schedules.MonthlySchedule()
    if args.id is None:
        args.id = schedules.RECONCILE_SCHEDULE_ID if reconcile else schedules.DEFAULT_SCHEDULE_ID
    config = (
        schedules.MonthlySchedule(
            schedule_id=args.id,
            day_of_month=defaults.day_of_month if args.day is None else args.day,
            hour=args.hour,
            minute=args.minute,
            time_zone=defaults.time_zone if args.time_zone is None else args.time_zone,
            billing=args.billing or defaults.billing,
            overlap=args.overlap,
            catchup_window=timedelta(hours=args.catchup_hours),
            paused=args.paused,
            action="reconcile" if reconcile else "bill",
        )
        if args.schedule_command == "create"
        else None
    )
    if args.schedule_command == "backfill":
        period_range(args.start, args.end)  # raises if the range ends before it starts
    client = await connect(temporal)
    handle = client.get_schedule_handle(args.id)
    if config is not None:
        await _create_schedule(client, temporal.task_queue, config, args)
        return 0
    # Every other command acts on one of ours: an unknown or foreign id is refused first.
    ours = await schedules.our_schedule(client, args.id)
    if args.schedule_command == "describe":
        print(schedules.describe(ours, await schedules.launch_input(client, ours)))
        missed = await schedules.missed_launches(client, args.id)
        await _warn_missed(args.id, missed, paused=ours.schedule.state.paused)
    elif args.schedule_command in ("pause", "unpause") and ours.schedule.state.paused == (
        args.schedule_command == "pause"
    ):
        # Its note says who paused it and why: kept, not overwritten.
        state = ours.schedule.state
        note = f" ({schedules.shown_note(state.note)})" if state.note else ""
        print(f"schedule {args.id} is {'paused' if state.paused else 'active'}{note}: unchanged")
    elif args.schedule_command == "pause":
        await handle.pause(note=_note(args))
        print(f"paused schedule {args.id}")
    elif args.schedule_command == "unpause":
        await handle.unpause(note=_note(args))
        print(f"unpaused schedule {args.id}")
        await _warn_missed(args.id, await schedules.missed_launches(client, args.id), paused=False)
    elif args.schedule_command == "trigger":
        async with _ledger() as conn:
            period = await schedules.trigger(
                client, conn, args.id, early=args.early, while_paused=args.while_paused
            )
        print(f"triggered schedule {args.id}" + (f": it bills {period}" if period else ""))
    elif args.schedule_command == "backfill":
        async with _ledger() as conn:
            done = await schedules.backfill(
                client,
                conn,
                args.id,
                args.start,
                args.end,
                late=args.late,
                while_paused=args.while_paused,
            )
        print(
            f"backfilling {len(done.launches)} launches, {args.start} to {args.end}: "
            + ", ".join(t.isoformat() for t in done.launches)
        )
        if done.completed:
            print(
                f"  left as they are, their runs completed: {', '.join(done.completed)}"
                " (bill one again by hand: python starter.py run PERIOD)"
            )
    elif args.schedule_command == "delete":
        await handle.delete()
        print(f"deleted schedule {args.id}")
    return 0


def _check_create_flags(args: argparse.Namespace) -> None:
    """Refuse a flag the kind of schedule asked for would ignore."""
    if args.reconcile:
        ignored = [
            flag
            for flag, given in (
                ("--day", args.day is not None),
                ("--leave-unbilled", args.leave_unbilled),
            )
            if given
        ]
        if ignored:
            verb = "goes" if len(ignored) == 1 else "go"
            raise InvalidInputError(
                f"{' and '.join(ignored)} {verb} with a billing schedule, not --reconcile (a"
                " reconciliation fires every day, and bills nothing)"
            )
    elif args.billing_schedule is not None:
        raise InvalidInputError(
            "--billing-schedule names the schedule a reconciliation follows: it goes with"
            " --reconcile"
        )


async def _create_schedule(
    client: Client, task_queue: str, config: schedules.MonthlySchedule, args: argparse.Namespace
) -> None:
    if config.action == "reconcile":
        config = await _following(client, config, args)
    elif not args.leave_unbilled:
        async with _ledger() as conn:
            unbilled = await schedules.unbilled_before(conn, config, datetime.now(UTC))
        if unbilled is not None:
            raise InvalidInputError(unbilled.describe(config.schedule_id, datetime.now(UTC)))
    try:
        await schedules.create_schedule(client, config, task_queue)
    except ScheduleAlreadyRunningError:
        raise InvalidInputError(
            f"a schedule {args.id!r} exists already: `schedule describe --id {args.id}`"
            " shows it; delete it first to create it anew, or pass another --id"
        ) from None
    daily = config.action == "reconcile"
    when = "every day" if daily else f"day {config.day_of_month}"
    what = "reconciling the period billed" if daily else "billing"
    followed = ""
    if config.billing_schedule_id is not None:
        months = config.months_time_zone
        elsewhere = f", its months in {months}" if months not in (None, config.time_zone) else ""
        followed = f" (following {config.billing_schedule_id}{elsewhere})"
    print(
        f"created schedule {config.schedule_id}: {when} at {config.hour:02d}:{config.minute:02d}"
        f" {config.time_zone}, {what} in {config.billing}{followed}"
    )


async def _following(
    client: Client, config: schedules.MonthlySchedule, args: argparse.Namespace
) -> schedules.MonthlySchedule:
    """A daily reconciliation takes its billing schedule's mode and zone, so that it checks
    the months that schedule bills, and alerts when one of its firings billed nothing."""
    followed = args.billing_schedule or schedules.DEFAULT_SCHEDULE_ID
    if followed == config.schedule_id:
        raise InvalidInputError(
            f"the reconciliation {followed} would follow itself: name the billing schedule it"
            " follows with --billing-schedule, or give it another --id"
        )
    try:
        _, billing = await schedules.launcher_of(client, followed)
    except ForeignScheduleError:
        raise
    except UnknownScheduleError:
        print(
            f"note: no billing schedule {followed!r} to follow (billed by hand?): this one"
            f" reconciles in {config.billing}, {config.time_zone}, and checks no firing;"
            " create it after the billing schedule, or pass --billing-schedule",
            file=sys.stderr,
        )
        return config
    if billing.action != "bill":
        raise InvalidInputError(
            f"--billing-schedule {followed} reconciles: name the schedule that bills"
        )
    if args.billing is not None and args.billing != billing.options.billing:
        raise InvalidInputError(
            f"--billing {args.billing} differs from the billing schedule {followed}'s"
            f" ({billing.options.billing}): the reconciliation would check the wrong month."
            " Leave --billing out to follow it, or name another with --billing-schedule"
        )
    # `--time-zone` says only when it fires: its months are read in the billing schedule's.
    return config.model_copy(
        update={
            "billing": billing.options.billing,
            "time_zone": billing.time_zone if args.time_zone is None else args.time_zone,
            "months_time_zone": billing.time_zone,
            "billing_schedule_id": followed,
        }
    )


async def _warn_missed(schedule_id: str, missed: list[schedules.Missed], *, paused: bool) -> None:
    """Name the times the schedule launched nothing at, and the months left unbilled. A month
    whose run completed since (billed by hand) is only noted, and one whose run was
    cancelled is named with the `run` that bills it again: a launch leaves either as it is."""
    periods = sorted({str(m.period) for m in missed if m.period is not None})
    completed: dict[str, bool] = {}
    unread = ""
    if periods:
        try:
            async with _ledger() as conn:
                completed = await ledger.completed_runs(conn, periods)
        except CONNECTION_ERRORS as exc:
            unread = (
                f" (the ledger could not be read, {type(exc).__name__}: months billed since by"
                " hand are listed too)"
            )
    billed = [p for p, cancelled in completed.items() if not cancelled]
    cancelled = [p for p, cancelled in completed.items() if cancelled]
    if billed:
        print(
            f"note: {schedule_id} launched nothing at "
            + ", ".join(m.at.isoformat() for m in missed if str(m.period) in billed)
            + f", and their months have completed runs since (by hand?): {', '.join(billed)}",
            file=sys.stderr,
        )
    if cancelled:
        print(
            f"WARNING: {schedule_id} launched nothing for {', '.join(cancelled)}, and the runs"
            " of them started since were cancelled; a launch leaves a cancelled run as it is,"
            " so bill them again by hand: "
            + schedules.run_by_hand([parse_period(p) for p in cancelled], datetime.now(UTC)),
            file=sys.stderr,
        )
    missed = [m for m in missed if str(m.period) not in completed]
    if not missed:
        return
    print(
        f"WARNING: {schedule_id} launched nothing at {len(missed)} of its times, and Temporal"
        " does not make them up (a paused schedule skips its times, and so does one Temporal"
        " could not fire within its catch-up window; a launch that ended before starting its"
        " run, terminated or failed, started nothing either): "
        + ", ".join(m.at.isoformat() for m in missed)
        + unread,
        file=sys.stderr,
    )
    unbilled = [m.period for m in missed if m.period is not None]
    if unbilled:
        print(
            f"  unbilled by it: {', '.join(map(str, unbilled))}; to bill them:"
            f" python starter.py schedule backfill --id {schedule_id}"
            f" --start {unbilled[0]} --end {unbilled[-1]}"
            + (" --late" if is_late(unbilled[0], datetime.now(UTC)) else "")
            + schedules.while_paused(paused),
            file=sys.stderr,
        )


def _note(args: argparse.Namespace) -> str | None:
    """A schedule's note, kept by Temporal and printed by `describe`: redacted, as reasons
    are."""
    note: str | None = args.note
    return None if note is None else shown_line(note)


async def cmd_migrate(_: argparse.Namespace) -> int:
    roles = load_settings(DatabaseRolesSettings).roles()
    applied = await migrate(load_settings(DatabaseSettings).database_url, roles=roles)
    print("applied " + ", ".join(applied) if applied else "database is up to date")
    if roles is not None:
        print(f"granted the ledger's tables to {roles.ledger} and the vault's to {roles.vault}")
    return 0


async def cmd_import(args: argparse.Namespace) -> int:
    rows = read_customers_csv(args.file)
    pool = await create_pool(load_settings(DatabaseSettings).database_url)
    try:
        changes = await import_customers(pool, rows, while_running=args.while_running)
        periods = ", ".join(sorted({c.period for c in changes}))
        named = listed([f"{c.customer_id} ({c.was} -> {c.becomes})" for c in changes])
        if changes and not args.while_running:
            raise InvalidInputError(
                f"{args.file} adds or changes the price of {len(changes)} customers the open"
                f" run of {periods} has not billed yet:"
                f" {named}. That run may bill them at a"
                " price its plan and its key's cap did not count (a new currency pauses it)."
                " Import once it has ended, or pass --while-running (also"
                " if that run failed or was terminated, which leaves it open in the ledger);"
                " nothing was imported"
            )
        shared = await sharing_a_stripe_customer(pool, [r.customer_id for r in rows])
    finally:
        await pool.close()
    print(f"imported {len(rows)} customers from {args.file}")
    if shared:
        # Refused only for ids spelt alike (_refuse_respelt): two ids may be two accounts.
        print(
            f"warning: {len(shared)} Stripe customers are charged under more than one active"
            " customer id, once per id every period: "
            + listed([f"{stripe_id} ({', '.join(ids)})" for stripe_id, ids in shared.items()])
            + ". If one customer was imported twice under another id, deactivate the extra"
            " one: python starter.py customers deactivate ID",
            file=sys.stderr,
        )
    if changes:
        # --while-running: what the open run may now bill otherwise, for the record.
        print(f"note: the open run of {periods} may bill these as now imported: {named}")
    return 0


async def cmd_deactivate(args: argparse.Namespace) -> int:
    # Bad input is named before anything is contacted, as by every other command.
    for customer_id in args.customer_ids:
        validate_customer_id(customer_id)
    pool = await create_pool(load_settings(DatabaseSettings).database_url)
    try:
        done = await deactivate_customers(pool, args.customer_ids, while_running=args.while_running)
    finally:
        await pool.close()
    claimed = [b for b in done.still_billable if b.claimed]
    unclaimed = [b for b in done.still_billable if not b.claimed]
    notes = []
    if claimed:
        notes.append(
            f"{len(claimed)} claims are open, which a run charges whether or not the customer is"
            f" active: {_billables(claimed)};"
            " `starter.py skip PERIOD CUSTOMER --reason ...` stops one"
        )
    if unclaimed:
        notes.append(
            f"{len(unclaimed)} customers an open run has not claimed yet:"
            f" {_billables(unclaimed)}; that run does not charge them, but reports failed"
            " (unknown_customer) those whose child it has started"
        )
    if notes and not args.while_running:
        raise InvalidInputError(
            "; ".join(notes)
            + ". Nothing was deactivated: skip those claims first, or deactivate once the run"
            " has ended, or pass --while-running (also if a run failed or was terminated,"
            " which leaves it open in the ledger)"
        )
    if done.deactivated:
        print(f"deactivated {len(done.deactivated)} customers: {', '.join(done.deactivated)}")
    if done.already_inactive:
        print(f"already inactive: {', '.join(done.already_inactive)}")
    for note in notes:
        print(f"note: {note}")
    return 0


def _billables(billables: list[Billable]) -> str:
    return listed([f"{b.customer_id} ({b.period})" for b in billables])


async def cmd_failures(args: argparse.Namespace) -> int:
    async with _ledger() as conn:
        failures = await period_failures(conn, str(args.period))
    _emit(failures, args.json, describe_failures(failures))
    return 0


async def cmd_show_customer(args: argparse.Namespace) -> int:
    async with _ledger() as conn:
        history = await customer_history.customer_history(
            conn, args.customer_id, period=args.period, limit=args.limit
        )
    _emit(history, args.json, describe_customer(history))
    return 0


async def cmd_seed_demo(args: argparse.Namespace) -> int:
    written = await seed_demo(args.count)
    print(f"created {written} demo customers in Stripe and the ledger")
    return 0


async def cmd_demo(args: argparse.Namespace) -> int:
    from devstack.demo import run_demo  # the local stack is only needed by the demo

    return await run_demo(args)


# argparse names no public type for "a parser or a group of its flags".
def _add_late(command: argparse._ActionsContainer) -> None:
    """`run` and `schedule backfill` bill old periods only when told to (billing.periods)."""
    command.add_argument(
        "--late",
        action="store_true",
        help=f"bill periods more than {LATE_MONTHS} months before this one anyway",
    )


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="starter.py", description=__doc__.split("\n")[0])
    commands = root.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="start (or join) the run of a billing period")
    run.add_argument("period", type=_period, help="YYYY-MM")
    run.add_argument("--wait", action="store_true", help="wait for the run and print its summary")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    # A month is ahead or late, never both: the two together are a mistyped period.
    when = run.add_mutually_exclusive_group()
    when.add_argument(
        "--ahead", action="store_true", help="bill a period later than next month anyway"
    )
    _add_late(when)
    run.set_defaults(handler=cmd_run)

    status = commands.add_parser("status", help="counts of a period's run")
    status.add_argument("period", type=_period, help="YYYY-MM")
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=cmd_status)

    for action, text in (
        ("pause", "stop starting charges; charges already sent finish"),
        ("resume", "continue a paused run"),
        ("cancel", "charge nothing more; customers not yet charged end cancelled"),
    ):
        control = commands.add_parser(action, help=text)
        control.add_argument("period", type=_period, help="YYYY-MM")
        control.add_argument(
            "--reason", required=True, type=_reason, help="recorded with your name"
        )
        control.add_argument("--operator", help="default: $BILLING_OPERATOR or your login")
        control.add_argument("--json", action="store_true")
        control.set_defaults(handler=cmd_control)

    renew = commands.add_parser(
        "renew-keys",
        help="give a paused run new vault keys, capped for what it has left (cap reached,"
        " key expired); then resume it. A cancelled run held up by a refused key then ends",
    )
    renew.add_argument("period", type=_period, help="YYYY-MM")
    renew.add_argument("--reason", required=True, type=_reason, help="recorded with your name")
    renew.add_argument("--operator", help="default: $BILLING_OPERATOR or your login")
    renew.add_argument("--json", action="store_true")
    renew.set_defaults(handler=cmd_renew_keys)

    skip = commands.add_parser("skip", help="do not charge one customer this period")
    skip.add_argument("period", type=_period, help="YYYY-MM")
    skip.add_argument("customer", help="the customer id")
    skip.add_argument("--reason", required=True, type=_reason)
    skip.add_argument("--operator")
    skip.add_argument("--json", action="store_true")
    # A period with no run takes the skip for later: a month far from now is most likely
    # mistyped (billing.periods.check_skip_by_hand).
    skip_when = skip.add_mutually_exclusive_group()
    skip_when.add_argument(
        "--ahead", action="store_true", help="record a skip for a period later than next month"
    )
    skip_when.add_argument(
        "--late",
        action="store_true",
        help=f"record a skip for a period more than {LATE_MONTHS} months before this one",
    )
    skip.set_defaults(handler=cmd_skip)

    failures = commands.add_parser(
        "failures", help="a period's failed customers, by Stripe's failure and decline code"
    )
    failures.add_argument("period", type=_period, help="YYYY-MM")
    failures.add_argument("--json", action="store_true")
    failures.set_defaults(handler=cmd_failures)

    watch = commands.add_parser("watch", help="a live progress bar until the run ends")
    watch.add_argument("period", type=_period, help="YYYY-MM")
    watch.add_argument(
        "--interval",
        # A floor, so that a typo does not query Temporal in a busy loop.
        type=_number(3600, least=0.2),
        default=1.0,
        help="seconds between updates",
    )
    watch.set_defaults(handler=cmd_watch)

    preview = commands.add_parser("preview", help="who a run would charge; charges nothing")
    preview.add_argument("period", type=_period, help="YYYY-MM")
    preview.add_argument("--json", action="store_true")
    preview.set_defaults(handler=cmd_preview)

    reconcile = commands.add_parser(
        "reconcile",
        help="resolve open claims and unknown vault reservations; report Stripe charges the"
        " ledger does not hold (exit 1 if any)",
    )
    reconcile.add_argument("period", type=_period, help="YYYY-MM")
    reconcile.add_argument("--json", action="store_true", help="print the report as JSON")
    reconcile.set_defaults(handler=cmd_reconcile)

    handled = commands.add_parser(
        "handled",
        help="record that a person has handled a reconciliation finding: later reports count"
        " it instead of listing it (and exit 0 for it); with the period alone, list the marks"
        " made under it",
    )
    handled.add_argument("period", type=_period, help="YYYY-MM")
    handled.add_argument(
        "kind",
        nargs="?",
        type=str.lower,  # as the report prints it, DUPLICATE, or as its JSON has it
        choices=get_args(FindingKind),
        help="the finding's kind, as the report names it",
    )
    handled.add_argument(
        "charge_id", nargs="?", type=_charge_id, help="the finding's Stripe charge id"
    )
    handled.add_argument(
        "--reason", type=_reason, help="what was done (or why it is taken back); required to mark"
    )
    handled.add_argument("--undo", action="store_true", help="take the mark back")
    handled.add_argument("--operator", help="default: $BILLING_OPERATOR or your login")
    handled.add_argument("--json", action="store_true")
    handled.set_defaults(handler=cmd_handled)

    commands.add_parser(
        "setup", help="register the search attributes on a Temporal cluster"
    ).set_defaults(handler=cmd_setup)

    schedule = commands.add_parser("schedule", help="monthly runs with Temporal Schedules")
    schedule_commands = schedule.add_subparsers(dest="schedule_command", required=True)
    defaults = schedules.MonthlySchedule()
    for name, text in (
        ("create", "create the monthly schedule"),
        ("describe", "show the schedule, its next and recent runs"),
        ("pause", "stop firing"),
        ("unpause", "fire again"),
        (
            "trigger",
            "fire now (bills the period the schedule would bill now, once its firing is past)",
        ),
        ("backfill", "run missed periods"),
        ("delete", "delete the schedule (runs already started go on)"),
    ):
        sub = schedule_commands.add_parser(name, help=text)
        sub.add_argument(
            "--id",
            type=_schedule_id,
            help=f"schedule id (default {schedules.DEFAULT_SCHEDULE_ID};"
            f" {schedules.RECONCILE_SCHEDULE_ID} for create --reconcile)",
        )
        sub.set_defaults(handler=cmd_schedule)
        if name in ("pause", "unpause"):
            sub.add_argument("--note", default=None)
        if name in ("trigger", "backfill"):
            sub.add_argument(
                "--while-paused",
                action="store_true",
                help="launch even though the schedule is paused (refused otherwise)",
            )
        if name == "trigger":
            sub.add_argument(
                "--early",
                action="store_true",
                help="bill the month now, though the schedule's own firing for it is ahead",
            )
        if name == "backfill":
            sub.add_argument("--start", type=_period, required=True, help="first period")
            sub.add_argument("--end", type=_period, required=True, help="last period")
            _add_late(sub)
        if name == "create":
            sub.add_argument("--day", type=int, help=f"1-28 (default {defaults.day_of_month})")
            sub.add_argument("--hour", type=int, default=defaults.hour)
            sub.add_argument("--minute", type=int, default=defaults.minute)
            # No defaults here: a reconciliation takes these from its billing schedule.
            sub.add_argument(
                "--time-zone",
                help=f"IANA name (default {defaults.time_zone}); a reconciliation following a"
                " billing schedule fires in it, and reads months in that schedule's zone",
            )
            sub.add_argument(
                "--billing",
                choices=["arrears", "advance"],
                help="bill the month that ended (arrears) or the one starting (advance);"
                f" default {defaults.billing}",
            )
            sub.add_argument(
                "--overlap",
                choices=[
                    "skip",
                    "buffer_one",
                    "buffer_all",
                    "cancel_other",
                    "terminate_other",
                    "allow_all",
                ],
                default=defaults.overlap,
            )
            sub.add_argument(
                "--catchup-hours",
                type=_number(24 * 366),
                default=defaults.catchup_window.total_seconds() / 3600,
                help="how late a missed firing still runs",
            )
            sub.add_argument("--paused", action="store_true", help="create it paused")
            sub.add_argument(
                "--reconcile",
                action="store_true",
                help="a daily reconciliation of the period the schedule would bill, at --hour"
                f" and --minute (no --day; id {schedules.RECONCILE_SCHEDULE_ID} by default)",
            )
            sub.add_argument(
                "--billing-schedule",
                type=_schedule_id,
                help="with --reconcile: the billing schedule whose mode and zone it follows,"
                " and whose firings of the last two months it checks billed their months"
                f" (default {schedules.DEFAULT_SCHEDULE_ID})",
            )
            sub.add_argument(
                "--leave-unbilled",
                action="store_true",
                help="create a billing schedule even though months between the ledger's latest"
                " run and its first firing would be billed by nothing",
            )

    commands.add_parser("migrate", help="apply database migrations").set_defaults(
        handler=cmd_migrate
    )

    customers = commands.add_parser("customers", help="manage customers due for billing")
    customer_commands = customers.add_subparsers(dest="customers_command", required=True)
    imp = customer_commands.add_parser("import", help="import a CSV (all rows or none)")
    imp.add_argument("file", type=Path)
    imp.add_argument(
        "--while-running",
        action="store_true",
        help="change prices a running period has not billed yet anyway",
    )
    imp.set_defaults(handler=cmd_import)
    deactivate = customer_commands.add_parser(
        "deactivate",
        help="bill customers no more: no run opened from now on lists them (past rows stay)",
    )
    deactivate.add_argument("customer_ids", nargs="+", metavar="customer_id")
    deactivate.add_argument(
        "--while-running",
        action="store_true",
        help="even customers a period may still charge (an open claim is charged anyway)",
    )
    deactivate.set_defaults(handler=cmd_deactivate)
    show = customer_commands.add_parser(
        "show", help="one customer: what it is billed now, and what each period did"
    )
    show.add_argument("customer_id", type=_argument(validate_customer_id))
    show.add_argument("--period", type=_period, help="only this period (YYYY-MM)")
    show.add_argument(
        "--limit",
        type=_positive_up_to(customer_history.MAX_PERIODS_SHOWN, "periods"),
        default=customer_history.DEFAULT_PERIODS_SHOWN,
        help="how many periods, newest first",
    )
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=cmd_show_customer)
    seed = customer_commands.add_parser("seed-demo", help="create demo customers")
    seed.add_argument("--count", type=_demo_count, default=1000)
    seed.set_defaults(handler=cmd_seed_demo)

    demo = commands.add_parser("demo", help="bill a period of demo customers on the local stack")
    demo.add_argument("--customers", type=_demo_count, default=1000)
    demo.add_argument("--period", type=_period, default=None, help="default: last month")
    demo.add_argument("--json", action="store_true")
    demo.add_argument(
        "--keep-running", action="store_true", help="leave the local stack up for the Web UI"
    )
    demo.set_defaults(handler=cmd_demo)
    return root


# The flag, or argument, each field of the CLI's models comes from.
_GIVEN_AS = {
    "schedule_id": "--id",
    "day_of_month": "--day",
    "hour": "--hour",
    "minute": "--minute",
    "time_zone": "--time-zone",
    "catchup_window": "--catchup-hours",
    "billing_schedule_id": "--billing-schedule",
    "reason": "--reason",
    "operator": "--operator",
    "customer_id": "the customer id",
}


def _validation_problem(error: ErrorDetails) -> str:
    """One of pydantic's errors as the person who typed the command gave it: the flag, not
    the model's field, and the reason without pydantic's "Value error, " prefix."""
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "string_too_long" and isinstance(error["input"], str):
        message += f" (got {len(error['input'])})"
    field = ".".join(str(_GIVEN_AS.get(str(part), part)) for part in error["loc"])
    return f"{field}: {message}" if field else message


def _first_line(exc: Exception) -> str:
    # asyncpg adds DETAIL and HINT lines (e.g. the failing row): the error is one line.
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _reader_gone() -> bool:
    """Whoever read the CLI's output stopped reading: stdout's pipe has no reader left."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    if not any(events & select.POLLERR for _, events in poller.poll(0)):
        return False
    # Nothing more can be said there; the last flush at exit must not fail too.
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], Coroutine[Any, Any, int]] = args.handler
    try:
        logs.configure("WARNING")
        return asyncio.run(handler(args))
    except RunEndedError as exc:
        # The run it reports on failed or was terminated: as a failure `run --wait` saw.
        if getattr(args, "json", False):
            ended = EndedRun(period=exc.period, workflow_id=exc.workflow_id, state=exc.state)
            print(ended.model_dump_json())
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except BillingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RPCError as exc:
        # Temporal refused a call: its own words carry no secret of ours.
        print(f"error: Temporal answered {exc.status.name}: {exc.message}", file=sys.stderr)
        return 2
    except WorkflowQueryFailedError as exc:
        # The run is open but cannot answer (e.g. its workflow task keeps failing).
        print(
            f"error: the run did not answer its status query: {exc.message} (see its workflow"
            " task's failure in the Web UI)",
            file=sys.stderr,
        )
        return 2
    except WorkflowFailureError as exc:
        # The run itself failed (exit 1 means reconciliation findings): its causes, in order.
        print(f"error: {failure_chain(exc)}", file=sys.stderr)
        return 3
    except (
        asyncpg.UndefinedTableError,
        asyncpg.UndefinedColumnError,
        asyncpg.UndefinedFunctionError,
    ) as exc:
        print(
            f"error: the database lacks part of the billing ledger ({_first_line(exc)}): apply"
            " the migrations with 'python starter.py migrate' (a worker applies them too when"
            " it starts)",
            file=sys.stderr,
        )
        return 2
    except asyncpg.PostgresError as exc:
        # E.g. a read-only or unprivileged DATABASE_URL; PostgreSQL's message names no secret.
        print(
            f"error: PostgreSQL refused: {_first_line(exc)} ({type(exc).__name__})", file=sys.stderr
        )
        return 2
    except ValidationError as exc:
        for error in exc.errors():
            print(f"error: {_validation_problem(error)}", file=sys.stderr)
        return 2
    except CONNECTION_ERRORS as exc:
        if isinstance(exc, BrokenPipeError) and _reader_gone():
            # What was asked was done; its output found no reader (`| head`). Exit as a
            # process that SIGPIPE ends does.
            return 128 + signal.SIGPIPE
        # A statement past its time (asyncpg's command_timeout) or a connection lost midway
        # (a refused first connection is a BillingError): what was asked may or may not have
        # happened.
        print(
            f"error: {type(exc).__name__} while talking to the database"
            f" ({redact(str(exc)) or 'no answer in time'}): it may or may not have taken effect;"
            " check (`status`, `preview`) before running it again",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: the Temporal client's Rust threads can abort a finalizing
    # interpreter (temporalio sdk-python issue 300), turning a clean exit into SIGABRT.
    os._exit(code)

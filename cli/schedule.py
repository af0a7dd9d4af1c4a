"""`schedule ...`: the monthly billing and daily reconciliation schedules."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime, timedelta

from temporalio.client import Client, ScheduleAlreadyRunningError
from temporalio.service import RPCError

from billing import ledger, run_states, schedules
from billing.config import TemporalSettings, load_settings
from billing.errors import ForeignScheduleError, InvalidInputError, UnknownScheduleError
from billing.periods import check_far_flags, is_late, parse_period, period_range
from billing.redact import shown_line
from billing.temporal_client import connect
from cli import arguments
from cli.database import LEDGER_UNREADABLE, ledger_connection


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
        # --late for a range whose first month is recent: a mistyped year, most likely.
        check_far_flags(args.start, datetime.now(UTC), late=args.late)
    client = await connect(temporal)
    handle = client.get_schedule_handle(args.id)
    if config is not None:
        await _create_schedule(client, temporal.task_queue, config, args)
        return 0
    # Every other command acts on one of ours: an unknown or foreign id is refused first.
    ours = await schedules.our_schedule(client, args.id)
    if args.schedule_command == "describe":
        request = await schedules.launch_input(client, ours)
        print(schedules.describe(ours, request))
        await _warn_followed_gone(client, args.id, request.billing_schedule_id)
        missed = await schedules.missed_launches(client, args.id)
        await _warn_missed(args.id, missed, paused=ours.schedule.state.paused)
        await _warn_unfinished(client, args.id, paused=ours.schedule.state.paused)
    elif args.schedule_command in ("pause", "unpause") and ours.schedule.state.paused == (
        args.schedule_command == "pause"
    ):
        # Its note says who paused it and why: kept, not overwritten.
        state = ours.schedule.state
        note = f" ({schedules.shown_note(state.note)})" if state.note else ""
        print(f"schedule {args.id} is {'paused' if state.paused else 'active'}{note}: unchanged")
    elif args.schedule_command == "pause":
        await handle.pause(note=arguments.note(args))
        print(f"paused schedule {args.id}")
    elif args.schedule_command == "unpause":
        await handle.unpause(note=arguments.note(args, "unpaused"))
        print(f"unpaused schedule {args.id}")
        try:
            missed = await schedules.missed_launches(client, args.id)
        except (InvalidInputError, RPCError) as exc:
            # Unpaused all the same: a failure here would read as an unpause that failed.
            print(
                f"note: the firings it skipped were not looked for: {shown_line(str(exc))}",
                file=sys.stderr,
            )
        else:
            await _warn_missed(args.id, missed, paused=False)
    elif args.schedule_command == "trigger":
        async with ledger_connection() as conn:
            period = await schedules.trigger(
                client, conn, args.id, early=args.early, while_paused=args.while_paused
            )
            joined = await run_states.joined_open_runs(
                client, conn, [str(period)] if period else []
            )
        if joined.get(str(period)) == "paused":
            # The launch joins that run, which bills nothing until it is resumed.
            print(
                f"triggered schedule {args.id}: {period}'s run is open and paused, which the"
                " launch joins: it bills nothing until resumed (`python starter.py status"
                f" {period}` says how)"
            )
        else:
            print(f"triggered schedule {args.id}" + (f": it bills {period}" if period else ""))
    elif args.schedule_command == "backfill":
        async with ledger_connection() as conn:
            # Before the launches, which open runs of their own.
            joined = await run_states.joined_open_runs(
                client, conn, [str(p) for p in period_range(args.start, args.end)]
            )
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
        if done.finished:
            print(
                f"  left as they are: {run_states.describe_finished(done.finished)}"
                " (bill one again by hand, once its run has ended: python starter.py run PERIOD)"
            )
        # A cancelled run still open is among those left as they are.
        joined = {p: control for p, control in joined.items() if p not in done.finished}
        paused = [p for p, control in joined.items() if control == "paused"]
        running = [p for p in joined if p not in paused]
        if running:
            # A second backfill of the same months starts nothing new.
            print(
                f"  joining the open runs of {', '.join(running)}: each customer is billed"
                " once all the same"
            )
        if paused:
            # Their launches join those runs, which bill nothing until resumed.
            print(
                f"  joining the open, paused runs of {', '.join(paused)}: each bills nothing"
                " until resumed (`python starter.py status PERIOD` says how)"
            )
    elif args.schedule_command == "delete":
        # Read before the delete: a failure to read them then stops the command with nothing
        # deleted, not after it, as if the delete had failed.
        left = await schedules.followers(client, args.id)
        await handle.delete()
        print(f"deleted schedule {args.id}")
        if left:
            print(f"warning: {schedules.describe_followers(args.id, left)}", file=sys.stderr)
    return 0


def _check_create_flags(args: argparse.Namespace) -> None:
    """Refuse a flag the kind of schedule asked for would ignore."""
    if args.reconcile:
        ignored = _given(("--day", args.day is not None), ("--leave-unbilled", args.leave_unbilled))
        if ignored:
            names, several = ignored
            raise InvalidInputError(
                f"{names} {'go' if several else 'goes'} with a billing schedule, not --reconcile"
                " (a reconciliation fires every day, and bills nothing)"
            )
        if args.billed_by_hand and args.billing_schedule is not None:
            raise InvalidInputError(
                "--billed-by-hand says the reconciliation follows no billing schedule:"
                f" leave it out to follow {args.billing_schedule}"
            )
        return
    following = _given(
        ("--billing-schedule", args.billing_schedule is not None),
        ("--billed-by-hand", args.billed_by_hand),
    )
    if following:
        names, several = following
        raise InvalidInputError(
            f"{names} {'say' if several else 'says'} what a reconciliation follows: it goes with"
            " --reconcile"
        )


def _given(*flags: tuple[str, bool]) -> tuple[str, bool] | None:
    """The flags given, named together, and whether there are several; None if none is."""
    given = [flag for flag, on in flags if on]
    return (" and ".join(given), len(given) > 1) if given else None


async def _create_schedule(
    client: Client, task_queue: str, config: schedules.MonthlySchedule, args: argparse.Namespace
) -> None:
    if config.action == "reconcile":
        config = await _following(client, config, args)
    elif not args.leave_unbilled:
        async with ledger_connection() as conn:
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
    followed = " (billed by hand: following no billing schedule)" if daily else ""
    if config.billing_schedule_id is not None:
        months = config.months_time_zone
        elsewhere = f", its months in {months}" if months not in (None, config.time_zone) else ""
        followed = f" (following {config.billing_schedule_id}{elsewhere})"
    print(
        f"created schedule {config.schedule_id}: {when} at {config.hour:02d}:{config.minute:02d}"
        f" {config.time_zone}, {what} in {config.billing}{followed}"
    )
    risk = _OVERLAP_RISKS.get(config.overlap)
    if risk is not None:
        made_up = (
            "the next day's firing reconciles what that one would have"
            if daily
            else "`schedule describe` names such firings, with the backfill that bills their months"
        )
        print(
            f"warning: --overlap {config.overlap}: {risk}; {made_up} (the default,"
            " buffer_all, loses none)",
            file=sys.stderr,
        )


# What each overlap policy but buffer_all and allow_all can lose: a firing due while a launch
# is still open (no worker for a while, an outage over two firings caught up at once).
_OVERLAP_RISKS = {
    "skip": "Temporal drops a firing due while a launch is still open",
    "buffer_one": "Temporal drops a firing due while a launch is open and another waits",
    "cancel_other": "a firing cancels a launch still open, which may not have started its run",
    "terminate_other": "a firing ends a launch still open, which may not have started its run",
}


async def _following(
    client: Client, config: schedules.MonthlySchedule, args: argparse.Namespace
) -> schedules.MonthlySchedule:
    """A daily reconciliation takes its billing schedule's mode and zone, so that it checks
    the months that schedule bills, and alerts when one of its firings billed nothing."""
    if args.billed_by_hand:
        return config
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
        # Followed by nothing, it would check no month left unbilled, for good: a billing
        # schedule created next would go unwatched.
        named = "" if args.billing_schedule is None else " (mistyped?)"
        raise InvalidInputError(
            f"no billing schedule {followed!r}{named} for the reconciliation to follow, so"
            " nothing was created: create the billing schedule first (`python starter.py"
            " schedule create`), name the one it follows with --billing-schedule, or pass"
            " --billed-by-hand if periods are billed by hand (it then checks no schedule's"
            " firings)"
        ) from None
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


async def _warn_followed_gone(client: Client, schedule_id: str, followed: str | None) -> None:
    """Say so when the billing schedule a reconciliation follows is gone: only the worker's
    log and the launches' details would."""
    if followed is None:
        return
    try:
        _, request = await schedules.launcher_of(client, followed)
        bills = request.action == "bill"
    except UnknownScheduleError:  # a schedule not ours too
        bills = False
    except InvalidInputError as exc:  # written by another release: it may bill
        print(
            f"note: the billing schedule {followed} it follows could not be read:"
            f" {shown_line(str(exc))}",
            file=sys.stderr,
        )
        return
    if not bills:
        gone = schedules.describe_followers(followed, [schedule_id])
        print(f"warning: {gone}", file=sys.stderr)


async def _warn_unfinished(client: Client, schedule_id: str, *, paused: bool) -> None:
    """Name the months its launches started whose run ended before finishing: no launch
    starts one again on its own, and the customers it had not claimed are unbilled."""
    try:
        async with ledger_connection() as conn:
            unfinished = await schedules.launched_unfinished(client, conn, schedule_id)
    except LEDGER_UNREADABLE as exc:
        print(
            f"note: the ledger could not be read ({type(exc).__name__}): runs of months"
            f" {schedule_id} launched that ended before finishing were not looked for",
            file=sys.stderr,
        )
        return
    if unfinished:
        months = ", ".join(map(str, unfinished))
        print(
            f"WARNING: the runs {schedule_id} launched for {months} ended (terminated, failed)"
            " before they finished, and no launch starts them again: the customers they had"
            " not claimed are unbilled (a run paused then starts again running); to bill"
            f" them: python starter.py schedule backfill"
            f" --id {schedule_id} --start {unfinished[0]} --end {unfinished[-1]}"
            + (" --late" if is_late(unfinished[0], datetime.now(UTC)) else "")
            + schedules.while_paused(paused),
            file=sys.stderr,
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
            async with ledger_connection() as conn:
                completed = await ledger.completed_runs(conn, periods)
        except LEDGER_UNREADABLE as exc:
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
    maybe = [m.at.isoformat() for m in missed if m.maybe_waiting]
    if maybe:
        print(
            f"  some of {', '.join(maybe)} may be firings Temporal holds for the launch still"
            " open, which start once it ends: `schedule describe` again then",
            file=sys.stderr,
        )
    unbilled = list(dict.fromkeys(m.period for m in missed if m.period is not None))
    if unbilled:
        print(
            f"  unbilled by it: {', '.join(map(str, unbilled))}; to bill them:"
            f" python starter.py schedule backfill --id {schedule_id}"
            f" --start {unbilled[0]} --end {unbilled[-1]}"
            + (" --late" if is_late(unbilled[0], datetime.now(UTC)) else "")
            + schedules.while_paused(paused),
            file=sys.stderr,
        )

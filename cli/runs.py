"""Commands on a period's run: run, status, watch, pause/resume/cancel, renew-keys, skip,
failures and preview."""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC, datetime
from typing import Any

from temporalio.client import Client, WorkflowFailureError, WorkflowHandle, WorkflowQueryFailedError
from temporalio.service import RPCError

from billing import ledger, operations
from billing.config import (
    BillingSettings,
    CapSettings,
    DatabaseSettings,
    TemporalSettings,
    load_settings,
)
from billing.db import create_pool
from billing.errors import (
    BillingError,
    InvalidPeriodError,
    NoWorkerError,
    RunEndedError,
    ServiceUnavailableError,
)
from billing.failures import period_failures
from billing.keys import period_workflow_id
from billing.models import (
    OpenRun,
    OperatorRequest,
    PeriodProgress,
    PeriodStatus,
    PeriodSummary,
    SkipRequest,
)
from billing.periods import (
    Period,
    check_far_flags,
    check_run_by_hand,
    parse_period,
    run_command,
)
from billing.preview import preview_period
from billing.reporting import (
    describe,
    describe_failures,
    describe_preview,
    describe_renewal,
    describe_totals,
    next_step,
    resumed_unrenewed,
    ui_link,
)
from billing.runs import (
    TEMPORAL_AWAY,
    ended_as,
    period_status,
    result_across_outages,
    run_ended,
    start_period,
    started_across_outages,
    status_from_ledger,
    summary_progress,
    tell_if_away,
)
from billing.temporal_client import connect, described
from billing.wording import counted
from cli import arguments
from cli.database import ledger_connection, ledger_totals, read_for_a_note
from cli.output import OutageNotice, emit

# How often `run --wait` asks whether the run it waits for has paused.
PAUSE_CHECK_SECONDS = 30.0
# How long `run` waits for a new run's opening (its plan) before it says how the run stands.
PLAN_WAIT_SECONDS = 15.0
PLAN_POLL_SECONDS = 0.5


async def cmd_run(args: argparse.Namespace) -> int:
    now = datetime.now(UTC)
    check_far_flags(args.period, now, ahead=args.ahead, late=args.late)
    check_run_by_hand(args.period, now, ahead=args.ahead, late=args.late)
    temporal = load_settings(TemporalSettings)
    client = await connect(temporal)
    outage = OutageNotice(f"the run of {args.period}")
    handle = await _started(client, args, temporal, outage)
    try:
        progress = await period_status(client, args.period)
        if not args.wait:
            progress = await _planned(client, args.period, progress)
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
        emit(
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
        emit(
            progress,
            args.json,
            f"period {args.period} {progress.state} as {handle.id}\n"
            f"  {ui_link(temporal, handle.id)}",
        )
        return 0
    return await _wait_and_report(client, handle, args, temporal, told=concern)


async def _planned(client: Client, period: Period, progress: PeriodProgress) -> PeriodProgress:
    """How the run stands once its opening has made the plan, for PLAN_WAIT_SECONDS at
    most: an opening refused (a key too small, a revoked key) fails the run a moment after
    it started, which `run` would otherwise report as running (RunEndedError says how it
    ended; the caller tells a worker or Temporal gone meanwhile as at its first look)."""
    deadline = asyncio.get_running_loop().time() + PLAN_WAIT_SECONDS
    while progress.expected_due is None and progress.state == "running":
        if asyncio.get_running_loop().time() >= deadline:
            break
        await asyncio.sleep(PLAN_POLL_SECONDS)
        progress = await period_status(client, period)
    return progress


async def _started(
    client: Client, args: argparse.Namespace, temporal: TemporalSettings, outage: OutageNotice
) -> WorkflowHandle[Any, PeriodSummary]:
    """The period's run, started or joined. A start whose answer an outage lost may have
    started it: `--wait` tries again once Temporal is back (a start joins the open run);
    without it, `run` says so and what to do."""

    async def start() -> WorkflowHandle[Any, PeriodSummary]:
        return await start_period(client, args.period, temporal.task_queue)

    if args.wait:
        return await started_across_outages(
            client, period_workflow_id(args.period), start, PeriodSummary, outage
        )
    try:
        return await start()
    except RPCError as exc:
        if exc.status not in TEMPORAL_AWAY:
            raise
        raise ServiceUnavailableError(
            f"Temporal could not be reached to start the run of {args.period}"
            f" ({exc.status.name}: {exc.message}): it may have started all the same. Once"
            " Temporal is back, run this again (it joins a run already open), or see"
            f" `python starter.py status {args.period}`"
        ) from None


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


async def _wait_and_report(
    client: Client,
    handle: WorkflowHandle[Any, PeriodSummary],
    args: argparse.Namespace,
    temporal: TemporalSettings,
    *,
    outage: OutageNotice | None = None,
    told: str | None = None,
) -> int:
    """Wait for the run's summary, saying once each time it waits for a person (it may
    pause itself, e.g. at its key's cap) rather than wait without a word; `outage` may
    have told already that Temporal is away."""
    outage = outage or OutageNotice(f"the run of {args.period}")
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
    emit(summary, args.json, describe(summary) + f"\n  {ui_link(temporal, handle.id)}")
    return 0


async def cmd_status(args: argparse.Namespace) -> int:
    client = await connect(load_settings(TemporalSettings))
    try:
        progress = await _period_status(client, args.period)
    except (RunEndedError, NoWorkerError) as exc:
        # Ended with no summary, or no worker answers: what the period's runs billed is still
        # worth saying.
        totals = await ledger_totals(str(args.period))
        if totals is None or totals.empty:
            raise
        no_worker = isinstance(exc, NoWorkerError)
        said = f"{exc}; {describe_totals(str(args.period), totals, run_open=no_worker)}"
        if isinstance(exc, RunEndedError):
            raise RunEndedError(
                said, period=exc.period, workflow_id=exc.workflow_id, state=exc.state
            ) from None
        raise NoWorkerError(said) from None
    totals = await ledger_totals(str(args.period))
    shown = None if totals is None or totals.empty else totals
    status = PeriodStatus(**progress.model_dump(), ledger=shown)
    emit(status, args.json, describe(status))
    return 0


async def _period_status(client: Client, period: Period) -> PeriodProgress:
    """The period's status, from the ledger when Temporal holds no run of it, or one that
    ended before its close which the ledger has closed since (cancelled by an operator)."""
    try:
        progress = await period_status(client, period)
    except RunEndedError:
        async with ledger_connection() as conn:
            record = await ledger.period_record(conn, str(period))
        if record is None or record.summary is None or record.run_id is None:
            raise
        # Only the run the ledger closed: a later one refused at its opening (a key too
        # small) ended leaving the record, and summary, of the run before it.
        ended = await described(client.get_workflow_handle(period_workflow_id(period)))
        if ended is None or ended.raw_info.first_run_id != record.run_id:
            raise
        return summary_progress(record.summary)
    if progress.state != "not_started":
        return progress
    # "not_started" is only true if the ledger, which remembers runs Temporal no longer
    # keeps, has none either: unreadable, it is an error, not a guess.
    async with ledger_connection() as conn:
        record = await ledger.period_record(conn, str(period))
    return status_from_ledger(period, record, progress)


async def cmd_control(args: argparse.Namespace) -> int:
    # Bad input is refused before anything is contacted.
    request = OperatorRequest(reason=args.reason, operator=arguments.operator(args))
    client = await connect(load_settings(TemporalSettings))
    # Read before the resume lifts the pause it is about; a resume with the same keys would
    # only be refused again (cap, expiry, revoke), claiming more customers first.
    unrenewed = (
        await read_for_a_note(
            "whether the run's keys were renewed since it paused itself is not checked",
            lambda conn: ledger.self_pause_unrenewed(conn, str(args.period)),
        )
        if args.command == "resume"
        else None
    )
    try:
        progress = await operations.control(client, args.period, args.command, request)
    except operations.NotRunningError as exc:
        if args.command != "cancel":
            raise
        namespace = load_settings(BillingSettings).billing_key_namespace
        async with ledger_connection() as conn:
            cancelled = await operations.cancel_ended_run(
                client, conn, namespace, args.period, request
            )
            record = None if cancelled else await ledger.period_record(conn, str(args.period))
        if cancelled is None:
            summary = None if record is None else record.summary
            if summary is None or summary.cancelled_by is None:
                raise
            raise operations.NotRunningError(
                f"{exc}; the ledger records it cancelled by {summary.cancelled_by}:"
                f" {summary.cancel_reason}"
            ) from None
        emit(cancelled, args.json, _describe_ended_cancel(cancelled))
        return 0
    emit(progress, args.json, describe(progress))
    warning = None if unrenewed is None else resumed_unrenewed(str(args.period), unrenewed)
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def _describe_ended_cancel(cancelled: operations.EndedRunCancelled) -> str:
    period = parse_period(cancelled.period)
    in_doubt = (
        f"; {counted(cancelled.in_doubt, 'claim')} whose charge was sent before it ended"
        f" {'is' if cancelled.in_doubt == 1 else 'are'} left to reconciliation"
        f" (`python starter.py reconcile {period}`)"
        if cancelled.in_doubt
        else ""
    )
    return (
        f"the run of {period} had ended before its close; the ledger records the cancel and"
        " closes the period. The customers it had not started are cancelled and stay"
        " unbilled: no launch starts the period again, and reconciliation reports them no more"
        f" (`{run_command(period, datetime.now(UTC))}` bills those it had not claimed; one it"
        f" had claimed but not yet sent stays cancelled, as the run's own cancel leaves it)"
        f"{in_doubt}. Children it left running finish the charges they had sent. The counts"
        " below are the ledger's as of the cancel:\n" + describe(cancelled.summary)
    )


async def cmd_renew_keys(args: argparse.Namespace) -> int:
    request = OperatorRequest(reason=args.reason, operator=arguments.operator(args))
    client = await connect(load_settings(TemporalSettings))
    renewal = await operations.renew_keys(client, args.period, request)
    emit(renewal, args.json, describe_renewal(renewal))
    return 0


async def cmd_skip(args: argparse.Namespace) -> int:
    check_far_flags(args.period, datetime.now(UTC), ahead=args.ahead, late=args.late)
    request = SkipRequest(
        customer_id=args.customer, reason=args.reason, operator=arguments.operator(args)
    )
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
        emit(result, args.json, said)
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
        outage = OutageNotice(f"the run of {args.period}")
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
                tell_if_away(exc, outage)
                continue
            outage.back()
    print(describe(progress))
    return 0


async def cmd_failures(args: argparse.Namespace) -> int:
    async with ledger_connection() as conn:
        failures = await period_failures(conn, str(args.period))
    emit(failures, args.json, describe_failures(failures))
    return 0


async def cmd_preview(args: argparse.Namespace) -> int:
    pool = await create_pool(load_settings(DatabaseSettings).database_url, max_size=1)
    try:
        preview = await preview_period(
            pool, str(args.period), load_settings(CapSettings).billing_cap_multiplier
        )
    finally:
        await pool.close()
    emit(preview, args.json, describe_preview(preview))
    try:
        check_run_by_hand(args.period, datetime.now(UTC))
    except InvalidPeriodError as exc:
        # A preview charges nothing, but the run it previews would be refused as asked.
        print(f"note: `run {args.period}` would be refused: {exc}", file=sys.stderr)
    return 0

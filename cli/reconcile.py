"""`reconcile` and `handled`: reconciliation of a period, and the findings a person handled."""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import timedelta

import asyncpg
from temporalio.service import RPCError

from billing import ledger
from billing.config import TemporalSettings, load_settings
from billing.errors import InvalidInputError
from billing.keys import reconcile_workflow_id
from billing.reconciliation import FindingKind, HandledMarks, HandledRequest, ReconcileReport
from billing.reporting import (
    describe_handled,
    describe_handled_marks,
    describe_reconciliation,
    ui_link,
)
from billing.runs import (
    awaits_a_worker,
    result_across_outages,
    start_reconcile,
    started_across_outages,
    tell_if_away,
)
from billing.temporal_client import connect
from cli import arguments
from cli.database import ledger_connection, read_for_a_note
from cli.output import OutageNotice, emit

# How long `reconcile` waits before it says that no worker has taken its workflow up.
NO_WORKER_SECONDS = 15.0


async def cmd_reconcile(args: argparse.Namespace) -> int:
    temporal = load_settings(TemporalSettings)
    client = await connect(temporal)
    if not args.unbilled and await _never_run(str(args.period)):
        # A mistyped month, most likely: its report would read as a period billed clean.
        raise InvalidInputError(
            f"the ledger holds no row of {args.period}: no run has billed it, so a"
            " reconciliation would look up every active customer's charges on Stripe (at the"
            " cluster's Stripe rate) and expect none. Check the month; --unbilled reconciles it"
            " all the same. Nothing was started"
        )
    outage = OutageNotice(f"the reconciliation of {args.period}")
    handle = await started_across_outages(
        client,
        reconcile_workflow_id(args.period),
        lambda: start_reconcile(client, args.period, temporal.task_queue),
        ReconcileReport,
        outage,
    )
    result = asyncio.ensure_future(
        result_across_outages(client, handle, ReconcileReport, outage, outage.back)
    )
    waited = (await asyncio.wait({result}, timeout=NO_WORKER_SECONDS))[0]
    try:
        stalled = not waited and await awaits_a_worker(handle, timedelta(seconds=NO_WORKER_SECONDS))
    except RPCError as exc:
        tell_if_away(exc, outage)
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
    emit(report, args.json, describe_reconciliation(report) + f"\n  {ui_link(temporal, handle.id)}")
    return 1 if report.needs_a_person else 0


async def _never_run(period: str) -> bool:
    """Whether the ledger holds nothing of the period: no customer's row, and no run opened
    it (one stuck before its first claim is no mistyped month). False if it cannot say."""

    async def read(conn: asyncpg.Connection) -> bool:
        totals = await ledger.period_totals(conn, period)
        return totals.empty and await ledger.period_record(conn, period) is None

    return bool(
        await read_for_a_note(f"whether a run of {period} billed anyone is unchecked", read)
    )


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
        operator=arguments.operator(args),
        undo=args.undo,
    )
    async with ledger_connection() as conn:
        if not (args.undo or args.force):
            _check_reported(args, await ledger.reported_kinds(conn, args.charge_id))
        result = await ledger.mark_handled(conn, request)
    emit(result, args.json, describe_handled(result))
    return 2 if result.change == "none" else 0


def _check_reported(args: argparse.Namespace, reported: dict[FindingKind, str]) -> None:
    """A mark only for a finding a reconciliation reported: a mistyped charge id, confirmed
    as handled, would leave the real finding open while the operator believed it seen to."""
    under = reported.get(args.kind)
    if under == str(args.period):
        return
    if under is not None:
        raise InvalidInputError(
            f"reconciliation reported {args.kind.upper()} for {args.charge_id} under {under},"
            f" not {args.period}: mark it under {under}, where `handled {under}` lists it."
            " Nothing was marked"
        )
    elsewhere = (
        "; it reported "
        + ", ".join(f"{kind.upper()} under {period}" for kind, period in reported.items())
        if reported
        else ""
    )
    raise InvalidInputError(
        f"no reconciliation has reported {args.kind.upper()} for {args.charge_id}{elsewhere}:"
        f" check the kind and the charge id against the report (python starter.py reconcile"
        f" {args.period} lists its findings). Nothing was marked; --force marks it all the"
        " same (for a finding reported by a worker from before reported findings were kept)"
    )


async def _list_handled(args: argparse.Namespace) -> int:
    if args.reason is not None or args.undo or args.force:
        raise InvalidInputError(
            "--reason, --undo and --force go with a finding's kind and charge id: without"
            " them, handled only lists the marks made under the period"
        )
    period = str(args.period)
    async with ledger_connection() as conn:
        listed = HandledMarks(period=period, marks=await ledger.handled_marks(conn, period))
    emit(listed, args.json, describe_handled_marks(listed))
    return 0

"""An operator's word to a running period: pause, resume, cancel, skip (client side)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Literal, TypeVar

import asyncpg
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
    WorkflowUpdateStage,
)
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.workflow import UpdateMethodMultiParam

from billing import ledger, run_states
from billing.config import BillingSettings
from billing.db import create_pool
from billing.errors import BillingError, NoWorkerError
from billing.keys import idempotency_key, period_workflow_id
from billing.models import (
    OperatorRequest,
    PeriodProgress,
    PeriodSummary,
    Record,
    SkipRequest,
    SkipResult,
)
from billing.period_keys import KeyRenewal
from billing.periods import Period, check_skip_by_hand
from billing.temporal_client import workflow_status
from workflows.billing_period import HANDING_OVER, BillingPeriodWorkflow

Action = Literal["pause", "resume", "cancel"]
_NOT_RUNNING = (RPCStatusCode.NOT_FOUND, RPCStatusCode.FAILED_PRECONDITION)
# How long a worker has to take up an operator's request. Once taken up it runs to its end
# (its ledger write may retry through an outage); until then no worker may be there at all.
# Long enough for a busy worker that first replays a long history.
ACCEPT_TIMEOUT = timedelta(seconds=30)
# How soon an update refused as the run hands over is tried again on the next run.
HAND_OVER_RETRY = timedelta(milliseconds=200)
Request = TypeVar("Request")
Answer = TypeVar("Answer")


class OperatorRefusedError(BillingError):
    """The run refused the request (e.g. resuming a cancelled run); the message says why."""


class NotRunningError(BillingError):
    pass


class EndedRunCancelled(Record):
    """An operator's cancel of a run that ended before its close, recorded in the ledger:
    the customers it had not started are cancelled, and the period closed with what the
    ledger holds (`summary`)."""

    period: str
    operator: str
    reason: str
    summary: PeriodSummary
    # Claims whose charge was sent before the run ended, left to reconciliation.
    in_doubt: int


# How many customers a cancel of an ended run marks at a time.
_CANCEL_PAGE = 1000


async def cancel_ended_run(
    client: Client,
    conn: asyncpg.Connection,
    key_namespace: str,
    period: Period,
    request: OperatorRequest,
) -> EndedRunCancelled | None:
    """Record an operator's cancel of a period's run that ended before its close (terminated
    on purpose, say), which no update reaches, as its run would have: the customers it had
    not started are marked cancelled (a later run claims them afresh), and the period is
    closed with the ledger's counts, so that every command reads the run as over and the
    customers as cancelled. Children it left running finish the charges they had sent.
    None when the ledger holds no such run (none open, or one still running)."""
    async with conn.transaction():
        # No opening lands between the check and the writes.
        await ledger.lock_period(conn, str(period))
        # An operator's cancel recorded by a release that left the period open is closed now.
        if str(period) not in await run_states.ended_open(client, conn, [str(period)]):
            return None
        await ledger.set_control(conn, str(period), "cancelled", request.reason, request.operator)
        after: str | None = None
        while True:
            page, _ = await ledger.cancel_unstarted_page(
                conn,
                str(period),
                after,
                _CANCEL_PAGE,
                key_namespace,
                request.reason,
                request.operator,
            )
            if page.next_cursor is None:
                break
            after = page.next_cursor
        record = await ledger.period_record(conn, str(period))
        assert record is not None, "ended_open found the period's row"
        totals = await ledger.period_totals(conn, str(period))
        summary = PeriodSummary(
            period=str(period),
            workflow_id=record.workflow_id,
            run_id=record.run_id,
            due=totals.charged + totals.failed + totals.skipped + totals.cancelled + totals.claimed,
            charged=totals.charged,
            already_billed=0,
            failed=totals.failed,
            skipped=totals.skipped,
            cancelled=totals.cancelled,
            total_charged_cents=sum(totals.charged_by_currency.values()),
            charged_by_currency=totals.charged_by_currency,
            cancel_reason=request.reason,
            cancelled_by=request.operator,
        )
        await ledger.finish_period(conn, str(period), summary.model_dump_json())
    return EndedRunCancelled(
        period=str(period),
        operator=request.operator,
        reason=request.reason,
        summary=summary,
        in_doubt=totals.claimed,
    )


def _handing_over(exc: WorkflowUpdateFailedError) -> bool:
    return isinstance(exc.cause, ApplicationError) and exc.cause.type == HANDING_OVER


def _refused(exc: WorkflowUpdateFailedError) -> OperatorRefusedError:
    cause = exc.cause
    # An update that ran an activity fails with "Activity task failed": say what the activity said.
    while isinstance(cause, ActivityError) and cause.cause is not None:
        cause = cause.cause
    return OperatorRefusedError(str(getattr(cause, "message", None) or cause or exc))


async def control(
    client: Client, period: Period, action: Action, request: OperatorRequest
) -> PeriodProgress:
    update = {
        "pause": BillingPeriodWorkflow.pause,
        "resume": BillingPeriodWorkflow.resume,
        "cancel": BillingPeriodWorkflow.cancel,
    }[action]
    return await _to_the_run(client, period, update, request, f"the {action} of {period}", action)


async def renew_keys(client: Client, period: Period, request: OperatorRequest) -> KeyRenewal:
    """New vault keys for the period's paused run, in place of those refused (see
    activities.period.PeriodActivities.renew_keys); resume the run to bill the rest."""
    return await _to_the_run(
        client,
        period,
        BillingPeriodWorkflow.renew_keys,
        request,
        f"the key renewal of {period}",
        "renew the keys of",
    )


async def _to_the_run(
    client: Client,
    period: Period,
    update: UpdateMethodMultiParam[[BillingPeriodWorkflow, Request], Answer],
    request: Request,
    what: str,
    doing: str,
) -> Answer:
    """An operator's update to the period's run (see _update): refused by the run, or with
    no run to `doing`, it says so."""
    handle = client.get_workflow_handle_for(BillingPeriodWorkflow.run, period_workflow_id(period))
    try:
        return await _update(handle, update, request, what)
    except WorkflowUpdateFailedError as exc:
        raise _refused(exc) from None
    except RPCError as exc:
        if exc.status not in _NOT_RUNNING:
            raise
        status = await workflow_status(handle)
        if status == WorkflowExecutionStatus.RUNNING:
            # Temporal takes no update while the run's workflow task is failing or timed out.
            raise NoWorkerError(
                f"the run of {period} is open, but could not take {what} now: its workflow"
                " task is failing or timed out (a worker hung, crashed or failing on it). It"
                f" may or may not take effect: check `python starter.py status {period}` and"
                " the run in the Web UI, and try again once a worker runs it"
            ) from None
        if status is None:
            raise NotRunningError(f"no run of {period} is running to {doing}") from None
        ended = f"ended {status.name.lower()}"
        if status == WorkflowExecutionStatus.COMPLETED:
            summary = await handle.result()
            ended = (
                f"was cancelled by {summary.cancelled_by}" if summary.cancelled_by else "completed"
            )
        raise NotRunningError(
            f"no run of {period} is running to {doing}: its last run {ended}"
            f" (`python starter.py status {period}` says how)"
        ) from None


async def _update(
    handle: WorkflowHandle[BillingPeriodWorkflow, object],
    update: UpdateMethodMultiParam[[BillingPeriodWorkflow, Request], Answer],
    request: Request,
    what: str,
) -> Answer:
    """Run an update (see _taken), tried again while the run hands over to its next run,
    which takes it (for ACCEPT_TIMEOUT at most: a hand-over takes a moment)."""
    deadline = time.monotonic() + ACCEPT_TIMEOUT.total_seconds()
    while True:
        try:
            return await _taken(handle, update, request, what)
        except WorkflowUpdateFailedError as exc:
            if not _handing_over(exc) or time.monotonic() >= deadline:
                raise
        await asyncio.sleep(HAND_OVER_RETRY.total_seconds())


async def _taken(
    handle: WorkflowHandle[BillingPeriodWorkflow, object],
    update: UpdateMethodMultiParam[[BillingPeriodWorkflow, Request], Answer],
    request: Request,
    what: str,
) -> Answer:
    """Run an update, waiting at most ACCEPT_TIMEOUT for a worker to take it up: with no
    worker polling, the call would otherwise wait for ever, saying nothing."""
    deadline = asyncio.timeout(ACCEPT_TIMEOUT.total_seconds())
    try:
        async with deadline:
            started = await handle.start_update(
                update, request, wait_for_stage=WorkflowUpdateStage.ACCEPTED
            )
    except (WorkflowUpdateRPCTimeoutOrCancelledError, TimeoutError):
        if not deadline.expired():
            # The SDK reports a cancel from outside (Ctrl-C) in the same words.
            raise asyncio.CancelledError from None
        raise NoWorkerError(
            f"no worker took up {what} within {ACCEPT_TIMEOUT.total_seconds():.0f} s: is a"
            " worker polling the period's task queue? Temporal holds the request until one"
            " does, so it may still take effect once a worker runs (the Web UI shows it)"
        ) from None
    return await started.result()


async def skip(
    client: Client,
    settings: BillingSettings,
    database_url: str,
    period: Period,
    request: SkipRequest,
    *,
    ahead: bool = False,
    late: bool = False,
) -> SkipResult:
    """Skip through the running period, or, when none runs, mark it for the next run. For a
    period that has had no run, one far from now is refused unless `ahead` or `late` says
    it is meant (periods.check_skip_by_hand)."""
    handle = client.get_workflow_handle_for(BillingPeriodWorkflow.run, period_workflow_id(period))
    try:
        return await _update(
            handle,
            BillingPeriodWorkflow.skip,
            request,
            f"the skip of {request.customer_id} in {period}",
        )
    except WorkflowUpdateFailedError as exc:
        raise _refused(exc) from None
    except RPCError as exc:
        if exc.status not in _NOT_RUNNING:
            raise
    key = idempotency_key(settings.billing_key_namespace, request.customer_id, period)
    pool = await create_pool(database_url, max_size=1)
    try:
        async with pool.acquire() as conn:
            if await ledger.period_record(conn, str(period)) is None:
                check_skip_by_hand(period, datetime.now(UTC), ahead=ahead, late=late)
            return await ledger.request_skip(
                conn, request.customer_id, str(period), key, request.reason, request.operator
            )
    finally:
        await pool.close()

"""How a period's run stands, read from the ledger and Temporal together: open, ended before
its close (terminated, failed, gone), or finished as a launch leaves it."""

from __future__ import annotations

from typing import Literal

import asyncpg
from temporalio.client import Client, WorkflowExecutionStatus

from billing import ledger
from billing.keys import period_workflow_id
from billing.models import Control
from billing.periods import Period, parse_period
from billing.temporal_client import workflow_status

# How a launch finds a period's run it leaves as it is (finished_runs).
Finished = Literal["completed", "cancelled", "cancelling"]


# A period's run whose ledger row is still open is billing while its workflow runs (or has
# just completed, its close written first); in any other state it ended without a close.
_STILL_BILLING = frozenset(
    {
        WorkflowExecutionStatus.RUNNING,
        WorkflowExecutionStatus.CONTINUED_AS_NEW,
        WorkflowExecutionStatus.COMPLETED,
    }
)


async def ended_open(
    client: Client, conn: asyncpg.Connection, periods: list[str]
) -> dict[str, Control]:
    """Those of `periods` whose run ended before its close (terminated by an operator who
    thought it stuck, failed, or cancelled by a release before Temporal's cancel was one;
    gone from Temporal since), with the control it had: the ledger holds it open until an
    operator's `cancel` closes it (operations.cancel_ended_run)."""
    ended = {}
    for period, control in (await ledger.open_runs(conn, sorted(periods))).items():
        run = client.get_workflow_handle(period_workflow_id(parse_period(period)))
        if ended_unclosed(await workflow_status(run)):
            ended[period] = control
    return ended


def ended_unclosed(status: WorkflowExecutionStatus | None) -> bool:
    """Whether a period's run the ledger holds open has ended without its close, by its
    workflow's status (None: gone from Temporal)."""
    return status not in _STILL_BILLING


async def joined_open_runs(
    client: Client, conn: asyncpg.Connection, periods: list[str]
) -> dict[str, Control]:
    """Those of `periods` whose run is open, with its control: a launch joins it (and one
    paused bills nothing until it is resumed). One the ledger holds open whose workflow has
    ended is not (ended_open): a launch starts it again, running."""
    open_runs = await ledger.open_runs(conn, periods)
    ended = await ended_open(client, conn, list(open_runs))
    return {p: control for p, control in open_runs.items() if p not in ended}


async def ended_unfinished(
    client: Client, conn: asyncpg.Connection, periods: list[Period]
) -> list[Period]:
    """Those of `periods` whose run ended before its close (ended_open) unless an operator
    had cancelled it: the customers it had not claimed are billed by no run and have no claim
    to reconcile (the period's reconciliation counts them). A launch (`schedule trigger` or
    `backfill`) or `run` starts it again, running even if it was paused."""
    ended = await ended_open(client, conn, [str(p) for p in periods])
    return [parse_period(p) for p, control in ended.items() if control != "cancelled"]


async def finished_runs(conn: asyncpg.Connection, periods: list[str]) -> dict[str, Finished]:
    """Those of `periods` a launch leaves as they are, in order: a run that completed (cancelled
    ones too), or one an operator cancelled that has not closed, whose customers it had not
    charged stay unbilled as the operator asked: still finishing the charges it had sent (a
    launch would join it, starting nothing), or ended before its close."""
    completed = await ledger.completed_runs(conn, periods)
    open_runs = await ledger.open_runs(conn, periods)
    finished: dict[str, Finished] = {
        p: "cancelled" if cancelled else "completed" for p, cancelled in completed.items()
    }
    finished |= {p: "cancelling" for p, control in open_runs.items() if control == "cancelled"}
    return dict(sorted(finished.items()))


def describe_finished(finished: dict[str, Finished]) -> str:
    """Each period's run as a launch finds it, for the operator told it is left as it is."""
    said = {
        "completed": "completed",
        "cancelled": "was cancelled",
        # Only Temporal tells a run finishing its charges from one terminated before its close.
        "cancelling": "was cancelled (it may still be finishing the charges it had sent)",
    }
    return "; ".join(f"{period}'s run {said[how]}" for period, how in finished.items())

"""Runs one command and turns its errors into one line and an exit code."""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import asyncpg
from pydantic import ValidationError
from pydantic_core import ErrorDetails
from temporalio.client import WorkflowFailureError, WorkflowQueryFailedError
from temporalio.service import RPCError, RPCStatusCode

from billing import logs
from billing.db import CONNECTION_ERRORS
from billing.errors import BillingError, RunEndedError, validation_reason
from billing.models import EndedRun
from billing.redact import redact
from billing.reporting import failure_chain
from billing.runs import TEMPORAL_AWAY
from cli.commands import parser

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
    message = validation_reason(error["msg"])
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
        # Temporal refused a call, or was not there to: its own words carry no secret of ours.
        if exc.status in TEMPORAL_AWAY:
            print(
                f"error: Temporal cannot be reached ({exc.status.name}: {exc.message}): what"
                " runs there goes on; try again once it is back",
                file=sys.stderr,
            )
            return 2
        hint = (
            ": the namespace lacks the project's search attributes; `python starter.py setup`"
            " registers them"
            if exc.status == RPCStatusCode.INVALID_ARGUMENT and "search attribute" in exc.message
            else ""
        )
        print(f"error: Temporal answered {exc.status.name}: {exc.message}{hint}", file=sys.stderr)
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

"""Replaying histories against the current workflow code, both ways the code can run."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner
from temporalio.workflow import NondeterminismError

from billing.data_converter import DATA_CONVERTER
from tests.integration.timeline import events
from worker import WORKFLOWS

HISTORIES = Path(__file__).resolve().parent.parent / "histories"
# The SDK's code for a workflow that did not yield within its deadlock timeout.
DEADLOCK = "[TMPRL1101]"
DEADLOCK_TRIES = 3


async def replay(histories: Iterable[WorkflowHistory]) -> None:
    """Replay as the worker runs them, then with every workflow inside the sandbox, whose
    checks (no clock, randomness or I/O of the workflow's own) the worker skips for the
    period and its children."""
    recorded = list(histories)

    async def each() -> AsyncIterator[WorkflowHistory]:
        for history in recorded:
            yield history

    for unsandboxed_runner in (UnsandboxedWorkflowRunner(), SandboxedWorkflowRunner()):
        replayer = Replayer(
            workflows=WORKFLOWS,
            data_converter=DATA_CONVERTER,
            unsandboxed_workflow_runner=unsandboxed_runner,
        )
        for tries_left in reversed(range(DEADLOCK_TRIES)):
            try:
                results = await replayer.replay_workflows(each(), raise_on_replay_failure=False)
                for history in recorded:
                    failure = results.replay_failures.get(history.run_id)
                    if isinstance(failure, NondeterminismError):
                        # A rare one, seen once in CI, is read from the log: it may not come back.
                        raise AssertionError(f"{failure}\n{events(history)}") from failure
                    if failure is not None:
                        raise failure
                break
            except RuntimeError as failure:
                # An activation past the SDK's 2 s deadlock check on a loaded machine (one
                # starting 60 children in the sandbox): slowness, not a replay that differs,
                # which fails as NondeterminismError, and a real deadlock fails every try.
                if DEADLOCK not in str(failure) or not tries_left:
                    raise


def keep(histories: Iterable[WorkflowHistory]) -> None:
    """With RECORD_HISTORIES=1, write the histories to tests/histories, which test_replay
    replays ever after: a workflow change that breaks them fails there."""
    if not os.environ.get("RECORD_HISTORIES"):
        return
    HISTORIES.mkdir(exist_ok=True)
    for history in histories:
        started = history.events[0].workflow_execution_started_event_attributes
        name = f"{started.workflow_type.name}--{history.workflow_id}--{history.run_id}.json"
        (HISTORIES / name).write_text(history.to_json())

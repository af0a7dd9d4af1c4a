"""Replaying histories against the current workflow code, both ways the code can run."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from worker import WORKFLOWS


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
            data_converter=pydantic_data_converter,
            unsandboxed_workflow_runner=unsandboxed_runner,
        )
        await replayer.replay_workflows(each(), raise_on_replay_failure=True)

"""Temporal goes away while a command waits on a run or watches it (a restart, a deploy, a
network cut): the run goes on on the server, so the command goes on once Temporal is back,
rather than ending in an error while the run bills on."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError

from billing import operations
from billing.keys import reconcile_workflow_id
from billing.models import OperatorRequest
from billing.periods import period_for
from billing.runs import start_period
from starter import NO_WORKER_SECONDS
from tests.integration.cuttable_front import CuttableFront, cuttable_front
from tests.integration.harness import Harness, eventually
from tests.integration.invariants import assert_billed_once

PERIOD = period_for(datetime.now(UTC), "advance")


async def _connected(front: CuttableFront) -> bool:
    return front.connections > 0


class Stderr:
    """A starter process's stderr, read as it comes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        self._stream = process.stderr
        self.lines: list[str] = []
        self.reading = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while line := await self._stream.readline():
            self.lines.append(line.decode())

    async def says(self, words: str) -> bool:
        return any(words in line for line in self.lines)


async def test_run_wait_outlasts_temporal_going_away(harness: Harness) -> None:
    customers = await harness.seed(3)
    async with cuttable_front(harness.client.service_client.config.target_host) as front:
        waiting = await harness.starter_process(
            "run", str(PERIOD), "--wait", TEMPORAL_ADDRESS=front.address
        )
        assert waiting.stdout is not None
        stderr = Stderr(waiting)
        said = stderr.lines
        saying = stderr.says
        # No worker yet: `run` says so after its status query, then waits for the summary.
        await eventually(lambda: saying("no worker answered its query"))
        await front.cut()
        await eventually(lambda: saying("warning: Temporal cannot be reached ("))
        assert waiting.returncode is None, said
        await front.restore()
        async with harness.running_worker():
            out = (await asyncio.wait_for(waiting.stdout.read(), 120)).decode()
            code = await waiting.wait()
        await stderr.reading
    assert code == 0, said
    # Only the summary: the SDK's retries while Temporal was away are logged on stderr.
    assert out.startswith(f"period {PERIOD} (") and "charged 3," in out, out
    assert any("temporalio_client::retry" in line for line in said), said
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_watch_outlasts_temporal_going_away(harness: Harness) -> None:
    customers = await harness.seed(4)
    operator = OperatorRequest(reason="outage test", operator="alice")
    async with (
        harness.running_worker(),
        cuttable_front(harness.client.service_client.config.target_host) as front,
    ):
        handle = await start_period(harness.client, PERIOD, harness.task_queue)
        # Paused until Temporal is away from the watch, so that the run cannot end first.
        await operations.control(harness.client, PERIOD, "pause", operator)
        watching = await harness.starter_process(
            "watch", str(PERIOD), "--interval", "0.2", TEMPORAL_ADDRESS=front.address
        )
        assert watching.stdout is not None
        stderr = Stderr(watching)
        await eventually(lambda: _connected(front))
        # Its first counts in, a dozen further looks at 0.2 s.
        await asyncio.sleep(3)
        await front.cut()
        await eventually(lambda: stderr.says("warning: Temporal cannot be reached"))
        # The run ends while the watch cannot see it; the watch goes on, and reports it.
        await operations.control(harness.client, PERIOD, "resume", operator)
        summary = await handle.result()
        assert watching.returncode is None, stderr.lines
        await front.restore()
        out = (await asyncio.wait_for(watching.stdout.read(), 60)).decode()
        code = await watching.wait()
        await stderr.reading
    assert code == 0, stderr.lines
    assert await stderr.says("note: Temporal is reachable again"), stderr.lines
    assert summary.charged == 4 and "charged 4," in out, out
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_reconcile_outlasts_temporal_going_away(harness: Harness) -> None:
    """Temporal is away when `reconcile` looks whether a worker took its workflow up."""
    async with cuttable_front(harness.client.service_client.config.target_host) as front:
        started = time.monotonic()
        reconciling = await harness.starter_process(
            "reconcile", str(PERIOD), TEMPORAL_ADDRESS=front.address
        )
        assert reconciling.stdout is not None
        stderr = Stderr(reconciling)
        handle = harness.client.get_workflow_handle(reconcile_workflow_id(PERIOD))

        async def opened() -> bool:
            try:
                return (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
            except RPCError:
                return False

        await eventually(opened)
        await front.cut()
        # Past the look for a worker, and the SDK's retries of it.
        await asyncio.sleep(max(0.0, started + NO_WORKER_SECONDS + 15 - time.monotonic()))
        assert reconciling.returncode is None, stderr.lines
        assert await stderr.says("warning: Temporal cannot be reached"), stderr.lines
        await front.restore()
        async with harness.running_worker():
            out = (await asyncio.wait_for(reconciling.stdout.read(), 120)).decode()
            code = await reconciling.wait()
        await stderr.reading
    assert code == 0, stderr.lines
    assert str(PERIOD) in out, out

"""Temporal goes away while a command waits on a run (a restart, a deploy, a network cut):
the run goes on on the server, so the wait resumes once Temporal is back, rather than ending
in an error while the run bills on."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from billing.periods import period_for
from tests.integration.cuttable_front import cuttable_front
from tests.integration.harness import Harness, eventually
from tests.integration.invariants import assert_billed_once

PERIOD = period_for(datetime.now(UTC), "advance")


async def test_run_wait_outlasts_temporal_going_away(harness: Harness) -> None:
    customers = await harness.seed(3)
    async with cuttable_front(harness.client.service_client.config.target_host) as front:
        waiting = await harness.starter_process(
            "run", str(PERIOD), "--wait", TEMPORAL_ADDRESS=front.address
        )
        assert waiting.stderr is not None and waiting.stdout is not None
        said: list[str] = []

        async def read_stderr() -> None:
            assert waiting.stderr is not None
            while line := await waiting.stderr.readline():
                said.append(line.decode())

        async def saying(words: str) -> bool:
            return any(words in line for line in said)

        reading = asyncio.create_task(read_stderr())
        # No worker yet: `run` says so after its status query, then waits for the summary.
        await eventually(lambda: saying("no worker answered its query"))
        await front.cut()
        await eventually(lambda: saying("warning: Temporal cannot be reached (UNAVAILABLE"))
        assert waiting.returncode is None, said
        await front.restore()
        async with harness.running_worker():
            out = (await asyncio.wait_for(waiting.stdout.read(), 120)).decode()
            code = await waiting.wait()
        await reading
    assert code == 0, said
    # Only the summary: the SDK's retries while Temporal was away are logged on stderr.
    assert out.startswith(f"period {PERIOD} (") and "charged 3," in out, out
    assert any("temporalio_client::retry" in line for line in said), said
    await assert_billed_once(harness, str(PERIOD), customers)

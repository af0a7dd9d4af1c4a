"""Temporal goes away while a command waits on a run or watches it (a restart, a deploy, a
network cut): the run goes on on the server, so the command goes on once Temporal is back,
rather than ending in an error while the run bills on."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import pytest
from temporalio import workflow
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Worker

import billing.runs
from billing import operations
from billing.errors import ServiceUnavailableError
from billing.keys import period_workflow_id, reconcile_workflow_id
from billing.models import OperatorRequest, PeriodSummary, RunOptions
from billing.periods import period_for
from billing.runs import result_across_outages, start_period
from cli import commands, runs
from cli.main import main
from cli.output import OutageNotice
from cli.reconcile import NO_WORKER_SECONDS
from tests.integration.cuttable_front import CuttableFront, cuttable_front
from tests.integration.harness import Harness, at_least
from tests.integration.holds import ActivityHold, BillHold
from tests.integration.invariants import assert_billed_once
from tests.integration.test_runs_told_apart import PREPARE, HoldEachRun
from tests.waiting import eventually

PERIOD = period_for(datetime.now(UTC), "advance")


def _running(harness: Harness, workflow_id: str) -> Callable[[], Awaitable[bool]]:
    """A check that the workflow's latest run is open."""
    handle = harness.client.get_workflow_handle(workflow_id)

    async def check() -> bool:
        try:
            return (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
        except RPCError:
            return False

    return check


async def _called(front: CuttableFront, method: str, times: int = 1) -> bool:
    return front.calls.count(method) >= times


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


@pytest.mark.parametrize("cut", ["as-it-asks-how-the-run-stands", "as-it-waits"])
async def test_run_wait_outlasts_temporal_going_away(harness: Harness, cut: str) -> None:
    customers = await harness.seed(3)

    async with cuttable_front(harness.client.service_client.config.target_host) as front:
        waiting = await harness.starter_process(
            "run", str(PERIOD), "--wait", TEMPORAL_ADDRESS=front.address
        )
        assert waiting.stdout is not None
        stderr = Stderr(waiting)
        if cut == "as-it-waits":
            # No worker yet: `run` says so after its status query (10 s), then waits.
            await eventually(lambda: stderr.says("no worker answered its query"))
        else:
            # Started: its status query waits for a worker that is not there.
            await eventually(_running(harness, period_workflow_id(PERIOD)))
        await front.cut()
        await eventually(lambda: stderr.says("warning: Temporal cannot be reached ("))
        assert waiting.returncode is None, stderr.lines
        await front.restore()
        async with harness.running_worker():
            out = (await asyncio.wait_for(waiting.stdout.read(), 120)).decode()
            code = await waiting.wait()
        await stderr.reading
    assert code == 0, stderr.lines
    # Only the summary on stdout, and none of the SDK's retry lines (30 a minute) on stderr.
    assert out.startswith(f"period {PERIOD} (") and "charged 3," in out, out
    assert not any("temporalio_client::retry" in line for line in stderr.lines), stderr.lines
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_run_without_wait_says_the_run_is_open_when_temporal_goes_away(
    harness: Harness,
) -> None:
    """Started, then Temporal went away before it said how the run stands: `run` says the
    run is open and goes on, not only Temporal's words."""

    async with cuttable_front(harness.client.service_client.config.target_host) as front:
        starting = await harness.starter_process("run", str(PERIOD), TEMPORAL_ADDRESS=front.address)
        stderr = Stderr(starting)
        # Cut once it has the start's answer and asks how the run stands: its status query
        # waits for a worker that is not there. (Cut before that answer, `run` rightly says
        # the run may have started: a test below.)
        await eventually(lambda: _called(front, "QueryWorkflow"))
        await front.cut()
        code = await asyncio.wait_for(starting.wait(), 120)
        await stderr.reading
    assert code == 2, stderr.lines
    assert await stderr.says(
        f"error: the run of {PERIOD} is open as {period_workflow_id(PERIOD)}, but Temporal could"
        " not be reached to say how it stands (UNAVAILABLE"
    ), stderr.lines


async def test_watch_outlasts_temporal_going_away(harness: Harness) -> None:
    customers = await harness.seed(4)
    operator = OperatorRequest(reason="outage test", operator="alice")
    async with (
        harness.running_worker(),
        cuttable_front(harness.client.service_client.config.target_host) as front,
    ):
        # One charge at a time, each a second long, so the pause lands before the run ends.
        await harness.set_faults(latency_ms=1000)
        handle = await start_period(
            harness.client, PERIOD, harness.task_queue, RunOptions(max_in_flight=1)
        )
        # Paused until Temporal is away from the watch, so that the run cannot end first.
        await operations.control(harness.client, PERIOD, "pause", operator)
        watching = await harness.starter_process(
            "watch", str(PERIOD), "--interval", "0.2", TEMPORAL_ADDRESS=front.address
        )
        assert watching.stdout is not None
        stderr = Stderr(watching)
        # Its first counts in (a failed first look ends the watch) and two looks after them.
        await eventually(lambda: _called(front, "QueryWorkflow", times=3))
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


@pytest.mark.parametrize("meets", ["its-close", "a-cancel-finishing", "no-worker"])
async def test_watch_goes_on_until_the_run_has_ended(
    harness: Harness,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    meets: str,
) -> None:
    """A run writing its close, one cancelled while charges it sent are still out, or one
    whose worker is gone for a while (a deploy) has not ended: a watch that stopped there
    left the operator reading "closing", "cancelling" or an error as the run's last word."""
    customers = await harness.seed(4)
    monkeypatch.setattr(billing.runs, "QUERY_TIMEOUT", timedelta(seconds=1))
    hold = ActivityHold("close_period*") if meets == "its-close" else BillHold()
    operator = OperatorRequest(reason="watch test", operator="alice")
    async with cuttable_front(harness.client.service_client.config.target_host) as front:
        harness.use_cli_env(monkeypatch, TEMPORAL_ADDRESS=front.address)
        watch = None

        async def looked(times: int) -> bool:
            assert watch is not None
            return watch.done() or await _called(front, "QueryWorkflow", times)

        async with harness.running_worker(interceptors=[hold]):
            handle = await start_period(
                harness.client, PERIOD, harness.task_queue, RunOptions(max_in_flight=2)
            )
            if meets == "its-close":
                await asyncio.wait_for(hold.reached.wait(), 60)
            else:
                # Two charges sent and held: a cancel waits for them, a pause lets them end.
                await eventually(lambda: at_least(harness.money_requests(), 2))
                word: Literal["cancel", "pause"] = (
                    "cancel" if meets == "a-cancel-finishing" else "pause"
                )
                await operations.control(harness.client, PERIOD, word, operator)
            watch = asyncio.ensure_future(
                asyncio.to_thread(main, ["watch", str(PERIOD), "--interval", "0.2"])
            )
            # Its first look, and two more at a run that has not ended.
            await eventually(lambda: looked(3))
            ended_early = watch.done()
            hold.go.set()  # before the check, or a failed one waits on the hold
            assert not ended_early, capsys.readouterr()
            if meets != "no-worker":
                summary = await handle.result()
        if meets == "no-worker":
            # Its worker gone: two looks more, each waiting out its query.
            seen = front.calls.count("QueryWorkflow")
            await eventually(lambda: looked(seen + 2))
            assert not watch.done(), capsys.readouterr()
            async with harness.running_worker():
                await operations.control(harness.client, PERIOD, "resume", operator)
                summary = await handle.result()
        code = await asyncio.wait_for(watch, 60)
    out, err = capsys.readouterr()
    assert code == 0, err
    if meets == "a-cancel-finishing":
        assert (summary.charged, summary.cancelled) == (2, 2)
        assert "state cancelled" in out and "cancelled by alice: watch test" in out, out
    else:
        assert summary.charged == 4 and "state completed" in out, out
        await assert_billed_once(harness, str(PERIOD), customers)
    assert f"due 4: charged {summary.charged}, already billed" in out, out


async def test_reconcile_outlasts_temporal_going_away(harness: Harness) -> None:
    """Temporal is away when `reconcile` looks whether a worker took its workflow up."""
    async with cuttable_front(harness.client.service_client.config.target_host) as front:
        started = time.monotonic()
        reconciling = await harness.starter_process(
            "reconcile", str(PERIOD), "--unbilled", TEMPORAL_ADDRESS=front.address
        )
        assert reconciling.stdout is not None
        stderr = Stderr(reconciling)
        await eventually(_running(harness, reconcile_workflow_id(PERIOD)))
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
    # Its wait is one long poll: it says Temporal is back all the same (it said nothing).
    assert await stderr.says("note: Temporal is reachable again"), stderr.lines


@pytest.mark.parametrize("wait", [True, False], ids=["wait", "no-wait"])
async def test_run_whose_start_answer_was_lost_joins_the_run_it_started(
    harness: Harness,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    wait: bool,
) -> None:
    """Temporal started the run, then went away before `run` had its answer. With --wait it
    asks again once Temporal answers, joins the run it started and reports it, as `reconcile`
    does; without, it says the run may have started, and what to do, not only Temporal's
    words."""
    customers = await harness.seed(2)
    harness.use_cli_env(monkeypatch)
    started: list[str | None] = []

    async def answer_lost_once(*args: Any) -> WorkflowHandle[Any, PeriodSummary]:
        handle = await start_period(*args)
        started.append(handle.first_execution_run_id)
        if len(started) == 1:
            raise RPCError("connection reset", RPCStatusCode.UNAVAILABLE, b"")
        return handle

    monkeypatch.setattr(runs, "start_period", answer_lost_once)
    args = commands.parser().parse_args(["run", str(PERIOD), *(["--wait"] if wait else [])])
    async with harness.running_worker():
        if wait:
            assert await asyncio.wait_for(runs.cmd_run(args), 60) == 0
            out, err = capsys.readouterr()
            assert "charged 2," in out, out
            assert "warning: Temporal cannot be reached (UNAVAILABLE: connection reset)" in err
            # Joined (the run still open), or found ended: started once.
            assert set(started) == {started[0]}
        else:
            with pytest.raises(
                ServiceUnavailableError,
                match=f"to start the run of {PERIOD} \\(UNAVAILABLE: connection reset\\): it"
                " may have started all the same",
            ):
                await runs.cmd_run(args)
            await harness.client.get_workflow_handle(period_workflow_id(PERIOD)).result()
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_run_wait_that_joined_an_open_run_which_ended_during_the_outage_starts_no_other(
    harness: Harness,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The period's run A is open when `run --wait` first looks; its start joins A but the
    answer is lost, and A completes during the outage. The command's next try saw the same
    latest run and started a second, reporting "charged 0, already billed 2" for the run it
    had joined: a run open at the first look and ended since is the one it joined
    (helper-162 F1)."""
    await harness.seed(2)
    harness.use_cli_env(monkeypatch)
    hold = HoldEachRun(PREPARE)
    started: list[str | None] = []

    async def joined_then_answer_lost(*args: Any) -> WorkflowHandle[Any, PeriodSummary]:
        handle = await start_period(*args)
        started.append(handle.result_run_id)
        if len(started) == 1:
            # Joined A; A goes on and completes while Temporal is away for this command.
            hold.release(PREPARE, handle.result_run_id or "")
            await harness.client.get_workflow_handle(period_workflow_id(PERIOD)).result()
            raise RPCError("connection reset", RPCStatusCode.UNAVAILABLE, b"")
        # A second run (if the command starts one): let it go so the command can end.
        hold.release_all(PREPARE)
        return handle

    monkeypatch.setattr(runs, "start_period", joined_then_answer_lost)
    args = commands.parser().parse_args(["run", str(PERIOD), "--wait"])
    async with harness.running_worker(interceptors=[hold]):
        first = await start_period(harness.client, PERIOD, harness.task_queue)
        run_a = (await first.describe()).run_id
        await hold.reached(PREPARE, run_a)  # A is open at the command's first look
        assert await asyncio.wait_for(runs.cmd_run(args), 90) == 0
        out, _ = capsys.readouterr()
    assert started[0] == run_a
    assert set(started) == {run_a}, (
        f"the command started another run {started[1:]} after joining {run_a}; it reported: {out!r}"
    )
    assert "charged 2," in out, out


@workflow.defn(name="ContinuesOnce", sandboxed=False)
class ContinuesOnce:
    """Continues as new once, then waits to be told to finish."""

    def __init__(self) -> None:
        self._finish = False

    @workflow.signal
    def finish(self) -> None:
        self._finish = True

    @workflow.run
    async def run(self, hops: int) -> int:
        if hops > 0:
            workflow.continue_as_new(hops - 1)
        await workflow.wait_condition(lambda: self._finish)
        return 7


async def test_a_wait_resumes_from_the_latest_run_it_reached(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an outage the wait goes on from the run it had followed to, not from the first
    run of the chain, which may have passed the namespace's retention meanwhile."""
    queue = f"chain-{uuid.uuid4()}"
    heard: list[RPCError] = []
    async with (
        Worker(harness.client, task_queue=queue, workflows=[ContinuesOnce]),
        cuttable_front(harness.client.service_client.config.target_host) as front,
    ):
        through_front = await Client.connect(front.address, namespace=harness.client.namespace)
        # The runs the wait goes on to, as it takes their handles.
        followed_to: list[str | None] = []
        real_handle = through_front.get_workflow_handle

        def following(*args: Any, **kwargs: Any) -> WorkflowHandle[Any, Any]:
            followed_to.append(kwargs.get("run_id"))
            return real_handle(*args, **kwargs)

        monkeypatch.setattr(through_front, "get_workflow_handle", following)
        handle = await through_front.start_workflow(
            ContinuesOnce.run, 1, id=f"chain-{uuid.uuid4()}", task_queue=queue
        )
        waiting = asyncio.ensure_future(
            result_across_outages(through_front, handle, int, heard.append)
        )
        first_run = handle.result_run_id
        assert first_run is not None
        first = harness.client.get_workflow_handle(handle.id, run_id=first_run)

        async def continued() -> bool:
            return (await first.describe()).status == WorkflowExecutionStatus.CONTINUED_AS_NEW

        await eventually(continued)

        async def followed() -> bool:
            # Its long poll saw the first run close: it waits on the run continued to.
            return any(run not in (None, first_run) for run in followed_to)

        await eventually(followed)
        await front.cut()
        await eventually(lambda: _any(heard))
        # Retention drops the first run while Temporal is away from the waiter.
        await harness.client.workflow_service.delete_workflow_execution(
            DeleteWorkflowExecutionRequest(
                namespace=harness.client.namespace,
                workflow_execution=WorkflowExecution(workflow_id=handle.id, run_id=first_run),
            )
        )

        async def gone() -> bool:
            try:
                await first.describe()
            except RPCError as exc:
                return exc.status == RPCStatusCode.NOT_FOUND
            return False

        # Deleting is a task of the server's own, seconds to tens of seconds away.
        await eventually(gone, timeout=120)
        await front.restore()
        await harness.client.get_workflow_handle(handle.id).signal(ContinuesOnce.finish)
        assert await asyncio.wait_for(waiting, 60) == 7


async def _any(items: list[RPCError]) -> bool:
    return bool(items)


async def test_a_notice_told_of_an_outage_elsewhere_hears_it_end_with_the_result(
    harness: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    """`reconcile` shares its notice with its look for a worker: when that look met the outage
    and the result's long poll, retried inside the SDK, outlasted it, the result says so."""
    queue = f"chain-{uuid.uuid4()}"
    async with Worker(harness.client, task_queue=queue, workflows=[ContinuesOnce]):
        handle = await harness.client.start_workflow(
            ContinuesOnce.run, 0, id=f"chain-{uuid.uuid4()}", task_queue=queue
        )
        await handle.signal(ContinuesOnce.finish)
        notice = OutageNotice("the chain")
        notice(RPCError("tcp connect error", RPCStatusCode.UNAVAILABLE, b""))
        result = result_across_outages(harness.client, handle, int, notice, notice.back)
        assert await asyncio.wait_for(result, 60) == 7
    assert "note: Temporal is reachable again" in capsys.readouterr().err


@pytest.mark.parametrize("partition", [False, True], ids=["no-worker", "partition"])
async def test_a_status_query_temporal_stopped_answering_is_not_blamed_on_the_workers(
    harness: Harness,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    partition: bool,
) -> None:
    """With no worker a run's status query times out; one Temporal stopped answering midway
    (a partition: no refusal, only silence) times out alike, and is an outage: `status`
    said "is a worker polling?" of both (helper-212)."""
    await harness.seed(1)
    await start_period(harness.client, PERIOD, harness.task_queue)
    monkeypatch.setattr(billing.runs, "QUERY_TIMEOUT", timedelta(seconds=2))
    async with cuttable_front(harness.client.service_client.config.target_host) as front:
        harness.use_cli_env(monkeypatch, TEMPORAL_ADDRESS=front.address)
        status = asyncio.ensure_future(asyncio.to_thread(main, ["status", str(PERIOD)]))
        await eventually(lambda: _called(front, "QueryWorkflow"))
        if partition:
            front.freeze()
        code = await asyncio.wait_for(status, 60)
    err = capsys.readouterr().err
    said = {
        "Temporal cannot be reached (CANCELLED: Timeout expired)": partition,
        "no worker answered its query within 2 s": not partition,
    }
    assert (code, {words: words in err for words in said}) == (2, said), err

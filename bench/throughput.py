"""End-to-end billing throughput on the local stack, against Temporal's ceiling and a baseline.

Three measurements (four with --shaped-ceiling), one after the other, on the same stack (the
running one in `.devstack/env`, or one started for the run and stopped after, unless
--keep-running):

- ceiling: `FanOutWorkflow` (bench/ceiling_workflows.py) fans out N children that do nothing,
  exactly as BillingPeriodWorkflow fans out customers; it runs on its own task queue with a
  Worker inside this process, so the stack's worker is untouched. Half the children before the
  orchestrated run and half after (`ceiling_halves_per_s`); children/s over both.
- shaped ceiling (--shaped-ceiling): the same, with children of the billing child's shape that
  do no work (`ShapedChildWorkflow`: the bill as a local activity answering at once, the
  BillingStatus upsert): no-op, shaped, orchestrated, shaped, no-op. It splits the gap to the
  ceiling into what the child's shape costs Temporal (and the worker) and what the billing
  work costs on top.
- orchestrated: N demo customers (all with pm_card_visa) are created in the emulator and the
  ledger, and a fresh period of them is billed by `billing.runs.start_period` on the stack's
  worker, timed from the start to the period's summary. Customers/s.
- baseline: a plain asyncio loop, no Temporal, bills N other customers for another fresh
  period through the same code: open the period as a run's preparation does (plan, keys,
  record), list due customers, then with the
  orchestrated window's concurrency claim (ledger.claim), pass the gate (ledger.begin_charge),
  charge through the vault with the period's key (or straight to Stripe without
  BILLING_VAULT_URL), retrying what Temporal would retry with Temporal's policy, record
  (ledger.record_charge), close. Customers/s.

A period bills every active customer, so for the run the customers already in the ledger are
set inactive and set active again at the end; the benchmark's own customers are left inactive.
--emulator-latency-ms and --rate-limit-rps are set on the emulator (POST /_emulator/faults)
for the orchestrated and baseline runs only, and reset after. --stripe-rps is the worker's
BILLING_STRIPE_RPS, the cluster's own limit; a worker reads it at start, so it needs a stack
started by this run. The baseline has no limit of its own: it retries the emulator's 429s.

    .venv/bin/python bench/throughput.py --customers 500 --json
    .venv/bin/python bench/throughput.py --customers 300 --emulator-latency-ms 300 \\
        --rate-limit-rps 25 --stripe-rps 25 --json

Prints one JSON object (with --json, the only thing on stdout) and writes it to bench/results/.
`cpu_cores` gives, per measurement, the cores each process of the stack used on average and
`machine_busy_cores` all the machine's: anything else running shows up there.
`cpu_ms_per_customer` gives the CPU time each spent per customer (per child in a ceiling), and
`machine` the machine's; `cpu_per_emulator` the same in units of the emulator's, whose work
does not change with the code: compare those across sessions (the machine's speed drifts).
`orchestrated.other_pollers` names any worker besides the stack's that polled its task queue
during the run (a warning says so too): its share is not measured.
`parent_tasks`, `parent_task_ms` and `parent_busy` give, for the period's runs and the
ceiling's parent, its workflow tasks, the mean time each was in flight, and the share of the
measurement that one was (read from the histories).

One run's ratio to the ceiling moves by about 0.06 between runs of the same code (machine
noise, bench/FINDINGS.md). --rounds R repeats the orchestrated run R times, each on a fresh
period of fresh customers between halves of the ceilings, on the same stack: the top-level
figures pool the rounds (all customers over all the time), `each_round` gives each round's
rates and ratios, and `ceiling_ratio_mean` the mean of its ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

import aiohttp
import asyncpg
import stripe
import uvloop
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from temporalio.api.enums.v1 import EventType, TaskQueueType  # noqa: E402
from temporalio.api.taskqueue.v1 import TaskQueue  # noqa: E402
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest  # noqa: E402
from temporalio.client import Client, WorkflowHistory  # noqa: E402
from temporalio.service import RPCError, RPCStatusCode  # noqa: E402
from temporalio.worker import PollerBehavior, PollerBehaviorSimpleMaximum, Worker  # noqa: E402

from activities.period import PeriodActivities, PrepareRequest  # noqa: E402
from activities.stripe_access import DirectAccess, StripeAccess, VaultAccess  # noqa: E402
from activities.stripe_failures import to_temporal_failure  # noqa: E402
from activities.stripe_gateway import StripeGateway  # noqa: E402
from bench.ceiling_workflows import (  # noqa: E402
    CEILING_CHILDREN,
    ChildKind,
    FanOutInput,
    FanOutResult,
    FanOutWorkflow,
)
from bench.stack_support import write_result  # noqa: E402
from billing import ledger, payload_walks  # noqa: E402
from billing.config import (  # noqa: E402
    BillingSettings,
    DatabaseSettings,
    ObservabilitySettings,
    TemporalSettings,
)
from billing.customers import upsert_customers  # noqa: E402
from billing.db import create_pool  # noqa: E402
from billing.keys import idempotency_key, period_workflow_id  # noqa: E402
from billing.metrics import temporal_runtime  # noqa: E402
from billing.migrations import migrate  # noqa: E402
from billing.models import ChargeFailure, ChargeResult, Claim, RunOptions  # noqa: E402
from billing.periods import Period  # noqa: E402
from billing.runs import drain, start_period  # noqa: E402
from billing.seeding import create_demo_customers  # noqa: E402
from billing.stripe_client import stripe_client, stripe_http, stripe_session  # noqa: E402
from billing.temporal_client import connect  # noqa: E402
from devstack.demo import ensure_stack  # noqa: E402
from devstack.stack import StackConfig  # noqa: E402
from vault.client import VaultAdmin  # noqa: E402
from worker import (  # noqa: E402
    NONSTICKY_TO_STICKY_POLL_RATIO,
    WORKFLOW_CACHE,
    WORKFLOW_TASK_POLLING,
    WORKFLOW_TASK_SLOTS,
)

# The retry policy of the charge activity (workflows/customer_charge.py), for the baseline.
RETRY_INITIAL = 1.0
RETRY_BACKOFF = 2.0
RETRY_MAX = 30.0
BASELINE_WORKFLOW_ID = "bench-baseline"
RSS_SAMPLE_SECONDS = 2.0
# Often enough to meet the busiest moments of a run; each probe holds the row a millisecond.
LOCK_SAMPLE_SECONDS = 0.5
T = TypeVar("T")
QUIET = False


def say(message: str) -> None:
    print(message, file=sys.stderr if QUIET else sys.stdout, flush=True)


# -- CPU accounting (Linux /proc) ---------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_seconds() -> float:
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def emulator_units(ms_per_customer: dict[str, float]) -> dict[str, float]:
    """Each process's CPU per customer in units of the emulator's: its code and its work per
    customer (one create through the vault) do not change with the billing code, so these
    compare across sessions on a machine whose speed drifts 5-10% between them (FINDINGS,
    2026-12-06: a worker's 7.1 then 7.7 ms per customer were 14.0 units both). Empty for a
    ceiling, which never calls the emulator."""
    emulator = ms_per_customer.get("emulator", 0.0)
    if emulator < 0.05:
        return {}
    return {name: round(ms / emulator, 1) for name, ms in ms_per_customer.items()}


def _processes() -> Iterator[tuple[int, int, list[str]]]:
    """(pid, parent pid, argv) of every process we may read."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = [a.decode(errors="replace") for a in cmdline.read().split(b"\0") if a]
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if argv:
            yield int(entry), ppid, argv


def _port(argv: list[str]) -> str | None:
    for flag in ("--port", "-p"):
        if flag in argv and argv.index(flag) + 1 < len(argv):
            return argv[argv.index(flag) + 1]
    return None


async def other_pollers(client: Client, task_queue: str, since: datetime) -> list[str]:
    """Workers other than the stack's that polled the task queue's workflow tasks since
    `since`: one started by hand shares the run's children, and the figures then mix two
    workers (the CPU meter counts only the stack's). Identities are the SDK's default,
    pid@host. The local stack's queue has one partition, so its pollers are all listed."""
    ours = {f"{pid}@{socket.gethostname()}" for pid in stack_processes()["worker"]}
    try:
        response = await client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=client.namespace,
                task_queue=TaskQueue(name=task_queue),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
            )
        )
    except RPCError as exc:
        # The run is measured already; its figures are kept, unchecked.
        print(f"warning: could not list the pollers of {task_queue}: {exc}", file=sys.stderr)
        return []
    return sorted(
        poller.identity
        for poller in response.pollers
        if poller.identity not in ours and poller.last_access_time.ToDatetime(UTC) >= since
    )


def _stack_supervisor() -> int | None:
    """The pid of `python -m devstack up`, whose child the stack's worker is."""
    try:
        return int(StackConfig().pid_file.read_text())
    except (OSError, ValueError):
        return None


def stack_processes() -> dict[str, list[int]]:
    """The local stack's processes, found by their command line and the ports in the env; the
    worker also by its parent, so a worker started by hand from the same file is not counted."""
    temporal_port = os.environ["TEMPORAL_ADDRESS"].rsplit(":", 1)[1]
    ports = {
        "emulator": str(urlsplit(os.environ.get("STRIPE_EMULATOR_URL", "")).port),
        "vault": str(urlsplit(os.environ.get("BILLING_VAULT_URL", "")).port),
        "postgres": str(urlsplit(os.environ["DATABASE_URL"]).port),
    }
    found: dict[str, list[int]] = {
        "temporal": [],
        "worker": [],
        "postgres": [],
        "vault": [],
        "emulator": [],
    }
    postmasters: set[int] = set()
    supervisor = _stack_supervisor()
    table = list(_processes())
    for pid, ppid, argv in table:
        name = Path(argv[0]).name
        if name == "temporal" and "start-dev" in argv and _port(argv) == temporal_port:
            found["temporal"].append(pid)
        elif str(ROOT / "worker.py") in argv and supervisor in (None, ppid):
            found["worker"].append(pid)
        elif "-m" in argv and "vault" in argv and _port(argv) == ports["vault"]:
            found["vault"].append(pid)
        elif "stripe_emulator" in argv and _port(argv) == ports["emulator"]:
            found["emulator"].append(pid)
        elif name == "postgres" and _port(argv) == ports["postgres"]:
            postmasters.add(pid)
    found["postgres"] = sorted(postmasters) + [p for p, pp, _ in table if pp in postmasters]
    found["benchmark"] = [os.getpid()]
    return found


class CpuMeter:
    """CPU used by each stack process (and the machine) between start() and stop(): cores,
    and time per customer."""

    def __init__(self) -> None:
        self._before: dict[str, dict[int, float]] = {}
        self._machine = 0.0
        self._started = 0.0

    @staticmethod
    def _sample() -> dict[str, dict[int, float]]:
        return {
            name: {pid: _cpu_seconds(pid) for pid in pids}
            for name, pids in stack_processes().items()
        }

    def start(self) -> None:
        self._before = self._sample()
        self._machine = _machine_busy_seconds()
        self._started = time.monotonic()

    def stop(self, customers: int) -> dict[str, dict[str, float]]:
        """`cpu_cores`: each process's cores on average, and the machine's; and
        `cpu_ms_per_customer`: the CPU time each spent per customer (or child), in ms."""
        elapsed = time.monotonic() - self._started
        used: dict[str, float] = {}
        for name, now in self._sample().items():
            before = self._before.get(name, {})
            # A process started meanwhile (the backend of a new PostgreSQL connection) counts
            # in full; one that ended meanwhile is lost.
            used[name] = sum(cpu - before.get(pid, 0.0) for pid, cpu in now.items())
        machine = _machine_busy_seconds() - self._machine
        per_customer = {
            name: cpu * 1000 / customers for name, cpu in {**used, "machine": machine}.items()
        }
        return {
            "cpu_cores": {
                **{name: round(cpu / elapsed, 2) for name, cpu in used.items()},
                "machine_busy_cores": round(machine / elapsed, 2),
            },
            "cpu_ms_per_customer": {name: round(ms, 2) for name, ms in per_customer.items()},
            # From the unrounded figures: the emulator's 0.5 ms rounds to 1%.
            "cpu_per_emulator": emulator_units(per_customer),
        }


# The dev server's log: a run must leave no warning of a Temporal limit in it (history size or
# count, pending children, signals, mutable state...).
TEMPORAL_LOG = StackConfig().log_dir / "temporal.log"
LIMIT_WARNING = re.compile(r'level=(WARN|ERROR) msg="[^"]*limit', re.IGNORECASE)


def temporal_log_size() -> int:
    return TEMPORAL_LOG.stat().st_size if TEMPORAL_LOG.exists() else 0


def temporal_limit_warnings(since: int) -> list[str]:
    """Lines about a Temporal limit the dev server logged after offset `since`."""
    if not TEMPORAL_LOG.exists():
        return []
    with TEMPORAL_LOG.open("rb") as log:
        log.seek(since)
        lines = log.read().decode(errors="replace").splitlines()
    return [line[:300] for line in lines if LIMIT_WARNING.search(line)]


def worker_memory_mb() -> dict[str, float]:
    """The stack's worker processes' resident memory now and at its peak (VmHWM), in MiB."""
    fields = {"VmRSS:": "worker_rss_mb", "VmHWM:": "worker_peak_rss_mb"}
    kib = dict.fromkeys(fields.values(), 0)
    for pid in stack_processes()["worker"]:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                name, *value = line.split()
                if name in fields:
                    kib[fields[name]] += int(value[0])
    return {name: round(size / 1024, 1) for name, size in kib.items()}


def reset_worker_peak() -> None:
    """Start the worker's VmHWM again from its resident size now, so that a run's peak is its
    own, not one of an earlier run on the same worker (`--rounds`, a kept stack)."""
    for pid in stack_processes()["worker"]:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError as exc:
            print(
                f"warning: the worker's peak memory could not be reset ({exc}): its peak is"
                " the highest since the worker started",
                file=sys.stderr,
            )


# -- the stack's data -----------------------------------------------------------------------


async def set_faults(latency_ms: int, rate_limit_rps: float | None) -> None:
    url = os.environ["STRIPE_EMULATOR_URL"].rstrip("/") + "/_emulator/faults"
    body = {"latency_ms": latency_ms, "rate_limit_rps": rate_limit_rps}
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"emulator refused {body}: {await response.text()}")


async def emulator_rate_limited() -> int:
    """How many requests the emulator has answered 429 so far."""
    url = os.environ["STRIPE_EMULATOR_URL"].rstrip("/") + "/_emulator/ledger"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        counts = (await response.json())["faults_injected"]
    return int(counts.get("rate_limited", 0))


async def fresh_periods(client: Client, pool: asyncpg.Pool, count: int) -> list[Period]:
    """Periods no run and no ledger row has touched; past ones, so keys expire soon."""
    async with pool.acquire() as conn:
        used = {
            row["p"]
            for row in await conn.fetch(
                "SELECT billing_period AS p FROM billing_periods"
                " UNION SELECT DISTINCT billing_period FROM billing_runs"
            )
        }
    periods: list[Period] = []
    while len(periods) < count:
        period = Period(2000 + secrets.randbelow(20), 1 + secrets.randbelow(12))
        if str(period) in used or period in periods:
            continue
        try:
            await client.get_workflow_handle(period_workflow_id(period)).describe()
            continue
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
        periods.append(period)
    return periods


async def seed(pool: asyncpg.Pool, count: int, prefix: str) -> list[str]:
    """N customers in the emulator and the ledger, every one with a card that is charged."""
    async with stripe_session(BillingSettings()) as client:
        rows = await create_demo_customers(client, count, prefix, card_for=lambda _: "pm_card_visa")
    await upsert_customers(pool, rows)
    return [row.customer_id for row in rows]


async def set_active(pool: asyncpg.Pool, customer_ids: list[str], active: bool) -> None:
    async with pool.acquire() as conn:
        await conn.execute(
            "UPDATE customers SET active = $2, updated_at = now()"
            " WHERE customer_id = ANY($1::text[])",
            customer_ids,
            active,
        )


# -- the three measurements ------------------------------------------------------------------


async def measure_ceiling(
    client: Client,
    customers: int,
    options: RunOptions,
    meter: CpuMeter,
    token: str,
    workflow_polls: int | None,
    child: ChildKind,
) -> dict[str, Any]:
    task_queue = f"bench-ceiling-{token}"
    children = CEILING_CHILDREN[child]
    # The stack's worker's slots and pollers (unless --ceiling-workflow-polls sets a fixed
    # number), so the fan-outs differ only in what the children do.
    polling: PollerBehavior = (
        WORKFLOW_TASK_POLLING
        if workflow_polls is None
        else PollerBehaviorSimpleMaximum(workflow_polls)
    )
    # As the stack's worker does (worker.create_worker).
    payload_walks.skip_identity_walks()
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[FanOutWorkflow, children.workflow],
        activities=list(children.activities),
        max_concurrent_workflow_tasks=WORKFLOW_TASK_SLOTS,
        max_cached_workflows=WORKFLOW_CACHE,
        workflow_task_poller_behavior=polling,
        nonsticky_to_sticky_poll_ratio=NONSTICKY_TO_STICKY_POLL_RATIO,
    ):

        async def fan_out(prefix: str, count: int) -> FanOutResult:
            return await client.execute_workflow(
                FanOutWorkflow.run,
                FanOutInput(
                    prefix=prefix,
                    count=count,
                    max_in_flight=options.max_in_flight,
                    max_starting=options.max_starting,
                    history_event_limit=options.history_event_limit,
                    child=child,
                ),
                id=prefix,
                task_queue=task_queue,
            )

        await fan_out(f"bench-warmup-{token}", min(customers, 50))
        prefix = f"bench-ceiling-{token}"
        meter.start()
        started = time.monotonic()
        result = await fan_out(prefix, customers)
        elapsed = time.monotonic() - started
        cpu = meter.stop(result.finished)
        # Keep the worker until every child is closed, or one stays open on a task queue
        # nobody polls.
        if not await drain(client, task_queue):
            say(f"warning: workflows still running on {task_queue}")
    runs = await workflow_runs(client, prefix)
    return {
        "per_s": customers / elapsed,
        "seconds": round(elapsed, 2),
        "finished": result.finished,
        "runs": result.runs,
        "max_history_events": max(runs.lengths),
        "workflow_task_timeouts": runs.task_timeouts,
        **runs.parent_figures(elapsed),
        **cpu,
    }


async def measure_orchestrated(
    client: Client,
    pool: asyncpg.Pool,
    period: Period,
    customer_ids: list[str],
    options: RunOptions,
    meter: CpuMeter,
    faults: tuple[int, float | None],
) -> dict[str, Any]:
    temporal = TemporalSettings()
    limited = await emulator_rate_limited()
    await set_faults(*faults)
    log_offset = temporal_log_size()
    samples: list[float] = []
    reset_worker_peak()
    lock_waits: list[float] = []
    # Tasks of their own: one failing leaves the other to be cancelled all the same.
    sampling = [
        asyncio.create_task(sample_worker_rss(samples)),
        asyncio.create_task(sample_period_lock_wait(pool, period, lock_waits)),
    ]
    try:
        meter.start()
        started_at = datetime.now(UTC)
        started = time.monotonic()
        handle = await start_period(client, period, temporal.task_queue, options)
        summary = await handle.result()
        elapsed = time.monotonic() - started
        cpu = meter.stop(len(customer_ids))
    finally:
        for task in sampling:
            task.cancel()
        # A sampler's own failure (its connection lost) costs only its figures.
        await asyncio.gather(*sampling, return_exceptions=True)
        await set_faults(0, None)
    runs = await workflow_runs(client, period_workflow_id(period))
    others = await other_pollers(client, temporal.task_queue, started_at)
    if others:
        print(
            f"warning: other workers polled {temporal.task_queue} during the run"
            f" ({', '.join(others)}): they took part of it, so these figures do not measure"
            " the stack's worker alone",
            file=sys.stderr,
        )
    return {
        "per_s": len(customer_ids) / elapsed,
        "finished": len(customer_ids),
        "other_pollers": others,
        "seconds": round(elapsed, 2),
        "period": str(period),
        "due": summary.due,
        "charged": summary.charged,
        "failed": summary.failed,
        "emulator_429s": await emulator_rate_limited() - limited,
        "runs": len(runs.lengths),
        "max_history_events": max(runs.lengths),
        "workflow_task_timeouts": runs.task_timeouts,
        **runs.parent_figures(elapsed),
        **cpu,
        **worker_memory_mb(),
        # The peak is one moment (a burst, a replay); the samples show what the run holds.
        "worker_rss_mb_median": round(statistics.median(samples), 1) if samples else None,
        "worker_rss_mb_p95": (
            round(statistics.quantiles(samples, n=20)[-1], 1) if len(samples) > 1 else None
        ),
        "temporal_limit_warnings": temporal_limit_warnings(log_offset),
        "period_lock_wait_ms_p95": (
            round(statistics.quantiles(lock_waits, n=20, method="inclusive")[-1], 1)
            if len(lock_waits) > 1
            else None
        ),
        "period_lock_wait_ms_max": round(max(lock_waits), 1) if lock_waits else None,
    }


async def sample_period_lock_wait(pool: asyncpg.Pool, period: Period, waits: list[float]) -> None:
    """Append, every LOCK_SAMPLE_SECONDS until cancelled, how long (ms) the period's row took
    to lock as a pause, cancel or close locks it: every claim and gate shares that row, so
    a run's own traffic is what such a writer waits behind."""
    async with pool.acquire() as conn:
        while True:
            started = time.monotonic()
            async with conn.transaction():
                await ledger.lock_period(conn, str(period))
            waits.append((time.monotonic() - started) * 1000)
            await asyncio.sleep(LOCK_SAMPLE_SECONDS)


async def sample_worker_rss(samples: list[float]) -> None:
    """Append the worker's resident memory (MiB) every RSS_SAMPLE_SECONDS until cancelled."""
    while True:
        samples.append(worker_memory_mb()["worker_rss_mb"])
        await asyncio.sleep(RSS_SAMPLE_SECONDS)


class Runs(NamedTuple):
    """The runs of one workflow ID (continue-as-new makes several)."""

    lengths: list[int]
    # Workflow tasks that timed out: a stalled workflow (e.g. its task left unpolled on the
    # worker's sticky queue for 10 s) shows up here before it shows up in the rate.
    task_timeouts: int
    # Its workflow tasks that completed, and the seconds they were in flight in all (from
    # started to completed: the worker's activation, the way there and back, and the wait
    # for the workflow's lock on the server). A parent busy most of the run is what bounds
    # a fan-out (bench/FINDINGS.md).
    tasks: int
    task_seconds: float

    def parent_figures(self, elapsed: float) -> dict[str, float | int]:
        return {
            "parent_tasks": self.tasks,
            "parent_task_ms": round(1000 * self.task_seconds / max(1, self.tasks), 1),
            "parent_busy": round(self.task_seconds / elapsed, 3),
        }


def task_seconds(history: WorkflowHistory) -> tuple[int, float]:
    """How many workflow tasks of the history completed, and their seconds in flight."""
    started: dict[int, datetime] = {}
    count, seconds = 0, 0.0
    for event in history.events:
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            started[event.event_id] = event.event_time.ToDatetime()
        elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            attributes = event.workflow_task_completed_event_attributes
            begun = started.get(attributes.started_event_id)
            if begun is not None:
                count += 1
                seconds += (event.event_time.ToDatetime() - begun).total_seconds()
    return count, seconds


async def workflow_runs(client: Client, workflow_id: str) -> Runs:
    histories: list[WorkflowHistory] = []
    async for execution in client.list_workflows(f'WorkflowId="{workflow_id}"'):
        handle = client.get_workflow_handle(workflow_id, run_id=execution.run_id)
        histories.append(await handle.fetch_history())
    if not histories:  # visibility lags a little behind the run
        histories.append(await client.get_workflow_handle(workflow_id).fetch_history())
    tasks = [task_seconds(h) for h in histories]
    return Runs(
        lengths=[len(h.events) for h in histories],
        task_timeouts=sum(
            e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT
            for h in histories
            for e in h.events
        ),
        tasks=sum(count for count, _ in tasks),
        task_seconds=sum(seconds for _, seconds in tasks),
    )


async def with_retries(call: Callable[[], Awaitable[T]]) -> tuple[T | ChargeFailure, int]:
    """What the charge activity's retry policy does: the same call, with backoff, until
    Stripe answers for good; a refusal comes back as its ChargeFailure."""
    attempt = 1
    while True:
        try:
            return await call(), attempt
        except stripe.StripeError as exc:
            failure = to_temporal_failure(exc)
            if failure.non_retryable:
                details = failure.details[0] if failure.details else None
                if isinstance(details, ChargeFailure):
                    return details, attempt
                raise
            delay = min(RETRY_INITIAL * RETRY_BACKOFF ** (attempt - 1), RETRY_MAX)
            if failure.next_retry_delay is not None:
                delay = failure.next_retry_delay.total_seconds()
            await asyncio.sleep(delay)
            attempt += 1


async def measure_baseline(
    pool: asyncpg.Pool,
    period: Period,
    customer_ids: list[str],
    options: RunOptions,
    meter: CpuMeter,
    faults: tuple[int, float | None],
) -> dict[str, Any]:
    settings = BillingSettings()
    name = str(period)
    retries = 0
    outcomes = {"charged": 0, "failed": 0}
    async with AsyncExitStack() as stack:
        http = await stack.enter_async_context(stripe_http(settings.billing_stripe_timeout_seconds))
        admin: VaultAdmin | None = None
        token = settings.vault_token()
        if settings.billing_vault_url and token:
            admin = VaultAdmin(settings.billing_vault_url, token)
            stack.push_async_callback(admin.close)
            box = settings.secret_box()
            access: StripeAccess = VaultAccess(
                pool, box, settings.billing_vault_url, settings.billing_charge_api, http
            )
        else:
            api_key = settings.stripe_api_key.get_secret_value()
            direct = stripe_client(api_key, settings.stripe_api_base, http)
            access = DirectAccess(StripeGateway(direct, settings.billing_charge_api))
        gate = asyncio.Semaphore(options.max_in_flight)

        async def bill(customer_id: str) -> None:
            nonlocal retries
            async with gate:
                key = idempotency_key(settings.billing_key_namespace, customer_id, period)
                async with pool.acquire() as conn:
                    claim: Claim = await ledger.claim(
                        conn, customer_id, name, key, charge_api=settings.billing_charge_api
                    )
                gateway = await access.gateway_for(claim)
                async with pool.acquire() as conn:
                    passage = await ledger.begin_charge(conn, claim, gateway.route)
                if passage.gate != "go":
                    raise RuntimeError(f"{customer_id}: the ledger's gate did not open")
                result, attempts = await with_retries(
                    lambda: gateway.charge(claim, passage.fencing_token)
                )
                retries += attempts - 1
                async with pool.acquire() as conn:
                    if isinstance(result, ChargeResult):
                        await ledger.record_charge(conn, key, result)
                        outcomes["charged"] += 1
                    else:
                        await ledger.record_unbilled(conn, key, "failed", result)
                        outcomes["failed"] += 1

        limited = await emulator_rate_limited()
        await set_faults(*faults)
        try:
            meter.start()
            started = time.monotonic()
            # Opened as a run's preparation opens it: the plan, the keys, the record.
            await PeriodActivities(pool, settings, admin).prepare(
                PrepareRequest(period=name, workflow_id=BASELINE_WORKFLOW_ID)
            )
            due: list[str] = []
            cursor: str | None = None
            while True:
                async with pool.acquire() as conn:
                    page = await ledger.due_page(conn, name, cursor, options.page_size)
                due += [c.customer_id for c in page.customers]
                cursor = page.next_cursor
                if cursor is None:
                    break
            await asyncio.gather(*(bill(c) for c in due))
            async with pool.acquire() as conn:
                await ledger.finish_period(conn, name, json.dumps(outcomes))
            elapsed = time.monotonic() - started
            cpu = meter.stop(len(customer_ids))
        finally:
            await set_faults(0, None)
    return {
        "per_s": len(customer_ids) / elapsed,
        "seconds": round(elapsed, 2),
        "period": name,
        "due": len(due),
        "through_vault": admin is not None,
        "retries": retries,
        "emulator_429s": await emulator_rate_limited() - limited,
        **outcomes,
        **cpu,
    }


@contextmanager
def step(what: str) -> Iterator[None]:
    say(f"{what}...")
    started = time.monotonic()
    yield
    say(f"  {what}: {time.monotonic() - started:.1f} s")


def combined(measurements: list[dict[str, Any]]) -> dict[str, Any]:
    """One measurement from several of one kind (a ceiling's halves, the orchestrated
    rounds): all children over all the time, the worst history, each process's cores
    weighted by time and its CPU per child by children."""
    seconds = sum(c["seconds"] for c in measurements)
    finished = sum(c["finished"] for c in measurements)
    tasks = sum(c["parent_tasks"] for c in measurements)
    processes = measurements[0]["cpu_cores"].keys()
    per_customer = {
        p: sum(c["cpu_ms_per_customer"][p] * c["finished"] for c in measurements) / finished
        for p in measurements[0]["cpu_ms_per_customer"]
    }
    return {
        "per_s": finished / seconds,
        "seconds": round(seconds, 2),
        "finished": finished,
        "runs": sum(c["runs"] for c in measurements),
        "max_history_events": max(c["max_history_events"] for c in measurements),
        "workflow_task_timeouts": sum(c["workflow_task_timeouts"] for c in measurements),
        "parent_tasks": tasks,
        "parent_task_ms": round(
            sum(c["parent_task_ms"] * c["parent_tasks"] for c in measurements) / max(1, tasks), 1
        ),
        "parent_busy": round(
            sum(c["parent_busy"] * c["seconds"] for c in measurements) / seconds, 3
        ),
        "cpu_cores": {
            p: round(sum(c["cpu_cores"][p] * c["seconds"] for c in measurements) / seconds, 2)
            for p in processes
        },
        "cpu_ms_per_customer": {p: round(ms, 2) for p, ms in per_customer.items()},
        "cpu_per_emulator": emulator_units(per_customer),
    }


# What pooled() adds up, and takes the highest of, over the orchestrated rounds.
_SUMMED = ("due", "charged", "failed", "emulator_429s")
_HIGHEST = (
    "worker_peak_rss_mb",
    "worker_rss_mb_median",
    "worker_rss_mb_p95",
    "period_lock_wait_ms_p95",
    "period_lock_wait_ms_max",
)


def pooled(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The orchestrated rounds as one run: combined, with the periods' counts summed and the
    worker's memory and the period's lock wait at their worst (the highest of any round)."""
    if len(rounds) == 1:
        return rounds[0]

    def highest(name: str) -> float | None:
        values = [r[name] for r in rounds if r[name] is not None]
        return max(values) if values else None

    return combined(rounds) | {
        "other_pollers": sorted({p for r in rounds for p in r["other_pollers"]}),
        "period": [r["period"] for r in rounds],
        **{name: sum(r[name] for r in rounds) for name in _SUMMED},
        "worker_rss_mb": rounds[-1]["worker_rss_mb"],
        **{name: highest(name) for name in _HIGHEST},
        "temporal_limit_warnings": [w for r in rounds for w in r["temporal_limit_warnings"]],
    }


class Round(NamedTuple):
    """One orchestrated run and the ceiling's halves around it."""

    orchestrated: dict[str, Any]
    halves: dict[ChildKind, list[dict[str, Any]]]

    def figures(self) -> dict[str, Any]:
        per_s = self.orchestrated["per_s"]
        ceilings = {kind: combined(h)["per_s"] for kind, h in self.halves.items()}
        shaped = ceilings.get(ChildKind.SHAPED)
        return {
            "period": self.orchestrated["period"],
            "orchestrated_per_s": round(per_s, 1),
            "ceiling_per_s": round(ceilings[ChildKind.NOOP], 1),
            "ceiling_ratio": round(per_s / ceilings[ChildKind.NOOP], 3),
            "shaped_ceiling_ratio": round(per_s / shaped, 3) if shaped is not None else None,
        }


async def run(args: argparse.Namespace, options: RunOptions) -> dict[str, Any]:
    faults = (args.emulator_latency_ms, args.rate_limit_rps)
    token = secrets.token_hex(3)
    n = args.customers
    # The ceiling and the baseline take as long as the run they are compared with, or less;
    # at 100,000 customers they may be measured on fewer (--compare-customers): a rate is a rate.
    m = args.compare_customers or n
    if args.stripe_rps is not None:
        os.environ["BILLING_STRIPE_RPS"] = str(args.stripe_rps)
    async with ensure_stack(quiet=QUIET, keep_running=args.keep_running) as started_here:
        if args.stripe_rps is not None and not started_here:
            raise SystemExit(
                "--stripe-rps is read by the worker at start: stop the running stack"
                " (python -m devstack down) and let this run start one"
            )
        database_url = DatabaseSettings().database_url
        # This process runs the ledger code of the working tree: its schema too (a worker
        # does the same at start).
        await migrate(database_url)
        # The SDK core's warnings go to stderr through logging, not into the JSON on stdout.
        runtime = temporal_runtime(ObservabilitySettings(temporal_metrics_port=None))
        client = await connect(TemporalSettings(), runtime)
        pool = await create_pool(database_url)
        meter = CpuMeter()
        await set_faults(0, None)
        async with pool.acquire() as conn:
            others: list[str] = [
                r["customer_id"]
                for r in await conn.fetch("SELECT customer_id FROM customers WHERE active")
            ]
        if others:
            say(f"setting {len(others)} other active customers inactive for the run")
        await set_active(pool, others, False)
        try:
            *orchestrated_periods, baseline_period = await fresh_periods(
                client, pool, args.rounds + 1
            )

            # Half the ceiling before each orchestrated run and half after, so that drift over
            # the run (the dev server's database grows) weighs on both sides alike.
            # With the shaped ceiling, in mirror order after it, so that neither kind of
            # child runs later on average.
            kinds = [ChildKind.NOOP, *([ChildKind.SHAPED] if args.shaped_ceiling else [])]

            async def ceiling_halves(
                halves: dict[ChildKind, list[dict[str, Any]]],
                count: int,
                which: str,
                order: list[ChildKind],
            ) -> None:
                for kind in order:
                    name = CEILING_CHILDREN[kind].name
                    with step(f"ceiling, {which.replace('-', ' ')}: {count} {name} children"):
                        halves[kind].append(
                            await measure_ceiling(
                                client,
                                count,
                                options,
                                meter,
                                f"{token}-{name}-{which}",
                                args.ceiling_workflow_polls,
                                kind,
                            )
                        )

            rounds: list[Round] = []
            for number, period in enumerate(orchestrated_periods, start=1):
                halves: dict[ChildKind, list[dict[str, Any]]] = {kind: [] for kind in kinds}
                round_ = f"round-{number}-" if args.rounds > 1 else ""
                await ceiling_halves(halves, (m + 1) // 2, f"{round_}before", kinds)
                with step(f"seeding {n} customers for {period}"):
                    mine = await seed(pool, n, f"bench-{token}-o{number}")
                try:
                    with step(f"orchestrated: billing {period}"):
                        orchestrated = await measure_orchestrated(
                            client, pool, period, mine, options, meter, faults
                        )
                finally:
                    await set_active(pool, mine, False)
                if m > 1:
                    await ceiling_halves(halves, m // 2, f"{round_}after", kinds[::-1])
                rounds.append(Round(orchestrated, halves))
            with step(f"seeding {m} other customers for {baseline_period}"):
                theirs = await seed(pool, m, f"bench-{token}-b")
            try:
                with step(f"baseline: billing {baseline_period} without Temporal"):
                    baseline = await measure_baseline(
                        pool, baseline_period, theirs, options, meter, faults
                    )
            finally:
                await set_active(pool, theirs, False)
        finally:
            await set_active(pool, others, True)
            await pool.close()
    orchestrated = pooled([r.orchestrated for r in rounds])
    ceiling = combined([h for r in rounds for h in r.halves[ChildKind.NOOP]])
    shaped = (
        combined([h for r in rounds for h in r.halves[ChildKind.SHAPED]])
        if args.shaped_ceiling
        else None
    )
    each = [r.figures() for r in rounds]
    return {
        "customers": n,
        "compare_customers": m,
        "rounds": args.rounds,
        "orchestrated_per_s": round(orchestrated["per_s"], 1),
        "ceiling_per_s": round(ceiling["per_s"], 1),
        "ceiling_ratio": round(orchestrated["per_s"] / ceiling["per_s"], 3),
        "ceiling_ratio_mean": round(statistics.fmean(f["ceiling_ratio"] for f in each), 3),
        "shaped_ceiling_per_s": round(shaped["per_s"], 1) if shaped is not None else None,
        "shaped_ceiling_ratio": (
            round(orchestrated["per_s"] / shaped["per_s"], 3) if shaped is not None else None
        ),
        "baseline_per_s": round(baseline["per_s"], 1),
        "ratio": round(orchestrated["per_s"] / baseline["per_s"], 3),
        "max_history_events": orchestrated["max_history_events"],
        "workflow_task_timeouts": orchestrated["workflow_task_timeouts"],
        "worker_peak_rss_mb": orchestrated["worker_peak_rss_mb"],
        "worker_rss_mb_median": orchestrated["worker_rss_mb_median"],
        "temporal_limit_warnings": len(orchestrated["temporal_limit_warnings"]),
        "period_lock_wait_ms_max": orchestrated["period_lock_wait_ms_max"],
        "emulator_latency_ms": args.emulator_latency_ms,
        "rate_limit_rps": args.rate_limit_rps,
        "stripe_rps": args.stripe_rps,
        "max_in_flight": options.max_in_flight,
        "max_starting": options.max_starting,
        "ceiling_workflow_polls": args.ceiling_workflow_polls,
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine_cpus": os.cpu_count(),
        "orchestrated": {k: v for k, v in orchestrated.items() if k != "per_s"},
        "ceiling": {k: v for k, v in ceiling.items() if k != "per_s"},
        "ceiling_halves_per_s": [
            round(h["per_s"], 1) for r in rounds for h in r.halves[ChildKind.NOOP]
        ],
        "shaped_ceiling": (
            {k: v for k, v in shaped.items() if k != "per_s"}
            | {
                "halves_per_s": [
                    round(h["per_s"], 1) for r in rounds for h in r.halves[ChildKind.SHAPED]
                ]
            }
            if shaped is not None
            else None
        ),
        "each_round": each,
        "baseline": {k: v for k, v in baseline.items() if k != "per_s"},
    }


def parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--customers", type=int, default=500, help="N per measurement (default 500)")
    p.add_argument(
        "--compare-customers",
        type=int,
        default=None,
        help="N for the ceiling and the baseline (default: --customers)",
    )
    p.add_argument("--emulator-latency-ms", type=int, default=0, help="added to every request")
    p.add_argument(
        "--rate-limit-rps", type=float, default=None, help="emulator's rate limit (default none)"
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=RunOptions().max_in_flight,
        help="the period's window; also the ceiling's and the baseline's concurrency",
    )
    p.add_argument(
        "--max-starting",
        type=int,
        default=RunOptions().max_starting,
        help="child starts unacknowledged at once, in the period and the ceiling",
    )
    p.add_argument(
        "--ceiling-workflow-polls",
        type=int,
        default=None,
        help="experiment: a fixed number of workflow task pollers for the ceiling's worker,"
        " half of them on the shared queue (default: autoscaling, as the stack's worker)",
    )
    p.add_argument(
        "--shaped-ceiling",
        action="store_true",
        help="also measure children of the billing child's shape that do no work",
    )
    p.add_argument(
        "--stripe-rps",
        type=float,
        default=None,
        help="the stack worker's BILLING_STRIPE_RPS (default none); needs a stack started here",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="orchestrated runs, each on a fresh period between halves of the ceilings; the"
        " figures pool them, `each_round` gives each and `ceiling_ratio_mean` their mean"
        " (default 1)",
    )
    p.add_argument("--keep-running", action="store_true", help="leave a stack started here up")
    p.add_argument("--json", action="store_true", help="print only the JSON object on stdout")
    return p


def main() -> int:
    global QUIET
    args = parser().parse_args()
    if args.customers < 1:
        raise SystemExit("--customers must be at least 1")
    if args.compare_customers is not None and args.compare_customers < 1:
        raise SystemExit("--compare-customers must be at least 1")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    try:
        options = RunOptions(max_in_flight=args.max_in_flight, max_starting=args.max_starting)
    except ValidationError as exc:
        flags = (f"--{str(e['loc'][0]).replace('_', '-')}: {e['msg']}" for e in exc.errors())
        raise SystemExit("; ".join(flags)) from None
    QUIET = args.json
    # The ceiling's worker and the baseline run here, on the loop the stack's worker runs on.
    result = uvloop.run(run(args, options))
    path = write_result("throughput", result)
    if not args.json:
        rates = ["orchestrated_per_s", "ceiling_per_s", "shaped_ceiling_per_s", "baseline_per_s"]
        others = [
            "ceiling_ratio",
            "ceiling_ratio_mean",
            "shaped_ceiling_ratio",
            "ratio",
            "max_history_events",
        ]
        for name in rates + others:
            if result[name] is not None:
                print(f"{name:>20}: {result[name]}")
    say(f"written to {path.relative_to(ROOT)}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

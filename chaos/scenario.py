"""A period billed while everything around it fails: the worker is SIGKILLed and restarted
every few seconds, PostgreSQL restarts once (and, where the stack can, the vault and
Temporal's server are SIGKILLed and started again once each), Stripe (the emulator) loses
answers, fails before and after committing and rate-limits, and the period is started twice
more (a second starter, a schedule's trigger) while it runs. Then the daily reconciliation
runs once, as it would after the period, and settles what the faults left in doubt (the
vault's reservations for answers lost after Stripe committed).

bench/chaos_run.py runs it on a local stack of its own, tests/integration/test_chaos.py on the
test session's services; chaos.invariants checks what it leaves behind.
"""

from __future__ import annotations

import asyncio
import math
import random
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import asyncpg
import stripe
from temporalio.client import Client

from billing.customers import CustomerRow, upsert_customers
from billing.models import PeriodSummary
from billing.periods import Period
from billing.reconciliation import ReconcileReport
from billing.runs import drain, result_across_outages, start_period, start_reconcile
from billing.schedules import MonthlySchedule, create_schedule
from billing.seeding import DECLINED_CARD, create_demo_customers, demo_card
from stripe_emulator.client import EmulatorClient

# The mix: a fifth of the answers lost after Stripe committed, 5% saved 500s after
# committing, 5% 500s before; and 5% of requests 429 whatever their rate, which a slow or
# loaded machine may never pass (at 2%, the suite's hundred customers drew none in one run).
FAULTS = {
    "drop_after_commit": 0.2,
    "error_after_commit": 0.05,
    "error_before_commit": 0.05,
    "rate_limited": 0.05,
}
# Stripe's test-mode limit: the period's first burst of charges passes it.
RATE_LIMIT_RPS = 25.0
SECOND_START = "second_start"
TRIGGER = "schedule_trigger"
POSTGRES_RESTART = "postgres_restart"
VAULT_CRASH = "vault_crash"
TEMPORAL_CRASH = "temporal_crash"
# Each disturbance, and how far the run is (finished customers / due) when it happens.
DISTURBANCES: tuple[tuple[str, float], ...] = (
    (SECOND_START, 0.1),
    (TRIGGER, 0.2),
    (POSTGRES_RESTART, 0.4),
    (VAULT_CRASH, 0.5),
    (TEMPORAL_CRASH, 0.6),
)


@dataclass(frozen=True)
class Plan:
    seed: int
    # A worker lives a random time in this range (seconds) before its SIGKILL.
    kill_every: tuple[float, float] = (2.0, 6.0)
    max_kills: int | None = None
    rate_limit_rps: float = RATE_LIMIT_RPS
    # Those of DISTURBANCES this run makes (each needs its Targets' means).
    disturb_at: tuple[tuple[str, float], ...] = DISTURBANCES[:3]
    timeout: float = 3600.0


@dataclass
class Targets:
    """Where the run happens, and how to start a worker process and restart the services
    (the vault and Temporal's server only where the stack runs them as processes)."""

    client: Client
    task_queue: str
    database_url: str
    emulator: EmulatorClient
    start_worker: Callable[[], subprocess.Popen[bytes]]
    restart_postgres: Callable[[], None]
    crash_vault: Callable[[], Awaitable[None]] | None = None
    crash_temporal: Callable[[], Awaitable[None]] | None = None


@dataclass
class Figures:
    due: int
    summary: PeriodSummary | None = None
    seconds: float = 0.0
    # The emulator's counts for this run, by kind (rate_limited: 429s).
    faults: dict[str, int] = field(default_factory=dict)
    kills: int = 0
    # Workers that ended on their own (one that starts while PostgreSQL is down gives up).
    worker_exits: int = 0
    postgres_restarts: int = 0
    vault_crashes: int = 0
    temporal_crashes: int = 0
    duplicate_starts: int = 0
    # Customers finished when each disturbance happened.
    disturbed_at: dict[str, int] = field(default_factory=dict)
    timed_out: bool = False
    reconcile: ReconcileReport | None = None

    def shortfalls(self) -> list[str]:
        """Why the run proves less than it should: it did not end, or chaos it was meant to
        survive did not happen."""
        missing = ["the run did not end in time"] if self.timed_out else []
        missing += [f"no {kind} fault was injected" for kind, n in self.faults.items() if not n]
        if not self.kills:
            missing.append("no worker was killed")
        for event, finished in self.disturbed_at.items():
            if finished >= self.due:
                missing.append(f"the {event} came after every customer had finished")
        return missing


@dataclass(frozen=True)
class Seeded:
    customers: list[CustomerRow]
    declined: frozenset[str]


async def seed(client: stripe.StripeClient, pool: asyncpg.Pool, count: int, prefix: str) -> Seeded:
    """`count` demo customers in Stripe and the ledger; the demo's declining cards included."""
    rows = await create_demo_customers(client, count, prefix, card_for=demo_card)
    await upsert_customers(pool, rows)
    declined = [r.customer_id for i, r in enumerate(rows, 1) if demo_card(i) == DECLINED_CARD]
    return Seeded(rows, frozenset(declined))


class _Workers:
    """One worker process at a time, SIGKILLed after a random lifetime and replaced."""

    def __init__(self, start: Callable[[], subprocess.Popen[bytes]], plan: Plan) -> None:
        self._start = start
        self._plan = plan
        # Its own generator: the kill times depend on the seed alone.
        self._rng = random.Random(plan.seed)
        self.process = start()
        self.kills = 0
        self.exits = 0

    def _lifetime(self) -> float:
        return time.monotonic() + self._rng.uniform(*self._plan.kill_every)

    async def churn(self, stop: asyncio.Event) -> None:
        kill_at = self._lifetime()
        while not stop.is_set():
            if self.process.poll() is not None:
                self.exits += 1
                self.process = self._start()
            elif time.monotonic() >= kill_at and self.kills != self._plan.max_kills:
                self.process.kill()
                self.process.wait()
                self.kills += 1
                self.process = self._start()
                kill_at = self._lifetime()
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except TimeoutError:
                pass

    def stop(self) -> None:
        """The last worker stops as an operator stops one: SIGTERM, in-flight work finishes."""
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def _finished(database_url: str, period: str) -> int:
    """Customers of the period with an outcome; 0 while PostgreSQL cannot be reached."""
    try:
        conn = await asyncpg.connect(database_url, timeout=5)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return 0
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM billing_runs WHERE billing_period = $1 AND status <> 'claimed'",
            period,
        )
        return count
    except (OSError, asyncpg.PostgresError):
        return 0
    finally:
        conn.terminate()


async def _reached(database_url: str, period: str, needed: int) -> int:
    while True:
        finished = await _finished(database_url, period)
        if finished >= needed:
            return finished
        await asyncio.sleep(0.5)


async def _disturb(
    targets: Targets, period: Period, plan: Plan, schedule: MonthlySchedule, figures: Figures
) -> None:
    for event, fraction in sorted(plan.disturb_at, key=lambda item: item[1]):
        figures.disturbed_at[event] = await _reached(
            targets.database_url, str(period), math.ceil(fraction * figures.due)
        )
        if event == SECOND_START:
            # Another starter, as on another machine: its own connection to Temporal.
            config = targets.client.service_client.config
            other = await Client.connect(
                config.target_host,
                namespace=targets.client.namespace,
                data_converter=targets.client.data_converter,
            )
            await start_period(other, period, targets.task_queue)
            figures.duplicate_starts += 1
        elif event == TRIGGER:
            handle = await create_schedule(targets.client, schedule, targets.task_queue)
            await handle.trigger()
            figures.duplicate_starts += 1
        elif event == POSTGRES_RESTART:
            await asyncio.to_thread(targets.restart_postgres)
            figures.postgres_restarts += 1
        elif event == VAULT_CRASH:
            assert targets.crash_vault is not None, "this stack cannot crash its vault"
            await targets.crash_vault()
            figures.vault_crashes += 1
        elif event == TEMPORAL_CRASH:
            assert targets.crash_temporal is not None, "this stack cannot crash Temporal"
            await targets.crash_temporal()
            figures.temporal_crashes += 1


async def run(
    targets: Targets, period: Period, due: int, plan: Plan, schedule: MonthlySchedule
) -> Figures:
    """Bill `period` under chaos; returns once every workflow of the run has closed (or
    `plan.timeout` passed) and the faults are off again. `schedule` must bill `period` when
    triggered now."""
    figures = Figures(due=due)
    before = await targets.emulator.faults_injected()
    await targets.emulator.configure(seed=plan.seed, rate_limit_rps=plan.rate_limit_rps, **FAULTS)
    started = time.monotonic()
    stop = asyncio.Event()
    workers = _Workers(targets.start_worker, plan)
    churning = asyncio.create_task(workers.churn(stop))
    disturbing: asyncio.Task[None] | None = None
    try:
        async with asyncio.timeout(plan.timeout):
            handle = await start_period(targets.client, period, targets.task_queue)
            disturbing = asyncio.create_task(_disturb(targets, period, plan, schedule, figures))
            # As `starter.py run` waits: across Temporal's outage.
            figures.summary = await result_across_outages(
                targets.client, handle, PeriodSummary, lambda exc: None
            )
            # Any disturbance still waiting happens now (and so fails shortfalls()).
            await disturbing
            # A start after the end runs the period again; children close after their parent.
            await drain(targets.client, targets.task_queue, timeout=plan.timeout)
    except TimeoutError:
        figures.timed_out = True
    finally:
        figures.seconds = time.monotonic() - started
        stop.set()
        if disturbing is not None:
            disturbing.cancel()
        await churning
        await asyncio.to_thread(workers.stop)
        await targets.emulator.configure(rate_limit_rps=None, **dict.fromkeys(FAULTS, 0.0))
    after = await targets.emulator.faults_injected()
    # The kinds this run injects, each of which must have happened; not the emulator's others.
    figures.faults = {kind: after[kind] - before.get(kind, 0) for kind in FAULTS}
    figures.kills, figures.worker_exits = workers.kills, workers.exits
    if not figures.timed_out:
        figures.reconcile = await _reconcile(targets, period, plan.timeout)
    return figures


async def _reconcile(targets: Targets, period: Period, timeout: float) -> ReconcileReport:
    worker = targets.start_worker()
    try:
        handle = await start_reconcile(targets.client, period, targets.task_queue)
        async with asyncio.timeout(timeout):
            return await handle.result()
    finally:
        worker.kill()
        worker.wait()

"""`starter.py demo`: bill a period of demo customers on the local stack, start to finish."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime

from billing.config import TemporalSettings, load_settings
from billing.errors import ServiceUnavailableError
from billing.models import PeriodSummary
from billing.periods import period_for
from billing.reporting import describe, ui_link
from billing.runs import period_status, start_period
from billing.seeding import seed_demo
from billing.temporal_client import connect
from devstack.processes import StackError
from devstack.stack import PROJECT_ROOT, StackConfig, read_env

STACK_START_TIMEOUT = 180


async def _stack_reachable(config: StackConfig) -> bool:
    if not config.env_file.exists():
        return False
    try:
        env = read_env(config.env_file)
        # The stack's own namespace, not one the shell may have set for another server.
        stack = TemporalSettings(
            address=env["TEMPORAL_ADDRESS"], namespace=env["TEMPORAL_NAMESPACE"]
        )
        await connect(stack)
    except (ServiceUnavailableError, KeyError):
        return False
    return True


async def _start_stack(config: StackConfig) -> subprocess.Popen[bytes]:
    config.root.mkdir(parents=True, exist_ok=True)
    log = config.root / "devstack.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "devstack", "up"],
            cwd=PROJECT_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + STACK_START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StackError(f"the local stack failed to start; see {log}")
        if config.pid_file.exists() and await _stack_reachable(config):
            return process
        await asyncio.sleep(0.5)
    process.terminate()
    raise StackError(f"the local stack did not start within {STACK_START_TIMEOUT} s; see {log}")


def _say(message: str, as_json: bool) -> None:
    # With --json, stdout carries only the summary object.
    print(message, file=sys.stderr if as_json else sys.stdout, flush=True)


@asynccontextmanager
async def ensure_stack(*, quiet: bool, keep_running: bool) -> AsyncIterator[bool]:
    """Use the running local stack, or start one (stopped again after, unless kept); its
    settings are put in this process's environment. Yields whether it was started here (its
    worker then has this process's environment)."""
    config = StackConfig()
    stack: subprocess.Popen[bytes] | None = None
    if not await _stack_reachable(config):
        _say(
            "starting the local stack (Temporal, PostgreSQL, Stripe emulator, vault, worker)...",
            quiet,
        )
        stack = await _start_stack(config)
    os.environ.update(read_env(config.env_file))
    try:
        yield stack is not None
    finally:
        if stack is not None and not keep_running:
            _say("stopping the local stack...", quiet)
            stack.terminate()
            stack.wait(120)
        else:
            _say("the local stack is still running: `python -m devstack down` stops it", quiet)


async def run_demo(args: argparse.Namespace) -> int:
    async with ensure_stack(quiet=args.json, keep_running=args.keep_running):
        temporal = load_settings(TemporalSettings)
        period = args.period or period_for(datetime.now(UTC))
        _say(f"creating {args.customers} demo customers (or finding them)...", args.json)
        seeded = await seed_demo(args.customers)
        client = await connect(temporal)
        handle = await start_period(client, period, temporal.task_queue)
        # The run bills every active customer due, not only the demo's.
        others = (
            f" (every active customer: {seeded.not_demo} of them not the demo's)"
            if seeded.not_demo
            else ""
        )
        _say(f"billing {period}{others}: {ui_link(temporal, handle.id)}", args.json)
        started = time.monotonic()
        task = asyncio.ensure_future(handle.result())
        while not task.done():
            progress = await period_status(client, period)
            finished = progress.due - progress.in_flight
            # `due` counts the customers listed so far: between two pages it is all finished.
            said = (
                "  opening the run: counting the customers due"
                if progress.expected_due is None
                else f"  {finished} of {progress.expected_due} customers finished,"
                f" {progress.in_flight} in flight, {progress.charged} charged,"
                f" {progress.failed} failed"
            )
            _say(said, args.json)
            await asyncio.wait({task}, timeout=2)
        summary: PeriodSummary = task.result()
        elapsed = time.monotonic() - started
        if args.json:
            print(summary.model_dump_json())
        else:
            print(describe(summary))
            # A rerun counts the customers who failed before as failed, sending nothing.
            rate = f" ({summary.charged / elapsed:.0f} charged/s)" if summary.charged else ""
            print(f"  took {elapsed:.1f} s{rate}")
        _say(
            f"Web UI: {temporal.ui_url}/namespaces/{temporal.namespace}/workflows"
            f"?query=BillingPeriod%3D%22{period}%22",
            args.json,
        )
    return 0

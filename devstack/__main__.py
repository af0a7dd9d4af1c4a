"""python -m devstack up [--no-worker] | down

`up` starts PostgreSQL, the Temporal dev server with its Web UI, the Stripe emulator and a
worker, writes `.devstack/env` for a second terminal (`source .devstack/env`), and stops it all
cleanly on Ctrl-C or SIGTERM. `down` stops a stack started elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from billing.db import where
from devstack.processes import StackError
from devstack.stack import LEDGER_ROLE, LocalStack, StackConfig


def _stack_pid(config: StackConfig) -> int | None:
    """The running local stack's pid. A pid file left by a stack that did not stop cleanly
    (a reboot, a kill) is removed: its pid may since be another process's."""
    try:
        pid = int(config.pid_file.read_text())
    except (FileNotFoundError, ValueError):
        return None
    if _is_stack(pid):
        return pid
    config.pid_file.unlink(missing_ok=True)
    return None


def _is_stack(pid: int) -> bool:
    """Whether `pid` runs `python -m devstack up` (not, say, `tail .devstack/devstack.log`)."""
    if Path("/proc/self").exists():
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            return False
    else:  # macOS has no /proc; its ps prints the command line
        shown = subprocess.run(
            ["ps", "-p", str(pid), "-o", "command="], capture_output=True, check=False
        )
        args = shown.stdout.split()
    return b" -m devstack up" in b" ".join(args)


async def up(config: StackConfig) -> None:
    running = _stack_pid(config)
    if running is not None:
        raise StackError(
            f"a local stack is already running (pid {running}): `python -m devstack down` stops it"
        )
    # Left by a stack that did not stop cleanly: they would tell `dev.py demo` that this one
    # is up before its emulator and vault are.
    config.env_file.unlink(missing_ok=True)
    stack = LocalStack(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stack.start()
    config.pid_file.write_text(str(os.getpid()))
    env = stack.environment
    print(
        "local stack is up\n"
        f"  Temporal Web UI   {env['TEMPORAL_UI_URL']}\n"
        f"  Temporal          {env['TEMPORAL_ADDRESS']} (namespace {env['TEMPORAL_NAMESPACE']})\n"
        # Its password stays in the environment file.
        f"  PostgreSQL        {where(env['DATABASE_URL'])} (as {LEDGER_ROLE})\n"
        f"  Stripe emulator   {env['STRIPE_EMULATOR_URL']}\n"
        f"  vault proxy       {env['BILLING_VAULT_URL']}\n"
        f"  worker            {'running' if config.worker else 'not started (--no-worker)'}\n"
        f"  environment       source {config.env_file}\n"
        f"  logs              {config.log_dir}\n"
        "Ctrl-C stops everything.",
        flush=True,
    )
    reported: set[str] = set()
    try:
        while not stop.is_set():
            for service in stack.exited():
                if service.name not in reported:
                    reported.add(service.name)
                    print(f"warning: {service.name} exited; see {service.log}", flush=True)
            try:
                await asyncio.wait_for(stop.wait(), timeout=1)
            except TimeoutError:
                pass
    finally:
        print("stopping the local stack...", flush=True)
        stack.stop()
        config.pid_file.unlink(missing_ok=True)
        print("stopped", flush=True)


def down(config: StackConfig, timeout: float = 90) -> int:
    pid = _stack_pid(config)
    if pid is None:
        print("no local stack is running")
        return 0
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        config.pid_file.unlink(missing_ok=True)
        print("no local stack is running (removed a stale pid file)")
        return 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print("local stack stopped")
            return 0
        time.sleep(0.2)
    print(f"the local stack (pid {pid}) did not stop within {timeout:.0f} s", file=sys.stderr)
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("up", help="start the local stack and wait for Ctrl-C")
    start.add_argument("--no-worker", action="store_true", help="start everything but the worker")
    defaults = StackConfig()
    for field in ("temporal_port", "ui_port", "postgres_port", "emulator_port", "vault_port"):
        start.add_argument(
            f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field)
        )
    commands.add_parser("down", help="stop the local stack started by `up`")
    args = parser.parse_args()
    if args.command == "down":
        return down(defaults)
    config = StackConfig(
        worker=not args.no_worker,
        temporal_port=args.temporal_port,
        ui_port=args.ui_port,
        postgres_port=args.postgres_port,
        emulator_port=args.emulator_port,
        vault_port=args.vault_port,
    )
    try:
        asyncio.run(up(config))
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Operator's command line: run and inspect billing periods, manage customers, run the demo.

python starter.py run 2026-12 --wait
python starter.py status 2026-12 --json
python starter.py migrate
python starter.py customers import customers.csv
python starter.py customers seed-demo --count 1000
python starter.py demo --customers 1000 --keep-running
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from billing import logs
from billing.config import DatabaseSettings, TemporalSettings
from billing.customers import read_customers_csv, upsert_customers
from billing.db import create_pool
from billing.errors import BillingError
from billing.migrations import migrate
from billing.periods import Period, parse_period
from billing.reporting import describe, ui_link
from billing.runs import period_status, start_period
from billing.seeding import seed_demo
from billing.temporal_client import connect


def _period(text: str) -> Period:
    try:
        return parse_period(text)
    except BillingError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def _emit(model: BaseModel, as_json: bool, text: str) -> None:
    print(model.model_dump_json() if as_json else text)


async def cmd_run(args: argparse.Namespace) -> int:
    temporal = TemporalSettings()
    client = await connect(temporal)
    handle = await start_period(client, args.period, temporal.task_queue)
    if not args.wait:
        _emit(
            await period_status(client, args.period),
            args.json,
            f"period {args.period} running as {handle.id}\n  {ui_link(temporal, handle.id)}",
        )
        return 0
    summary = await handle.result()
    _emit(summary, args.json, describe(summary) + f"\n  {ui_link(temporal, handle.id)}")
    return 0


async def cmd_status(args: argparse.Namespace) -> int:
    client = await connect(TemporalSettings())
    progress = await period_status(client, args.period)
    _emit(progress, args.json, describe(progress))
    return 0


async def cmd_migrate(_: argparse.Namespace) -> int:
    applied = await migrate(DatabaseSettings().database_url)
    print("applied " + ", ".join(applied) if applied else "database is up to date")
    return 0


async def cmd_import(args: argparse.Namespace) -> int:
    rows = read_customers_csv(args.file)
    pool = await create_pool(DatabaseSettings().database_url)
    try:
        written = await upsert_customers(pool, rows)
    finally:
        await pool.close()
    print(f"imported {written} customers from {args.file}")
    return 0


async def cmd_seed_demo(args: argparse.Namespace) -> int:
    written = await seed_demo(args.count)
    print(f"created {written} demo customers in Stripe and the ledger")
    return 0


async def cmd_demo(args: argparse.Namespace) -> int:
    from devstack.demo import run_demo  # the local stack is only needed by the demo

    return await run_demo(args)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="starter.py", description=__doc__.split("\n")[0])
    commands = root.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="start (or join) the run of a billing period")
    run.add_argument("period", type=_period, help="YYYY-MM")
    run.add_argument("--wait", action="store_true", help="wait for the run and print its summary")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    run.set_defaults(handler=cmd_run)

    status = commands.add_parser("status", help="counts of a period's run")
    status.add_argument("period", type=_period, help="YYYY-MM")
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=cmd_status)

    commands.add_parser("migrate", help="apply database migrations").set_defaults(
        handler=cmd_migrate
    )

    customers = commands.add_parser("customers", help="manage customers due for billing")
    customer_commands = customers.add_subparsers(dest="customers_command", required=True)
    imp = customer_commands.add_parser("import", help="import a CSV (all rows or none)")
    imp.add_argument("file", type=Path)
    imp.set_defaults(handler=cmd_import)
    seed = customer_commands.add_parser("seed-demo", help="create demo customers")
    seed.add_argument("--count", type=_positive, default=1000)
    seed.set_defaults(handler=cmd_seed_demo)

    demo = commands.add_parser("demo", help="bill a period of demo customers on the local stack")
    demo.add_argument("--customers", type=_positive, default=1000)
    demo.add_argument("--period", type=_period, default=None, help="default: last month")
    demo.add_argument("--json", action="store_true")
    demo.add_argument(
        "--keep-running", action="store_true", help="leave the local stack up for the Web UI"
    )
    demo.set_defaults(handler=cmd_demo)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.configure("WARNING")
    handler: Callable[[argparse.Namespace], Coroutine[Any, Any, int]] = args.handler
    try:
        return asyncio.run(handler(args))
    except BillingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

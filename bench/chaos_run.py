"""Chaos run: a period billed on a local stack while the worker is SIGKILLed and restarted
every few seconds, PostgreSQL restarts once, the vault and Temporal's dev server are each
SIGKILLed and started again once, Stripe (the emulator) loses answers after
committing (20%), answers 500 after (5%) and before (5%) committing and rate-limits, and the
period is started twice more (a second starter, a schedule's trigger). Then it checks, from
the emulator's ledger, Postgres and the vault: one successful charge per due customer (none
for the declined cards), no row left claimed, the same total in the ledger, in Stripe and in
the vault (spent, plus reservations reconciliation has yet to settle), no key over its cap.

    .venv/bin/python bench/chaos_run.py --customers 2000 --seed 1

The stack is its own, in .devstack-chaos/ (wiped at the start; its logs stay for a look
after) on ports of its own, so it runs beside the local stack and the test suite. Prints one
line of figures, writes them as JSON to bench/results/, and exits 1 on any violation (each
on stderr), including chaos that did not happen as planned.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import SecretStr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stack_support import write_result  # noqa: E402
from billing.config import BillingSettings, TemporalSettings  # noqa: E402
from billing.db import create_pool  # noqa: E402
from billing.periods import period_for  # noqa: E402
from billing.schedules import MonthlySchedule  # noqa: E402
from billing.stripe_client import stripe_session  # noqa: E402
from billing.temporal_client import connect  # noqa: E402
from chaos import scenario  # noqa: E402
from chaos.invariants import Expected, collect  # noqa: E402
from devstack.stack import LocalStack, StackConfig  # noqa: E402
from stripe_emulator.client import EmulatorClient  # noqa: E402
from vault.client import VaultAdmin  # noqa: E402

# Next to the default stack (7233, 8233, 5433, 12111, 8180), never on its ports.
STACK = StackConfig(
    root=ROOT / ".devstack-chaos",
    temporal_port=17233,
    ui_port=18233,
    postgres_port=15433,
    emulator_port=22111,
    vault_port=18180,
    worker=False,
)


def say(message: str) -> None:
    # stdout carries only the line of figures.
    print(message, file=sys.stderr, flush=True)


async def chaos(args: argparse.Namespace) -> dict[str, Any]:
    shutil.rmtree(STACK.root, ignore_errors=True)
    stack = LocalStack(STACK)
    say(f"starting a local stack in {STACK.root.relative_to(ROOT)}...")
    await stack.start()
    try:
        env = stack.environment
        temporal = TemporalSettings(
            address=env["TEMPORAL_ADDRESS"],
            namespace=env["TEMPORAL_NAMESPACE"],
            task_queue=env["TEMPORAL_TASK_QUEUE"],
        )
        client = await connect(temporal)
        say(f"seeding {args.customers} customers...")
        stripe_settings = BillingSettings(
            stripe_api_base=env["STRIPE_API_BASE"], stripe_api_key=SecretStr(env["STRIPE_API_KEY"])
        )
        # A pool for seeding and one for checking: none open across the PostgreSQL restart.
        pool = await create_pool(env["DATABASE_URL"])
        try:
            async with stripe_session(stripe_settings) as stripe_api:
                seeded = await scenario.seed(stripe_api, pool, args.customers, "chaos")
        finally:
            await pool.close()
        schedule = MonthlySchedule(schedule_id="chaos-monthly", paused=True)
        period = period_for(datetime.now(UTC), schedule.billing)
        targets = scenario.Targets(
            client=client,
            task_queue=temporal.task_queue,
            database_url=env["DATABASE_URL"],
            emulator=EmulatorClient(env["STRIPE_EMULATOR_URL"]),
            start_worker=lambda: stack.spawn_worker().process,
            restart_postgres=stack.postgres.restart,
            crash_vault=stack.restart_vault,
            crash_temporal=stack.restart_temporal,
        )
        plan = scenario.Plan(
            seed=args.seed,
            kill_every=(args.kill_min, args.kill_max),
            rate_limit_rps=args.rate_limit_rps,
            timeout=args.timeout,
            disturb_at=scenario.DISTURBANCES,
        )
        say(f"billing {period} under chaos (worker log: {STACK.log_dir / 'worker.log'})...")
        figures = await scenario.run(targets, period, len(seeded.customers), plan, schedule)
        say("checking Stripe's ledger, Postgres and the vault...")
        expected = Expected(str(period), seeded.customers, seeded.declined)
        # The owner's: the checks read the vault's reservations too, which the workers'
        # role (DATABASE_URL) may not.
        pool = await create_pool(stack.owner_dsn)
        try:
            async with VaultAdmin(
                env["BILLING_VAULT_URL"], env["BILLING_VAULT_ADMIN_TOKEN"]
            ) as admin:
                found = await collect(
                    expected, targets.emulator, pool, admin, figures.summary, figures.reconcile
                )
        finally:
            await pool.close()
    finally:
        say("stopping the stack...")
        await asyncio.to_thread(stack.stop)
    return {
        "customers": args.customers,
        "seed": args.seed,
        "period": str(period),
        "declined": len(seeded.declined),
        "seconds": round(figures.seconds, 1),
        "faults": {
            **figures.faults,
            "worker_kills": figures.kills,
            "postgres_restarts": figures.postgres_restarts,
            "vault_crashes": figures.vault_crashes,
            "temporal_crashes": figures.temporal_crashes,
            "duplicate_starts": figures.duplicate_starts,
        },
        "worker_exits": figures.worker_exits,
        **found.figures(),
        # Reservations the run left in doubt, settled by the reconciliation after it.
        "reservations_reconciled": len(figures.reconcile.reservations) if figures.reconcile else 0,
        "disturbed_at": figures.disturbed_at,
        "summary": figures.summary.model_dump() if figures.summary else None,
        "violations": figures.shortfalls() + found.violations,
        "kill_every_seconds": [args.kill_min, args.kill_max],
        "rate_limit_rps": args.rate_limit_rps,
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine_cpus": os.cpu_count(),
    }


def line(result: dict[str, Any]) -> str:
    faults = " ".join(f"{kind}={n}" for kind, n in result["faults"].items())
    vault = (
        f"{result['vault_spent_cents']} ({result['reservations_reconciled']} reservations"
        f" reconciled, {result['vault_unresolved']} unresolved)"
    )
    return (
        f"chaos seed={result['seed']}: {result['customers']} customers"
        f" ({result['declined']} declined), faults {faults}; duplicates={result['duplicates']}"
        f" lost={result['lost']}; totals ledger={result['ledger_total_cents']}"
        f" stripe={result['stripe_total_cents']} vault={vault}; {result['seconds']} s;"
        f" {len(result['violations'])} violations"
    )


def parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--customers", type=int, default=2000, help="due customers (default 2000)")
    p.add_argument("--seed", type=int, default=1, help="seeds the faults and the kill times")
    p.add_argument("--kill-min", type=float, default=2.0, help="shortest worker life, seconds")
    p.add_argument("--kill-max", type=float, default=6.0, help="longest worker life, seconds")
    p.add_argument(
        "--rate-limit-rps",
        type=float,
        default=scenario.RATE_LIMIT_RPS,
        help="the emulator's rate limit (default Stripe's test mode, 25/s)",
    )
    p.add_argument(
        "--timeout", type=float, default=3600, help="seconds the run may take (default 3600)"
    )
    return p


def main() -> int:
    args = parser().parse_args()
    if args.customers < 1 or not 0 < args.kill_min <= args.kill_max:
        raise SystemExit("need --customers >= 1 and 0 < --kill-min <= --kill-max")
    result = asyncio.run(chaos(args))
    path = write_result("chaos", result)
    for violation in result["violations"]:
        print(f"VIOLATION: {violation}", file=sys.stderr)
    say(f"written to {path.relative_to(ROOT)}")
    print(line(result), flush=True)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())

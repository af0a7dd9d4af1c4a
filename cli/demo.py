"""`demo` and `customers seed-demo`: demo customers, and a period of them billed locally."""

from __future__ import annotations

import argparse

from billing.seeding import seed_demo


async def cmd_seed_demo(args: argparse.Namespace) -> int:
    written = await seed_demo(args.count)
    print(f"created {written} demo customers in Stripe and the ledger")
    return 0


async def cmd_demo(args: argparse.Namespace) -> int:
    from devstack.demo import run_demo  # the local stack is only needed by the demo

    return await run_demo(args)

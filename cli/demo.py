"""`demo` and `customers seed-demo`: demo customers, and a period of them billed locally."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

from billing.errors import InvalidInputError
from billing.periods import check_far_flags, check_run_by_hand
from billing.seeding import seed_demo


async def cmd_seed_demo(args: argparse.Namespace) -> int:
    seeded = await seed_demo(args.count)
    print(
        f"{args.count} demo customers are in Stripe and the ledger ({seeded.written} rows"
        f" written); {seeded.active} active customers in all"
    )
    return 0


async def cmd_demo(args: argparse.Namespace) -> int:
    from devstack.demo import run_demo  # the local stack is only needed by the demo

    if args.period is not None:
        # The demo bills as `run` does: a mistyped month is refused before the stack starts.
        now = datetime.now(UTC)
        check_far_flags(args.period, now, ahead=args.ahead, late=args.late)
        check_run_by_hand(args.period, now, ahead=args.ahead, late=args.late)
    elif args.ahead or args.late:
        flag = "--ahead" if args.ahead else "--late"
        raise InvalidInputError(
            f"{flag} lets --period name a month far from this one: without --period the demo"
            " bills last month, which needs neither"
        )
    return await run_demo(args)

"""`customers ...`: import, deactivate and show the customers billed."""

from __future__ import annotations

import argparse
import sys

from billing import customer_history
from billing.config import DatabaseSettings, load_settings
from billing.customers import (
    Billable,
    deactivate_customers,
    import_customers,
    read_customers_csv,
    sharing_a_stripe_customer,
)
from billing.db import create_pool, where
from billing.errors import InvalidInputError
from billing.keys import validate_customer_id
from billing.reporting import describe_customer
from billing.wording import counted, listed
from cli.database import ledger_connection
from cli.output import emit


async def cmd_import(args: argparse.Namespace) -> int:
    rows = read_customers_csv(args.file)
    database_url = load_settings(DatabaseSettings).database_url
    pool = await create_pool(database_url)
    try:
        changes = await import_customers(
            pool, rows, while_running=args.while_running, reactivate=args.reactivate
        )
        periods = ", ".join(sorted({c.period for c in changes}))
        named = listed([f"{c.customer_id} ({c.was} -> {c.becomes})" for c in changes])
        if changes and not args.while_running:
            raise InvalidInputError(
                f"{args.file} adds or changes the price of {counted(len(changes), 'customer')}"
                " the open"
                f" run of {periods} has not billed yet:"
                f" {named}. That run may bill them at a"
                " price its plan and its key's cap did not count (a new currency pauses it)."
                " Import once it has ended, or pass --while-running (also"
                " if that run failed or was terminated, which leaves it open in the ledger);"
                " nothing was imported"
            )
        shared = await sharing_a_stripe_customer(pool, [r.customer_id for r in rows])
    finally:
        await pool.close()
    # Which ledger: a shell left with another deployment's DATABASE_URL imports there.
    print(
        f"imported {counted(len(rows), 'customer')} from {args.file} into the ledger at"
        f" {where(database_url)}"
    )
    if shared:
        # Refused only for ids spelt alike (_refuse_respelt): two ids may be two accounts.
        print(
            f"warning: {counted(len(shared), 'Stripe customer')} charged under more than one"
            " active customer id, once per id every period: "
            + listed([f"{stripe_id} ({', '.join(ids)})" for stripe_id, ids in shared.items()])
            + ". If one customer was imported twice under another id, deactivate the extra"
            " one: python starter.py customers deactivate ID",
            file=sys.stderr,
        )
    if changes:
        # --while-running: what the open run may now bill otherwise, for the record.
        print(
            f"note: the open run of {periods} may bill these as now imported: {named}"
            " (those its listing has passed, before it closes)"
        )
    return 0


async def cmd_deactivate(args: argparse.Namespace) -> int:
    # Bad input is named before anything is contacted, as by every other command.
    for customer_id in args.customer_ids:
        validate_customer_id(customer_id)
    pool = await create_pool(load_settings(DatabaseSettings).database_url)
    try:
        done = await deactivate_customers(pool, args.customer_ids, while_running=args.while_running)
    finally:
        await pool.close()
    claimed = [b for b in done.still_billable if b.claimed]
    unclaimed = [b for b in done.still_billable if not b.claimed]
    notes = []
    if claimed:
        notes.append(
            f"{counted(len(claimed), 'claim')} open, which a run charges whether or not the"
            f" customer is active: {_billables(claimed)};"
            " `starter.py skip PERIOD CUSTOMER --reason ...` stops one"
        )
    if unclaimed:
        notes.append(
            f"{counted(len(unclaimed), 'customer')} an open run has not claimed yet:"
            f" {_billables(unclaimed)}; that run does not charge them, but reports failed"
            " (unknown_customer) those whose child it has started"
        )
    if done.would_hold:
        notes.append(
            f"{counted(len(done.would_hold), 'active customer')} sharing a Stripe customer an"
            " open run billed under these ids, which that run would take for these renamed,"
            " and not bill: "
            + listed([f"{h.customer_id} in {h.period} (as {h.held_as})" for h in done.would_hold])
            + ". If they are other accounts, deactivate once the run has ended"
        )
    if notes and not args.while_running:
        raise InvalidInputError(
            "; ".join(notes)
            + ". Nothing was deactivated: skip those customers first, or deactivate once the run"
            " has ended, or pass --while-running (also if a run failed or was terminated,"
            " which leaves it open in the ledger)"
        )
    if done.deactivated:
        deactivated = counted(len(done.deactivated), "customer")
        print(f"deactivated {deactivated}: {', '.join(done.deactivated)}")
    if done.already_inactive:
        print(f"already inactive: {', '.join(done.already_inactive)}")
    for note in notes:
        print(f"note: {note}")
    return 0


def _billables(billables: list[Billable]) -> str:
    return listed([f"{b.customer_id} ({b.period})" for b in billables])


async def cmd_show_customer(args: argparse.Namespace) -> int:
    async with ledger_connection() as conn:
        history = await customer_history.customer_history(
            conn, args.customer_id, period=args.period, limit=args.limit
        )
    emit(history, args.json, describe_customer(history))
    return 0

"""The command table: every command, its arguments and the function that runs it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import get_args

from billing import customer_history, schedules
from billing.keys import validate_customer_id
from billing.periods import LATE_MONTHS
from billing.reconciliation import FindingKind
from cli import arguments
from cli.customers import cmd_deactivate, cmd_import, cmd_show_customer
from cli.demo import cmd_demo, cmd_seed_demo
from cli.deployment import cmd_migrate, cmd_setup
from cli.reconcile import cmd_handled, cmd_reconcile
from cli.runs import (
    cmd_control,
    cmd_failures,
    cmd_preview,
    cmd_renew_keys,
    cmd_run,
    cmd_skip,
    cmd_status,
    cmd_watch,
)
from cli.schedule import cmd_schedule


def parser() -> argparse.ArgumentParser:
    root = arguments.Parser(
        prog="starter.py",
        description="Operator's command line: run, watch and steer billing periods, schedules and"
        " customers.",
    )
    commands = root.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="start (or join) the run of a billing period")
    run.add_argument("period", type=arguments.period, help="YYYY-MM")
    run.add_argument("--wait", action="store_true", help="wait for the run and print its summary")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    arguments.add_far_months(run)
    run.set_defaults(handler=cmd_run)

    status = commands.add_parser("status", help="counts of a period's run")
    status.add_argument("period", type=arguments.period, help="YYYY-MM")
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=cmd_status)

    for action, text in (
        ("pause", "stop starting charges; charges already sent finish"),
        ("resume", "continue a paused run"),
        ("cancel", "charge nothing more; customers not yet charged end cancelled"),
    ):
        control = commands.add_parser(action, help=text)
        control.add_argument("period", type=arguments.period, help="YYYY-MM")
        arguments.add_operator_flags(control)
        control.add_argument("--json", action="store_true")
        control.set_defaults(handler=cmd_control)

    renew = commands.add_parser(
        "renew-keys",
        help="give a paused run new vault keys, capped for what it has left (cap reached,"
        " key expired); then resume it. A cancelled run held up by a refused key then ends",
    )
    renew.add_argument("period", type=arguments.period, help="YYYY-MM")
    arguments.add_operator_flags(renew)
    renew.add_argument("--json", action="store_true")
    renew.set_defaults(handler=cmd_renew_keys)

    skip = commands.add_parser("skip", help="do not charge one customer this period")
    skip.add_argument("period", type=arguments.period, help="YYYY-MM")
    skip.add_argument("customer", help="the customer id")
    arguments.add_operator_flags(skip)
    skip.add_argument("--json", action="store_true")
    # A period with no run takes the skip for later: a month far from now is most likely
    # mistyped (billing.periods.check_skip_by_hand).
    skip_when = skip.add_mutually_exclusive_group()
    skip_when.add_argument(
        "--ahead", action="store_true", help="record a skip for a period later than next month"
    )
    skip_when.add_argument(
        "--late",
        action="store_true",
        help=f"record a skip for a period more than {LATE_MONTHS} months before this one",
    )
    skip.set_defaults(handler=cmd_skip)

    failures = commands.add_parser(
        "failures", help="a period's failed customers, by Stripe's failure and decline code"
    )
    failures.add_argument("period", type=arguments.period, help="YYYY-MM")
    failures.add_argument("--json", action="store_true")
    failures.set_defaults(handler=cmd_failures)

    watch = commands.add_parser("watch", help="a live progress bar until the run ends")
    watch.add_argument("period", type=arguments.period, help="YYYY-MM")
    watch.add_argument(
        "--interval",
        # A floor, so that a typo does not query Temporal in a busy loop.
        type=arguments.number(3600, least=0.2),
        default=1.0,
        help="seconds between updates",
    )
    watch.set_defaults(handler=cmd_watch)

    preview = commands.add_parser("preview", help="who a run would charge; charges nothing")
    preview.add_argument("period", type=arguments.period, help="YYYY-MM")
    preview.add_argument("--json", action="store_true")
    preview.set_defaults(handler=cmd_preview)

    reconcile = commands.add_parser(
        "reconcile",
        help="resolve open claims and unknown vault reservations; report Stripe charges the"
        " ledger does not hold (exit 1 if any)",
    )
    reconcile.add_argument("period", type=arguments.period, help="YYYY-MM")
    reconcile.add_argument("--json", action="store_true", help="print the report as JSON")
    reconcile.add_argument(
        "--unbilled",
        action="store_true",
        help="reconcile a period the ledger holds no row of (no run has billed it)",
    )
    reconcile.set_defaults(handler=cmd_reconcile)

    handled = commands.add_parser(
        "handled",
        help="record that a person has handled a reconciliation finding: later reports count"
        " it instead of listing it (and exit 0 for it); with the period alone, list the marks"
        " made under it",
    )
    handled.add_argument("period", type=arguments.period, help="YYYY-MM")
    handled.add_argument(
        "kind",
        nargs="?",
        type=str.lower,  # as the report prints it, DUPLICATE, or as its JSON has it
        choices=get_args(FindingKind),
        help="the finding's kind, as the report names it",
    )
    handled.add_argument(
        "charge_id", nargs="?", type=arguments.charge_id, help="the finding's Stripe charge id"
    )
    handled.add_argument(
        "--reason",
        type=arguments.reason,
        help="what was done (or why it is taken back); required to mark",
    )
    handled.add_argument("--undo", action="store_true", help="take the mark back")
    handled.add_argument(
        "--force",
        action="store_true",
        help="mark a finding no reconciliation here reported (say, before this release)",
    )
    arguments.add_operator_flag(handled)
    handled.add_argument("--json", action="store_true")
    handled.set_defaults(handler=cmd_handled)

    commands.add_parser(
        "setup", help="register the search attributes on a Temporal cluster"
    ).set_defaults(handler=cmd_setup)

    schedule = commands.add_parser("schedule", help="monthly runs with Temporal Schedules")
    schedule_commands = schedule.add_subparsers(dest="schedule_command", required=True)
    defaults = schedules.MonthlySchedule()
    for name, text in (
        ("create", "create the monthly schedule"),
        ("describe", "show the schedule, its next and recent runs"),
        ("pause", "stop firing"),
        ("unpause", "fire again"),
        (
            "trigger",
            "fire now (bills the period the schedule would bill now, once its firing is past)",
        ),
        ("backfill", "run missed periods"),
        ("delete", "delete the schedule (runs already started go on)"),
    ):
        sub = schedule_commands.add_parser(name, help=text)
        sub.add_argument(
            "--id",
            type=arguments.schedule_id,
            help=f"schedule id (default {schedules.DEFAULT_SCHEDULE_ID};"
            f" {schedules.RECONCILE_SCHEDULE_ID} for create --reconcile)",
        )
        sub.set_defaults(handler=cmd_schedule)
        if name in ("pause", "unpause"):
            sub.add_argument("--note", default=None, help="why; `describe` shows it")
            arguments.add_operator_flag(sub)
        if name in ("trigger", "backfill"):
            sub.add_argument(
                "--while-paused",
                action="store_true",
                help="launch even though the schedule is paused (refused otherwise)",
            )
        if name == "trigger":
            sub.add_argument(
                "--early",
                action="store_true",
                help="bill the month now, though the schedule's own firing for it is ahead",
            )
        if name == "backfill":
            sub.add_argument("--start", type=arguments.period, required=True, help="first period")
            sub.add_argument("--end", type=arguments.period, required=True, help="last period")
            arguments.add_late(sub)
        if name == "create":
            sub.add_argument("--day", type=int, help=f"1-28 (default {defaults.day_of_month})")
            sub.add_argument("--hour", type=int, default=defaults.hour)
            sub.add_argument("--minute", type=int, default=defaults.minute)
            # No defaults here: a reconciliation takes these from its billing schedule.
            sub.add_argument(
                "--time-zone",
                help=f"IANA name (default {defaults.time_zone}); a reconciliation following a"
                " billing schedule fires in it, and reads months in that schedule's zone",
            )
            sub.add_argument(
                "--billing",
                choices=["arrears", "advance"],
                help="bill the month that ended (arrears) or the one starting (advance);"
                f" default {defaults.billing}",
            )
            sub.add_argument(
                "--overlap",
                choices=[
                    "skip",
                    "buffer_one",
                    "buffer_all",
                    "cancel_other",
                    "terminate_other",
                    "allow_all",
                ],
                default=defaults.overlap,
            )
            sub.add_argument(
                "--catchup-hours",
                type=arguments.number(24 * 366),
                default=defaults.catchup_window.total_seconds() / 3600,
                help="how late a missed firing still runs",
            )
            sub.add_argument("--paused", action="store_true", help="create it paused")
            sub.add_argument(
                "--reconcile",
                action="store_true",
                help="a daily reconciliation of the period the schedule would bill, at --hour"
                f" and --minute (no --day; id {schedules.RECONCILE_SCHEDULE_ID} by default)",
            )
            sub.add_argument(
                "--billing-schedule",
                type=arguments.schedule_id,
                help="with --reconcile: the billing schedule whose mode and zone it follows,"
                " and whose firings of the last two months it checks billed their months"
                f" (default {schedules.DEFAULT_SCHEDULE_ID})",
            )
            sub.add_argument(
                "--billed-by-hand",
                action="store_true",
                help="with --reconcile: follow no billing schedule (periods are billed by"
                " hand with `run`); without it, a reconciliation with no billing schedule to"
                " follow is refused",
            )
            sub.add_argument(
                "--leave-unbilled",
                action="store_true",
                help="create a billing schedule even though months between the ledger's latest"
                " run and its first firing would be billed by nothing",
            )

    commands.add_parser("migrate", help="apply database migrations").set_defaults(
        handler=cmd_migrate
    )

    customers = commands.add_parser("customers", help="manage customers due for billing")
    customer_commands = customers.add_subparsers(dest="customers_command", required=True)
    imp = customer_commands.add_parser("import", help="import a CSV (all rows or none)")
    imp.add_argument("file", type=Path)
    imp.add_argument(
        "--while-running",
        action="store_true",
        help="change prices a running period has not billed yet anyway",
    )
    imp.add_argument(
        "--reactivate",
        action="store_true",
        help="make customers deactivated before active again (billed from the next run on)",
    )
    imp.set_defaults(handler=cmd_import)
    deactivate = customer_commands.add_parser(
        "deactivate",
        help="bill customers no more: no run opened from now on lists them (past rows stay)",
    )
    deactivate.add_argument("customer_ids", nargs="+", metavar="customer_id")
    deactivate.add_argument(
        "--while-running",
        action="store_true",
        help="even customers a period may still charge (an open claim is charged anyway)",
    )
    deactivate.set_defaults(handler=cmd_deactivate)
    show = customer_commands.add_parser(
        "show", help="one customer: what it is billed now, and what each period did"
    )
    show.add_argument("customer_id", type=arguments.argument(validate_customer_id))
    show.add_argument("--period", type=arguments.period, help="only this period (YYYY-MM)")
    show.add_argument(
        "--limit",
        type=arguments.positive_up_to(customer_history.MAX_PERIODS_SHOWN, "periods"),
        default=customer_history.DEFAULT_PERIODS_SHOWN,
        help="how many periods, newest first",
    )
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=cmd_show_customer)
    seed = customer_commands.add_parser("seed-demo", help="create demo customers")
    seed.add_argument("--count", type=arguments.demo_count, default=1000)
    seed.set_defaults(handler=cmd_seed_demo)

    demo = commands.add_parser("demo", help="bill a period of demo customers on the local stack")
    demo.add_argument(
        "--customers",
        type=arguments.demo_count,
        default=1000,
        help="demo customers to create if missing; the run bills every active customer",
    )
    demo.add_argument("--period", type=arguments.period, default=None, help="default: last month")
    arguments.add_far_months(demo)
    demo.add_argument("--json", action="store_true")
    demo.add_argument(
        "--keep-running", action="store_true", help="leave the local stack up for the Web UI"
    )
    demo.set_defaults(handler=cmd_demo)
    return root

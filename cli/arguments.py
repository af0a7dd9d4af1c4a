"""The command line's argument types and shared flags: a bad value is argparse's error,
before anything is contacted."""

from __future__ import annotations

import argparse
import getpass
import math
import re
from collections.abc import Callable
from typing import NoReturn, TypeVar

from billing import schedules
from billing.config import OperatorSettings, load_settings
from billing.errors import BillingError, InvalidInputError, shown
from billing.periods import LATE_MONTHS, parse_period
from billing.reconciliation import CHARGE_ID_PATTERN
from billing.redact import one_line, redact, shown_line
from billing.seeding import MAX_DEMO_CUSTOMERS

T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors (an invalid choice, a value not a number, an argument
    not expected) quote the value given: one shaped like a key, pasted into the wrong flag,
    is shown redacted. Its sub-commands' parsers are of its class."""

    def error(self, message: str) -> NoReturn:
        super().error(redact(message))


def argument(check: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from one of billing's checks: its refusal is argparse's error."""

    def checked(text: str) -> T:
        try:
            return check(text)
        except BillingError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return checked


period = argument(parse_period)
schedule_id = argument(schedules.validate_schedule_id)


def reason(text: str) -> str:
    """An argparse type: why an operator acts, kept with the run; blank says nothing (a
    zero-width space included, which is kept as a space)."""
    if not one_line(text).strip():
        raise argparse.ArgumentTypeError("expected words saying why, got a blank reason")
    return text


def operator_name(text: str) -> str:
    """An argparse type: who acts, kept with what they did; blank names no one."""
    if not one_line(text).strip():
        raise argparse.ArgumentTypeError("expected the name of whoever acts, got a blank one")
    return text


def add_operator_flag(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--operator", type=operator_name, help="default: $BILLING_OPERATOR or your login"
    )


def charge_id(text: str) -> str:
    if re.fullmatch(CHARGE_ID_PATTERN, text) is None:
        raise argparse.ArgumentTypeError(
            f"expected a Stripe charge id as a report names it (ch_... or py_...), got"
            f" {shown(text)}"
        )
    return text


def positive(text: str) -> int:
    # isascii: "²" and other Unicode digits pass isdigit() but not int().
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {shown(text)}")
    return int(text)


def positive_up_to(high: int, things: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        count = positive(text)
        if count > high:
            raise argparse.ArgumentTypeError(f"at most {high:,} {things}, got {count:,}")
        return count

    return parse


demo_count = positive_up_to(MAX_DEMO_CUSTOMERS, "demo customers")


def number(high: float, *, least: float | None = None) -> Callable[[str], float]:
    """An argparse type: a number above 0 (or at least `least`) and at most `high` (so no
    nan, inf or overflow)."""
    wanted = f"above 0 and at most {high:g}" if least is None else f"from {least:g} to {high:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        # nan fails every comparison.
        if not (0 < value <= high and (least is None or value >= least)):
            raise argparse.ArgumentTypeError(f"expected a number {wanted}, got {shown(text)}")
        return value

    return parse


def operator(args: argparse.Namespace) -> str:
    # A --operator given blank is refused by its type, never replaced by a default.
    if args.operator is not None:
        given: str = args.operator
        return given
    named = load_settings(OperatorSettings).billing_operator
    if named is not None:
        return named
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name: a container's uid without a passwd entry
        raise InvalidInputError(
            "no operator name to record: pass --operator or set BILLING_OPERATOR"
        ) from None


def note(args: argparse.Namespace, done: str = "") -> str:
    """A schedule's note for a pause (or, with `done`, an unpause), kept by Temporal and
    printed by `describe`: who did it, and the note given, redacted as reasons are (without
    one, Temporal's own would read "Unpaused via Python SDK")."""
    given: str | None = args.note
    who = f"{done} by {operator(args)}".lstrip()
    return who + ("" if given is None else f": {shown_line(given)}")


# argparse names no public type for "a parser or a group of its flags".
def add_late(command: argparse._ActionsContainer) -> None:
    """`run` and `schedule backfill` bill old periods only when told to (billing.periods)."""
    command.add_argument(
        "--late",
        action="store_true",
        help=f"bill periods more than {LATE_MONTHS} months before this one anyway",
    )


def add_far_months(command: argparse.ArgumentParser) -> None:
    """`run` and `demo` bill a month far from now only when told which way: the two
    together are a mistyped period."""
    when = command.add_mutually_exclusive_group()
    when.add_argument(
        "--ahead", action="store_true", help="bill a period later than next month anyway"
    )
    add_late(when)


def add_operator_flags(command: argparse.ArgumentParser) -> None:
    """What a command that steers a run records with it: why, and who."""
    command.add_argument("--reason", required=True, type=reason, help="recorded with your name")
    add_operator_flag(command)

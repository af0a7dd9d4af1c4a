"""Billing periods: calendar months written `YYYY-MM`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from billing.errors import InvalidPeriodError, shown

_PERIOD_RE = re.compile(r"([0-9]{4})-([0-9]{2})")
MIN_YEAR = 2000
MAX_YEAR = 2999

Billing = Literal["arrears", "advance"]

# A run by hand bills today's active customers. A period this many months before the current
# one is refused without --late: `2016-12` typed for `2026-12` would charge every customer for
# a month before most of them joined. Three months leave room for a run missed in an outage.
LATE_MONTHS = 3


@dataclass(frozen=True, order=True, slots=True)
class Period:
    year: int
    month: int

    def __post_init__(self) -> None:
        if not MIN_YEAR <= self.year <= MAX_YEAR:
            raise InvalidPeriodError(
                f"billing period year {self.year} is outside {MIN_YEAR}-{MAX_YEAR}"
            )
        if not 1 <= self.month <= 12:
            raise InvalidPeriodError(f"billing period month {self.month} is not 01-12")

    def __str__(self) -> str:
        return f"{self.year:04d}-{self.month:02d}"

    @property
    def starts_at(self) -> datetime:
        return datetime(self.year, self.month, 1, tzinfo=UTC)

    @property
    def ends_at(self) -> datetime:
        """First instant after the period (exclusive end); past MAX_YEAR too, where no
        Period is (a key for 2999-12 expires in 3000)."""
        return datetime(*self.later(1), 1, tzinfo=UTC)

    def next(self) -> Period:
        return Period(*self.later(1))

    def later(self, months: int) -> tuple[int, int]:
        """The year and month `months` after this one, unchecked: past MAX_YEAR too."""
        year, month = divmod(self.year * 12 + self.month - 1 + months, 12)
        return year, month + 1

    def previous(self) -> Period:
        return Period(self.year - (self.month == 1), (self.month - 2) % 12 + 1)


def parse_period(text: str) -> Period:
    """Parse `YYYY-MM`; anything else raises InvalidPeriodError saying what was expected."""
    if not isinstance(text, str):
        raise InvalidPeriodError(f"billing period must be a string like 2026-12, got {text!r}")
    match = _PERIOD_RE.fullmatch(text)
    if match is None:
        raise InvalidPeriodError(
            f"billing period {shown(text)} is not in the form YYYY-MM, e.g. 2026-12"
        )
    return Period(int(match.group(1)), int(match.group(2)))


def period_for(moment: datetime, billing: Billing = "arrears") -> Period:
    """The period a run at `moment` bills: the month before it (arrears) or its own (advance)."""
    if moment.tzinfo is None:
        raise InvalidPeriodError("the run time must carry a time zone")
    current = Period(moment.year, moment.month)
    return current.previous() if billing == "arrears" else current


def period_range(first: Period, last: Period) -> list[Period]:
    """Every period from `first` to `last`, inclusive."""
    if last < first:
        raise InvalidPeriodError(f"period range ends ({last}) before it starts ({first})")
    periods = [first]
    while periods[-1] < last:
        periods.append(periods[-1].next())
    return periods


def is_late(period: Period, now: datetime) -> bool:
    """Whether `period` is more than LATE_MONTHS before the current month."""
    earliest = period_for(now, "advance")
    for _ in range(LATE_MONTHS):
        earliest = earliest.previous()
    return period < earliest


def _far(period: Period, now: datetime) -> Literal["ahead", "late"] | None:
    """Whether `period` is later than next month, or more than LATE_MONTHS before this one:
    most likely a mistyped month."""
    if period_for(now, "advance").next() < period:
        return "ahead"
    return "late" if is_late(period, now) else None


def run_command(period: Period, now: datetime) -> str:
    """The `run` command that bills `period` now, with the flag check_run_by_hand asks for."""
    far = _far(period, now)
    return f"python starter.py run {period}" + (f" --{far}" if far else "")


def check_far_flags(
    period: Period, now: datetime, *, ahead: bool = False, late: bool = False
) -> None:
    """Refuse `--ahead` or `--late` given for a period that needs neither: the flag says the
    operator meant a month far from this one, and the month typed is not (a mistyped year)."""
    far = _far(period, now)
    for flag, given in (("ahead", ahead), ("late", late)):
        if given and far != flag:
            meant = (
                f"later than next month ({period_for(now, 'advance').next()})"
                if flag == "ahead"
                else f"more than {LATE_MONTHS} months before the current month"
            )
            raise InvalidPeriodError(
                f"--{flag} is for a period {meant}, and {period} is not: check the period (a"
                f" mistyped year?), or leave --{flag} out"
            )


def check_run_by_hand(
    period: Period, now: datetime, *, ahead: bool = False, late: bool = False
) -> None:
    """Refuse a period an operator most likely mistyped, unless told it is meant.

    Next month may be billed early (in advance, near the turn of a month); later is refused
    without `ahead`. A period more than LATE_MONTHS before the current one is refused without
    `late`."""
    far = _far(period, now)
    if far == "ahead" and not ahead:
        raise InvalidPeriodError(
            f"{period} is later than next month ({period_for(now, 'advance').next()}), and a"
            " run now charges its customers ahead of time: check the period, or pass --ahead"
            " to bill it now"
        )
    if far == "late" and not late:
        raise InvalidPeriodError(
            f"{period} is more than {LATE_MONTHS} months before the current month"
            f" ({period_for(now, 'advance')}), and a run now charges every active customer for"
            " it, those who joined since included: check the period, or pass --late to bill it"
            " now"
        )


def check_skip_by_hand(
    period: Period, now: datetime, *, ahead: bool = False, late: bool = False
) -> None:
    """Refuse a skip for a period with no run that is most likely a mistyped month: it would
    wait in the ledger where no run looks, and the customer be charged in the month meant."""
    far = _far(period, now)
    if far is not None and not (ahead if far == "ahead" else late):
        when = (
            "is later than next month"
            if far == "ahead"
            else f"is more than {LATE_MONTHS} months before the current month"
        )
        raise InvalidPeriodError(
            f"{period} {when}, and has no run: a skip recorded for it stops no charge in any"
            f" other month. Check the period, or pass --{far} to record it anyway"
        )

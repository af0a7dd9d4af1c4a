"""How a message counts and lists things: shared by the models' warnings and the reports."""

from __future__ import annotations

from collections.abc import Sequence


def counted(count: int, noun: str) -> str:
    """ "1 customer", "2 customers": an English plural in s, which every noun here takes."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def listed(items: Sequence[str], shown: int = 5) -> str:
    """The first `shown` items, and how many more: a message names a few, not thousands."""
    more = len(items) - shown
    return ", ".join(items[:shown]) + (f" and {more} more" if more > 0 else "")

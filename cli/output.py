"""What commands print: a model as JSON or as words, and notes while Temporal is away."""

from __future__ import annotations

import sys
import time
from datetime import timedelta

from pydantic import BaseModel
from temporalio.service import RPCError

# While Temporal is away, how often a waiting command says it still is.
OUTAGE_REMINDER = timedelta(minutes=5)


def emit(model: BaseModel, as_json: bool, text: str) -> None:
    print(model.model_dump_json() if as_json else text)


class OutageNotice:
    """Tells that Temporal cannot be reached while a command waits on a run (again every
    OUTAGE_REMINDER while it lasts), and that it can again (`back()`, from any call that got
    through)."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._away_since: float | None = None
        self._told_at = 0.0

    def __call__(self, exc: RPCError) -> None:
        now = time.monotonic()
        if self._away_since is None:
            self._away_since = now
            print(
                f"warning: Temporal cannot be reached ({exc.status.name}: {exc.message}):"
                f" {self._what} goes on there, its workers reconnect; waiting for Temporal to"
                " come back",
                file=sys.stderr,
            )
        elif now - self._told_at >= OUTAGE_REMINDER.total_seconds():
            print(
                f"warning: Temporal still cannot be reached after"
                f" {(now - self._away_since) / 60:.0f} min ({exc.status.name}: {exc.message});"
                " waiting",
                file=sys.stderr,
            )
        else:
            return
        self._told_at = now

    def back(self) -> None:
        if self._away_since is not None:
            print("note: Temporal is reachable again", file=sys.stderr)
        self._away_since = None

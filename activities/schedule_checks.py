"""What a daily reconciliation checks of the billing schedule it follows (the launcher's
side; billing.schedules reads the schedule)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

import asyncpg
from temporalio import activity
from temporalio.exceptions import ApplicationError

from billing import logs, metrics, schedules
from billing.errors import InvalidInputError, UnknownScheduleError
from billing.models import Record

log = logging.getLogger("billing.schedules")

# The followed schedule holds arguments this release cannot read: no retry reads them.
SCHEDULE_UNREADABLE = "ScheduleUnreadable"


class FiringsRequest(Record):
    schedule_id: str
    nominal_time: datetime


class ScheduleCheckActivities:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @activity.defn(name="billing_firings")
    async def billing_firings(self, request: FiringsRequest) -> schedules.BillingFirings | None:
        """The billing schedule's settings, and the months its recent firings left
        unbilled, logged and counted for an alert; None once that schedule is gone (deleted,
        replaced by another kind), also logged and counted."""
        metrics.watch_schedule(request.schedule_id)
        try:
            async with self._pool.acquire() as conn:
                found = await schedules.billing_firings(
                    activity.client(), conn, request.schedule_id, request.nominal_time
                )
        except UnknownScheduleError as exc:
            # Nothing may bill at all: as loud as a month left unbilled.
            _alert(
                "followed_schedule_gone",
                metrics.count_followed_schedule_gone,
                request.schedule_id,
                detail=f"{exc}; the daily reconciliation keeps the mode and zone it was created"
                " with",
            )
            metrics.schedule_checked(request.schedule_id)
            return None
        except InvalidInputError as exc:
            # Written by another release: the launch warns and reconciles at once, where five
            # tries would hold it about 15 s for the same answer.
            raise ApplicationError(str(exc), type=SCHEDULE_UNREADABLE, non_retryable=True) from None
        if found.unbilled is not None:
            _alert(
                "unbilled_firing",
                metrics.count_unbilled_firing,
                request.schedule_id,
                fired_at=found.unbilled.at.isoformat(),
                period=str(found.unbilled.period),
                earlier=[str(p) for p in found.unbilled.earlier],
                ended_unfinished=[str(p) for p in found.unbilled.ended_unfinished],
                detail=found.unbilled.describe(),
            )
        metrics.schedule_checked(request.schedule_id)
        return found


def _alert(event: str, count: Callable[[str], None], schedule_id: str, **fields: object) -> None:
    """An ERROR event and its counter, which an operator's alert watches."""
    count(schedule_id)
    logs.log_event(log, event, level=logging.ERROR, schedule_id=schedule_id, **fields)

"""The ledger's database, as one command uses it."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import asyncpg

from billing import ledger
from billing.config import DatabaseSettings, SettingsError, load_settings
from billing.db import CONNECTION_ERRORS, create_pool
from billing.errors import ConfigurationError, ServiceUnavailableError
from billing.models import PeriodTotals

# What a command that reads the ledger only to say more (a schedule's `describe`) meets when
# it cannot: said in a note, not failed on, after the command has done its part.
LEDGER_UNREADABLE: tuple[type[Exception], ...] = (
    *CONNECTION_ERRORS,
    ServiceUnavailableError,
    ConfigurationError,
    SettingsError,
)
T = TypeVar("T")
# How long a command waits for the ledger when it reads it only to say more (read_for_a_note).
LEDGER_NOTE_SECONDS = 5.0


@contextlib.asynccontextmanager
async def ledger_connection() -> AsyncIterator[asyncpg.Connection]:
    """One connection to the ledger, for a command that reads or changes a row or two."""
    pool = await create_pool(load_settings(DatabaseSettings).database_url, max_size=1)
    try:
        async with pool.acquire() as conn:
            yield conn
    finally:
        await pool.close()


async def read_for_a_note(
    unread: str, read: Callable[[asyncpg.Connection], Awaitable[T]]
) -> T | None:
    """`read` of the ledger, for a command that reads it only to say more than what it asked
    Temporal; None, with a note saying what goes `unread`, if it cannot be read. Bounded:
    such a command must not hang on a database that takes connections but does not answer."""
    try:
        async with asyncio.timeout(LEDGER_NOTE_SECONDS), ledger_connection() as conn:
            return await read(conn)
    except (*LEDGER_UNREADABLE, TimeoutError, asyncpg.PostgresError) as exc:
        print(
            f"note: the ledger could not be read ({type(exc).__name__}): {unread}", file=sys.stderr
        )
        return None


async def ledger_totals(period: str) -> PeriodTotals | None:
    """The ledger's totals of the period's runs (`empty` when it holds no row of it): a
    rerun's summary counts what the runs before it charged as already billed."""
    return await read_for_a_note(
        f"the totals of {period}'s runs are not shown",
        lambda conn: ledger.period_totals(conn, period),
    )

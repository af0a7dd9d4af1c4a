"""Waiting, in a test, for something another task or process does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg


async def eventually(
    check: Callable[[], Awaitable[bool]],
    timeout: float = 60,
    *,
    explain: Callable[[], Awaitable[str]] | None = None,
) -> None:
    """Wait until `check()` is true; fail the test after `timeout` seconds, with what
    `explain()` then says (where the time went: a flake seen once in CI is read from its
    log, as it may not come back)."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() >= deadline:
            said = f"\n{await explain()}" if explain is not None else ""
            raise AssertionError(f"condition not reached in {timeout:g} s{said}")
        await asyncio.sleep(0.1)


async def waits_on_a_lock(
    pool: asyncpg.Pool, conn: asyncpg.Connection | None, statement: asyncio.Future[Any]
) -> bool:
    """Whether `statement`, a task running on `conn` (None: on a connection of its own from
    a pool, so any session of the database), waits for a lock (one the test's other
    transaction holds), or has ended without waiting: a test then lets that transaction go
    knowing the statement met it, rather than betting on how fast the machine is."""
    if statement.done():
        return True
    if conn is None:
        waiting = (
            "SELECT count(*) > 0 FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return bool(await pool.fetchval(waiting))
    waiting = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1"
    return bool(await pool.fetchval(waiting, conn.get_server_pid()))

"""The ledger's database, as one command uses it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import asyncpg

from billing.config import DatabaseSettings, SettingsError, load_settings
from billing.db import CONNECTION_ERRORS, create_pool
from billing.errors import ConfigurationError, ServiceUnavailableError

# What a command that reads the ledger only to say more (a schedule's `describe`) meets when
# it cannot: said in a note, not failed on, after the command has done its part.
LEDGER_UNREADABLE: tuple[type[Exception], ...] = (
    *CONNECTION_ERRORS,
    ServiceUnavailableError,
    ConfigurationError,
    SettingsError,
)


@contextlib.asynccontextmanager
async def ledger_connection() -> AsyncIterator[asyncpg.Connection]:
    """One connection to the ledger, for a command that reads or changes a row or two."""
    pool = await create_pool(load_settings(DatabaseSettings).database_url, max_size=1)
    try:
        async with pool.acquire() as conn:
            yield conn
    finally:
        await pool.close()

"""Connections to the ledger, with errors that say which database could not be reached."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import asyncpg

from billing.errors import ConfigurationError, ServiceUnavailableError

# Errors that say the database could not be reached or dropped the connection (a restart, a
# failover), as opposed to a statement it refused: only these are worth trying again.
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.OperatorInterventionError,
    # A pooled connection whose session the server ended mid-statement (a restart) can
    # still believe a statement is in progress (asyncpg issue 1069): seen on the retry of a
    # vault write during a restart. Whoever meets it drops that connection first.
    asyncpg.InternalClientError,
)


_MALFORMED = (
    "is not a valid PostgreSQL URL (postgresql://user:password@host:port/database):"
    " percent-encode any '/', '#', '?', '@' or ':' in the user name or password, and check"
    " the value of each parameter after '?' (sslmode, target_session_attrs, ...)"
)


def malformed_url(variable: str) -> ConfigurationError:
    """For a URL asyncpg cannot parse: its own message quotes the part it choked on, which
    may be the password, so it is never shown."""
    return ConfigurationError(f"{variable} {_MALFORMED}")


def where(dsn: str) -> str:
    """The URL's hosts and database, for a message: no user, password or parameters, any of
    which may hold a secret (`?password=...` too). Split as asyncpg splits it, so that an
    '@' in a parameter is not taken for the end of the user part."""
    hidden = "the host the URL names"
    try:
        parts = urlsplit(dsn)
    except ValueError:
        return hidden
    at_signs = parts.netloc.count("@")
    if at_signs > 1 or dsn.count("@") != at_signs:
        # An '@' in the user name or password, in a parameter, or after a '/', '?' or '#'
        # the password holds unescaped: which part is the password is a guess, so none of
        # the URL is shown.
        return hidden
    return parts.netloc.rpartition("@")[2] + parts.path.split(";", 1)[0]


def _unavailable(dsn: str, exc: Exception) -> ServiceUnavailableError:
    return ServiceUnavailableError(f"cannot reach PostgreSQL at {where(dsn)} (DATABASE_URL): {exc}")


@contextmanager
def _reaching(dsn: str) -> Iterator[None]:
    """What connecting to `dsn` raises, as errors that say which setting to fix."""
    try:
        yield
    except (OSError, asyncpg.PostgresError) as exc:
        raise _unavailable(dsn, exc) from None
    except ValueError:  # asyncpg's parser
        raise malformed_url("DATABASE_URL") from None
    except OverflowError as exc:  # a port past 65535: the socket's words quote no secret
        raise ConfigurationError(f"DATABASE_URL: {exc}") from None


async def connect(dsn: str) -> asyncpg.Connection:
    with _reaching(dsn):
        return await asyncpg.connect(dsn)


async def create_pool(dsn: str, *, max_size: int = 20) -> asyncpg.Pool:
    with _reaching(dsn):
        pool = await asyncpg.create_pool(
            dsn, min_size=1, max_size=max_size, command_timeout=30, reset=keep_session
        )
    assert pool is not None
    return pool


async def keep_session(conn: asyncpg.Connection) -> None:
    """Neither the ledger nor the vault sets session state (no SET, LISTEN, session advisory
    lock or cursor outside a transaction), so the default reset query, a round trip on every
    release, is skipped: a charge releases one three or four times. asyncpg still rolls back
    a transaction left open."""

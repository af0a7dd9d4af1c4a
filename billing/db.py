"""Connections to the ledger, with errors that say which database could not be reached."""

from __future__ import annotations

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
)


_MALFORMED = (
    "is not a valid PostgreSQL URL (postgresql://user:password@host:port/database):"
    " percent-encode any '/', '#', '?', '@' or ':' in the user name or password"
)


def check_dsn(dsn: str) -> str:
    """`dsn` if asyncpg can parse it. The error never quotes it, nor the parser's own message:
    both may hold the password."""
    try:
        parts = urlsplit(dsn)
        _ = parts.port
    except ValueError:
        raise ValueError(_MALFORMED) from None
    if parts.scheme not in ("postgresql", "postgres") or not parts.hostname:
        raise ValueError(_MALFORMED)
    return dsn


def _unavailable(dsn: str, exc: Exception) -> ServiceUnavailableError:
    # Only the host part: a DSN may carry a password.
    host = dsn.rsplit("@", 1)[-1]
    return ServiceUnavailableError(f"cannot reach PostgreSQL at {host} (DATABASE_URL): {exc}")


async def connect(dsn: str) -> asyncpg.Connection:
    try:
        return await asyncpg.connect(dsn)
    except (OSError, asyncpg.PostgresError) as exc:
        raise _unavailable(dsn, exc) from None
    except ValueError:  # asyncpg's parser, quoting the part it choked on
        raise ConfigurationError(f"DATABASE_URL {_MALFORMED}") from None


async def create_pool(dsn: str, *, max_size: int = 20) -> asyncpg.Pool:
    try:
        pool = await asyncpg.create_pool(
            dsn, min_size=1, max_size=max_size, command_timeout=30, reset=keep_session
        )
    except (OSError, asyncpg.PostgresError) as exc:
        raise _unavailable(dsn, exc) from None
    except ValueError:  # asyncpg's parser, quoting the part it choked on
        raise ConfigurationError(f"DATABASE_URL {_MALFORMED}") from None
    assert pool is not None
    return pool


async def keep_session(conn: asyncpg.Connection) -> None:
    """Neither the ledger nor the vault sets session state (no SET, LISTEN, session advisory
    lock or cursor outside a transaction), so the default reset query, a round trip on every
    release, is skipped: a charge releases one three or four times. asyncpg still rolls back
    a transaction left open."""

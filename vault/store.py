"""The vault's SQL for keys, the audit log and reservation listings (the cap is reservations.py)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Any, TypeVar
from uuid import UUID, uuid4

import asyncpg
from tenacity import (
    AsyncRetrying,
    before_sleep_log,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential_jitter,
)

from billing.db import CONNECTION_ERRORS, keep_session, malformed_url
from billing.errors import ConfigurationError
from vault.models import (
    AuditEntry,
    FindKeysQuery,
    IssueKeyRequest,
    KeyInfo,
    KeyList,
    ReservationInfo,
    ReservationList,
    ReservationState,
    Role,
)

_TODAY = "(now() AT TIME ZONE 'UTC')::date"

logger = logging.getLogger("vault.store")
# Any failure of a call to the database, refused statement or lost connection alike.
DATABASE_ERRORS = (asyncpg.PostgresError, *CONNECTION_ERRORS)
T = TypeVar("T")

_KEY_VIEW = f"""
    SELECT k.id, k.vendor, k.label, k.period, k.currency, k.cap_cents, k.daily_cap_cents,
           k.reserved_cents, k.spent_cents,
           k.cap_cents - k.reserved_cents - k.spent_cents AS remaining_cents,
           CASE WHEN k.daily_cap_cents IS NOT NULL
                THEN coalesce(d.reserved_cents + d.spent_cents, 0) END AS daily_used_cents,
           k.allowed_endpoints, k.expires_at, k.expires_at <= now() AS expired,
           k.revoked_at IS NOT NULL AS revoked, k.revoked_at, k.revoked_by, k.created_at,
           k.issued_by
    FROM vault_keys k
    LEFT JOIN vault_key_days d ON d.vault_key_id = k.id AND d.day = {_TODAY}
"""

RESERVATION_COLUMNS = """
    idempotency_key, endpoint, state, amount_cents, committed_cents, currency, customer, day,
    attempt, upstream_status, created_at, updated_at, counted_under
"""


def secret_digest(secret: str) -> bytes:
    """A key's secret or a token, as stored and compared: a plain hash suffices (each is
    random, nothing to brute-force), and digests are of equal length, so comparing them takes
    the same time whatever matched. A header's bytes that are not UTF-8 come as lone
    surrogates (aiohttp): hashed as they came, they match nothing, rather than raise."""
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


async def create_pool(dsn: str, size: int) -> asyncpg.Pool:
    try:
        pool = await asyncpg.create_pool(
            dsn, min_size=min(2, size), max_size=size, command_timeout=30, reset=keep_session
        )
    except ValueError:  # asyncpg's parser
        raise malformed_url("VAULT_DATABASE_URL") from None
    assert pool is not None
    return pool


# Each of the vault's tables with what its requests do there (vault_audit is append-only,
# billing/db_roles.py): checked once at start rather than met as a 500 on the first charge.
REQUIRED_TABLES: dict[str, tuple[str, ...]] = {
    "vault_keys": ("SELECT", "INSERT", "UPDATE"),
    "vault_key_days": ("SELECT", "INSERT", "UPDATE"),
    "vault_reservations": ("SELECT", "INSERT", "UPDATE"),
    "vault_fences": ("SELECT", "INSERT", "UPDATE"),
    "vault_audit": ("SELECT", "INSERT"),
    "vault_unauthenticated": ("INSERT",),
}
REQUIRED_FUNCTIONS = ("vault_reserve", "vault_finish", "vault_lock_commits")


async def check_schema(pool: asyncpg.Pool) -> None:
    """Refuse to start on a database the vault cannot work in: its tables missing (never
    migrated), or its role not granted them (migrated without BILLING_DB_VAULT_ROLE)."""
    async with pool.acquire() as conn:
        missing = [
            row["name"]
            for row in await conn.fetch(
                "SELECT name FROM unnest($1::text[]) AS name WHERE to_regclass(name) IS NULL"
                " UNION ALL SELECT name FROM unnest($2::text[]) AS name"
                " WHERE to_regproc(name) IS NULL",
                list(REQUIRED_TABLES),
                list(REQUIRED_FUNCTIONS),
            )
        ]
        if missing:
            raise ConfigurationError(
                f"the vault's tables are missing from the database VAULT_DATABASE_URL names"
                f" ({', '.join(sorted(missing))}): run `python starter.py migrate` with the"
                " schema owner's DATABASE_URL on that database, then start the vault again"
            )
        # One privilege per check: has_table_privilege with a list is true if any is held.
        needed = [(name, p) for name, ps in REQUIRED_TABLES.items() for p in ps]
        refused = sorted(
            {
                row["name"]
                for row in await conn.fetch(
                    "SELECT t.name FROM unnest($1::text[], $2::text[]) AS t(name, privilege)"
                    " WHERE NOT has_table_privilege(t.name, t.privilege)"
                    " UNION ALL SELECT name FROM unnest($3::text[]) AS name"
                    " WHERE NOT has_function_privilege(to_regproc(name)::oid, 'EXECUTE')",
                    [name for name, _ in needed],
                    [privilege for _, privilege in needed],
                    list(REQUIRED_FUNCTIONS),
                )
            }
        )
        if refused:
            raise ConfigurationError(
                f"the role VAULT_DATABASE_URL names may not use {', '.join(refused)}:"
                " run `python starter.py migrate` with the owner's DATABASE_URL and"
                " BILLING_DB_VAULT_ROLE set to that role, which grants the vault's tables"
            )


async def insert_key(
    conn: asyncpg.Connection,
    key_id: str,
    secret: str,
    request: IssueKeyRequest,
    issued_by: str,
) -> KeyInfo:
    await conn.execute(
        """
        INSERT INTO vault_keys (id, secret_sha256, vendor, label, period, currency, cap_cents,
                                daily_cap_cents, allowed_endpoints, expires_at, issued_by)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
        """,
        key_id,
        secret_digest(secret),
        request.vendor,
        request.label,
        request.period,
        request.currency,
        request.cap_cents,
        request.daily_cap_cents,
        request.allowed_endpoints,
        request.expires_at,
        issued_by,
    )
    info = await get_key(conn, key_id)
    assert info is not None
    return info


async def get_key(conn: asyncpg.Connection, key_id: str) -> KeyInfo | None:
    row = await conn.fetchrow(f"{_KEY_VIEW} WHERE k.id = $1", key_id)
    return None if row is None else KeyInfo.model_validate(dict(row))


async def find_keys(conn: asyncpg.Connection, query: FindKeysQuery) -> KeyList:
    """Newest first, revoked and expired included, a page at a time: a caller looking for
    "the key of a period" must see a revoked one, or it would issue a fresh key and undo the
    kill switch."""
    rows = await conn.fetch(
        f"""{_KEY_VIEW}
        WHERE ($1::text IS NULL OR k.period = $1) AND ($2::text IS NULL OR k.label = $2)
          AND ($4::text IS NULL OR (k.created_at, k.id) <
               (SELECT created_at, id FROM vault_keys WHERE id = $4))
        ORDER BY k.created_at DESC, k.id DESC LIMIT $3
        """,
        query.period,
        query.label,
        query.limit + 1,
        query.before,
    )
    keys = [KeyInfo.model_validate(dict(row)) for row in rows[: query.limit]]
    return KeyList(keys=keys, next_before=keys[-1].id if len(rows) > query.limit else None)


async def revoke_key(conn: asyncpg.Connection, key_id: str, by: Role) -> KeyInfo | None:
    # Revoking twice keeps the first time. An admin revoke marks the key whoever revoked it
    # first: the worker budget then counts its whole cap (vault.budget), as the operator's
    # kill switch must not leave room a worker revoke freed earlier.
    await conn.execute(
        """
        UPDATE vault_keys SET revoked_at = coalesce(revoked_at, now()),
                              revoked_by = CASE WHEN $2 = 'admin' THEN 'admin'
                                                ELSE coalesce(revoked_by, $2) END
        WHERE id = $1
        """,
        key_id,
        by,
    )
    return await get_key(conn, key_id)


async def raise_fence(
    conn: asyncpg.Connection, key_id: str, idempotency_key: str, below: int
) -> int:
    """Fence the idempotency key's requests through the key below `below` (vault_reserve
    refuses them), never lowering a fence; returns the fence standing."""
    standing: int = await conn.fetchval(
        """
        INSERT INTO vault_fences AS f (vault_key_id, idempotency_key, fenced_below)
        VALUES ($1, $2, $3)
        ON CONFLICT (vault_key_id, idempotency_key)
            DO UPDATE SET fenced_below = greatest(f.fenced_below, EXCLUDED.fenced_below)
        RETURNING fenced_below
        """,
        key_id,
        idempotency_key,
        below,
    )
    return standing


@dataclass(frozen=True, slots=True)
class KeyGrant:
    """What the proxy needs to know about the key a request presented."""

    id: str
    currency: str
    allowed_endpoints: list[str]
    revoked: bool
    expired: bool
    # What an issue checks, checked again on every request (models.never_issuable).
    cap_cents: int
    daily_cap_cents: int | None
    issued_by: str


async def key_for_secret(conn: asyncpg.Connection, secret: str) -> KeyGrant | None:
    row = await conn.fetchrow(
        """
        SELECT id, currency, allowed_endpoints, revoked_at IS NOT NULL AS revoked,
               expires_at <= now() AS expired, cap_cents, daily_cap_cents, issued_by
        FROM vault_keys WHERE secret_sha256 = $1
        """,
        secret_digest(secret),
    )
    return None if row is None else KeyGrant(**dict(row))


@dataclass(slots=True)
class AuditRecord:
    """One proxied request, filled in as the request is handled, or one change the admin API
    made to a key. Field order is the INSERT's."""

    method: str
    path: str
    vault_key_id: str | None = None
    idempotency_key: str | None = None
    amount_cents: int | None = None
    currency: str | None = None
    customer: str | None = None
    upstream_status: int | None = None
    decision: str = "refused_auth"
    refusal_code: str | None = None
    reservation_state: ReservationState | None = None
    latency_ms: float = 0.0
    # Makes the insert idempotent (migrations/009_audit_request_id.sql).
    request_id: UUID = field(default_factory=uuid4)
    # Who made an admin call (migrations/022_audit_admin_actions.sql).
    actor: Role | None = None


@dataclass(slots=True)
class PeerRefusals:
    """One row of vault_unauthenticated: a peer's requests with no known vault key over a
    window, as they are counted."""

    peer: str
    first_at: datetime
    last_at: datetime
    requests: int = 0


async def insert_unauthenticated(conn: asyncpg.Connection, rows: list[PeerRefusals]) -> None:
    await conn.executemany(
        """
        INSERT INTO vault_unauthenticated (peer, first_at, last_at, requests)
        VALUES ($1, $2, $3, $4)
        """,
        [(r.peer, r.first_at, r.last_at, r.requests) for r in rows],
    )


async def through_outage(
    pool: asyncpg.Pool, within: timedelta, operation: Callable[[asyncpg.Connection], Awaitable[T]]
) -> T:
    """Run `operation` on a pooled connection, again and again while the database cannot be
    reached, for `within` at most (TimeoutError past it): for writes that record what
    already happened upstream (a settle, an audit row), which no client retry would bring
    back. A first try may have committed before the connection dropped: a settle then finds
    itself done, and an audit row its request's id."""

    async def attempt() -> T:
        async with pool.acquire() as conn:
            try:
                return await operation(conn)
            except asyncpg.InternalClientError:
                # The connection is unusable (see CONNECTION_ERRORS): the pool opens another.
                conn.terminate()
                raise

    retrying = AsyncRetrying(
        retry=retry_if_exception_type(CONNECTION_ERRORS),
        stop=stop_after_delay(within.total_seconds()),
        wait=wait_exponential_jitter(multiplier=0.1, max=1.0, jitter=0.1),
        before_sleep=before_sleep_log(logger, logging.WARNING),
        reraise=True,
    )
    # The stop is checked between tries only; one try can hang far longer on a dead host.
    async with asyncio.timeout(within.total_seconds()):
        return await retrying(attempt)


async def insert_audit(conn: asyncpg.Connection, record: AuditRecord) -> None:
    await conn.execute(
        """
        INSERT INTO vault_audit (method, path, vault_key_id, idempotency_key, amount_cents,
                                 currency, customer, upstream_status, decision, refusal_code,
                                 reservation_state, latency_ms, request_id, actor)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
        ON CONFLICT (request_id) DO NOTHING
        """,
        # Not dataclasses.astuple: it deep-copies every field, a cost on every request.
        *(getattr(record, column.name) for column in fields(record)),
    )


async def audit_page(
    conn: asyncpg.Connection, key_id: str, limit: int, before: int | None
) -> list[AuditEntry]:
    rows = await conn.fetch(
        """
        SELECT id, at, vault_key_id, method, path, idempotency_key, amount_cents, currency,
               customer, upstream_status, decision, refusal_code, reservation_state, latency_ms,
               actor
        FROM vault_audit
        WHERE vault_key_id = $1 AND ($2::bigint IS NULL OR id < $2)
        ORDER BY id DESC LIMIT $3
        """,
        key_id,
        before,
        limit,
    )
    return [AuditEntry.model_validate(dict(row)) for row in rows]


async def list_reservations(
    conn: asyncpg.Connection,
    key_id: str,
    state: ReservationState | None,
    limit: int,
    after: int | None,
) -> ReservationList:
    """Oldest first, a page at a time: `next_after` leads to the next page."""
    rows = await conn.fetch(
        f"""
        SELECT id, {RESERVATION_COLUMNS} FROM vault_reservations
        WHERE vault_key_id = $1 AND ($2::text IS NULL OR state = $2)
              AND ($4::bigint IS NULL OR id > $4)
        ORDER BY id LIMIT $3
        """,
        key_id,
        state,
        limit,
        after,
    )
    return ReservationList(
        reservations=[reservation_info(row) for row in rows],
        next_after=rows[-1]["id"] if len(rows) == limit else None,
    )


def reservation_info(row: Any) -> ReservationInfo:
    return ReservationInfo.model_validate(dict(row))

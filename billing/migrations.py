"""Apply `migrations/*.sql` in name order, once each, recording what was applied.

Safe to run from many workers at start-up at once: an advisory lock serialises the runners,
and a file whose content changed after it was applied is refused rather than re-run.

A role that does not own the schema (the ledger's and the vault's, billing/db_roles.py)
cannot apply a migration: an up-to-date database is recognised by reading
`schema_migrations` alone, before any statement that needs more than SELECT, and a pending
migration such a role cannot apply is refused with what to run instead.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from billing.db import connect
from billing.db_roles import MIGRATIONS_TABLE, DatabaseRoles, apply_grants, granted_to
from billing.errors import MigrationError

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
# Any constant shared by all runners; "billing" in ASCII.
_LOCK_ID = 0x62696C6C696E67
# Pending versions named in an error, at most; the rest are counted.
_NAMED = 5


@dataclass(frozen=True)
class Migration:
    version: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def load_migrations(directory: Path = MIGRATIONS_DIR) -> list[Migration]:
    files = sorted(directory.glob("*.sql"))
    if not files:
        raise MigrationError(f"no migration files found in {directory}")
    return [Migration(path.stem, path.read_text()) for path in files]


async def _applied(conn: asyncpg.Connection) -> dict[str, str]:
    """Version to checksum of what was applied; empty when nothing ever was. SELECT only."""
    if await conn.fetchval("SELECT to_regclass($1) IS NULL", MIGRATIONS_TABLE):
        return {}
    return {
        row["version"]: row["checksum"]
        for row in await conn.fetch(f"SELECT version, checksum FROM {MIGRATIONS_TABLE}")
    }


def _pending(migrations: list[Migration], applied: dict[str, str]) -> list[Migration]:
    pending = []
    for migration in migrations:
        recorded = applied.get(migration.version)
        if recorded is None:
            pending.append(migration)
        elif recorded != migration.checksum:
            raise MigrationError(
                f"migration {migration.version} changed after it was applied;"
                " add a new migration file instead of editing an applied one"
            )
    return pending


def _not_allowed(pending: list[Migration]) -> MigrationError:
    names = [m.version for m in pending]
    shown = ", ".join(names[:_NAMED]) + (
        f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    )
    return MigrationError(
        f"{len(names)} migration(s) pending ({shown}) and the role DATABASE_URL names may not"
        " apply them (it does not own the schema): run"
        " `python starter.py migrate` with the owner's DATABASE_URL (and BILLING_DB_LEDGER_ROLE"
        " and BILLING_DB_VAULT_ROLE set, so the new tables are granted), then start this again"
    )


async def migrate(
    dsn: str, directory: Path = MIGRATIONS_DIR, *, roles: DatabaseRoles | None = None
) -> list[str]:
    """Apply pending migrations, then, with `roles`, grant each its objects (which only the
    owner may do); return the versions applied by this call."""
    migrations = load_migrations(directory)
    conn = await connect(dsn)
    try:
        # Without the lock or any CREATE, so a role with SELECT alone starts when current.
        if roles is None and not _pending(migrations, await _applied(conn)):
            return []
        try:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_ID)
                await conn.execute(
                    f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} ("
                    " version text PRIMARY KEY, checksum text NOT NULL,"
                    " applied_at timestamptz NOT NULL DEFAULT now())"
                )
                # Read again under the lock: another runner may have applied them meanwhile.
                pending = _pending(migrations, await _applied(conn))
                if pending and roles is None and (granted := await granted_to(conn)):
                    raise MigrationError(
                        f"this schema's tables are granted to {', '.join(granted)}: apply"
                        f" {len(pending)} pending migration(s) with BILLING_DB_LEDGER_ROLE and"
                        " BILLING_DB_VAULT_ROLE set, so that their new tables are granted too;"
                        " nothing was applied"
                    )
                for migration in pending:
                    await conn.execute(migration.sql)
                    await conn.execute(
                        f"INSERT INTO {MIGRATIONS_TABLE} (version, checksum) VALUES ($1, $2)",
                        migration.version,
                        migration.checksum,
                    )
                if roles is not None:
                    await apply_grants(conn, roles)
                return [m.version for m in pending]
        except asyncpg.InsufficientPrivilegeError:
            # Rolled back whole. Read again: what is pending now is what this role lacked.
            pending = _pending(migrations, await _applied(conn))
            if roles is None and not pending:
                return []  # applied meanwhile by another runner, the owner
            if roles is not None and not pending:
                raise MigrationError(
                    "BILLING_DB_LEDGER_ROLE and BILLING_DB_VAULT_ROLE are set but the role"
                    " DATABASE_URL names may not grant on the schema: run migrate with the"
                    " owner's DATABASE_URL"
                ) from None
            raise _not_allowed(pending) from None
    finally:
        await conn.close()

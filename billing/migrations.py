"""Apply `migrations/*.sql` in name order, once each, recording what was applied.

Safe to run from many workers at start-up at once: an advisory lock serialises the runners,
and a file whose content changed after it was applied is refused rather than re-run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from billing.db import connect
from billing.errors import MigrationError

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
# Any constant shared by all runners; "billing" in ASCII.
_LOCK_ID = 0x62696C6C696E67


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


async def migrate(dsn: str, directory: Path = MIGRATIONS_DIR) -> list[str]:
    """Apply pending migrations; return the versions applied by this call."""
    migrations = load_migrations(directory)
    conn = await connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_ID)
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version text PRIMARY KEY, checksum text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            applied = {
                row["version"]: row["checksum"]
                for row in await conn.fetch("SELECT version, checksum FROM schema_migrations")
            }
            done: list[str] = []
            for migration in migrations:
                recorded = applied.get(migration.version)
                if recorded is None:
                    await conn.execute(migration.sql)
                    await conn.execute(
                        "INSERT INTO schema_migrations (version, checksum) VALUES ($1, $2)",
                        migration.version,
                        migration.checksum,
                    )
                    done.append(migration.version)
                elif recorded != migration.checksum:
                    raise MigrationError(
                        f"migration {migration.version} changed after it was applied;"
                        " add a new migration file instead of editing an applied one"
                    )
            return done
    finally:
        await conn.close()

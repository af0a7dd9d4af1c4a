"""The ledger's and the vault's database roles (billing/db_roles.py), on real PostgreSQL: a
worker's DSN cannot reach the vault's keys, reservations or audit, the vault's cannot reach
the ledger, and a period still bills with each on its own role.

Roles are cluster-wide: each test's are named for its database (and this process), so tests
running side by side never share one, and they are dropped at teardown.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest
from pydantic import SecretStr

from billing.db_roles import DatabaseRoles
from billing.errors import ConfigurationError, MigrationError
from billing.migrations import MIGRATIONS_DIR, load_migrations, migrate
from billing.periods import period_for
from billing.runs import start_period
from devstack.postgres import LocalPostgres
from tests.conftest import new_database
from tests.integration.harness import PROJECT_ROOT, VAULT_ADMIN_TOKEN, Harness
from tests.integration.invariants import assert_billed_once
from vault.app import serve
from vault.settings import VaultSettings

PERIOD = period_for(datetime.now(UTC), "advance")

# Each table with a plain column an UPDATE may name.
VAULT_TABLES = {"vault_keys": "label", "vault_reservations": "state", "vault_audit": "method"}
APPEND_ONLY_TABLES = {"vault_unauthenticated": "peer"}
LEDGER_TABLES = {"billing_runs": "status", "customers": "customer_id"}
COLUMNS = VAULT_TABLES | LEDGER_TABLES | APPEND_ONLY_TABLES


@dataclass(frozen=True)
class RoleUrls:
    roles: DatabaseRoles
    ledger: str
    vault: str


def _role_names(database_url: str) -> DatabaseRoles:
    database = database_url.rsplit("/", 1)[1]
    return DatabaseRoles(
        ledger=f"{database}_{os.getpid()}_ledger", vault=f"{database}_{os.getpid()}_vault"
    )


async def _create_roles(owner_url: str, roles: DatabaseRoles) -> None:
    conn = await asyncpg.connect(owner_url)
    try:
        for role in (roles.ledger, roles.vault):
            await conn.execute(f"CREATE ROLE {role} LOGIN")
    finally:
        await conn.close()


async def _drop_roles(owner_url: str, roles: DatabaseRoles) -> None:
    conn = await asyncpg.connect(owner_url)
    try:
        # Their grants live in this database: dropped with them, then the roles themselves.
        await conn.execute(f"DROP OWNED BY {roles.ledger}, {roles.vault}")
        await conn.execute(f"DROP ROLE {roles.ledger}, {roles.vault}")
    finally:
        await conn.close()


def _migrations_and(directory: Path, later: dict[str, str]) -> Path:
    """The project's migrations copied to `directory`, with `later` (version to SQL) added or
    put in place of the copies."""
    for path in MIGRATIONS_DIR.glob("*.sql"):
        (directory / path.name).write_text(path.read_text())
    for version, sql in later.items():
        (directory / f"{version}.sql").write_text(sql)
    return directory


@pytest.fixture
async def role_urls(postgres: LocalPostgres, database_url: str) -> AsyncIterator[RoleUrls]:
    """The test's database migrated by its owner and granted to a ledger and a vault role."""
    roles = _role_names(database_url)
    await _create_roles(database_url, roles)
    try:
        await migrate(database_url, roles=roles)
        database = database_url.rsplit("/", 1)[1]
        yield RoleUrls(
            roles, postgres.dsn(database, roles.ledger), postgres.dsn(database, roles.vault)
        )
    finally:
        await _drop_roles(database_url, roles)


@pytest.fixture
async def db(role_urls: RoleUrls) -> AsyncIterator[asyncpg.Pool]:
    """The harness's pool, the workers' and the tests' own: on the ledger's role."""
    pool = await asyncpg.create_pool(role_urls.ledger, min_size=1, max_size=10)
    assert pool is not None
    yield pool
    await pool.close()


@pytest.fixture
def vault_database_url(role_urls: RoleUrls) -> str:
    return role_urls.vault


@pytest.fixture
async def other_role(database_url: str, role_urls: RoleUrls) -> AsyncIterator[str]:
    """A third role, neither the ledger's nor the vault's, dropped at teardown."""
    name = f"{role_urls.roles.ledger}_other"
    owner = await asyncpg.connect(database_url)
    try:
        await owner.execute(f"CREATE ROLE {name}")
        yield name
        await owner.execute(f"DROP OWNED BY {name}; DROP ROLE {name}")
    finally:
        await owner.close()


@pytest.fixture
async def as_ledger(role_urls: RoleUrls) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(role_urls.ledger)
    yield conn
    await conn.close()


@pytest.fixture
async def as_vault(role_urls: RoleUrls) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(role_urls.vault)
    yield conn
    await conn.close()


def _statements(table: str) -> list[str]:
    """One of each: PostgreSQL checks the privilege before it looks at a row or a
    constraint."""
    column = COLUMNS[table]
    return [
        f"SELECT * FROM {table} LIMIT 1",
        f"INSERT INTO {table} DEFAULT VALUES",
        f"UPDATE {table} SET {column} = {column}",
        f"DELETE FROM {table}",
    ]


async def _call_with_nulls(conn: asyncpg.Connection, function: str) -> None:
    arguments = await conn.fetchval("SELECT pronargs FROM pg_proc WHERE proname = $1", function)
    nulls = ", ".join(["NULL"] * arguments)
    await conn.execute(f"SELECT {function}({nulls})")


# Each role, and what of the other's it must be refused: every statement on its tables, and
# a call of each of its functions.
REFUSED = [
    *(("ledger", s) for table in VAULT_TABLES for s in _statements(table)),
    *(("vault", s) for table in LEDGER_TABLES for s in _statements(table)),
    *(("ledger", f"call {f}") for f in ("vault_reserve", "vault_finish", "vault_lock_commits")),
    ("vault", "call billing_begin_charge"),
]


@pytest.mark.parametrize(("role", "statement"), REFUSED, ids=str)
async def test_a_role_cannot_touch_the_others_tables_nor_call_its_functions(
    role_urls: RoleUrls, role: str, statement: str
) -> None:
    conn = await asyncpg.connect(role_urls.ledger if role == "ledger" else role_urls.vault)
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            if statement.startswith("call "):
                await _call_with_nulls(conn, statement.removeprefix("call "))
            else:
                await conn.execute(statement)
    finally:
        await conn.close()


async def test_the_ledger_role_cannot_forge_a_key_nor_change_the_schema(
    as_ledger: asyncpg.Connection,
) -> None:
    """F1's attack: a worker's DSN writing its own key row, or redefining the cap check."""
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await as_ledger.execute(
            "INSERT INTO vault_keys (id, secret_sha256, vendor, label, currency, cap_cents,"
            " allowed_endpoints, expires_at, issued_by) VALUES ('vk_forged', '\\x00', 'stripe',"
            " 'x', 'usd', 4611686018427387904, ARRAY['POST /v1/refunds'],"
            " now() + interval '1 day', 'admin')"
        )
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await as_ledger.execute(
            "CREATE OR REPLACE FUNCTION vault_lock_commits(p text) RETURNS void"
            " LANGUAGE sql AS 'SELECT'"
        )
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await as_ledger.execute("DELETE FROM schema_migrations")
    assert await as_ledger.fetchval("SELECT count(*) FROM schema_migrations") == len(
        load_migrations()
    )


@pytest.mark.parametrize("table", ["vault_audit", "vault_unauthenticated"])
async def test_the_vault_role_adds_audit_rows_but_never_changes_or_deletes_them(
    as_vault: asyncpg.Connection, table: str
) -> None:
    assert await as_vault.fetchval(f"SELECT count(*) FROM {table}") == 0
    for statement in _statements(table)[2:]:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await as_vault.execute(statement)


async def test_granting_again_is_idempotent_and_covers_a_new_table(
    database_url: str, role_urls: RoleUrls, as_ledger: asyncpg.Connection
) -> None:
    """A table a later migration adds is granted by its name, with no list to update."""
    owner = await asyncpg.connect(database_url)
    try:
        # serial: the ledger's inserts need its sequence granted too.
        await owner.execute(
            "CREATE TABLE vault_later (id serial, n int);"
            " CREATE TABLE ledger_later (id serial, n int)"
        )
    finally:
        await owner.close()
    assert await migrate(database_url, roles=role_urls.roles) == []
    assert await migrate(database_url, roles=role_urls.roles) == []
    await as_ledger.execute("INSERT INTO ledger_later (n) VALUES (1)")
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await as_ledger.execute("SELECT * FROM vault_later")


# A grant made before this migrate (by hand, or by an older release): what it gave beyond
# the end result is taken back.
STALE_GRANTS = [
    ("ledger", "GRANT ALL ON vault_keys TO {role}", "SELECT * FROM vault_keys"),
    ("vault", "GRANT UPDATE, DELETE ON vault_audit TO {role}", "DELETE FROM vault_audit"),
    ("ledger", "GRANT ALL ON vault_keys TO PUBLIC", "SELECT * FROM vault_keys"),
    # PostgreSQL's default before 15, kept by an upgrade: a table or function created by a
    # worker's role could shadow one the vault uses.
    ("ledger", "GRANT CREATE ON SCHEMA public TO PUBLIC", "CREATE TABLE vault_shadow (n int)"),
]


@pytest.mark.parametrize(("role", "grant", "statement"), STALE_GRANTS, ids=str)
async def test_a_grant_made_before_migrating_is_taken_back(
    database_url: str, role_urls: RoleUrls, role: str, grant: str, statement: str
) -> None:
    roles = role_urls.roles
    owner = await asyncpg.connect(database_url)
    try:
        await owner.execute(grant.format(role=roles.ledger if role == "ledger" else roles.vault))
    finally:
        await owner.close()
    assert await migrate(database_url, roles=roles) == []
    conn = await asyncpg.connect(role_urls.ledger if role == "ledger" else role_urls.vault)
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(statement)
    finally:
        await conn.close()


async def test_a_worker_on_the_ledger_role_starts_on_a_current_database(
    role_urls: RoleUrls,
) -> None:
    """Nothing pending: the workers' migrate at start needs SELECT on schema_migrations only."""
    assert await migrate(role_urls.ledger) == []


async def test_a_pending_migration_the_ledger_role_cannot_apply_is_refused_clearly(
    role_urls: RoleUrls, tmp_path: Path
) -> None:
    directory = _migrations_and(tmp_path, {"999_later": "CREATE TABLE later (n int);"})
    with pytest.raises(MigrationError) as refused:
        await migrate(role_urls.ledger, directory)
    message = str(refused.value)
    assert "999_later" in message and "python starter.py migrate" in message
    assert "owner's DATABASE_URL" in message


async def test_the_owner_migrating_without_the_roles_once_they_are_granted_is_refused(
    database_url: str, role_urls: RoleUrls, tmp_path: Path
) -> None:
    """A new table applied without the two settings would be out of the roles' reach, and
    the workers would meet `permission denied` only inside their activities."""
    directory = _migrations_and(tmp_path, {"999_later": "CREATE TABLE later (n int);"})
    with pytest.raises(MigrationError) as refused:
        await migrate(database_url, directory)
    message = str(refused.value)
    assert f"granted to {role_urls.roles.ledger}, {role_urls.roles.vault}" in message
    assert "BILLING_DB_LEDGER_ROLE and BILLING_DB_VAULT_ROLE set" in message
    assert await migrate(database_url, directory, roles=role_urls.roles) == ["999_later"]
    # Granted in the migrate that created it, not at the next one.
    ledger = await asyncpg.connect(role_urls.ledger)
    try:
        await ledger.execute("INSERT INTO later VALUES (1)")
    finally:
        await ledger.close()


async def test_worker_py_on_the_ledger_role_with_a_pending_migration_exits_with_what_to_run(
    database_url: str, role_urls: RoleUrls
) -> None:
    """The worker process as deployed: its start-up migrate meets a migration it may not
    apply (the last one, forgotten by the owner here) and says what to run."""
    last = load_migrations()[-1].version
    owner = await asyncpg.connect(database_url)
    try:
        await owner.execute("DELETE FROM schema_migrations WHERE version = $1", last)
    finally:
        await owner.close()
    done = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "worker.py")],
        env={**os.environ, "DATABASE_URL": role_urls.ledger},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert last in done.stderr and "python starter.py migrate" in done.stderr


async def test_an_unprivileged_role_on_a_database_never_migrated_is_refused_clearly(
    postgres: LocalPostgres,
) -> None:
    fresh = await new_database(postgres)
    roles = _role_names(fresh)
    await _create_roles(fresh, roles)
    try:
        with pytest.raises(MigrationError) as refused:
            await migrate(postgres.dsn(fresh.rsplit("/", 1)[1], roles.ledger))
        assert f"{len(load_migrations())} migration(s) pending" in str(refused.value)
    finally:
        await _drop_roles(fresh, roles)


@pytest.mark.parametrize("granted", [False, True], ids=["never-migrated", "not-granted"])
async def test_the_vault_refuses_to_start_without_its_tables_or_their_grants(
    postgres: LocalPostgres, template_database: str, granted: bool
) -> None:
    fresh = await new_database(postgres, template_database if granted else "template1")
    roles = _role_names(fresh)
    await _create_roles(fresh, roles)
    settings = VaultSettings(
        database_url=postgres.dsn(fresh.rsplit("/", 1)[1], roles.vault),
        admin_token=SecretStr(VAULT_ADMIN_TOKEN),
        upstream_stripe_base="https://api.stripe.com",
        upstream_stripe_secret=SecretStr("sk_test_unused"),
        max_cap_cents=100,
    )
    try:
        with pytest.raises(ConfigurationError) as refused:
            async with serve(settings):
                pass
        expected = "BILLING_DB_VAULT_ROLE" if granted else "tables are missing"
        assert expected in str(refused.value)
    finally:
        await _drop_roles(fresh, roles)


async def test_a_period_bills_with_the_workers_and_the_vault_on_their_own_roles(
    vaulted: Harness,
) -> None:
    """End to end: the vault on the vault's role, workers and CLI code on the ledger's."""
    customers = await vaulted.seed(8)
    async with vaulted.running_worker():
        handle = await start_period(vaulted.client, PERIOD, vaulted.task_queue)
        summary = await handle.result()
    assert summary.charged == 8
    await assert_billed_once(vaulted, str(PERIOD), customers)
    assert vaulted.vault is not None
    keys = await vaulted.vault.admin.find_keys(period=str(PERIOD))
    assert [k.spent_cents for k in keys] == [sum(c.amount_cents for c in customers)]


@pytest.mark.parametrize(
    ("superuser", "said"),
    [(False, "does not exist"), (True, "is a superuser")],
    ids=["missing", "superuser"],
)
async def test_a_ledger_role_the_grants_cannot_bind_is_refused_clearly(
    database_url: str, role_urls: RoleUrls, other_role: str, superuser: bool, said: str
) -> None:
    """A superuser passes every check the grants set up: a worker on it could write the
    vault's keys."""
    if superuser:
        owner = await asyncpg.connect(database_url)
        try:
            await owner.execute(f"ALTER ROLE {other_role} SUPERUSER")
        finally:
            await owner.close()
    ledger = other_role if superuser else f"{other_role}_missing"
    with pytest.raises(MigrationError) as refused:
        await migrate(database_url, roles=DatabaseRoles(ledger=ledger, vault=role_urls.roles.vault))
    assert f"BILLING_DB_LEDGER_ROLE: role {ledger} {said}" in str(refused.value)


async def test_runners_migrating_at_once_apply_each_migration_once(
    postgres: LocalPostgres,
) -> None:
    """Every worker migrates at start-up: the lock lets one apply, the others find it done."""
    fresh = await new_database(postgres)
    applied = await asyncio.gather(*(migrate(fresh) for _ in range(3)))
    assert sorted(applied, key=len) == [[], [], [m.version for m in load_migrations()]]


async def test_an_applied_migration_edited_afterwards_is_refused(
    database_url: str, tmp_path: Path
) -> None:
    last = load_migrations()[-1]
    directory = _migrations_and(tmp_path, {last.version: last.sql + "\n-- edited\n"})
    with pytest.raises(MigrationError, match=f"migration {last.version} changed after it"):
        await migrate(database_url, directory)


async def test_a_failing_migration_leaves_none_of_the_pending_ones_applied(
    database_url: str, tmp_path: Path
) -> None:
    directory = _migrations_and(
        tmp_path,
        {
            "998_first": "CREATE TABLE first_later (n int);",
            "999_broken": "CREATE TABLE x (n int, n int);",
        },
    )
    with pytest.raises(asyncpg.DuplicateColumnError):
        await migrate(database_url, directory)
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT to_regclass('first_later')") is None
        assert not await conn.fetchval(
            "SELECT count(*) FROM schema_migrations WHERE version = '998_first'"
        )
    finally:
        await conn.close()


async def test_a_directory_with_no_migrations_is_refused(database_url: str, tmp_path: Path) -> None:
    """A deployment that lost its migrations/ would otherwise start as if current."""
    with pytest.raises(MigrationError, match="no migration files found"):
        await migrate(database_url, tmp_path)


async def test_a_role_not_owning_the_schema_asked_to_grant_is_refused_clearly(
    role_urls: RoleUrls, other_role: str
) -> None:
    """Not a silent success: the grants the operator asked for were not made."""
    with pytest.raises(MigrationError, match="may not grant on the schema"):
        await migrate(
            role_urls.ledger, roles=DatabaseRoles(ledger=other_role, vault=role_urls.roles.vault)
        )

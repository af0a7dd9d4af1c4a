"""Who may touch which table: the ledger's role and the vault's role, granted after migrating.

The vault is the backstop against a worker host taken over, so the workers' role (the
ledger's) must not reach the vault's keys, reservations or audit. Every table, sequence and
function named `vault_*` belongs to the vault, everything else in the schema to the ledger;
`schema_migrations` belongs to whoever migrates, and both roles may read it to see that the
schema is current. Ownership is decided by the name read from the catalog on every migrate,
so a table added later cannot be forgotten: it is granted in the transaction that creates it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import asyncpg

from billing.errors import MigrationError

VAULT_PREFIX = "vault_"
MIGRATIONS_TABLE = "schema_migrations"
# Unquoted lower-case PostgreSQL identifiers only: nothing to escape, no case surprises.
ROLE_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
# The vault never updates or deletes an audit row (vault/store.py insert_audit, audit_page
# and insert_unauthenticated): its role may only add and read them, so even the vault's own
# DSN cannot erase what a key, or a peer with none, did.
APPEND_ONLY = frozenset({"vault_audit", "vault_unauthenticated"})

Owner = Literal["ledger", "vault", "migrations"]


@dataclass(frozen=True)
class DatabaseRoles:
    ledger: str
    vault: str

    def __post_init__(self) -> None:
        # The names go into GRANT statements unquoted and are not echoed: a bad one could be
        # anything pasted into the setting.
        for setting, name in self.settings():
            if not ROLE_NAME.fullmatch(name):
                raise MigrationError(
                    f"{setting}: must be a lower-case role name (letters, digits, '_'; at most"
                    " 63 characters, not starting with a digit)"
                )
        if self.ledger == self.vault:
            raise MigrationError(
                "BILLING_DB_LEDGER_ROLE and BILLING_DB_VAULT_ROLE must differ: with one role, a"
                " worker taken over could write the vault's keys"
            )

    def settings(self) -> tuple[tuple[str, str], tuple[str, str]]:
        """Each role with the setting that names it, for messages."""
        return ("BILLING_DB_LEDGER_ROLE", self.ledger), ("BILLING_DB_VAULT_ROLE", self.vault)


def owner_of(name: str) -> Owner:
    if name == MIGRATIONS_TABLE:
        return "migrations"
    return "vault" if name.startswith(VAULT_PREFIX) else "ledger"


# The project's own objects in the migrations' schema; what an extension installed there
# belongs to the extension. A sequence goes with the table that owns it (serial, identity),
# by that table's name.
_TABLES = """
SELECT c.relname AS name
FROM pg_class c
WHERE c.relnamespace = current_schema()::regnamespace
  AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
  AND NOT EXISTS (SELECT 1 FROM pg_depend d
                  WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid AND d.deptype = 'e')
ORDER BY 1
"""
_SEQUENCES = """
SELECT s.relname AS name, coalesce(t.relname, s.relname) AS owned_by
FROM pg_class s
LEFT JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = s.oid
     AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')
LEFT JOIN pg_class t ON t.oid = d.refobjid
WHERE s.relnamespace = current_schema()::regnamespace AND s.relkind = 'S'
  AND NOT EXISTS (SELECT 1 FROM pg_depend e
                  WHERE e.classid = 'pg_class'::regclass AND e.objid = s.oid AND e.deptype = 'e')
ORDER BY 1
"""
_ROUTINES = """
SELECT p.proname AS name, p.oid::regprocedure::text AS signature,
       CASE p.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END AS kind
FROM pg_proc p
WHERE p.pronamespace = current_schema()::regnamespace AND p.prokind IN ('f', 'p')
  AND NOT EXISTS (SELECT 1 FROM pg_depend d
                  WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e')
ORDER BY 2
"""


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def table_privileges(owner: Owner, table: str) -> tuple[str, str]:
    """What the ledger's and the vault's roles may do on `table`: (ledger, vault), each a
    GRANT list or '' for nothing."""
    full = "SELECT, INSERT, UPDATE, DELETE"
    if owner == "migrations":
        return "SELECT", "SELECT"
    if owner == "ledger":
        return full, ""
    return "", ("SELECT, INSERT" if table in APPEND_ONLY else full)


async def granted_to(conn: asyncpg.Connection) -> list[str]:
    """The roles, besides each table's owner, granted anything on the schema's tables: once
    a deployment has taken roles, a migration applied without them would leave its new
    tables out of their reach."""
    rows = await conn.fetch(
        """
        SELECT DISTINCT r.rolname
        FROM pg_class c, aclexplode(c.relacl) a
        JOIN pg_roles r ON r.oid = a.grantee
        WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind IN ('r', 'p')
          AND a.grantee <> c.relowner
        ORDER BY 1
        """
    )
    return [row["rolname"] for row in rows]


async def _check_roles(conn: asyncpg.Connection, roles: DatabaseRoles) -> None:
    rows = await conn.fetch(
        "SELECT rolname, rolsuper FROM pg_roles WHERE rolname = ANY($1::text[])",
        [roles.ledger, roles.vault],
    )
    found = {row["rolname"]: row for row in rows}
    me: str = await conn.fetchval("SELECT current_user")
    for setting, name in roles.settings():
        row = found.get(name)
        if row is None:
            raise MigrationError(
                f"{setting}: role {name} does not exist: create it first"
                f" (CREATE ROLE {name} LOGIN PASSWORD '...'), then migrate again"
            )
        if row["rolsuper"] or name == me:
            # A superuser, or the owner, passes every check this module would set up.
            raise MigrationError(
                f"{setting}: role {name} is a superuser or the role migrating: grants cannot"
                " bind it; give the workers and the vault roles of their own"
            )


async def apply_grants(conn: asyncpg.Connection, roles: DatabaseRoles) -> None:
    """Grant each role its own objects and nothing else, and PUBLIC nothing. Idempotent:
    everything is revoked from PUBLIC and both roles, then granted, in the caller's
    transaction, so no one sees a moment with more or less than the end result."""
    await _check_roles(conn, roles)
    ledger, vault = _quoted(roles.ledger), _quoted(roles.vault)
    everyone = f"PUBLIC, {ledger}, {vault}"
    # USAGE to reach the objects; CREATE from PUBLIC (granted by default before
    # PostgreSQL 15): a role that may create could shadow a function the other one calls.
    schema = _quoted(await conn.fetchval("SELECT current_schema()"))
    await conn.execute(f"REVOKE CREATE ON SCHEMA {schema} FROM PUBLIC")
    await conn.execute(f"GRANT USAGE ON SCHEMA {schema} TO {ledger}, {vault}")
    for row in await conn.fetch(_TABLES):
        name: str = row["name"]
        await conn.execute(f"REVOKE ALL ON TABLE {_quoted(name)} FROM {everyone}")
        for role, privileges in zip(
            (ledger, vault), table_privileges(owner_of(name), name), strict=True
        ):
            if privileges:
                await conn.execute(f"GRANT {privileges} ON TABLE {_quoted(name)} TO {role}")
    for row in await conn.fetch(_SEQUENCES):
        name = row["name"]
        await conn.execute(f"REVOKE ALL ON SEQUENCE {_quoted(name)} FROM {everyone}")
        owner = owner_of(row["owned_by"])
        if owner != "migrations":
            role = ledger if owner == "ledger" else vault
            await conn.execute(f"GRANT USAGE, SELECT ON SEQUENCE {_quoted(name)} TO {role}")
    for row in await conn.fetch(_ROUTINES):
        # regprocedure's text is already quoted as needed, with its argument types.
        routine = f"{row['kind']} {row['signature']}"
        await conn.execute(f"REVOKE ALL ON {routine} FROM {everyone}")
        role = vault if owner_of(row["name"]) == "vault" else ledger
        await conn.execute(f"GRANT EXECUTE ON {routine} TO {role}")

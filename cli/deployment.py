"""`setup` and `migrate`: prepare a Temporal cluster and the database."""

from __future__ import annotations

import argparse

from billing import search_attributes
from billing.config import DatabaseRolesSettings, DatabaseSettings, TemporalSettings, load_settings
from billing.migrations import migrate
from billing.temporal_client import connect


async def cmd_setup(_: argparse.Namespace) -> int:
    client = await connect(load_settings(TemporalSettings))
    added = await search_attributes.register(client)
    print(f"registered {', '.join(added)}" if added else "search attributes already registered")
    return 0


async def cmd_migrate(_: argparse.Namespace) -> int:
    roles = load_settings(DatabaseRolesSettings).roles()
    applied = await migrate(load_settings(DatabaseSettings).database_url, roles=roles)
    print("applied " + ", ".join(applied) if applied else "database is up to date")
    if roles is not None:
        print(f"granted the ledger's tables to {roles.ledger} and the vault's to {roles.vault}")
    return 0

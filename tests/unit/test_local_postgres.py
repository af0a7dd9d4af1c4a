"""The local stack's PostgreSQL starts, keeps its data across a restart, and stops."""

from __future__ import annotations

from pathlib import Path

import asyncpg

from devstack.postgres import LocalPostgres
from tests.conftest import free_port


async def test_restart_keeps_data(tmp_path: Path) -> None:
    server = LocalPostgres(tmp_path / "data", free_port())
    server.start()
    try:
        conn = await asyncpg.connect(server.dsn())
        await conn.execute("CREATE TABLE kept (n int); INSERT INTO kept VALUES (7)")
        await conn.close()
        server.restart()
        conn = await asyncpg.connect(server.dsn())
        assert await conn.fetchval("SELECT n FROM kept") == 7
        await conn.close()
    finally:
        server.stop()
    assert not (server.data_dir / "postmaster.pid").exists()

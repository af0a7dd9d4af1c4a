"""Real services for the tests: one PostgreSQL and one Temporal dev server per session.

Each test gets its own database (a copy of a migrated template) and its own Temporal
namespace, so workflow IDs like `billing-period-2026-12` never collide between tests.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta

import asyncpg
import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from billing import search_attributes
from billing.data_converter import DATA_CONVERTER
from billing.migrations import migrate
from devstack import stack
from devstack.postgres import LocalPostgres
from devstack.processes import StackError

TEMPLATE_DB = "billing_template"
# Registered when the dev server starts: one per test that takes a Temporal client.
NAMESPACES = [f"test-{i}" for i in range(200)]
DEV_SERVER_STARTUP = timedelta(seconds=60)
_databases = itertools.count()
_namespaces = iter(NAMESPACES)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def venv_binary(name: str) -> str:
    try:
        return stack.venv_binary(name)
    except StackError as missing:
        pytest.exit(str(missing))


@pytest.fixture(scope="session")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    server = LocalPostgres(tmp_path_factory.mktemp("postgres") / "data", free_port())
    server.start()
    yield server
    server.stop("immediate")


@pytest.fixture(scope="session")
async def template_database(postgres: LocalPostgres) -> str:
    conn = await asyncpg.connect(postgres.dsn())
    try:
        await conn.execute(f"CREATE DATABASE {TEMPLATE_DB}")
    finally:
        await conn.close()
    await migrate(postgres.dsn(TEMPLATE_DB))
    return TEMPLATE_DB


async def new_database(postgres: LocalPostgres, template: str = "template1") -> str:
    """A new database copied from `template`; its DSN."""
    name = f"test_{next(_databases)}"
    conn = await asyncpg.connect(postgres.dsn())
    try:
        await conn.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
    finally:
        await conn.close()
    return postgres.dsn(name)


@pytest.fixture
async def database_url(postgres: LocalPostgres, template_database: str) -> str:
    """A fresh, migrated database for one test."""
    return await new_database(postgres, template_database)


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=10)
    assert pool is not None
    yield pool
    await pool.close()


@pytest.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=venv_binary("temporal"),
        # The SDK waits 5 s by default; four test processes start their dev servers and
        # PostgreSQLs at once on two cores.
        dev_server_startup_timeout=DEV_SERVER_STARTUP,
        search_attributes=search_attributes.ALL,
        data_converter=DATA_CONVERTER,
        dev_server_extra_args=[
            *stack.DEV_SERVER_TUNING,
            # A deletion (the tests' stand-in for retention) waits until the server has saved
            # that the run's close was handled, which it does every 30 s by default.
            "--dynamic-config-value",
            'history.transferProcessorUpdateAckInterval="1s"',
            *(arg for ns in NAMESPACES for arg in ("--namespace", ns)),
        ],
    )
    yield env
    await env.shutdown()


@pytest.fixture
async def temporal_client(temporal_env: WorkflowEnvironment) -> Client:
    """A client on a namespace no other test uses."""
    namespace = next(_namespaces, None)
    if namespace is None:
        raise RuntimeError(f"all {len(NAMESPACES)} test namespaces are taken: raise NAMESPACES")
    return await Client.connect(
        temporal_env.client.service_client.config.target_host,
        namespace=namespace,
        data_converter=DATA_CONVERTER,
    )

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import asyncpg
import pytest
from pydantic import SecretStr
from temporalio.client import Client

from billing.config import BillingSettings
from billing.stripe_client import stripe_client, stripe_http
from stripe_emulator import EmulatorConfig, serve
from tests.integration.harness import (
    KEY_ENCRYPTION_KEYS,
    VAULT_ADMIN_TOKEN,
    VAULT_WORKER_BUDGET,
    VAULT_WORKER_TOKEN,
    Harness,
    VaultHandle,
)
from vault.app import serve as serve_vault
from vault.client import VaultAdmin
from vault.settings import VaultSettings

_keys = itertools.count()


@pytest.fixture
async def harness(
    temporal_client: Client, db: asyncpg.Pool, database_url: str
) -> AsyncIterator[Harness]:
    async with serve(EmulatorConfig()) as emulator:
        n = next(_keys)
        settings = BillingSettings(
            stripe_api_base=emulator.url,
            stripe_api_key=SecretStr(f"sk_test_harness{n}"),
            billing_key_namespace=f"test{n}",
            billing_key_encryption_keys=SecretStr(KEY_ENCRYPTION_KEYS),
        )
        async with stripe_http(settings.billing_stripe_timeout_seconds) as http:
            stripe_api = stripe_client(
                settings.stripe_api_key.get_secret_value(), settings.stripe_api_base, http
            )
            harness = Harness(
                client=temporal_client,
                pool=db,
                database_url=database_url,
                emulator_url=emulator.url,
                settings=settings,
                task_queue=f"billing-{n}",
                stripe=stripe_api,
                http=http,
            )
            try:
                yield harness
            finally:
                harness.stop_processes()


@pytest.fixture
def vault_database_url(database_url: str) -> str:
    """The vault's DSN: the test database's owner, as the harness's; a test giving the vault
    a role of its own overrides this (tests/integration/test_db_roles.py)."""
    return database_url


@pytest.fixture
async def vaulted(harness: Harness, vault_database_url: str) -> AsyncIterator[Harness]:
    """The harness with a vault in front of its emulator: workers charge with period keys."""
    settings = VaultSettings(
        database_url=vault_database_url,
        admin_token=SecretStr(VAULT_ADMIN_TOKEN),
        upstream_stripe_base=harness.emulator_url,
        upstream_stripe_secret=harness.settings.stripe_api_key,
        max_cap_cents=10**9,
        worker_token=SecretStr(VAULT_WORKER_TOKEN),
        worker_budget_cents=VAULT_WORKER_BUDGET,
        worker_currencies="usd,eur,jpy",  # parsed from text
    )
    async with (
        serve_vault(settings) as running,
        VaultAdmin(running.url, VAULT_ADMIN_TOKEN) as admin,
        VaultAdmin(running.url, VAULT_WORKER_TOKEN) as worker,
    ):
        harness.vault = VaultHandle(url=running.url, admin=admin, worker=worker)
        yield harness

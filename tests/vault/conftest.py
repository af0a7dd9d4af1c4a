"""Fixtures for the vault's tests: a real Postgres database per test (tests/conftest.py), an
in-process Stripe emulator and vault, the admin client, and the Stripe SDK pointed at the vault.

Every test also checks, on teardown, that no secret reached the captured logs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest
import stripe

from stripe_emulator import EmulatorConfig, RunningEmulator
from stripe_emulator import serve as serve_emulator
from vault.app import RunningVault, serve
from vault.client import VaultAdmin
from vault.models import IssuedKey
from vault.settings import VaultSettings

from .support import (
    ADMIN_TOKEN,
    MAX_CAP_CENTS,
    UPSTREAM_SECRET,
    WORKER_BUDGET_CENTS,
    WORKER_CURRENCIES,
    WORKER_TOKEN,
    key_request,
    via_vault,
)


class Secrets:
    """Every secret a test handled: none may appear in logs, audit rows or responses."""

    def __init__(self) -> None:
        self.values = [ADMIN_TOKEN, WORKER_TOKEN, UPSTREAM_SECRET]

    def found_in(self, text: str) -> list[str]:
        return [secret for secret in self.values if secret in text]


@pytest.fixture
def secrets_seen() -> Secrets:
    return Secrets()


@pytest.fixture(autouse=True)
def _no_secret_logged(caplog: pytest.LogCaptureFixture, secrets_seen: Secrets) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield
    logged = caplog.text + "".join(repr(record.args) for record in caplog.records)
    assert secrets_seen.found_in(logged) == []


@pytest.fixture
async def emulator() -> AsyncIterator[RunningEmulator]:
    async with serve_emulator(EmulatorConfig()) as running:
        yield running


@pytest.fixture
def vault_settings(
    database_url: str, emulator: RunningEmulator, request: pytest.FixtureRequest
) -> VaultSettings:
    """The vault's settings; a test marked `@pytest.mark.vault_settings(name=value, ...)`
    changes those it names."""
    marker = request.node.get_closest_marker("vault_settings")
    return VaultSettings(
        database_url=database_url,
        admin_token=ADMIN_TOKEN,
        upstream_stripe_base=emulator.url,
        upstream_stripe_secret=UPSTREAM_SECRET,
        max_cap_cents=MAX_CAP_CENTS,
        upstream_timeout_seconds=5,
        worker_token=WORKER_TOKEN,
        worker_budget_cents=WORKER_BUDGET_CENTS,
        worker_currencies=WORKER_CURRENCIES,  # parsed from text
        **(marker.kwargs if marker is not None else {}),
    )


@pytest.fixture
async def vault(vault_settings: VaultSettings) -> AsyncIterator[RunningVault]:
    async with serve(vault_settings) as running:
        yield running


@pytest.fixture
async def admin(vault: RunningVault) -> AsyncIterator[VaultAdmin]:
    async with VaultAdmin(vault.url, ADMIN_TOKEN) as client:
        yield client


@pytest.fixture
async def worker(vault: RunningVault) -> AsyncIterator[VaultAdmin]:
    """The client as workers hold it: with the worker token."""
    async with VaultAdmin(vault.url, WORKER_TOKEN) as client:
        yield client


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


Issue = Callable[..., Awaitable[IssuedKey]]


@pytest.fixture
def issue(admin: VaultAdmin, secrets_seen: Secrets) -> Issue:
    """Issue a key (fields as in key_request) and remember its secret."""

    async def issue_key(**overrides: Any) -> IssuedKey:
        issued = await admin.issue_key(key_request(**overrides))
        secrets_seen.values.append(issued.secret.get_secret_value())
        return issued

    return issue_key


@pytest.fixture
async def stripe_via_vault(
    vault: RunningVault,
) -> AsyncIterator[Callable[[IssuedKey], stripe.StripeClient]]:
    """The stock Stripe SDK, async over aiohttp, calling Stripe through the vault."""
    async with aiohttp.ClientSession() as session:

        def client(key: IssuedKey) -> stripe.StripeClient:
            return via_vault(key.secret.get_secret_value(), vault.url, session)

        yield client


@pytest.fixture
async def direct_stripe(emulator: RunningEmulator) -> AsyncIterator[stripe.StripeClient]:
    """The SDK straight to the emulator, for setting up customers and reading results."""
    async with aiohttp.ClientSession() as session:
        yield stripe.StripeClient(
            UPSTREAM_SECRET,
            base_addresses={"api": emulator.url},
            http_client=stripe.AIOHTTPClient(session=session),
        )


# The vault's tests charge naming no payment method, the only request most of them need:
# Stripe then charges the customer's legacy default source, so their customers have one.
@pytest.fixture
async def customer(direct_stripe: stripe.StripeClient) -> str:
    """A customer whose default source pays."""
    return await _with_source(direct_stripe, "tok_visa")


@pytest.fixture
async def declining_customer(direct_stripe: stripe.StripeClient) -> str:
    """A customer whose default source is declined (402 card_declined)."""
    return await _with_source(direct_stripe, "tok_chargeCustomerFail")


@pytest.fixture
async def returned_debit_customer(direct_stripe: stripe.StripeClient) -> tuple[str, str]:
    """A customer and its SEPA debit (in eur; a debit is never a default source), which the
    bank returns once it settles."""
    method = "pm_sepaDebit_fails"
    created = await direct_stripe.v1.customers.create_async(
        params={"payment_method": method, "invoice_settings": {"default_payment_method": method}}
    )
    settings = created.invoice_settings
    assert settings is not None and isinstance(settings.default_payment_method, str)
    return created.id, settings.default_payment_method


async def _with_source(client: stripe.StripeClient, token: str) -> str:
    return (await client.v1.customers.create_async(params={"source": token})).id

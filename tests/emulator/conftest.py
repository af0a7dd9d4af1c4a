"""Fixtures for the Stripe emulator's tests: one in-process emulator, reset before each test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
import stripe

from stripe_emulator import EmulatorConfig, RunningEmulator, serve

from .support import API_KEY, Raw


@pytest.fixture(scope="session")
async def emulator() -> AsyncIterator[RunningEmulator]:
    async with serve() as running:
        yield running


@pytest.fixture(autouse=True)
def _fresh_emulator(emulator: RunningEmulator) -> None:
    emulator.state.reset(EmulatorConfig().model_dump())


@pytest.fixture(scope="session")
async def http_session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def raw(http_session: aiohttp.ClientSession, emulator: RunningEmulator) -> Raw:
    return Raw(http_session, emulator.url)


@pytest.fixture(scope="session")
async def sdk(emulator: RunningEmulator) -> AsyncIterator[stripe.StripeClient]:
    """The real SDK, async over aiohttp (use the ``*_async`` methods)."""
    async with aiohttp.ClientSession() as session:
        yield stripe.StripeClient(
            API_KEY,
            base_addresses={"api": emulator.url},
            http_client=stripe.AIOHTTPClient(session=session),
        )


@pytest.fixture(scope="session")
def sync_sdk(emulator: RunningEmulator) -> stripe.StripeClient:
    """The real SDK over ``requests``; call it in ``asyncio.to_thread`` (the server shares the
    test's event loop)."""
    return stripe.StripeClient(API_KEY, base_addresses={"api": emulator.url})

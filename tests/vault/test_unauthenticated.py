"""The per-peer counts of requests with no known vault key (vault/unauthenticated.py)."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta

import aiohttp
import asyncpg
import pytest

from devstack.postgres import LocalPostgres
from tests.waiting import eventually
from vault import unauthenticated
from vault.app import RunningVault, serve
from vault.settings import VaultSettings
from vault.unauthenticated import OVERFLOW_PEER, Tally, peer_of


@pytest.mark.parametrize(
    ("remote", "peer"),
    [
        ("192.0.2.7", "192.0.2.7"),
        ("::ffff:192.0.2.7", "192.0.2.7"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),
        (None, "unknown"),
        ("not an address", "unknown"),
    ],
)
def test_a_peer_is_its_ipv4_address_or_its_ipv6_64(remote: str | None, peer: str) -> None:
    assert peer_of(remote) == peer


def test_peers_past_the_bound_are_counted_together() -> None:
    tally = Tally()
    bound = unauthenticated._MAX_PEERS
    for i in range(bound + 5):
        tally.count(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    tally.count("10.0.0.0")  # counted apart already: stays apart
    rows = tally.drain()
    assert len(rows) == bound + 1
    assert {r.peer: r.requests for r in rows}["10.0.0.0"] == 2
    assert [(r.peer, r.requests) for r in rows if r.peer == OVERFLOW_PEER] == [(OVERFLOW_PEER, 5)]
    assert tally.drain() == []


def test_a_clock_stepped_back_keeps_a_rows_last_after_its_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    start = datetime(2026, 12, 4, 12, tzinfo=UTC)
    times = iter([start, start - timedelta(seconds=30)])

    class SteppedBack:
        @staticmethod
        def now(tz: object) -> datetime:
            return next(times)

    monkeypatch.setattr(unauthenticated, "datetime", SteppedBack)
    tally = Tally()
    tally.count("192.0.2.7")
    tally.count("192.0.2.7")
    [row] = tally.drain()
    assert (row.first_at, row.last_at, row.requests) == (start, start, 2)


@pytest.mark.vault_settings(unauthenticated_window_seconds=1)
# Refused: the database up but rejecting the rows, an error no retry is made for.
@pytest.mark.parametrize("failure", ["outage", "refused"])
async def test_each_window_is_written_while_the_vault_runs_and_an_outage_stops_none_after_it(
    vault: RunningVault,
    http: aiohttp.ClientSession,
    db: asyncpg.Pool,
    postgres: LocalPostgres,
    caplog: pytest.LogCaptureFixture,
    failure: str,
) -> None:
    """Written only when the vault stops, a window's counts would be lost to a vault that
    dies; a write raising past a database outage (or a database error) would end the task
    that writes them, and no later window would be written while the vault runs."""

    async def send_keyless(requests: int) -> None:
        for _ in range(requests):
            async with http.get(f"{vault.url}/stripe/v1/payment_intents/pi_1") as response:
                assert response.status == 401

    async def written(requests: int) -> bool:
        # Summed: where a window ends among the requests is the clock's to say.
        total = "SELECT coalesce(sum(requests), 0) FROM vault_unauthenticated"
        return bool(await db.fetchval(total) == requests)

    async def given_up() -> bool:
        # Logged as an error: the window's counts are lost.
        return any(
            r.name == "vault.unauthenticated" and r.levelno >= logging.ERROR for r in caplog.records
        )

    await send_keyless(3)
    await eventually(lambda: written(3), timeout=10)
    refuse = "ALTER TABLE vault_unauthenticated ADD CONSTRAINT refuse CHECK (requests < 0)"
    if failure == "outage":
        await asyncio.to_thread(postgres.stop)
    else:
        await db.execute(refuse + " NOT VALID")
    try:
        await send_keyless(1)
        await eventually(given_up, timeout=30)
    finally:
        if failure == "outage":
            await asyncio.to_thread(postgres.start)
        else:
            await db.execute("ALTER TABLE vault_unauthenticated DROP CONSTRAINT refuse")
    await send_keyless(2)
    # The outage's window is lost (logged), not the ones after it.
    await eventually(lambda: written(3 + 2), timeout=30)


@pytest.mark.vault_settings(unauthenticated_window_seconds=3600)
async def test_a_vault_that_stops_mid_window_writes_that_windows_counts(
    vault_settings: VaultSettings, http: aiohttp.ClientSession, db: asyncpg.Pool
) -> None:
    """A window cut short by a stop (a deploy, a scale-in) is written as the vault stops:
    probing with guessed keys just before a restart must not vanish from the counts."""
    async with serve(vault_settings) as vault:
        for _ in range(3):
            async with http.get(f"{vault.url}/stripe/v1/payment_intents/pi_1") as response:
                assert response.status == 401
        assert await db.fetchval("SELECT count(*) FROM vault_unauthenticated") == 0
    assert await db.fetchval("SELECT sum(requests) FROM vault_unauthenticated") == 3

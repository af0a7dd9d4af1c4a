"""`python -m vault`: one ready line on stdout, clear start-up errors, graceful stop."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from stripe_emulator import RunningEmulator
from vault.client import VaultAdmin

from .support import ADMIN_TOKEN, UPSTREAM_SECRET, key_request, set_faults

ROOT = Path(__file__).resolve().parents[2]


def _env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VAULT_")}
    env["PYTHONPATH"] = str(ROOT)
    return env | settings


async def _vault_process(env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vault",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


@pytest.fixture
async def vault_process(
    database_url: str, emulator: RunningEmulator
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    process = await _vault_process(
        _env(
            VAULT_DATABASE_URL=database_url,
            VAULT_ADMIN_TOKEN=ADMIN_TOKEN,
            VAULT_UPSTREAM_STRIPE_BASE=emulator.url,
            VAULT_UPSTREAM_STRIPE_SECRET=UPSTREAM_SECRET,
            VAULT_MAX_CAP_CENTS="1000000",
        )
    )
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
    assert line.startswith("vault listening on http://127.0.0.1:"), line
    url = line.removeprefix("vault listening on ").strip()
    assert not url.endswith(":0")
    yield process, url
    if process.returncode is None:
        process.kill()
        await process.wait()


async def test_serves_then_stops_on_sigterm_after_finishing_in_flight_requests(
    vault_process: tuple[asyncio.subprocess.Process, str],
    emulator: RunningEmulator,
    customer: str,
) -> None:
    process, url = vault_process
    async with VaultAdmin(url, ADMIN_TOKEN) as admin:
        key = await admin.issue_key(key_request())
    await set_faults(emulator, latency_ms=500)
    async with aiohttp.ClientSession() as http:

        async def slow_charge() -> int:
            async with http.post(
                url + "/stripe/v1/payment_intents",
                data={
                    "amount": "100",
                    "currency": "usd",
                    "customer": customer,
                    "confirm": "true",
                    "off_session": "true",
                    "automatic_payment_methods[enabled]": "true",
                    "automatic_payment_methods[allow_redirects]": "never",
                },
                headers={
                    "Authorization": f"Bearer {key.secret.get_secret_value()}",
                    "Idempotency-Key": "in-flight",
                },
            ) as response:
                return response.status

        in_flight = asyncio.create_task(slow_charge())
        await asyncio.sleep(0.25)
        process.send_signal(signal.SIGTERM)
        assert await in_flight == 200
    assert await asyncio.wait_for(process.wait(), 30) == 0
    assert process.stdout is not None and process.stderr is not None
    assert await process.stdout.read() == b""  # the ready line was the only one
    assert key.secret.get_secret_value() not in (await process.stderr.read()).decode()


async def test_missing_settings_are_named_and_no_secret_is_printed() -> None:
    process = await _vault_process(
        _env(VAULT_UPSTREAM_STRIPE_SECRET=UPSTREAM_SECRET, VAULT_ADMIN_TOKEN="short")  # noqa: S106
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2
    assert stdout == b""
    message = stderr.decode()
    assert "VAULT_ADMIN_TOKEN: must be at least 16 characters" in message
    assert "VAULT_MAX_CAP_CENTS: is required but not set" in message
    # No default: the local emulator's address would take the real secret.
    assert "VAULT_UPSTREAM_STRIPE_BASE: is required but not set" in message
    assert UPSTREAM_SECRET not in message and "short" not in message


async def test_unreachable_database_is_a_clear_start_up_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    process = await _vault_process(
        _env(
            VAULT_DATABASE_URL=f"postgresql://postgres:pw-not-shown@127.0.0.1:{closed_port}/x",
            VAULT_ADMIN_TOKEN=ADMIN_TOKEN,
            VAULT_UPSTREAM_STRIPE_BASE="https://api.stripe.com",
            VAULT_UPSTREAM_STRIPE_SECRET=UPSTREAM_SECRET,
            VAULT_MAX_CAP_CENTS="100",
        )
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 1
    assert stdout == b""
    assert "vault could not start" in stderr.decode()
    assert "pw-not-shown" not in stderr.decode()

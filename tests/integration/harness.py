"""A billing stack for one test: its database, namespace, emulator and worker(s)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import stripe
from temporalio.client import Client
from temporalio.worker import Worker

from activities.stripe_access import StripeAccess, VaultAccess
from billing.config import BillingSettings
from billing.customers import CustomerRow, upsert_customers
from billing.periods import Period
from billing.runs import period_status
from billing.seeding import create_demo_customers
from vault.client import VaultAdmin
from worker import create_worker, direct_access

PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class VaultHandle:
    url: str
    admin: VaultAdmin


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 60) -> None:
    """Wait until `check()` is true; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


async def at_least(count: Awaitable[int], n: int) -> bool:
    return await count >= n


def always_visa(_: int) -> str:
    return "pm_card_visa"


@dataclass
class Harness:
    client: Client
    pool: asyncpg.Pool
    database_url: str
    emulator_url: str
    settings: BillingSettings
    task_queue: str
    stripe: stripe.StripeClient
    http: stripe.HTTPClient
    vault: VaultHandle | None = None
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    async def seed(
        self, count: int, card_for: Callable[[int], str] = always_visa, prefix: str = "cust"
    ) -> list[CustomerRow]:
        rows = await create_demo_customers(self.stripe, count, prefix=prefix, card_for=card_for)
        await upsert_customers(self.pool, rows)
        return rows

    async def _emulator(self, method: str, path: str, body: Any = None) -> Any:
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, self.emulator_url + path, json=body) as response,
        ):
            response.raise_for_status()
            return await response.json()

    async def charges(self) -> list[dict[str, Any]]:
        ledger = await self._emulator("GET", "/_emulator/ledger")
        charges: list[dict[str, Any]] = ledger["charges"]
        return charges

    async def requests(self) -> list[dict[str, Any]]:
        log = await self._emulator("GET", "/_emulator/requests")
        requests: list[dict[str, Any]] = log["requests"]
        return requests

    async def succeeded(self) -> int:
        """Successful charges in Stripe's (the emulator's) ledger."""
        return sum(c["status"] == "succeeded" for c in await self.charges())

    async def money_requests(self) -> int:
        """Charge requests Stripe received, refused or not."""
        return sum(
            r["method"] == "POST" and r["path"] == "/v1/payment_intents"
            for r in await self.requests()
        )

    async def in_state(self, period: Period, state: str) -> bool:
        return (await period_status(self.client, period)).state == state

    async def faults_injected(self) -> dict[str, int]:
        ledger = await self._emulator("GET", "/_emulator/ledger")
        injected: dict[str, int] = ledger["faults_injected"]
        return injected

    async def set_faults(self, **faults: Any) -> None:
        await self._emulator("POST", "/_emulator/faults", faults)

    def worker(self) -> Worker:
        """A worker charging directly, or through the vault when the harness has one."""
        if self.vault is None:
            access: StripeAccess = direct_access(self.stripe, self.settings)
            return create_worker(self.client, self.task_queue, self.pool, access, self.settings)
        access = VaultAccess(self.pool, self.vault.url, self.settings.billing_charge_api, self.http)
        return create_worker(
            self.client, self.task_queue, self.pool, access, self.settings, self.vault.admin
        )

    @asynccontextmanager
    async def running_worker(self) -> AsyncIterator[Worker]:
        async with self.worker() as worker:
            yield worker

    def worker_process(self) -> subprocess.Popen[bytes]:
        """worker.py in its own process, so a test can SIGKILL it."""
        config = self.client.service_client.config
        env = {
            **os.environ,
            "TEMPORAL_ADDRESS": config.target_host,
            "TEMPORAL_NAMESPACE": self.client.namespace,
            "TEMPORAL_TASK_QUEUE": self.task_queue,
            "DATABASE_URL": self.database_url,
            "STRIPE_API_BASE": self.settings.stripe_api_base,
            "STRIPE_API_KEY": self.settings.stripe_api_key.get_secret_value(),
            "BILLING_CHARGE_API": self.settings.billing_charge_api,
            "BILLING_KEY_NAMESPACE": self.settings.billing_key_namespace,
        }
        process = subprocess.Popen(
            [sys.executable, str(PROJECT_ROOT / "worker.py")],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.processes.append(process)
        return process

    async def ledger_rows(self, period: str) -> list[asyncpg.Record]:
        async with self.pool.acquire() as conn:
            rows: list[asyncpg.Record] = await conn.fetch(
                "SELECT * FROM billing_runs WHERE billing_period = $1 ORDER BY customer_id", period
            )
            return rows

    def stop_processes(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()

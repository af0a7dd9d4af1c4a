"""Throughput of the Stripe emulator: confirmed PaymentIntent creations per second on one core.

Starts ``python -m stripe_emulator`` pinned to core 0 (``taskset``), drives it from this
process (pinned to another core when there is one) with many concurrent aiohttp requests, each
with its own idempotency key, and prints requests/s, latency percentiles and the server's CPU
use. The target is at least 1,000 charges/s, so the emulator never bottlenecks a billing
benchmark.

    .venv/bin/python bench/emulator_throughput.py --requests 20000 --concurrency 64 [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import time
from typing import Any

import aiohttp

API_KEY = "sk_test_benchmark"
READY = re.compile(r"stripe emulator listening on (\S+)")
CUSTOMERS = 100


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of ``pid`` (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _start_server() -> tuple[asyncio.subprocess.Process, str, bool]:
    command = [sys.executable, "-m", "stripe_emulator", "--port", "0"]
    pinned = shutil.which("taskset") is not None
    if pinned:
        command = ["taskset", "-c", "0", *command]  # taskset execs: the pid is Python's
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
    match = READY.search(line)
    if match is None:
        process.kill()
        raise SystemExit(f"emulator did not start: {line!r}")
    return process, match.group(1), pinned


async def _customers(session: aiohttp.ClientSession, url: str) -> list[tuple[str, str]]:
    """Customers with a saved card: (customer id, the card's payment method id)."""
    customers = []
    for _ in range(CUSTOMERS):
        async with session.post(
            f"{url}/v1/customers",
            data={
                "payment_method": "pm_card_visa",
                "invoice_settings[default_payment_method]": "pm_card_visa",
            },
        ) as response:
            body = await response.json()
            customers.append((body["id"], body["invoice_settings"]["default_payment_method"]))
    return customers


async def _drive(
    session: aiohttp.ClientSession,
    url: str,
    customers: list[tuple[str, str]],
    count: int,
    concurrency: int,
    run: str,
) -> tuple[list[float], int]:
    """Send ``count`` confirmed PaymentIntents; return latencies (s) and the non-200 count."""
    latencies: list[float] = []
    failures = 0
    next_index = iter(range(count))

    async def worker() -> None:
        nonlocal failures
        for index in next_index:
            # Named, as the billing core names it: Stripe charges no saved card unasked.
            customer, payment_method = customers[index % len(customers)]
            data = {
                "amount": "1999",
                "currency": "usd",
                "customer": customer,
                "payment_method": payment_method,
                "confirm": "true",
                "off_session": "true",
                "automatic_payment_methods[enabled]": "true",
                "automatic_payment_methods[allow_redirects]": "never",
                "metadata[billing_key]": f"{run}-{index}",
            }
            started = time.perf_counter()
            async with session.post(
                f"{url}/v1/payment_intents",
                data=data,
                headers={"Idempotency-Key": f"{run}-{index}"},
            ) as response:
                await response.read()
                if response.status != 200:
                    failures += 1
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, failures


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def run(requests: int, concurrency: int) -> dict[str, Any]:
    process, url, pinned = await _start_server()
    with contextlib.suppress(AttributeError, OSError):
        if (os.cpu_count() or 1) > 1:
            os.sched_setaffinity(0, {1})  # keep the client off the server's core
    try:
        connector = aiohttp.TCPConnector(limit=concurrency)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
            customers = await _customers(session, url)
            warmup = min(1000, max(requests // 10, 1))
            await _drive(session, url, customers, warmup, concurrency, "warmup")
            cpu_before = _cpu_seconds(process.pid)
            started = time.perf_counter()
            latencies, failures = await _drive(
                session, url, customers, requests, concurrency, "measured"
            )
            elapsed = time.perf_counter() - started
            cpu_after = _cpu_seconds(process.pid)
            async with session.get(f"{url}/_emulator/ledger") as response:
                charges = len((await response.json())["charges"])
    finally:
        process.terminate()
        await process.wait()
    server_cpu = None
    if cpu_before is not None and cpu_after is not None:
        server_cpu = (cpu_after - cpu_before) / elapsed
    rps = requests / elapsed
    return {
        "requests": requests,
        "concurrency": concurrency,
        "server_pinned_to_one_core": pinned,
        "seconds": round(elapsed, 3),
        "requests_per_second": round(rps, 1),
        "p50_ms": round(_percentile(latencies, 0.50) * 1000, 2),
        "p99_ms": round(_percentile(latencies, 0.99) * 1000, 2),
        "mean_ms": round(statistics.fmean(latencies) * 1000, 2),
        "failures": failures,
        "charges_in_ledger": charges,
        "server_cpu_utilisation": None if server_cpu is None else round(server_cpu, 3),
        # What the server alone could sustain on its core if the client were not the limit.
        "server_capacity_per_second": (
            None if not server_cpu else round(rps / min(server_cpu, 1.0), 1)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print only one JSON line")
    args = parser.parse_args()
    result = asyncio.run(run(args.requests, args.concurrency))
    if args.json:
        print(json.dumps(result))
        return
    for name, value in result.items():
        print(f"{name:>28}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

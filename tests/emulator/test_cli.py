"""``python -m stripe_emulator``: the ready line, flags, clean exit on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import sys

import aiohttp
import pytest

READY = re.compile(r"stripe emulator listening on (http://127\.0\.0\.1:\d+)\n")


async def _start(*flags: str) -> tuple[asyncio.subprocess.Process, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "stripe_emulator",
        "--port",
        "0",
        *flags,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 10)).decode()
    match = READY.fullmatch(line)
    assert match, line
    return process, match.group(1)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_cli_serves_with_flags_and_stops_cleanly(signum: signal.Signals) -> None:
    process, url = await _start(
        "--drop-after-commit", "0.2", "--latency-ms", "3", "--rate-limit-rps", "50", "--seed", "9"
    )
    try:
        async with aiohttp.ClientSession() as session, session.get(url + "/_emulator/faults") as r:
            config = await r.json()
        assert (config["drop_after_commit"], config["latency_ms"]) == (0.2, 3)
        assert (config["rate_limit_rps"], config["seed"]) == (50, 9)
    finally:
        process.send_signal(signum)
        assert await asyncio.wait_for(process.wait(), 10) == 0


async def test_cli_refuses_bad_values() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "stripe_emulator",
        "--error-after-commit",
        "2",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 10)
    assert process.returncode == 2
    assert b"argument --error-after-commit: Input should be less than or equal to 1" in stderr
    assert b"pydantic" not in stderr


async def test_cli_says_why_it_cannot_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for flags, status, message in (
            (["--port", port], 1, b"stripe emulator could not start: [Errno 98]"),
            (["--port", "70000"], 2, b"--port: 70000 is not a TCP port (0-65535)"),
        ):
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "stripe_emulator",
                *flags,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            _, stderr = await asyncio.wait_for(process.communicate(), 10)
            assert process.returncode == status
            assert message in stderr and b"Traceback" not in stderr

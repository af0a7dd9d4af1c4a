"""Child processes of the local stack: started with their output in a log file, stopped in order."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from billing.errors import BillingError


class StackError(BillingError):
    """The local stack could not start; the message says which part and where its log is."""


def ensure_port_free(port: int, what: str) -> None:
    with socket.socket() as sock:
        # As servers do: connections of a stopped server in TIME_WAIT do not hold the port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise StackError(
                f"port {port} for {what} is in use: is another local stack running?"
                " (`python -m devstack down`), or choose another port"
            ) from None


@dataclass
class Service:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 40) -> None:
        if not self.alive():
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
            self.process.wait()


def spawn(
    name: str,
    argv: Sequence[str],
    log_dir: Path,
    env: Mapping[str, str] | None = None,
    withhold: Collection[str] = (),
) -> Service:
    """Start a service with this process's environment and `env` over it; the names in
    `withhold` it gets from neither (a shell that sourced `.devstack/env` holds them)."""
    inherited = {k: v for k, v in os.environ.items() if k not in withhold}
    log = log_dir / f"{name}.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=inherited | {k: v for k, v in (env or {}).items() if k not in withhold},
            # Own session: a Ctrl-C in the terminal reaches the stack, which stops these in order.
            start_new_session=True,
        )
    return Service(name, process, log)


async def wait_for_http(service: Service, url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if not service.alive():
                raise StackError(f"{service.name} exited during start-up; see {service.log}")
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                    if response.status < 500:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise StackError(
        f"{service.name} did not answer at {url} within {timeout:.0f} s; see {service.log}"
    )

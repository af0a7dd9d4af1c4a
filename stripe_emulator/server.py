"""Running the emulator: in-process for tests (``serve``), or as a process (``__main__``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from .app import create_app
from .config import EmulatorConfig
from .emulator import EMULATOR, Emulator


class RunningEmulator:
    """A listening emulator: its base URL (no trailing slash) and its live configuration."""

    def __init__(self, url: str, app: web.Application) -> None:
        self.url = url
        self.app = app

    @property
    def state(self) -> Emulator:
        return self.app[EMULATOR]

    @property
    def config(self) -> EmulatorConfig:
        return self.state.config

    def configure(self, **changes: Any) -> EmulatorConfig:
        """In-process equivalent of ``POST /_emulator/faults``."""
        return self.state.configure(changes)


async def start(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    # No access log: it would cost more than handling a request does.
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_port = runner.addresses[0][1]
    return runner, f"http://{host}:{bound_port}"


@asynccontextmanager
async def serve(
    config: EmulatorConfig | None = None, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[RunningEmulator]:
    """``async with serve() as emulator:`` listens on ``emulator.url`` until the block ends."""
    app = create_app(config)
    runner, url = await start(app, host, port)
    try:
        yield RunningEmulator(url, app)
    finally:
        await runner.cleanup()

"""`python -m vault --host H --port P`: run the vault until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import asyncpg
import uvloop

from billing import logs
from billing.config import SettingsError, load_settings
from billing.errors import ConfigurationError
from vault.app import serve
from vault.settings import VaultSettings


async def _run(settings: VaultSettings, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with serve(settings, host, port) as vault:
        print(f"vault listening on {vault.url}", flush=True)
        await stop.wait()
        logging.getLogger("vault").info("stopping: finishing in-flight requests")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vault", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8180, help="0 picks a free port")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"argument --port: {args.port} is not a TCP port (0-65535)")
    try:
        # The project's logging: JSON with LOG_FORMAT=json, and every line passes the redactor.
        logs.configure()
        settings = load_settings(VaultSettings)
    except SettingsError as error:
        print(f"vault: {error}", file=sys.stderr)
        return 2
    try:
        # uvloop, as the worker runs on: the vault is one hop on every charge.
        uvloop.run(_run(settings, args.host, args.port))
    except (OSError, asyncpg.PostgresError) as error:
        # Unreachable database, port in use. The message names no secret.
        print(f"vault could not start: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    except ConfigurationError as error:
        print(f"vault: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m stripe_emulator --host 127.0.0.1 --port 12111 [--drop-after-commit 0.2 ...]``"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import uvloop
from pydantic import ValidationError

from .app import create_app
from .config import EmulatorConfig
from .server import start


def _parse(argv: list[str] | None) -> tuple[str, int, EmulatorConfig]:
    parser = argparse.ArgumentParser(
        prog="python -m stripe_emulator",
        description="Stripe-compatible local server for tests and benchmarks (never production).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=12111, help="0 picks a free port")
    # One flag per EmulatorConfig field; only those given are passed, the rest keep defaults.
    fields = {
        "drop_after_commit": float,
        "error_before_commit": float,
        "error_saved_before_commit": float,
        "error_after_commit": float,
        "rate_limited": float,
        "latency_ms": int,
        "rate_limit_rps": float,
        "endpoint_rate_limit_rps": float,
        "seed": int,
        "idempotency_ttl_seconds": float,
    }
    for name, kind in fields.items():
        description = EmulatorConfig.model_fields[name].description
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=kind,
            default=None,
            metavar=kind.__name__.upper(),
            help=description,
        )
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"argument --port: {args.port} is not a TCP port (0-65535)")
    given = {name: getattr(args, name) for name in fields if getattr(args, name) is not None}
    try:
        config = EmulatorConfig.model_validate(given)
    except ValidationError as error:
        # One line per flag, named as typed: pydantic's own text names fields and links docs.
        parser.error(
            "; ".join(
                f"argument --{str(problem['loc'][0]).replace('_', '-')}: {problem['msg']}"
                for problem in error.errors(include_url=False)
            )
        )
    return args.host, args.port, config


async def _run(host: str, port: int, config: EmulatorConfig) -> None:
    runner, url = await start(create_app(config), host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    # Tooling waits for exactly this line.
    print(f"stripe emulator listening on {url}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    host, port, config = _parse(argv)
    try:
        # uvloop, as the worker and the vault run on, so the emulator costs the stack little.
        uvloop.run(_run(host, port, config))
    except OSError as error:  # port in use, unknown host
        print(f"stripe emulator could not start: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

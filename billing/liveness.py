"""Whether the worker's event loop still runs: `/health` beside `/metrics`.

The metrics server answers from a thread of its own, so `/metrics` answers while the loop is
blocked (a synchronous call, a CPU-bound step), when the worker polls and charges nothing. The
loop marks a heartbeat every HEARTBEAT_SECONDS; `/health` fails once it is STALL_LIMIT_SECONDS
old, for a liveness probe to restart the worker (Temporal hands its tasks to another). Compose
only marks the container unhealthy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import Gauge

HEARTBEAT_SECONDS = 1.0
STALL_LIMIT_SECONDS = 30.0
HEALTH_PATH = "/health"

LOOP_LAG = Gauge(
    "billing_worker_event_loop_lag_seconds",
    "Seconds since the worker's event loop last marked its heartbeat, at scrape time;"
    " above a second or two, something blocks the loop.",
)

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class Heartbeat:
    def __init__(self) -> None:
        self._last = time.monotonic()
        LOOP_LAG.set_function(self.age)

    def age(self) -> float:
        return time.monotonic() - self._last

    async def run(self) -> None:
        """Mark the heartbeat until cancelled; a late wake-up is the loop's lag."""
        while True:
            self._last = time.monotonic()
            await asyncio.sleep(HEARTBEAT_SECONDS)


def with_health(app: WsgiApp, heartbeat: Heartbeat) -> WsgiApp:
    """`app` (the metrics), with `/health` answering 503 while the loop is stalled."""

    def serve(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return app(environ, start_response)
        age = heartbeat.age()
        stalled = age > STALL_LIMIT_SECONDS
        status = "503 Service Unavailable" if stalled else "200 OK"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        if stalled:
            return [f"the worker's event loop has not run for {age:.0f} s\n".encode()]
        return [b"ok\n"]

    return serve

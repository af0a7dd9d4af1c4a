"""The worker's `/health`: it fails while the event loop is blocked, though the metrics
server's own thread still answers `/metrics`."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

from billing import liveness, metrics
from billing.config import ObservabilitySettings
from tests.conftest import free_port


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - http only
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


async def test_health_fails_while_the_event_loop_is_blocked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(liveness, "HEARTBEAT_SECONDS", 0.05)
    monkeypatch.setattr(liveness, "STALL_LIMIT_SECONDS", 0.5)
    port = free_port()
    heartbeat = liveness.Heartbeat()
    server = metrics.serve(ObservabilitySettings(billing_metrics_port=port), heartbeat)
    assert server is not None
    base = f"http://127.0.0.1:{port}"
    beating = asyncio.create_task(heartbeat.run())
    try:
        await asyncio.sleep(0.8)  # running, the loop keeps its heartbeat young
        assert await asyncio.to_thread(_get, base + "/health") == (200, "ok\n")
        seen: dict[str, tuple[int, str]] = {}
        probed = threading.Event()

        def probe() -> None:
            try:
                time.sleep(0.8)
                seen["health"] = _get(base + "/health")
                seen["metrics"] = _get(base + "/metrics")
            finally:  # a probe that raised lets the loop go too, its error in the thread's
                probed.set()

        prober = threading.Thread(target=probe)
        prober.start()
        # A synchronous wait blocks the loop until the probe is done, however late a loaded
        # machine runs it.
        assert probed.wait(timeout=30)
        prober.join()
        status, text = seen["health"]
        assert status == 503
        assert re.fullmatch(r"the worker's event loop has not run for \d+ s\n", text)
        status, text = seen["metrics"]
        [lag] = [
            float(line.split()[1])
            for line in text.splitlines()
            if line.startswith("billing_worker_event_loop_lag_seconds ")
        ]
        assert status == 200 and lag >= 0.8
        await asyncio.sleep(0.1)  # the loop runs again, and marks its heartbeat
        assert await asyncio.to_thread(_get, base + "/health") == (200, "ok\n")
    finally:
        beating.cancel()
        server.shutdown()
        server.server_close()


def test_a_worker_just_started_is_healthy_and_metrics_pass_through() -> None:
    # With the limits the worker runs with, not the test's: a probe right after start-up
    # must not have the worker restarted.
    heartbeat = liveness.Heartbeat()
    app = liveness.with_health(lambda environ, start_response: [b"metrics\n"], heartbeat)
    started: list[tuple[str, list[tuple[str, str]]]] = []

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        started.append((status, headers))

    assert app({"PATH_INFO": liveness.HEALTH_PATH}, start_response) == [b"ok\n"]
    assert started == [("200 OK", [("Content-Type", "text/plain; charset=utf-8")])]
    assert app({"PATH_INFO": "/metrics"}, start_response) == [b"metrics\n"]
    assert len(started) == 1

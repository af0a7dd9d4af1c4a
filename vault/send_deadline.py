"""A charge is sent within `send_within` of its reservation, or not at all.

Checked before the forward, and again once aiohttp holds the upstream connection: the last
wait before the request's bytes are written (the connection pool full, a connect). aiohttp's
own timeout runs on the monotonic clock, which a suspended machine may stop; the checks
count by the wall clock too."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

import aiohttp


@dataclass(frozen=True, slots=True)
class Stamp:
    monotonic: float
    wall: float

    @classmethod
    def now(cls) -> Stamp:
        return cls(time.monotonic(), time.time())

    def seconds_ago(self) -> float:
        # The wall clock also counts a machine suspended, which the monotonic one may not.
        return max(time.monotonic() - self.monotonic, time.time() - self.wall)


class HeldUpError(Exception):
    """The charge was not sent in time: nothing of it was written upstream."""

    def __init__(self, held_up: float) -> None:
        super().__init__(f"held up {held_up:.1f} s")
        self.held_up = held_up


@dataclass(frozen=True, slots=True)
class SendBy:
    """When a charge must be sent by; an upstream request's `trace_request_ctx`."""

    reserving: Stamp
    within_seconds: float

    def check(self) -> None:
        held_up = self.reserving.seconds_ago()
        if held_up > self.within_seconds:
            raise HeldUpError(held_up)


async def _on_connection(
    session: aiohttp.ClientSession, context: SimpleNamespace, params: object
) -> None:
    send_by = context.trace_request_ctx
    if isinstance(send_by, SendBy):
        send_by.check()


def deadline_trace() -> aiohttp.TraceConfig:
    """Checks a request's SendBy once it has its connection, new or reused (aiohttp lets the
    connection go when a hook raises)."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(_on_connection)
    trace.on_connection_reuseconn.append(_on_connection)
    return trace

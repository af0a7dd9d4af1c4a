"""A charge is sent within `send_within` of its reservation, or not at all.

Checked before the forward, and again once aiohttp holds the upstream connection: the last
wait before the request's bytes are written (the connection pool full, a connect). aiohttp's
own timeout runs on the monotonic clock, which a suspended machine may stop; the checks
count by the wall clock too."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import aiohttp
from aiohttp.client_reqrep import ClientRequest
from aiohttp.connector import Connection
from aiohttp.tracing import Trace


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
    """When a charge must be sent by."""

    reserving: Stamp
    within_seconds: float

    def check(self) -> None:
        held_up = self.reserving.seconds_ago()
        if held_up > self.within_seconds:
            raise HeldUpError(held_up)


# The deadline of the request this task is sending upstream, if it has one.
_SENDING: ContextVar[SendBy | None] = ContextVar("vault_sending", default=None)


@contextmanager
def sending(send_by: SendBy | None) -> Iterator[None]:
    """Checks `send_by` now, and holds the requests sent within to it (DeadlineConnector)."""
    if send_by is not None:
        send_by.check()
    token = _SENDING.set(send_by)
    try:
        yield
    finally:
        _SENDING.reset(token)


class DeadlineConnector(aiohttp.TCPConnector):
    """Checks the deadline of the request being sent once it holds its connection, new or
    reused, and closes a connection it refuses (raised from one of aiohttp's trace hooks,
    the refusal would leave the socket open, tracked by nothing)."""

    async def connect(
        self, req: ClientRequest, traces: list[Trace], timeout: aiohttp.ClientTimeout
    ) -> Connection:
        connection = await super().connect(req, traces, timeout)
        send_by = _SENDING.get()
        if send_by is not None:
            try:
                send_by.check()
            except HeldUpError:
                connection.close()
                raise
        return connection

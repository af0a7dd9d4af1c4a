"""Waiting, in a test, for something another task or process does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 60) -> None:
    """Wait until `check()` is true; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)

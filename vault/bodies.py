"""A request's body, read within VAULT_BODY_TIMEOUT_SECONDS."""

from __future__ import annotations

import asyncio

from aiohttp import web

from vault.errors import Refusal
from vault.state import STATE


async def read_body(request: web.Request) -> bytes:
    """The whole body, or 408 `body_timeout` once it has taken longer than the setting: a
    client trickling a body (up to the 1 MiB aiohttp reads) would otherwise hold the request,
    and its connection, for as long as it liked. Read before anything is reserved, so the 408
    leaves nothing to undo. The connection is closed after the answer, as HTTP asks of a
    408, once aiohttp has read what more arrives of the body for its lingering time (10 s),
    so that the client gets the answer rather than a reset."""
    within = request.app[STATE].settings.body_timeout_seconds
    try:
        async with asyncio.timeout(within):
            return await request.read()
    except TimeoutError:
        raise Refusal(
            "refused_request",
            408,
            "body_timeout",
            f"the request's body did not arrive within {within:g} s: send the"
            " body whole, at once, then retry",
            should_retry=True,
            close_connection=True,
        ) from None

"""A plain TCP front for the dev server that can be cut (its port closed, its connections
dropped) and restored on the same port: Temporal going away and coming back as a client sees
it (a restart, a deploy, a network cut), without restarting the test session's server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from tests.integration.tls_front import pipe


class CuttableFront:
    def __init__(self, target: str) -> None:
        self._host, port = target.rsplit(":", 1)
        self._target_port = int(port)
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self.port = 0
        # Connections taken so far.
        self.connections = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(
            self._host, self._target_port
        )
        if self._server is None:
            # Cut while this connection was being opened upstream.
            writer.transport.abort()
            upstream_writer.transport.abort()
            return
        self._open |= {writer, upstream_writer}
        self.connections += 1
        try:
            await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))
        finally:
            self._open -= {writer, upstream_writer}

    async def restore(self) -> None:
        """Listen (again) on the front's port; the first call picks a free one."""
        self._server = await asyncio.start_server(self._forward, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """Close the port and drop every connection through it, as a dead server would."""
        assert self._server is not None
        self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        await self._server.wait_closed()
        self._server = None


@contextlib.asynccontextmanager
async def cuttable_front(target: str) -> AsyncIterator[CuttableFront]:
    front = CuttableFront(target)
    await front.restore()
    try:
        yield front
    finally:
        if front._server is not None:
            await front.cut()

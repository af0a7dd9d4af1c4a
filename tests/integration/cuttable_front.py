"""A plain TCP front for the dev server that can be cut (its port closed, its connections
dropped) and restored on the same port: Temporal going away and coming back as a client sees
it (a restart, a deploy, a network cut), without restarting the test session's server. It can
also be frozen: connections stay open and nothing passes, as in a network partition."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import hpack

from tests.integration.tls_front import pipe

# What a client's HTTP/2 connection begins with, and the frames and flags that carry a
# request's headers.
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADERS, _CONTINUATION = 0x1, 0x9
_END_HEADERS, _PADDED, _PRIORITY = 0x4, 0x8, 0x20


class _CallReader:
    """Reads the gRPC methods a client calls down one connection from the header blocks
    of its HTTP/2 requests (every block is decoded, in order, so that hpack keeps the
    connection's header table): a test can tell what a command has gone on to do."""

    def __init__(self, calls: list[str]) -> None:
        self._calls = calls
        self._decoder = hpack.Decoder()
        self._preface_left = len(_PREFACE)
        self._buffer = b""
        self._block = b""
        self._broken = False

    def __call__(self, data: bytes) -> None:
        if self._broken:
            return
        try:
            self._read(data)
        except hpack.HPACKError:
            # Reading stops; the connection itself goes on, so no outage is made up.
            self._broken = True

    def _read(self, data: bytes) -> None:
        skipped = min(self._preface_left, len(data))
        self._preface_left -= skipped
        self._buffer += data[skipped:]
        # A frame: 3 bytes of payload length, its type, flags and stream id, then the payload.
        while len(self._buffer) >= 9:
            end = 9 + int.from_bytes(self._buffer[:3], "big")
            if len(self._buffer) < end:
                return
            kind, flags, payload = self._buffer[3], self._buffer[4], self._buffer[9:end]
            self._buffer = self._buffer[end:]
            if kind == _HEADERS:
                if flags & _PADDED:
                    payload = payload[1 : len(payload) - payload[0]]
                if flags & _PRIORITY:
                    payload = payload[5:]
                self._block = payload
            elif kind == _CONTINUATION:
                self._block += payload
            else:
                continue
            if flags & _END_HEADERS:
                path = dict(self._decoder.decode(self._block, raw=True)).get(b":path")
                self._block = b""
                if path is not None:
                    self._calls.append(path.decode().rsplit("/", 1)[-1])


class CuttableFront:
    def __init__(self, target: str) -> None:
        self._host, port = target.rsplit(":", 1)
        self._target_port = int(port)
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self.port = 0
        # Connections taken so far, and the gRPC methods called through them, in order.
        self.connections = 0
        self.calls: list[str] = []
        self._flowing = asyncio.Event()
        self._flowing.set()

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
            await asyncio.gather(
                pipe(reader, upstream_writer, _CallReader(self.calls), self._flowing),
                pipe(upstream_reader, writer, flowing=self._flowing),
            )
        finally:
            self._open -= {writer, upstream_writer}

    async def restore(self) -> None:
        """Listen (again) on the front's port; the first call picks a free one."""
        self._server = await asyncio.start_server(self._forward, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def freeze(self) -> None:
        """Pass nothing either way, connections kept open: a partition, not a refusal."""
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    async def cut(self) -> None:
        """Close the port and drop every connection through it, as a dead server would."""
        assert self._server is not None
        self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        # What a freeze held goes nowhere now; its pipes see their connections closed.
        self._flowing.set()
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

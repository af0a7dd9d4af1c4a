"""A TLS front for the dev server, which speaks only plaintext: to a client it looks like a
Temporal Cloud endpoint (a server certificate from a private CA, and a client certificate
demanded when `client_ca` is given). Certificates come from trustme."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable

import trustme

SERVER_NAME = "temporal.test"


async def pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    seen: Callable[[bytes], None] | None = None,
    flowing: asyncio.Event | None = None,
) -> None:
    """Copy one direction of a connection until it closes (the cuttable front's too),
    showing each piece to `seen` first, and holding it while `flowing` is clear."""
    try:
        while data := await reader.read(65536):
            if seen is not None:
                seen(data)
            if flowing is not None:
                await flowing.wait()
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def tls_front(
    target: str, server_ca: trustme.CA, client_ca: trustme.CA | None = None
) -> AsyncIterator[str]:
    """Listen with TLS on a free local port and pass each connection on to `target`."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ca.issue_cert(SERVER_NAME).configure_cert(context)
    # gRPC runs over HTTP/2, which TLS clients ask for by ALPN.
    context.set_alpn_protocols(["h2"])
    if client_ca is not None:
        client_ca.configure_trust(context)
        context.verify_mode = ssl.CERT_REQUIRED
    host, port = target.rsplit(":", 1)

    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    server = await asyncio.start_server(forward, "127.0.0.1", 0, ssl=context)
    async with server:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"

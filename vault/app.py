"""The vault's aiohttp application, and `serve` to run it in-process."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from billing.redact import redact
from vault import admin, metrics, proxy
from vault.errors import VaultError
from vault.openapi import openapi_document
from vault.settings import VaultSettings
from vault.state import lifecycle, longest_request

logger = logging.getLogger("vault")

VERSION = "0.1.0"
# Finishing in-flight requests on shutdown takes at most their longest time plus a little.
_SHUTDOWN_MARGIN_SECONDS = 5.0


class _MalformedRequests(logging.Filter):
    """aiohttp's parser quotes a header line it rejects, whole, in the error its server logs:
    an Authorization line with a stray control byte would put the admin or worker token,
    which no pattern can tell from other text, in the log. Such a record keeps the peer and
    the kind of error only."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else None
            record.msg = "refused a malformed request from %s (%s, HTTP %s): not logged"
            record.args = (peer, type(error).__name__, error.code)
            record.exc_info = record.exc_text = None
        return True


_MALFORMED_REQUESTS = _MalformedRequests()


@web.middleware
async def _errors(request: web.Request, handler: admin.Handler) -> web.StreamResponse:
    """Every error in one JSON shape, aiohttp's own (404, 405) included."""
    try:
        return await handler(request)
    except VaultError as error:
        return error.response()
    except web.HTTPException as error:
        if error.status < 400:
            raise
        allow = {"Allow": error.headers["Allow"]} if "Allow" in error.headers else None
        return VaultError(error.status, None, error.reason).response(allow)
    except Exception:
        logger.exception("admin request failed: %s %s", request.method, redact(request.path))
        return VaultError(500, "vault_error", "internal error", error_type="api_error").response()


def create_app(settings: VaultSettings) -> web.Application:
    # For whatever runs the app; aiohttp's server logger is shared by the process, the filter
    # added once however many apps.
    logging.getLogger("aiohttp.server").addFilter(_MALFORMED_REQUESTS)
    app = web.Application(middlewares=[_errors])
    app.cleanup_ctx.append(lifecycle(settings))
    admin.add_routes(app.router)
    document = openapi_document(admin.OPERATIONS, VERSION, settings.max_cap_cents)

    async def openapi(request: web.Request) -> web.Response:
        return web.json_response(document)

    app.router.add_get("/vault/openapi.json", openapi)
    app.router.add_route("*", "/stripe/{tail:.*}", proxy.handle)
    app.router.add_get("/metrics", metrics.handle)
    return app


@dataclass(frozen=True)
class RunningVault:
    url: str


def shutdown_seconds(settings: VaultSettings) -> float:
    """How long a stopping vault lets its in-flight requests finish."""
    return longest_request(settings).total_seconds() + _SHUTDOWN_MARGIN_SECONDS


@asynccontextmanager
async def serve(
    settings: VaultSettings, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[RunningVault]:
    """Run the vault on host:port (0: any free port) until the block exits, then stop
    accepting, finish in-flight requests and close the database pool."""
    runner = web.AppRunner(
        create_app(settings),
        # The audit table is the per-request record; an access log would only add cost.
        access_log=None,
        shutdown_timeout=shutdown_seconds(settings),
        # aiohttp's server starts this clock when a connection opens and again after each
        # answer, and closes the connection if a request's headers have not all arrived when
        # it runs out, however slowly they trickle in: the only bound on reading headers that
        # its server has (it has none on the number of connections).
        keepalive_timeout=settings.header_timeout_seconds,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound_port = runner.addresses[0][1]
        shown_host = f"[{host}]" if ":" in host else host
        yield RunningVault(url=f"http://{shown_host}:{bound_port}")
    finally:
        await runner.cleanup()

"""The aiohttp application: /v1 routes through the emulator's pipeline, plus inspection."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from .config import EmulatorConfig
from .emulator import EMULATOR, Emulator
from .errors import JSON, StripeError
from .inspection import routes as inspection_routes
from .resources import charges, customers, payment_intents, payment_methods, refunds
from .routing import Call, Route

ROUTES = [
    *customers.ROUTES,
    *payment_methods.ROUTES,
    *payment_intents.ROUTES,
    *charges.ROUTES,
    *refunds.ROUTES,
]


def _unknown_url(call: Call) -> JSON:
    raise StripeError(
        404, f"Unrecognized request URL ({call.url}). Please see https://stripe.com/docs."
    )


_UNKNOWN = Route("*", "/v1/{tail:.*}", _unknown_url)


def _endpoint(
    emulator: Emulator, route: Route
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def endpoint(request: web.Request) -> web.StreamResponse:
        return await emulator.handle(request, route)

    return endpoint


def create_app(config: EmulatorConfig | None = None) -> web.Application:
    emulator = Emulator(config or EmulatorConfig())
    app = web.Application()
    app[EMULATOR] = emulator
    app.router.add_routes(inspection_routes)
    # Registration order matters: /v1/payment_intents/search before /v1/payment_intents/{id}.
    for route in [*ROUTES, _UNKNOWN]:
        app.router.add_route(route.method, route.path, _endpoint(emulator, route))
    return app

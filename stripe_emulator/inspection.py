"""``/_emulator/*``: health, fault configuration, ledger, request log, settling bank debits,
reset. No auth."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from .emulator import EMULATOR
from .payments import settle_debit

routes = web.RouteTableDef()


def _bad_request(message: str) -> web.Response:
    return web.json_response(
        {"error": {"type": "invalid_request_error", "message": message}}, status=400
    )


async def _changes(request: web.Request) -> dict[str, Any] | web.Response:
    """The JSON object in the body ({} when empty), or a 400 response."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        changes = json.loads(raw)
    except ValueError as error:
        return _bad_request(f"Body is not JSON: {error}")
    if not isinstance(changes, dict):
        return _bad_request("Body must be a JSON object.")
    return changes


@routes.get("/_emulator/health")
async def _health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


@routes.get("/_emulator/faults")
async def _get_faults(request: web.Request) -> web.Response:
    return web.json_response(request.app[EMULATOR].config.model_dump())


@routes.post("/_emulator/faults")
async def _set_faults(request: web.Request) -> web.Response:
    changes = await _changes(request)
    if isinstance(changes, web.Response):
        return changes
    try:
        config = request.app[EMULATOR].configure(changes)
    except ValidationError as error:
        return _bad_request(str(error))
    return web.json_response(config.model_dump())


@routes.post("/_emulator/reset")
async def _reset(request: web.Request) -> web.Response:
    changes = await _changes(request)
    if isinstance(changes, web.Response):
        return changes
    try:
        config = request.app[EMULATOR].reset(changes)
    except ValidationError as error:
        return _bad_request(str(error))
    return web.json_response({"ok": True, "config": config.model_dump()})


@routes.get("/_emulator/ledger")
async def _ledger(request: web.Request) -> web.Response:
    emulator = request.app[EMULATOR]
    return web.json_response(
        {
            "charges": [charge.to_ledger() for charge in emulator.store.charges.order],
            "faults_injected": emulator.faults.counts,
        }
    )


@routes.get("/_emulator/requests")
async def _requests(request: web.Request) -> web.Response:
    return web.json_response({"requests": list(request.app[EMULATOR].request_log)})


@routes.post("/_emulator/settle_debits")
async def _settle_debits(request: web.Request) -> web.Response:
    """The banks answer pending debits: `{"charge": "ch_..."}` settles that one, `{}` all.
    Each succeeds, or fails if its account returns debits (`pm_sepaDebit_fails`)."""
    changes = await _changes(request)
    if isinstance(changes, web.Response):
        return changes
    unknown = set(changes) - {"charge"}
    if unknown:
        return _bad_request(f"Unknown field(s): {', '.join(sorted(unknown))}; only charge.")
    store = request.app[EMULATOR].store
    charge_id = changes.get("charge")
    if charge_id is None:
        pending = [charge for charge in store.charges.order if charge.pending]
    else:
        charge = store.charges.by_id.get(charge_id) if isinstance(charge_id, str) else None
        if charge is None or not charge.pending:
            return _bad_request(f"No pending bank debit has the id {charge_id!r}.")
        pending = [charge]
    for charge in pending:
        settle_debit(store, charge)
    return web.json_response({"settled": [charge.to_ledger() for charge in pending]})

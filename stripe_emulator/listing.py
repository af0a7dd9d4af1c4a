"""Stripe's list objects: newest first, ``limit``, ``starting_after``/``ending_before`` cursors."""

from __future__ import annotations

from .errors import JSON
from .routing import Call
from .store import R, Table
from .validation import limit, string


def list_object(call: Call, table: Table[R], records: list[R]) -> JSON:
    params = call.params
    items, has_more = table.page(
        records, limit(params), string(params, "starting_after"), string(params, "ending_before")
    )
    return {
        "object": "list",
        "data": [record.to_api() for record in items],
        "has_more": has_more,
        "url": call.url,
    }

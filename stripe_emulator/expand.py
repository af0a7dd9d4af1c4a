"""``expand[]``: replace id fields of a response by the objects they name."""

from __future__ import annotations

from .errors import JSON, invalid
from .forms import Params
from .store import Store

# Paths are checked against these names before the request executes, so a typo is a 400 that
# changes nothing; a known name absent from the returned object is then skipped, never an error
# raised after a charge was committed.
_FIELDS = frozenset(
    {
        "charge",
        "customer",
        "data",
        "default_payment_method",
        "invoice_settings",
        "latest_charge",
        "payment_intent",
        "payment_method",
    }
)
_MAX_DEPTH = 4  # Stripe's limit


def expand_paths(params: Params) -> list[list[str]]:
    value = params.get("expand")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(path, str) for path in value):
        raise invalid("Invalid array", param="expand")
    paths = []
    for path in value:
        segments = path.split(".")
        if len(segments) > _MAX_DEPTH or not _FIELDS.issuperset(segments):
            raise invalid(f"This property cannot be expanded ({path}).", param="expand")
        paths.append(segments)
    return paths


def expand(body: JSON, paths: list[list[str]], store: Store) -> None:
    for segments in paths:
        _expand(body, segments, store)


def _expand(node: JSON, segments: list[str], store: Store) -> None:
    head, rest = segments[0], segments[1:]
    value = node.get(head)
    if head == "data" and isinstance(value, list):
        for item in value:
            if rest:
                _expand(item, rest, store)
        return
    if isinstance(value, str):
        found = store.find(value)
        if found is None:
            return
        value = node[head] = found.to_api()
    if rest and isinstance(value, dict):
        _expand(value, rest, store)

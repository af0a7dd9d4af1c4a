"""Stripe's form encoding: ``metadata[k]=v``, ``expand[]=x`` / ``expand[0]=x``, nested hashes."""

from __future__ import annotations

import itertools
import re
from typing import Any
from urllib.parse import parse_qsl

from .errors import invalid

Params = dict[str, Any]

_BRACKETS = re.compile(r"\[([^\[\]]*)\]")
_KEY = re.compile(r"([^\[\]]+)((?:\[[^\[\]]*\])*)")

# Hashes whose keys are the caller's own strings: "0", "1" there are keys, not array indices.
_FREE_FORM = frozenset({"metadata"})


def decode(encoded: str) -> Params:
    """Decode a query string or form body into nested dicts and lists of strings."""
    root: Params = {}
    for key, value in parse_qsl(encoded, keep_blank_values=True):
        match = _KEY.fullmatch(key)
        if match is None or not match.group(2):
            _assign(root, key, value, key)
            continue
        path = [match.group(1), *_BRACKETS.findall(match.group(2))]
        node: Params | list[Any] = root
        for segment, child in itertools.pairwise(path):
            nxt = node.get(segment) if isinstance(node, dict) else None
            if nxt is None:
                nxt = [] if child == "" else {}
                _assign(node, segment, nxt, key)
            elif not isinstance(nxt, list | dict):
                raise invalid(f"Invalid hash: {key} mixes a value and a hash.", param=path[0])
            node = nxt
        _assign(node, path[-1], value, key)
    return {k: _listify(k, v) for k, v in root.items()}


def _assign(node: Params | list[Any], segment: str, value: Any, key: str) -> None:
    if isinstance(node, list):
        if segment != "":
            raise invalid(f"Invalid array: {key}.", param=key.partition("[")[0])
        node.append(value)
    elif segment == "" or isinstance(node.get(segment), list | dict):
        raise invalid(f"Invalid hash: {key}.", param=key.partition("[")[0])
    else:
        node[segment] = value


def _listify(name: str, value: Any) -> Any:
    """Turn ``{"0": a, "1": b}`` (the SDK's indexed arrays) into ``[a, b]``."""
    if not isinstance(value, dict) or name in _FREE_FORM:
        return value
    converted = {k: _listify(k, v) for k, v in value.items()}
    if converted and all(k.isdigit() for k in converted):
        return [converted[k] for k in sorted(converted, key=int)]
    return converted

"""What a resource handler receives and how routes are declared."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .errors import JSON
from .forms import Params
from .store import Store


@dataclass(slots=True)
class Call:
    store: Store
    params: Params
    path: Mapping[str, str]
    url: str
    idempotency_key: str | None


# Handlers are synchronous on purpose: each runs to completion without yielding to the event
# loop, so concurrent requests never see half-applied state and no locks are needed.
Handler = Callable[[Call], JSON]


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    handler: Handler
    # Money-moving endpoints: the only ones fault injection applies to.
    moves_money: bool = False

"""Stripe's idempotency keys: saved responses replayed per (API key, key), mismatches refused."""

from __future__ import annotations

import hashlib
import json
from collections import deque
from dataclasses import dataclass

from .errors import StripeError
from .forms import Params

MAX_KEY_LENGTH = 255

Scope = tuple[str, str]  # (API key, Idempotency-Key)


@dataclass(frozen=True, slots=True)
class Saved:
    status: int
    body: bytes
    request_id: str
    headers: dict[str, str]


@dataclass(slots=True)
class _Entry:
    endpoint: str
    fingerprint: bytes
    saved: Saved | None = None  # None while the first request is executing
    saved_at: float = 0.0


@dataclass(slots=True)
class Pending:
    """The first request of a key, executing: it ends with ``save`` or ``release``. Holding the
    store itself keeps this right if the emulator is reset meanwhile."""

    store: IdempotencyStore
    scope: Scope
    entry: _Entry

    def save(self, saved: Saved, now: float) -> None:
        self.entry.saved = saved
        self.entry.saved_at = now
        self.store._expiry.append((self.scope, self.entry))

    def release(self) -> None:
        """Forget a request that ended without a saved result (validation error, fault);
        a no-op after ``save``."""
        if self.entry.saved is None and self.store._entries.get(self.scope) is self.entry:
            del self.store._entries[self.scope]


def fingerprint(params: Params) -> bytes:
    canonical = json.dumps(params, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).digest()


def _mismatch(message: str) -> StripeError:
    return StripeError(
        400,
        f"{message} Try using a key other than the one you used if you meant to execute a "
        "different request.",
        error_type="idempotency_error",
    )


class IdempotencyStore:
    def __init__(self) -> None:
        self._entries: dict[Scope, _Entry] = {}
        # Saved entries in the order they were saved, for expiring them in O(1) amortised.
        self._expiry: deque[tuple[Scope, _Entry]] = deque()

    def begin(
        self, scope: Scope, endpoint: str, params: Params, now: float, ttl: float
    ) -> Saved | Pending:
        """The saved response to replay, or a ``Pending`` marking ``scope`` as executing.
        A response is replayed for ``ttl`` seconds after it was saved: the TTL in force now,
        so shortening it forgets the keys saved longer ago at once.

        Raises 400 for another endpoint or other parameters, 409 while the first is executing.
        """
        forgotten = now - ttl
        self._expire(forgotten)
        entry = self._entries.get(scope)
        digest = fingerprint(params)
        if entry is None:
            entry = self._entries[scope] = _Entry(endpoint, digest)
            return Pending(self, scope, entry)
        if entry.endpoint != endpoint:
            raise _mismatch(
                "Keys for idempotent requests can only be used for the same endpoint they were "
                f"first used for ('{entry.endpoint}' vs '{endpoint}')."
            )
        if entry.fingerprint != digest:
            raise _mismatch(
                "Keys for idempotent requests can only be used with the same parameters they "
                "were first used with."
            )
        if entry.saved is None:
            # Stripe types this one invalid_request_error; 409 makes stripe-python raise APIError.
            raise StripeError(
                409,
                "There is currently another in-progress request using this Stripe "
                f"Idempotency-Key '{scope[1]}'. Please try again later.",
                code="idempotency_key_in_use",
            )
        return entry.saved

    def _expire(self, forgotten: float) -> None:
        """Drop the entries saved at or before ``forgotten``, oldest first."""
        expiry = self._expiry
        while expiry and expiry[0][1].saved_at <= forgotten:
            scope, entry = expiry.popleft()
            if self._entries.get(scope) is entry:
                del self._entries[scope]

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
    expires_at: float = 0.0


def fingerprint(params: Params) -> bytes:
    canonical = json.dumps(params, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).digest()


def _error(status: int, message: str, code: str | None = None) -> StripeError:
    return StripeError(status, message, error_type="idempotency_error", code=code)


class IdempotencyStore:
    def __init__(self) -> None:
        self._entries: dict[Scope, _Entry] = {}
        # Saved entries in the order they were saved, for expiring them in O(1) amortised.
        self._expiry: deque[tuple[Scope, _Entry]] = deque()

    def begin(self, scope: Scope, endpoint: str, params: Params, now: float) -> Saved | None:
        """The saved response to replay, or None after marking ``scope`` as executing.

        Raises 400 for another endpoint or other parameters, 409 while the first is executing.
        """
        self._expire(now)
        entry = self._entries.get(scope)
        digest = fingerprint(params)
        if entry is None or (entry.saved is not None and entry.expires_at <= now):
            self._entries[scope] = _Entry(endpoint, digest)
            return None
        key = scope[1]
        if entry.endpoint != endpoint:
            raise _error(
                400,
                "Keys for idempotent requests can only be used for the same endpoint they were "
                f"first used for ('{entry.endpoint}' vs '{endpoint}'). Try using a key other "
                f"than '{key}' if you meant to execute a different request.",
            )
        if entry.fingerprint != digest:
            raise _error(
                400,
                "Keys for idempotent requests can only be used with the same parameters they "
                f"were first used with. Try using a key other than '{key}' if you meant to "
                "execute a different request.",
            )
        if entry.saved is None:
            # Stripe types this one invalid_request_error; 409 makes stripe-python raise APIError.
            raise StripeError(
                409,
                "There is currently another in-progress request using this Stripe "
                f"Idempotency-Key '{key}'. Please try again later.",
                code="idempotency_key_in_use",
            )
        return entry.saved

    def save(self, scope: Scope, saved: Saved, now: float, ttl: float) -> None:
        entry = self._entries[scope]
        entry.saved = saved
        entry.expires_at = now + ttl
        self._expiry.append((scope, entry))

    def release(self, scope: Scope) -> None:
        """Forget a request that ended without a saved result (validation error, fault)."""
        entry = self._entries.get(scope)
        if entry is not None and entry.saved is None:
            del self._entries[scope]

    def _expire(self, now: float) -> None:
        # Only the oldest saved entries are checked here; an entry saved under a longer TTL can
        # shield later ones, which ``begin`` then treats as expired on lookup.
        expiry = self._expiry
        while expiry and expiry[0][1].expires_at <= now:
            scope, entry = expiry.popleft()
            if self._entries.get(scope) is entry:
                del self._entries[scope]

"""A token bucket of ``rps`` requests per second per key: an API key, or an API key and an
endpoint."""

from __future__ import annotations


class RateLimiter:
    def __init__(self, rps: float | None) -> None:
        self.rps = rps
        # Up to one second's worth of requests may arrive in a burst.
        self._capacity = max(rps or 0.0, 1.0)
        self._buckets: dict[str, tuple[float, float]] = {}

    def allow(self, key: str, now: float) -> bool:
        if self.rps is None:
            return True
        tokens, last = self._buckets.get(key, (self._capacity, now))
        tokens = min(self._capacity, tokens + (now - last) * self.rps)
        allowed = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
        return allowed

"""A token bucket of ``rate_limit_rps`` requests per second per API key."""

from __future__ import annotations


class RateLimiter:
    def __init__(self, rps: float | None) -> None:
        self.rps = rps
        # Up to one second's worth of requests may arrive in a burst.
        self._capacity = max(rps or 0.0, 1.0)
        self._buckets: dict[str, tuple[float, float]] = {}

    def allow(self, api_key: str, now: float) -> bool:
        if self.rps is None:
            return True
        tokens, last = self._buckets.get(api_key, (self._capacity, now))
        tokens = min(self._capacity, tokens + (now - last) * self.rps)
        allowed = tokens >= 1.0
        self._buckets[api_key] = (tokens - 1.0 if allowed else tokens, now)
        return allowed

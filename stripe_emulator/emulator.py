"""The emulator's state and the pipeline every /v1 request goes through.

Pipeline: auth -> decode params -> rate limit (or a drawn 429) -> idempotency (replay, 400
mismatch, 409 in flight) -> latency -> fault before commit -> execute (or a saved fault in its
place) -> faults after commit -> save -> answer.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import random
import time
from collections import deque
from typing import Any

from aiohttp import web

from . import forms
from .config import EmulatorConfig
from .errors import JSON, StripeError, api_error, invalid
from .expand import expand, expand_paths
from .faults import (
    DROP_AFTER_COMMIT,
    ERROR_AFTER_COMMIT,
    ERROR_BEFORE_COMMIT,
    ERROR_SAVED_BEFORE_COMMIT,
    RATE_LIMITED,
    Faults,
)
from .idempotency import MAX_KEY_LENGTH, IdempotencyStore, Pending, Saved
from .ratelimit import RateLimiter
from .routing import Call, Route
from .store import Store

REQUEST_LOG_SIZE = 200_000
_log = logging.getLogger(__name__)
_TEST_KEY_PREFIX = "sk_test_"
_INJECTED = "An unknown error occurred (injected by the Stripe emulator)."
_request_ids = random.Random()


class Emulator:
    """All state of one emulator; reset swaps in fresh state and keeps the configuration."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self._clear()

    def _clear(self) -> None:
        self.store = Store()
        self.idempotency = IdempotencyStore()
        self.limiter = RateLimiter(self.config.rate_limit_rps)
        self.endpoint_limiter = RateLimiter(self.config.endpoint_rate_limit_rps)
        self.faults = Faults(self.config.seed)
        self.request_log: deque[JSON] = deque(maxlen=REQUEST_LOG_SIZE)

    def configure(self, changes: dict[str, Any]) -> EmulatorConfig:
        """Apply a partial update (raises pydantic's ValidationError for bad values)."""
        config = self.config.updated(changes)
        if "seed" in changes:
            self.faults.reseed(config.seed)
        if config.rate_limit_rps != self.config.rate_limit_rps:
            self.limiter = RateLimiter(config.rate_limit_rps)
        if config.endpoint_rate_limit_rps != self.config.endpoint_rate_limit_rps:
            self.endpoint_limiter = RateLimiter(config.endpoint_rate_limit_rps)
        self.config = config
        return config

    def reset(self, changes: dict[str, Any]) -> EmulatorConfig:
        self.config = self.config.updated(changes)
        self._clear()
        return self.config

    async def handle(self, request: web.Request, route: Route) -> web.StreamResponse:
        request_id = f"req_{_request_ids.getrandbits(56):014x}"
        log: JSON = {
            "method": request.method,
            "path": request.path,
            "api_key_suffix": None,
            "idempotency_key": request.headers.get("Idempotency-Key") or None,
            "params": None,
            "status": None,
            "replayed": False,
            "fault": None,
        }
        self.request_log.append(log)
        try:
            response = await self._handle(request, route, log, request_id)
        except StripeError as error:
            response = _respond(error.status, _dumps(error.body()), request_id, error.headers)
        if log["fault"] != DROP_AFTER_COMMIT:
            log["status"] = response.status
        return response

    async def _handle(
        self, request: web.Request, route: Route, log: JSON, request_id: str
    ) -> web.StreamResponse:
        api_key = _api_key(request.headers.get("Authorization"))
        log["api_key_suffix"] = api_key[-4:]
        is_post = request.method == "POST"
        encoded = (
            (await request.read()).decode(errors="replace")
            if is_post
            else request.rel_url.raw_query_string
        )
        # Decoded before the rate limit, so the request log shows what a refused request sent.
        params = log["params"] = forms.decode(encoded)
        now = time.monotonic()
        endpoint = f"{api_key} {route.method} {route.path}"
        # Stripe counts a call against its endpoint's limit and its account's.
        if not (self.endpoint_limiter.allow(endpoint, now) and self.limiter.allow(api_key, now)):
            self.faults.counts[RATE_LIMITED] += 1
            raise _rate_limited()
        # A 429 drawn, however fast requests come: a slow machine may never pass the rate.
        if self.faults.draw(RATE_LIMITED, self.config.rate_limited):
            raise _rate_limited()
        paths = expand_paths(params)
        key: str | None = log["idempotency_key"]
        call = Call(self.store, params, request.match_info, request.path, key if is_post else None)
        # Stripe ignores Idempotency-Key on GET: reads are idempotent anyway.
        if not is_post or key is None:
            return await self._execute(request, route, call, paths, None, log, request_id)
        if len(key) > MAX_KEY_LENGTH:
            raise invalid(
                f"Keys for idempotent requests can only be a maximum of {MAX_KEY_LENGTH} "
                "characters long.",
                param="Idempotency-Key",
            )
        begun = self.idempotency.begin(
            (api_key, key), f"POST {request.path}", params, now, self.config.idempotency_ttl_seconds
        )
        if isinstance(begun, Saved):
            log["replayed"] = True
            return _respond(
                begun.status,
                begun.body,
                request_id,
                {
                    **begun.headers,
                    "Idempotent-Replayed": "true",
                    "Original-Request": begun.request_id,
                    "Idempotency-Key": key,
                },
            )
        try:
            return await self._execute(request, route, call, paths, begun, log, request_id)
        finally:
            # No-op once a result was saved; otherwise a retry with this key executes afresh.
            begun.release()

    async def _execute(
        self,
        request: web.Request,
        route: Route,
        call: Call,
        paths: list[list[str]],
        pending: Pending | None,
        log: JSON,
        request_id: str,
    ) -> web.StreamResponse:
        config = self.config
        if config.latency_ms:
            await asyncio.sleep(config.latency_ms / 1000)
        faults = self.faults if route.moves_money else None
        if faults and faults.draw(ERROR_BEFORE_COMMIT, config.error_before_commit):
            log["fault"] = ERROR_BEFORE_COMMIT
            raise _fault_error(_INJECTED, should_retry=True)
        dropped = False
        if faults and faults.draw(ERROR_SAVED_BEFORE_COMMIT, config.error_saved_before_commit):
            # Stripe saves the result of every request that began executing, a 500 included,
            # whether or not the charge was made before it failed: here it was not.
            log["fault"] = ERROR_SAVED_BEFORE_COMMIT
            status, body, headers = _saved_fault()
        else:
            status, body, headers = _executed(route, call, paths)
            dropped = faults is not None and faults.draw(
                DROP_AFTER_COMMIT, config.drop_after_commit
            )
            if (
                faults
                and not dropped
                and faults.draw(ERROR_AFTER_COMMIT, config.error_after_commit)
            ):
                log["fault"] = ERROR_AFTER_COMMIT
                status, body, headers = _saved_fault()
        payload = _dumps(body)
        if pending is not None:
            pending.save(Saved(status, payload, request_id, headers), time.monotonic())
        if dropped:
            log["fault"] = DROP_AFTER_COMMIT
            # Close without answering: the client sees a connection error, never a response.
            request.protocol.force_close()
        if call.idempotency_key is not None:
            headers = {**headers, "Idempotency-Key": call.idempotency_key}
        return _respond(status, payload, request_id, headers)


def _executed(route: Route, call: Call, paths: list[list[str]]) -> tuple[int, JSON, dict[str, str]]:
    try:
        body = route.handler(call)
        expand(body, paths, call.store)
    except StripeError as error:
        # Only a 402 happens after execution began (the declined charge is stored); any other
        # error refused the request before it changed anything, so it is not saved.
        if error.status != 402:
            raise
        return 402, error.body(), {}
    except Exception:
        # A fault of the emulator's own, perhaps after a charge was stored: Stripe saves the 500
        # of a request that began executing, so a retry with the key replays it, never charges.
        _log.exception("the emulator failed executing %s", call.url)
        return _saved_fault("An unknown error occurred.")
    return 200, body, {}


def _saved_fault(message: str = _INJECTED) -> tuple[int, JSON, dict[str, str]]:
    fault = _fault_error(message, should_retry=False)
    return fault.status, fault.body(), fault.headers


def _dumps(body: JSON) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _respond(status: int, payload: bytes, request_id: str, headers: dict[str, str]) -> web.Response:
    return web.Response(
        body=payload,
        status=status,
        headers={"Content-Type": "application/json", "Request-Id": request_id, **headers},
    )


def _api_key(authorization: str | None) -> str:
    """The secret key from Bearer auth (what the SDK sends) or Basic auth (``curl -u key:``)."""
    if not authorization:
        raise _unauthorized(
            "You did not provide an API key. You need to provide your API key in the "
            "Authorization header, using Bearer auth (e.g. 'Authorization: Bearer "
            "YOUR_SECRET_KEY')."
        )
    scheme, _, credentials = authorization.partition(" ")
    key = credentials.strip()
    if scheme.lower() == "basic":
        try:
            key = base64.b64decode(key, validate=True).decode().partition(":")[0]
        except (binascii.Error, UnicodeDecodeError):
            key = ""
    elif scheme.lower() != "bearer":
        key = ""
    if not key.startswith(_TEST_KEY_PREFIX) or len(key) == len(_TEST_KEY_PREFIX):
        # Never echo the key: only its last four characters, like Stripe's masked form.
        shown = f" ending in {key[-4:]}" if len(key) >= 12 else ""
        raise _unauthorized(f"Invalid API Key provided{shown}. Use a test key (sk_test_...).")
    return key


def _unauthorized(message: str) -> StripeError:
    error = StripeError(401, message)
    error.headers["WWW-Authenticate"] = 'Bearer realm="Stripe"'
    return error


def _rate_limited() -> StripeError:
    error = StripeError(
        429,
        "Request rate limit exceeded. You can learn more about rate limits here "
        "https://stripe.com/docs/rate-limits.",
        code="rate_limit",
    )
    error.headers["Stripe-Should-Retry"] = "true"
    return error


def _fault_error(message: str, *, should_retry: bool) -> StripeError:
    error = api_error(message)
    # Stripe asks not to retry a 500 it saved for the key: a retry would only replay it.
    error.headers["Stripe-Should-Retry"] = "true" if should_retry else "false"
    return error


EMULATOR = web.AppKey("emulator", Emulator)

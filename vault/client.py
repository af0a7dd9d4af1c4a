"""Async client of the vault's admin API, for the workers and operators' tools.

async with VaultAdmin(url, token) as vault:
    issued = await vault.issue_key(IssueKeyRequest(...))
    issued.secret.get_secret_value()  # "vk_..."; shown once, masked in repr and JSON
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Literal, TypeVar
from urllib.parse import quote

import aiohttp
from pydantic import BaseModel, SecretStr, ValidationError

from vault.models import (
    AuditEntry,
    AuditPage,
    ErrorResponse,
    Fence,
    FenceRequest,
    IssuedKey,
    IssueKeyRequest,
    KeyInfo,
    KeyList,
    ReservationInfo,
    ReservationList,
    ResolveRequest,
    Status,
)

M = TypeVar("M", bound=BaseModel)


class VaultAdminError(Exception):
    """The vault refused or failed an admin call; `code` and the message are the vault's."""

    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(f"vault admin API {status} {code or ''}: {message}".replace("  ", " "))
        self.status = status
        self.code = code
        self.message = message


class VaultAuthError(VaultAdminError):
    """401: the token is missing or wrong."""


class VaultForbidden(VaultAdminError):
    """403: the worker token may not do this (an admin-only call, a key past its budget)."""


class VaultInvalidRequest(VaultAdminError):
    """400/422: a field failed validation; the message names it."""


class VaultNotFound(VaultAdminError):
    """404: no such key or reservation."""


class VaultConflict(VaultAdminError):
    """409: the reservation's state does not allow the resolution."""


class VaultUnavailable(VaultAdminError):
    """5xx, a connection error or a timeout: the call may be retried."""


_ERRORS: dict[int, type[VaultAdminError]] = {
    400: VaultInvalidRequest,
    401: VaultAuthError,
    403: VaultForbidden,
    404: VaultNotFound,
    409: VaultConflict,
    422: VaultInvalidRequest,
}


class VaultAdmin:
    """With the admin token, or the worker token for what workers need (vault/budget.py)."""

    def __init__(self, base_url: str, token: str | SecretStr, *, timeout: float = 10.0):
        self._base = base_url.rstrip("/") + "/vault"
        self._token = token if isinstance(token, SecretStr) else SecretStr(token)
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"VaultAdmin({self._base!r})"

    async def __aenter__(self) -> VaultAdmin:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def issue_key(self, request: IssueKeyRequest) -> IssuedKey:
        return await self._call(
            "POST", "/keys", IssuedKey, body=request.model_dump(mode="json", exclude_none=True)
        )

    async def ready(self) -> None:
        """Raises VaultAdminError unless the vault answers and its database is ready."""
        await self._call("GET", "/ready", Status)

    async def find_keys(
        self, *, period: str | None = None, label: str | None = None
    ) -> list[KeyInfo]:
        """Every key of the period and label, newest first, revoked and expired included."""
        query = {name: value for name, value in (("period", period), ("label", label)) if value}
        keys: list[KeyInfo] = []
        before: str | None = None
        while True:
            page = await self._call(
                "GET", "/keys", KeyList, query=query | ({"before": before} if before else {})
            )
            keys += page.keys
            if page.next_before is None:
                return keys
            before = page.next_before

    async def get_key(self, key_id: str) -> KeyInfo:
        return await self._call("GET", f"/keys/{_segment(key_id)}", KeyInfo)

    async def revoke(self, key_id: str) -> KeyInfo:
        return await self._call("POST", f"/keys/{_segment(key_id)}/revoke", KeyInfo)

    async def audit(
        self, key_id: str, limit: int = 100, before: int | None = None
    ) -> list[AuditEntry]:
        """Newest first; pass the last entry's id as `before` for the next page."""
        query = {"limit": str(limit)} | ({"before": str(before)} if before is not None else {})
        page = await self._call("GET", f"/keys/{_segment(key_id)}/audit", AuditPage, query=query)
        return page.entries

    async def unknown_reservations(
        self, key_id: str, page_size: int = 1000
    ) -> list[ReservationInfo]:
        """Every reservation whose outcome the vault does not know, oldest first, read a page
        at a time: reconcile them with Stripe."""
        found: list[ReservationInfo] = []
        after: int | None = None
        while True:
            query = {"state": "unknown", "limit": str(page_size)}
            page = await self._call(
                "GET",
                f"/keys/{_segment(key_id)}/reservations",
                ReservationList,
                query=query | ({"after": str(after)} if after is not None else {}),
            )
            found += page.reservations
            if page.next_after is None:
                return found
            after = page.next_after

    async def resolve(
        self,
        key_id: str,
        idempotency_key: str,
        outcome: Literal["succeeded", "failed"],
        amount_cents: int | None = None,
        *,
        attempt: int | None = None,
        min_idle_seconds: int | None = None,
    ) -> ReservationInfo:
        fields: dict[str, object] = {"outcome": outcome}
        if amount_cents is not None:
            fields["amount_cents"] = amount_cents
        if attempt is not None:
            fields["attempt"] = attempt
        if min_idle_seconds is not None:
            fields["min_idle_seconds"] = min_idle_seconds
        body = ResolveRequest.model_validate(fields)
        return await self._call(
            "POST",
            f"/keys/{_segment(key_id)}/reservations/{_segment(idempotency_key)}/resolve",
            ReservationInfo,
            body=body.model_dump(mode="json", exclude_none=True),
        )

    async def fence(self, key_id: str, idempotency_key: str, below: int) -> Fence:
        """Refuse the idempotency key's requests through the key with a fencing token below
        `below`, or none; returns the fence standing (never lowered)."""
        return await self._call(
            "POST",
            f"/keys/{_segment(key_id)}/fences/{_segment(idempotency_key)}",
            Fence,
            body=FenceRequest(below=below).model_dump(mode="json"),
        )

    async def _call(
        self,
        method: str,
        path: str,
        response_model: type[M],
        *,
        body: dict[str, Any] | None = None,
        query: dict[str, str] | None = None,
    ) -> M:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        headers = {"Authorization": f"Bearer {self._token.get_secret_value()}"}
        try:
            async with self._session.request(
                method, self._base + path, json=body, params=query, headers=headers
            ) as response:
                payload = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as error:
            raise VaultUnavailable(0, None, f"{type(error).__name__}: {error}") from None
        if status >= 400:
            raise _error(status, payload)
        try:
            return response_model.model_validate_json(payload)
        except ValidationError as error:
            # Field names only: the input may be an issued key with its secret.
            fields = ", ".join(".".join(map(str, e["loc"])) or "the body" for e in error.errors())
            raise VaultUnavailable(status, None, f"unexpected response; bad: {fields}") from None


def _segment(value: str) -> str:
    return quote(value, safe="")


def _error(status: int, payload: bytes) -> VaultAdminError:
    try:
        detail = ErrorResponse.model_validate_json(payload).error
        code, message = detail.code, detail.message
    except ValidationError:
        code, message = None, payload[:200].decode(errors="replace")
    kind = _ERRORS.get(status, VaultUnavailable if status >= 500 else VaultAdminError)
    return kind(status, code, message)

"""The admin API under /vault: issue, find, inspect and revoke keys; audit; reservations.

OPERATIONS is the single list the routes are registered from and the OpenAPI document is
generated from, so the two cannot drift apart.
"""

from __future__ import annotations

import hmac
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

import asyncpg
from aiohttp import web
from pydantic import BaseModel, ValidationError

from billing.redact import SECRET_RE, redact
from vault import budget, metrics, reservations, store
from vault.bodies import read_body
from vault.errors import VaultError, invalid_input
from vault.models import (
    IDEMPOTENCY_KEY_PATTERN,
    KEY_ID_PATTERN,
    MAX_CAP_CONTEXT,
    REVEAL_SECRET_CONTEXT,
    SECRET_PREFIX,
    AdminAction,
    AuditPage,
    AuditQuery,
    Fence,
    FenceRequest,
    FindKeysQuery,
    IssuedKey,
    IssueKeyRequest,
    KeyInfo,
    KeyList,
    ReservationInfo,
    ReservationList,
    ReservationsQuery,
    ResolveRequest,
    Role,
    Status,
    new_key_id,
)
from vault.state import STATE

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
M = TypeVar("M", bound=BaseModel)
# Who may call an operation: anyone; the admin token only; either token.
Access = Literal["public", "admin", "worker"]
# aiohttp types a key by a runtime type, which a Literal has not.
ROLE: web.RequestKey[Role] = web.RequestKey("vault_role", str)  # type: ignore[arg-type]

_KEY_ID_RE = re.compile(KEY_ID_PATTERN)
_IDEMPOTENCY_KEY_RE = re.compile(IDEMPOTENCY_KEY_PATTERN)


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    operation_id: str
    summary: str
    handler: Handler
    response: type[BaseModel]
    status: int = 200
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    access: Access = "admin"
    # Statuses beyond those implied by the operation's inputs (401, 404, 400/422).
    other_errors: tuple[int, ...] = ()


def _reply(model: BaseModel, status: int = 200, *, reveal_secret: bool = False) -> web.Response:
    return web.Response(
        status=status,
        body=model.model_dump_json(context={REVEAL_SECRET_CONTEXT: reveal_secret}),
        content_type="application/json",
    )


async def _body(request: web.Request, model: type[M], **context: object) -> M:
    try:
        return model.model_validate_json(await read_body(request), context=context)
    except ValidationError as error:
        raise invalid_input(error, "request body") from None


def _query(request: web.Request, model: type[M]) -> M:
    query = request.query
    repeated = [name for name in query if len(query.getall(name)) > 1]
    if repeated:
        raise VaultError(
            422, "parameter_repeated", f"{repeated[0]} is given more than once", param=repeated[0]
        )
    try:
        return model.model_validate(dict(query))
    except ValidationError as error:
        raise invalid_input(error, "query") from None


def _key_id(request: web.Request) -> str:
    key_id = request.match_info["key_id"]
    if _KEY_ID_RE.fullmatch(key_id) is None:
        raise _no_key(key_id)
    return key_id


def _no_key(key_id: str) -> VaultError:
    shown = key_id if _KEY_ID_RE.fullmatch(key_id) else "(malformed id)"
    return VaultError(404, "resource_missing", f"no vault key {shown}", param="key_id")


def _role(request: web.Request) -> Role | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    presented = store.secret_digest(token.strip() if scheme.lower() == "bearer" else "")
    state = request.app[STATE]
    # Compared in constant time, so response timing reveals nothing about either token.
    is_admin = hmac.compare_digest(presented, state.admin_token_digest)
    worker = state.worker_token_digest
    is_worker = worker is not None and hmac.compare_digest(presented, worker)
    return "admin" if is_admin else "worker" if is_worker else None


def _authorized(access: Access, handler: Handler) -> Handler:
    if access == "public":
        return handler

    async def checked(request: web.Request) -> web.StreamResponse:
        role = _role(request)
        if role is None:
            metrics.REFUSALS.labels(code="admin_token_invalid").inc()
            raise VaultError(
                401,
                # The code from before the worker token, for clients that match on it.
                "admin_token_invalid",
                "send the admin or worker token as 'Authorization: Bearer <token>'",
                error_type="authentication_error",
            )
        if role == "worker" and access == "admin":
            metrics.REFUSALS.labels(code="admin_token_required").inc()
            raise VaultError(
                403,
                "admin_token_required",
                f"{request.method} {request.path} needs the admin token: the worker token"
                " issues keys within its budget, reads keys and reservations, resolves them and"
                " revokes its own keys",
                error_type="permission_error",
            )
        request[ROLE] = role
        return await handler(request)

    return checked


def _worker_policy(request: web.Request) -> budget.WorkerPolicy | None:
    """The policy the call is held to: the worker budget for the worker token, else none."""
    return request.app[STATE].worker_policy if request[ROLE] == "worker" else None


def _refused(error: budget.WorkerKeyRefused) -> VaultError:
    return VaultError(403, "worker_key_refused", str(error), error_type="permission_error")


async def _audit(
    conn: asyncpg.Connection,
    request: web.Request,
    key_id: str,
    action: AdminAction,
    started: float,
    *,
    currency: str,
    reservation: ReservationInfo | None = None,
    idempotency_key: str | None = None,
) -> None:
    """Record a change made through the admin API in the key's audit, with the token that
    made it, in the change's own transaction."""
    actor: Role = request[ROLE]
    record = store.AuditRecord(
        method=request.method,
        # Whatever a path held by mistake, the audit keeps no key.
        path=redact(request.path),
        vault_key_id=key_id,
        currency=currency,
        decision=action,
        latency_ms=(time.monotonic() - started) * 1000,
        actor=actor,
        idempotency_key=idempotency_key,
    )
    if reservation is not None:
        record.idempotency_key = reservation.idempotency_key
        # What it committed, or for a release, the room it freed.
        record.amount_cents = (
            reservation.committed_cents
            if reservation.state == "committed"
            else reservation.amount_cents
        )
        record.customer = reservation.customer
        record.reservation_state = reservation.state
    await store.insert_audit(conn, record)


async def issue_key(request: web.Request) -> web.Response:
    started = time.monotonic()
    state = request.app[STATE]
    issue = await _body(request, IssueKeyRequest, **{MAX_CAP_CONTEXT: state.settings.max_cap_cents})
    key_id = issue.key_id or new_key_id()
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    by = request[ROLE]
    policy = _worker_policy(request)
    async with state.pool.acquire() as conn, conn.transaction():
        if policy is not None:
            try:
                issue = await budget.admit(conn, issue, policy)
            except budget.WorkerKeyRefused as error:
                raise _refused(error) from None
        try:
            info = await store.insert_key(conn, key_id, secret, issue, by)
        except asyncpg.UniqueViolationError as error:
            if error.constraint_name != "vault_keys_pkey":
                raise
            raise VaultError(
                409,
                "key_id_taken",
                f"a key with id {key_id} exists: its secret was shown only to the request"
                " that issued it. Choose another id; revoke that key if its answer was lost",
            ) from None
        await _audit(conn, request, key_id, "issued", started, currency=info.currency)
    return _reply(IssuedKey(**info.model_dump(), secret=secret), status=201, reveal_secret=True)


async def find_keys(request: web.Request) -> web.Response:
    query = _query(request, FindKeysQuery)
    async with request.app[STATE].pool.acquire() as conn:
        found = await store.find_keys(conn, query)
    return _reply(found)


async def get_key(request: web.Request) -> web.Response:
    key_id = _key_id(request)
    async with request.app[STATE].pool.acquire() as conn:
        info = await store.get_key(conn, key_id)
    if info is None:
        raise _no_key(key_id)
    return _reply(info)


async def revoke_key(request: web.Request) -> web.Response:
    started = time.monotonic()
    key_id = _key_id(request)
    async with request.app[STATE].pool.acquire() as conn, conn.transaction():
        # Workers revoke the keys they issued that no run stores any more (billing.period_keys:
        # a failed opening's, one replaced): a kill switch moves no money, and a key the worker
        # revoked counts only what it took; one the admin revoked, its whole cap (vault.budget).
        _own_keys_only(request, key_id, await _require_key(conn, key_id), "revoke it")
        info = await store.revoke_key(conn, key_id, request[ROLE])
        if info is None:
            raise _no_key(key_id)
        await _audit(conn, request, key_id, "revoked", started, currency=info.currency)
    return _reply(info)


async def audit(request: web.Request) -> web.Response:
    key_id = _key_id(request)
    query = _query(request, AuditQuery)
    async with request.app[STATE].pool.acquire() as conn:
        await _require_key(conn, key_id)
        entries = await store.audit_page(conn, key_id, query.limit, query.before)
    next_before = entries[-1].id if len(entries) == query.limit else None
    return _reply(AuditPage(entries=entries, next_before=next_before))


async def list_reservations(request: web.Request) -> web.Response:
    key_id = _key_id(request)
    query = _query(request, ReservationsQuery)
    state = request.app[STATE]
    async with state.pool.acquire() as conn:
        await _require_key(conn, key_id)
        await reservations.mark_stale_unknown(conn, key_id, state.stale_after)
        page = await store.list_reservations(conn, key_id, query.state, query.limit, query.after)
    return _reply(page)


async def resolve(request: web.Request) -> web.Response:
    started = time.monotonic()
    key_id = _key_id(request)
    idempotency_key = request.match_info["idempotency_key"]
    _refuse_secret(idempotency_key)
    resolution = await _body(request, ResolveRequest)
    state = request.app[STATE]
    async with state.pool.acquire() as conn, conn.transaction():
        # Only its own keys' releases are counted against the worker budget.
        _own_keys_only(request, key_id, await _require_key(conn, key_id), "settle its reservations")
        if _IDEMPOTENCY_KEY_RE.fullmatch(idempotency_key) is None:
            raise VaultError(404, "resource_missing", "no reservation for a malformed key")
        try:
            info: ReservationInfo = await reservations.resolve(
                conn,
                key_id,
                idempotency_key,
                resolution.root.outcome,
                resolution.amount_cents,
                resolution.root.attempt,
                resolution.min_idle,
                state.stale_after,
                _worker_policy(request),
            )
        except reservations.NotFound as error:
            raise VaultError(404, "resource_missing", str(error)) from None
        except reservations.Conflict as error:
            raise VaultError(409, "reservation_conflict", str(error)) from None
        except budget.WorkerKeyRefused as error:
            raise _refused(error) from None
        except ValueError as error:
            raise VaultError(422, "parameter_invalid", str(error), param="amount_cents") from None
        await _audit(
            conn, request, key_id, "resolved", started, currency=info.currency, reservation=info
        )
    return _reply(info)


async def fence(request: web.Request) -> web.Response:
    started = time.monotonic()
    key_id = _key_id(request)
    idempotency_key = request.match_info["idempotency_key"]
    body = await _body(request, FenceRequest)
    if _IDEMPOTENCY_KEY_RE.fullmatch(idempotency_key) is None:
        raise VaultError(
            422, "parameter_invalid", "the idempotency key is malformed", param="idempotency_key"
        )
    _refuse_secret(idempotency_key)
    async with request.app[STATE].pool.acquire() as conn, conn.transaction():
        # A fence only refuses requests: the worker token may fence its own keys.
        _own_keys_only(request, key_id, await _require_key(conn, key_id), "fence it")
        standing = await store.raise_fence(conn, key_id, idempotency_key, body.below)
        info = await store.get_key(conn, key_id)
        assert info is not None  # required above, in this transaction
        await _audit(
            conn,
            request,
            key_id,
            "fenced",
            started,
            currency=info.currency,
            idempotency_key=idempotency_key,
        )
    return _reply(Fence(idempotency_key=idempotency_key, fenced_below=standing))


def _refuse_secret(idempotency_key: str) -> None:
    """A path's idempotency key is stored and audited as given: a key pasted there by mistake
    would be kept for good."""
    if SECRET_RE.search(idempotency_key):
        raise VaultError(
            422,
            "secret_in_parameter",
            "the idempotency key looks like a secret key; never send a key there",
            param="idempotency_key",
        )


def _own_keys_only(request: web.Request, key_id: str, issued_by: str, what: str) -> None:
    if issued_by != "worker" and request[ROLE] == "worker":
        raise VaultError(
            403,
            "admin_token_required",
            f"{key_id} was issued with the admin token: {what} with it",
            error_type="permission_error",
        )


async def _require_key(conn: asyncpg.Connection, key_id: str) -> str:
    """Who issued the key: "admin" or "worker"."""
    issued_by: str | None = await conn.fetchval(
        "SELECT issued_by FROM vault_keys WHERE id = $1", key_id
    )
    if issued_by is None:
        raise _no_key(key_id)
    return issued_by


async def health(request: web.Request) -> web.Response:
    return _reply(Status(status="ok"))


async def ready(request: web.Request) -> web.Response:
    try:
        async with request.app[STATE].pool.acquire(timeout=2) as conn:
            # Reachable and migrated: the vault's own table answers.
            await conn.fetchval("SELECT 1 FROM vault_keys LIMIT 1", timeout=2)
    except store.DATABASE_ERRORS as error:
        raise VaultError(
            503,
            "database_unavailable",
            f"the database is not ready: {type(error).__name__}",
            error_type="api_error",
        ) from None
    return _reply(Status(status="ready"))


_KEY = "/vault/keys/{key_id}"

OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "POST",
        "/vault/keys",
        "issueKey",
        "Issue a key; its secret is in this response only",
        issue_key,
        IssuedKey,
        status=201,
        body=IssueKeyRequest,
        access="worker",
        other_errors=(403, 409),
    ),
    Operation(
        "GET",
        "/vault/keys",
        "findKeys",
        "Find keys by period and label, newest first",
        find_keys,
        KeyList,
        query=FindKeysQuery,
        access="worker",
    ),
    Operation(
        "GET",
        _KEY,
        "getKey",
        "A key's caps, usage, expiry and state",
        get_key,
        KeyInfo,
        access="worker",
    ),
    Operation(
        "POST",
        _KEY + "/revoke",
        "revokeKey",
        "Revoke a key: its next request is refused (the worker token: its own keys only)",
        revoke_key,
        KeyInfo,
        access="worker",
        other_errors=(403,),
    ),
    Operation(
        "GET",
        _KEY + "/audit",
        "keyAudit",
        "The key's proxied requests, newest first",
        audit,
        AuditPage,
        query=AuditQuery,
    ),
    Operation(
        "GET",
        _KEY + "/reservations",
        "keyReservations",
        "The key's reservations, oldest first",
        list_reservations,
        ReservationList,
        query=ReservationsQuery,
        access="worker",
    ),
    Operation(
        "POST",
        _KEY + "/reservations/{idempotency_key}/resolve",
        "resolveReservation",
        "Settle a reservation left unknown with what Stripe's records show",
        resolve,
        ReservationInfo,
        body=ResolveRequest,
        access="worker",
        other_errors=(403, 409),
    ),
    Operation(
        "POST",
        _KEY + "/fences/{idempotency_key}",
        "fenceRequest",
        "Refuse the idempotency key's earlier attempts through the key: those whose fencing"
        " token is below the one given, or that carry none (the worker token: its own keys)",
        fence,
        Fence,
        body=FenceRequest,
        access="worker",
        other_errors=(403,),
    ),
    Operation(
        "GET",
        "/vault/health",
        "health",
        "Liveness",
        health,
        Status,
        access="public",
    ),
    Operation(
        "GET",
        "/vault/ready",
        "ready",
        "Readiness: the database answers",
        ready,
        Status,
        access="public",
        other_errors=(503,),
    ),
)


def add_routes(router: web.UrlDispatcher) -> None:
    for operation in OPERATIONS:
        router.add_route(
            operation.method, operation.path, _authorized(operation.access, operation.handler)
        )

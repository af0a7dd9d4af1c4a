"""`/stripe/v1/...`: authenticate the vault key, check the allowlist, reserve, forward, settle,
and write one audit row, whatever happened; a request with no known key is counted instead
(vault/unauthenticated.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar
from urllib.parse import parse_qs, parse_qsl, unquote_plus

import aiohttp
import asyncpg
from aiohttp import web
from yarl import URL

from billing.db import CONNECTION_ERRORS
from billing.redact import SECRET_RE, redact
from vault import cancels, metrics, reservations, store
from vault.bodies import read_body
from vault.endpoints import (
    CANCEL,
    FENCE_HEADER,
    HELD_UP,
    METERED,
    PATH_RE,
    UPSTREAM_UNREACHABLE,
    allows,
)
from vault.errors import Refusal, VaultError
from vault.models import (
    IDEMPOTENCY_KEY_PATTERN,
    SECRET_PREFIX,
    Decision,
    ReservationState,
    never_issuable,
)
from vault.reservations import Charge, Outcome, Reservation
from vault.send_deadline import HeldUpError, SendBy, Stamp, sending
from vault.state import STATE, VaultState
from vault.store import AuditRecord, KeyGrant
from vault.unauthenticated import KeyUncheckable, Unauthenticated, peer_of

logger = logging.getLogger("vault.proxy")
T = TypeVar("T")
# What a database outage can hold up after Stripe has answered.
LateWrite = Literal["settle", "audit"]

FORM = "application/x-www-form-urlencoded"
_FORWARDED_HEADERS = ("Content-Type", "Idempotency-Key", "Stripe-Version")
# What the Stripe SDK reads from a response, besides the body.
_RETURNED_HEADERS = (
    "Content-Type",
    "Request-Id",
    "Idempotent-Replayed",
    "Stripe-Should-Retry",
    "Stripe-Version",
    "Retry-After",
)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
# Percent-decodings of a value looked through for a key: none sends one encoded more often.
_DECODING_ROUNDS = 8
_IDEMPOTENCY_KEY_RE = re.compile(IDEMPOTENCY_KEY_PATTERN)
# Stripe's ceiling on `amount` is eight digits; a sign, decimals or exponent are refused.
_AMOUNT_RE = re.compile(r"[0-9]{1,8}")
_CURRENCY_RE = re.compile(r"[a-z]{3}")
# A form's parameter name as Stripe's SDKs write it: `amount`, `metadata[key]`, `expand[]`.
_PARAMETER_NAME_RE = re.compile(r"[a-z][a-z0-9_]*(\[[^\[\]]*\])*")
_CUSTOMER_RE = re.compile(r"[A-Za-z0-9_]{1,255}")
# What a request that moves money may say: what the workers send (activities/stripe_gateway.py
# charge_params) and how the charge reads on a statement or receipt. Anything else could send
# the money elsewhere within the cap (transfer_data[destination], on_behalf_of,
# application_fee_amount, destination on a Connect platform), or change what a charge is.
_CHARGE_PARAMETERS = frozenset(
    {
        "amount",
        "currency",
        "customer",
        "description",
        "confirm",
        "off_session",
        "payment_method",
        "source",
        "statement_descriptor",
        "statement_descriptor_suffix",
        "receipt_email",
    }
)
# Parameters of nested values: any key of metadata, only these of the others.
_CHARGE_NESTED = re.compile(
    r"metadata\[[^\[\]]*\]|automatic_payment_methods\[(enabled|allow_redirects)\]"
)
_FENCING_TOKEN_RE = re.compile(r"[1-9][0-9]{0,8}")


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    body: bytes
    headers: dict[str, str]


async def handle(request: web.Request) -> web.Response:
    state = request.app[STATE]
    started = time.perf_counter()
    # The raw path: percent-encoding is refused below rather than decoded.
    path = request.rel_url.raw_path.removeprefix("/stripe")
    record = AuditRecord(method=_clean(request.method, 16), path=_audited_path(request, path))
    audited = True
    try:
        response = await _proxy(state, request, path, record)
    except Unauthenticated as refusal:
        # No key to audit it under: counted per peer, one row a window, whatever the flood.
        state.unauthenticated.count(peer_of(request.remote))
        record.refusal_code = refusal.code
        response = refusal.response()
        audited = False
    except Refusal as refusal:
        if refusal.decision is not None:
            record.decision = refusal.decision
        record.refusal_code = refusal.code
        response = refusal.response()
    except Exception:
        logger.exception("vault failed on %s %s", record.method, record.path)
        response = VaultError(
            500,
            "vault_error",
            "the vault failed while handling this request; retry with the same Idempotency-Key",
            error_type="api_error",
            should_retry=True,
        ).response()
    record.latency_ms = (time.perf_counter() - started) * 1000
    metrics.observe(record)
    if not audited:
        return response
    # The answer goes back even if the row cannot be written yet: for a charge it says what
    # happened to the money.
    await _record(
        state,
        lambda conn: store.insert_audit(conn, record),
        "audit",
        f"write the audit row of {record.method} {record.path}",
    )
    return response


async def _proxy(
    state: VaultState, request: web.Request, path: str, record: AuditRecord
) -> web.Response:
    grant = await _authenticate(state, request, record)
    if PATH_RE.fullmatch(path) is None:
        raise Refusal(
            "refused_request",
            404,
            "url_invalid",
            "Unrecognized request URL: the vault forwards /v1/... paths of letters, digits,"
            " '_' and '-' only",
        )
    _refuse_secret("path", path)
    # Nothing forwarded may carry a key: the query string (decoded, so a percent-encoded key
    # is found too), the forwarded headers and, once read, the body.
    _refuse_secret("query string", request.rel_url.query_string)
    for name in _FORWARDED_HEADERS:
        _refuse_secret(name, request.headers.get(name, ""))
    endpoint = f"{request.method} {path}"
    if not allows(grant.allowed_endpoints, request.method, path):
        raise Refusal(
            "refused_endpoint",
            403,
            "endpoint_not_allowed",
            f"this vault key may not call {endpoint}",
        )
    idempotency_key = request.headers.get("Idempotency-Key")
    if idempotency_key is not None:
        record.idempotency_key = _clean(idempotency_key, 255)
        if _IDEMPOTENCY_KEY_RE.fullmatch(idempotency_key) is None:
            raise Refusal(
                "refused_request",
                400,
                "idempotency_key_invalid",
                "Idempotency-Key must be 1-255 letters, digits, '_', '.', ':' or '-'",
            )
    try:
        body = await read_body(request)
    except web.HTTPRequestEntityTooLarge:
        raise Refusal("refused_request", 413, "body_too_large", "the body is too large") from None
    text = body.decode("utf-8", "replace")
    _refuse_secret("the body", text)
    if body and request.method == "GET":
        raise Refusal(
            "refused_request",
            400,
            "body_not_allowed",
            "a GET sends its parameters in the URL, not in a body",
        )
    _check_parameters("the query string", request.rel_url.raw_query_string)
    _check_parameters("the body", text)
    if allows([CANCEL], request.method, path):
        await cancels.check(state, grant, path.split("/")[3], record)

    reservation = None
    send_by = None
    confirms = True
    if endpoint in METERED:
        reservation, send_by, confirms = await _reserve_charge(
            state, request, grant, endpoint, body, record
        )
    # Replayed or executed: only Stripe's answer says which (below), even for a reservation
    # committed already, since a commit by resolve may stand for a charge Stripe never made.
    record.decision = "forwarded"

    try:
        answer = await _forward(state, request, path, body, send_by)
    except HeldUpError as held:
        assert reservation is not None
        raise await _held_up(state, reservation, held.held_up, record) from None
    except Exception as failure:
        if _never_connected(request, failure):
            raise await _not_connected(
                state, reservation, record, endpoint, grant.id, failure
            ) from None
        # The request may or may not have gone out, whatever failed: settled unknown, not left
        # pending, or the retry would be refused as in flight and the cap would hold it.
        if reservation is not None and reservation.owned:
            record.reservation_state = await _settle(state, reservation, "unknown", None)
        if not isinstance(failure, aiohttp.ClientError | TimeoutError):
            raise  # the vault's own failure (a header aiohttp refuses, a bug): a 500 (handle)
        timed_out = isinstance(failure, TimeoutError)
        logger.warning(
            "upstream gave no answer to %s (key %s): %s", endpoint, grant.id, type(failure).__name__
        )
        raise Refusal(
            None,
            504 if timed_out else 502,
            "upstream_timeout" if timed_out else "upstream_unavailable",
            "Stripe did not answer, so "
            + (
                "the charge may or may not have been made"
                if endpoint in METERED
                else "the request may or may not have taken effect"
            )
            + "; retry with the same Idempotency-Key",
            error_type="api_error",
            should_retry=True,
        ) from None
    record.upstream_status = answer.status
    replayed = _replayed(answer)
    record.decision = "replayed" if replayed else "forwarded"
    if (
        reservation is not None
        and reservation.state == "committed"
        and not replayed
        and (200 <= answer.status < 300 or answer.status == 402)
    ):
        # Its commit (a resolve, say) came before Stripe had made the charge, which this
        # request made: counted once already, it is not counted again, but who resolved it
        # as charged should know it was not then.
        logger.warning(
            "Stripe executed %s (status %d) with Idempotency-Key %s of key %s afresh, though its"
            " reservation was committed already (resolved before Stripe had charged?)",
            endpoint,
            answer.status,
            record.idempotency_key,
            grant.id,
        )
    if reservation is not None and reservation.owned:
        outcome = _outcome(answer, in_doubt=reservation.in_doubt, confirms=confirms)
        record.reservation_state = await _settle(state, reservation, outcome, answer.status)
    body = _without_client_secrets(answer.body)
    if state.upstream_secret in body:
        body = body.replace(state.upstream_secret, b"[redacted]")
    return web.Response(status=answer.status, body=body, headers=answer.headers)


async def _reserve_charge(
    state: VaultState,
    request: web.Request,
    grant: KeyGrant,
    endpoint: str,
    body: bytes,
    record: AuditRecord,
) -> tuple[Reservation, SendBy, bool]:
    """The charge's reservation, when it must be sent by, and whether it asks Stripe to
    confirm what it creates."""
    charge, confirms = _charge(request, endpoint, body, record)
    idempotency_key = request.headers.get("Idempotency-Key")
    if idempotency_key is None:
        raise Refusal(
            "refused_request",
            400,
            "idempotency_key_required",
            "a request that moves money needs an Idempotency-Key header, the same on every"
            " retry of the same charge",
        )
    if charge.currency != grant.currency:
        raise Refusal(
            "refused_request",
            400,
            "currency_mismatch",
            f"this vault key charges {grant.currency} only, not {charge.currency}",
            param="currency",
        )
    reservation, send_by = await _reserve(
        state, grant.id, idempotency_key, charge, _fencing_token(request)
    )
    record.reservation_state = reservation.state
    return reservation, send_by, confirms


async def _held_up(
    state: VaultState, reservation: Reservation, held_up: float, record: AuditRecord
) -> Refusal:
    """A charge not sent within `send_within` of its reservation (the vault's process frozen,
    a paused container, a suspended machine) is not sent at all. Its reservation may have
    been found stale and released meanwhile, and a retry may have charged with the key: sent
    once Stripe has forgotten the key, a day on, it would charge again."""
    await _settle_unsent(state, reservation, record)
    return Refusal(
        "refused_request",
        503,
        HELD_UP,
        f"the vault was held up {held_up:.1f} s between reserving this charge and sending it,"
        f" past the {state.send_within.total_seconds():.0f} s it may take, so it did not send"
        " it; retry with the same Idempotency-Key",
        error_type="api_error",
        should_retry=True,
    )


def _never_connected(request: web.Request, failure: Exception) -> bool:
    """Whether the forward failed connecting, before a byte of the request was written. Only
    for a POST: aiohttp tries an idempotent method again on a new connection when a reused
    one was dropped, so a failed connect may follow a request sent."""
    connecting = isinstance(failure, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)
    return connecting and request.method == "POST"


async def _not_connected(
    state: VaultState,
    reservation: Reservation | None,
    record: AuditRecord,
    endpoint: str,
    key_id: str,
    failure: Exception,
) -> Refusal:
    """No connection to Stripe was made (refused, not resolved, timed out): nothing was sent."""
    logger.warning(
        "could not connect to Stripe for %s (key %s): %s", endpoint, key_id, type(failure).__name__
    )
    await _settle_unsent(state, reservation, record)
    return Refusal(
        "refused_request",
        503,
        UPSTREAM_UNREACHABLE,
        "the vault could not connect to Stripe, so it sent nothing; retry with the same"
        " Idempotency-Key",
        error_type="api_error",
        should_retry=True,
    )


async def _settle_unsent(
    state: VaultState, reservation: Reservation | None, record: AuditRecord
) -> None:
    """Nothing of this attempt reached Stripe: its room is freed, but a reservation it took
    over from an attempt that may have stays in doubt."""
    if reservation is not None and reservation.owned:
        outcome: Outcome = "unknown" if reservation.in_doubt else "failed"
        record.reservation_state = await _settle(state, reservation, outcome, None)


def _fencing_token(request: web.Request) -> int | None:
    token = request.headers.get(FENCE_HEADER)
    if token is None:
        return None
    if _FENCING_TOKEN_RE.fullmatch(token) is None:
        raise Refusal(
            "refused_request",
            400,
            "fencing_token_invalid",
            f"{FENCE_HEADER} must be a whole number from 1 to 999999999",
        )
    return int(token)


async def _authenticate(state: VaultState, request: web.Request, record: AuditRecord) -> KeyGrant:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token.startswith(SECRET_PREFIX):
        raise Unauthenticated("send a vault key as 'Authorization: Bearer vk_...'")
    try:
        async with state.pool.acquire() as conn:
            grant = await store.key_for_secret(conn, token)
    except (*CONNECTION_ERRORS, asyncpg.TooManyConnectionsError):
        raise KeyUncheckable() from None
    if grant is None:
        raise Unauthenticated("unknown vault key")
    record.vault_key_id = grant.id
    forged = never_issuable(
        cap_cents=grant.cap_cents,
        daily_cap_cents=grant.daily_cap_cents,
        allowed_endpoints=grant.allowed_endpoints,
        issued_by=grant.issued_by,
        max_cap_cents=state.settings.max_cap_cents,
    )
    if forged is not None:
        # Written past the admin API (by a role that can write vault_keys), or issued under a
        # higher VAULT_MAX_CAP_CENTS than now: either way not a key to forward for.
        logger.error("refused vault key %s, which this vault would not issue: %s", grant.id, forged)
        raise Refusal(
            "refused_auth",
            403,
            "vault_key_not_issuable",
            f"this vault key is refused: {forged}, so the vault's admin API did not issue it as"
            " it stands; revoke it, and check who can write the vault's tables",
            error_type="permission_error",
        )
    if grant.revoked:
        raise Refusal("refused_auth", 401, "vault_key_revoked", "this vault key has been revoked")
    if grant.expired:
        raise Refusal("refused_auth", 401, "vault_key_expired", "this vault key has expired")
    return grant


def _charge(
    request: web.Request, endpoint: str, body: bytes, record: AuditRecord
) -> tuple[Charge, bool]:
    """Amount, currency and customer of a metered request, read exactly as Stripe reads them;
    anything ambiguous (a repeated field, a query string, another encoding) is refused. And
    whether it asks Stripe to confirm what it creates (anything but an absent or false
    `confirm`)."""
    if request.content_type != FORM:
        raise Refusal(
            "refused_request", 400, "content_type_invalid", f"send the parameters as {FORM}"
        )
    if request.rel_url.raw_query_string:
        raise Refusal(
            "refused_request",
            400,
            "parameters_in_query",
            "send the parameters of a request that moves money in its body, not in the URL",
        )
    try:
        fields = parse_qs(
            body.decode(), keep_blank_values=True, errors="strict", max_num_fields=1000
        )
    except UnicodeDecodeError:
        raise Refusal(
            "refused_request", 400, "body_invalid", "the body is not a UTF-8 form"
        ) from None
    except ValueError:  # parse_qs past max_num_fields
        raise Refusal(
            "refused_request", 400, "body_invalid", "the body has more than 1000 fields"
        ) from None
    others = sorted(
        name
        for name in fields
        if name not in _CHARGE_PARAMETERS and _CHARGE_NESTED.fullmatch(name) is None
    )
    if others:
        # Names only: they passed _check_parameters, so they are plain parameter names.
        raise Refusal(
            "refused_request",
            400,
            "parameter_not_allowed",
            f"a request that moves money may not send {', '.join(others[:5])}: the vault"
            f" forwards {', '.join(sorted(_CHARGE_PARAMETERS))}, metadata[...] and"
            " automatic_payment_methods[enabled|allow_redirects] only",
            param=others[0],
        )
    amount = _single(fields, "amount")
    currency = _single(fields, "currency")
    customer = _single(fields, "customer")
    valid_amount = amount is not None and _AMOUNT_RE.fullmatch(amount) is not None
    record.amount_cents = int(amount) if amount is not None and valid_amount else None
    record.currency = None if currency is None else _clean(currency, 16)
    record.customer = None if customer is None else _clean(customer, 255)
    if amount is None or currency is None:
        missing = "amount" if amount is None else "currency"
        raise Refusal(
            "refused_request",
            400,
            "parameter_missing",
            f"Missing required param: {missing}.",
            param=missing,
        )
    if not valid_amount or int(amount) == 0:
        raise Refusal(
            "refused_request",
            400,
            "parameter_invalid_integer",
            "amount must be a positive whole number of cents, at most 99999999",
            param="amount",
        )
    currency = currency.lower()
    if _CURRENCY_RE.fullmatch(currency) is None:
        raise Refusal(
            "refused_request",
            400,
            "parameter_invalid",
            "currency must be a three-letter ISO code",
            param="currency",
        )
    if customer is not None and _CUSTOMER_RE.fullmatch(customer) is None:
        raise Refusal(
            "refused_request", 400, "parameter_invalid", "customer is not an id", param="customer"
        )
    confirms = fields.get("confirm", ["false"]) != ["false"]
    return Charge(endpoint, int(amount), currency, customer), confirms


def _refuse_secret(name: str, value: str) -> None:
    """Values the vault stores or forwards must never hold a key, even one sent by mistake,
    or percent-encoded once or more."""
    if SECRET_RE.search(value) or SECRET_RE.search(_decoded(value)):
        raise Refusal(
            "refused_request",
            400,
            "secret_in_parameter",
            f"{name} contains what looks like a secret key; never send a key there",
            param=name,
        )


def _check_parameters(where: str, raw: str) -> None:
    """Parameter names Stripe's SDKs send, read one way only, and no `expand`.

    The vault reads a charge's amount with Python's parser; a parser that splits on ';' or
    trims a space after '&' (as some web frameworks do) would read ``& amount=999`` or
    ``;amount=999`` as a second amount, past the cap the vault reserved for. So a name must
    be a lowercase word with ``[key]`` groups after it, and ';' must be encoded.

    Stripe's `expand` puts other objects inside the one asked for (a charge's customer and
    card): it would let a key read what its allowlist refuses. The workers never expand."""
    if ";" in raw:
        raise Refusal(
            "refused_request",
            400,
            "parameter_name_invalid",
            f"{where} holds a ';': encode it as %3B, as Stripe's SDKs do",
        )
    for position, (name, _) in enumerate(
        parse_qsl(raw, keep_blank_values=True, errors="replace"), start=1
    ):
        if _PARAMETER_NAME_RE.fullmatch(name) is None:
            # Its name is not echoed: it is the caller's text, and may hold anything.
            raise Refusal(
                "refused_request",
                400,
                "parameter_name_invalid",
                f"{where}'s parameter {position} has a name Stripe's SDKs never send: a"
                " lowercase word (letters, digits, '_'), then any [key] groups",
            )
        if name == "expand" or name.startswith("expand["):
            raise Refusal(
                "refused_request",
                400,
                "parameter_not_allowed",
                f"{where} asks Stripe to expand objects into the answer, which a vault key may"
                " not: read each object through an endpoint the key allows",
                param="expand",
            )


def _single(fields: dict[str, list[str]], name: str) -> str | None:
    values = fields.get(name)
    if values is None:
        return None
    if len(values) > 1:
        raise Refusal(
            "refused_request",
            400,
            "parameter_repeated",
            f"{name} is given more than once",
            param=name,
        )
    return values[0]


async def _reserve(
    state: VaultState,
    key_id: str,
    idempotency_key: str,
    charge: Charge,
    fencing_token: int | None,
) -> tuple[Reservation, SendBy]:
    try:
        async with state.pool.acquire() as conn:
            # Before the reservation's own clock starts (its updated_at), after any wait for a
            # connection, which would only shorten the time left to send.
            send_by = SendBy(Stamp.now(), state.send_within.total_seconds())
            reservation = await reservations.reserve(
                conn, key_id, idempotency_key, charge, state.stale_after, fencing_token
            )
            return reservation, send_by
    except reservations.CapExceeded as refused:
        decision: Decision = "refused_daily_cap" if refused.daily else "refused_cap"
        raise Refusal(
            decision, 402, "spend_cap_exceeded", str(refused), fenced_below=refused.fenced_below
        ) from None
    except reservations.KeyUnusable as refused:
        code = "vault_key_revoked" if refused.revoked else "vault_key_expired"
        raise Refusal("refused_auth", 401, code, str(refused)) from None
    except reservations.InFlight as refused:
        raise Refusal(
            "refused_in_flight", 409, "idempotency_key_in_use", str(refused), should_retry=True
        ) from None
    except reservations.ReplayExpired as refused:
        # One in doubt is retried once reconciliation releases it; a charged one never.
        raise Refusal(
            "refused_request",
            409,
            "idempotency_key_expired",
            str(refused),
            should_retry=not refused.committed,
        ) from None
    except reservations.Superseded as refused:
        # The same request again gets the same answer: only a new token may be sent.
        raise Refusal(
            "refused_request",
            409,
            "attempt_superseded",
            str(refused),
            fenced_below=refused.fenced_below,
        ) from None
    except reservations.Mismatch as refused:
        raise Refusal(
            "refused_request",
            400,
            "idempotency_key_reused",
            str(refused),
            error_type="idempotency_error",
        ) from None


async def _forward(
    state: VaultState, request: web.Request, path: str, body: bytes, send_by: SendBy | None
) -> _Answer:
    headers = {"Authorization": state.upstream_authorization}
    for name in _FORWARDED_HEADERS:
        value = request.headers.get(name)
        if value is not None:
            headers[name] = value
    query = request.rel_url.raw_query_string
    url = URL(
        state.settings.upstream_stripe_base + path + (f"?{query}" if query else ""), encoded=True
    )
    with sending(send_by):
        async with state.upstream.request(
            request.method, url, data=body or None, headers=headers, allow_redirects=False
        ) as response:
            payload = await response.read()
            returned = {
                name: response.headers[name]
                for name in _RETURNED_HEADERS
                if name in response.headers
            }
            return _Answer(response.status, payload, returned)


def _outcome(answer: _Answer, *, in_doubt: bool, confirms: bool) -> Outcome:
    """What an upstream answer says about the money of this reservation, whose request asked
    Stripe to confirm what it created if `confirms`."""
    if 200 <= answer.status < 300:
        if _replayed(answer) and _status_of(answer) in _UNSETTLED:
            # Saved up to a day ago, while the bank had yet to answer the debit: it may have
            # returned it since. Reconciliation looks up where it stands.
            return "unknown"
        if not confirms and _status_of(answer) in _NOT_CHARGED:
            # Created, not asked to confirm: no money moved, and none can through the vault
            # (no key may confirm it, and a replay of its key answers the same), so its room
            # is freed rather than spent for good. One asked to confirm that Stripe left so
            # may yet be rolled forward (activities/stripe_gateway.py): it stays spent.
            return "failed"
        return "succeeded"
    if 400 <= answer.status < 500:
        if not in_doubt:
            return "failed"
        # An earlier attempt may have executed. Only a decline (executed now, so nothing was
        # saved under the key before, or replayed) or a replayed answer speaks for it; the
        # rest (401, 403, 409, 429, an idempotency error, a validation error) prove only that
        # this attempt did not execute.
        return "failed" if answer.status == 402 or _replayed(answer) else "unknown"
    # 5xx (Stripe may have executed before failing) and anything unexpected.
    return "unknown"


# A bank debit Stripe made and the bank has yet to answer: its PaymentIntent, its Charge.
_UNSETTLED = frozenset({"processing", "pending"})
# A PaymentIntent created unconfirmed, which moved no money. Not requires_action: the
# customer may still authenticate it, and the charge go through.
_NOT_CHARGED = frozenset({"requires_payment_method", "requires_confirmation"})


def _status_of(answer: _Answer) -> object:
    """The `status` of the object a 2xx answer carries; None if it carries none."""
    try:
        found = json.loads(answer.body)
    except ValueError:
        return None
    return found.get("status") if isinstance(found, dict) else None


def _without_client_secrets(body: bytes) -> bytes:
    """The body with every `client_secret` field taken out, at any depth.

    A PaymentIntent's client_secret plus the account's publishable key (public in any
    checkout page) confirms the intent straight with Stripe, past the vault's cap. The
    workers never read it. A body that is not JSON passes unchanged."""
    if b"client_secret" not in body:
        return body  # most answers: no parse, no re-encoding
    try:
        found = json.loads(body)
    except ValueError:
        return body
    return json.dumps(_strip_client_secrets(found)).encode()


def _strip_client_secrets(value: object) -> object:
    if isinstance(value, dict):
        return {
            name: _strip_client_secrets(item)
            for name, item in value.items()
            if name != "client_secret"
        }
    if isinstance(value, list):
        return [_strip_client_secrets(item) for item in value]
    return value


def _replayed(answer: _Answer) -> bool:
    """Stripe answered from what it saved with the Idempotency-Key, executing nothing."""
    return answer.headers.get("Idempotent-Replayed", "").lower() == "true"


async def _settle(
    state: VaultState, reservation: Reservation, outcome: Outcome, status: int | None
) -> ReservationState:
    settled = await _record(
        state,
        lambda conn: reservations.settle(conn, reservation, outcome, status),
        "settle",
        f"settle reservation {reservation.id} as {outcome}",
    )
    # Not yet written: the reservation stays pending, so counted, until the write behind
    # the answer lands (found stale meanwhile, it still takes it).
    return "pending" if settled is None else settled


async def _record(
    state: VaultState,
    write: Callable[[asyncpg.Connection], Awaitable[T]],
    kind: LateWrite,
    what: str,
) -> T | None:
    """Write what already happened upstream (a settle, an audit row), which no client retry
    would bring back, through a database outage: for `outage_retry` while the client waits,
    then on behind its answer (None) for `late_write_within`. A vault stopped before that
    leaves a settle to reconciliation, and loses the audit row."""
    try:
        return await store.through_outage(state.pool, state.outage_retry, write)
    except CONNECTION_ERRORS:
        pass
    except store.DATABASE_ERRORS:
        logger.exception("could not %s", what)
        return None
    if state.behind.pending_count >= state.behind.pending_limit:
        # Spawning would wait for room, holding up the answer.
        logger.error("could not %s: %d writes already wait behind answers", what, len(state.behind))
        metrics.LATE_WRITES.labels(kind=kind, result="lost").inc()
        return None
    logger.warning("could not %s yet: trying on behind the answer", what)
    metrics.LATE_WRITES.labels(kind=kind, result="deferred").inc()
    await state.behind.spawn(_record_late(state, write, kind, what))
    return None


async def _record_late(
    state: VaultState,
    write: Callable[[asyncpg.Connection], Awaitable[object]],
    kind: LateWrite,
    what: str,
) -> None:
    result = "lost"
    try:
        await store.through_outage(state.pool, state.late_write_within, write)
        result = "landed"
        logger.info("managed to %s once the database was back", what)
    except store.DATABASE_ERRORS:
        logger.exception("could not %s", what)
    except asyncio.CancelledError:
        # The vault stops: a settle is left to reconciliation, an audit row is lost.
        logger.error("could not %s before the vault stopped", what)
        raise
    finally:
        metrics.LATE_WRITES.labels(kind=kind, result=result).inc()


def _audited_path(request: web.Request, path: str) -> str:
    """The path and, decoded so that a percent-encoded key is redacted too, the query string:
    which customer or page a list read asked for."""
    query = request.rel_url.raw_query_string
    audited = _clean(path, 300)
    return audited + "?" + _clean(_decoded(query), 500) if query else audited


def _decoded(text: str) -> str:
    """`text` percent-decoded until it no longer changes (_DECODING_ROUNDS at most): a key
    encoded twice over is still one to refuse and to redact."""
    for _ in range(_DECODING_ROUNDS):
        decoded = unquote_plus(text)
        if decoded == text:
            break
        text = decoded
    return text


def _clean(text: str, limit: int) -> str:
    """Text for the audit log: secrets redacted, control characters and what is not UTF-8
    (aiohttp keeps a header's stray bytes as lone surrogates, which Postgres refuses)
    replaced, length bounded."""
    storable = text.encode("utf-8", "replace").decode("utf-8")
    return _CONTROL_RE.sub("?", redact(storable))[:limit]

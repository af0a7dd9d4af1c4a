"""I5: no secret (the upstream Stripe key, a vault key, the admin token) in audit rows, stored
reservations, responses or logs (the autouse fixture checks the captured logs of every test)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager

import aiohttp
import asyncpg
import pytest
import stripe
from aiohttp import web
from yarl import URL

from stripe_emulator import RunningEmulator
from vault.app import RunningVault, serve
from vault.client import VaultAdmin, VaultUnavailable
from vault.endpoints import FENCE_HEADER, UPSTREAM_UNREACHABLE
from vault.models import IssuedKey
from vault.proxy import _without_client_secrets
from vault.settings import VaultSettings

from .conftest import Issue, Secrets
from .support import (
    ADMIN_TOKEN,
    UPSTREAM_SECRET,
    WORKER_TOKEN,
    charge,
    charge_in_doubt,
    closed_port,
    key_request,
    proxied_calls,
    stand_in_upstream,
    via_vault,
)

StripeFor = Callable[[IssuedKey], stripe.StripeClient]


async def _table_text(db: asyncpg.Pool) -> str:
    rows = []
    for table in ("vault_audit", "vault_reservations", "vault_keys", "vault_key_days"):
        rows += [repr(dict(row)) for row in await db.fetch(f"SELECT * FROM {table}")]
    return "\n".join(rows)


async def test_no_secret_in_audit_rows_reservations_or_responses(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    declining_customer: str,
    vault: RunningVault,
    emulator: RunningEmulator,
    http: aiohttp.ClientSession,
    db: asyncpg.Pool,
    secrets_seen: Secrets,
) -> None:
    key = await issue(cap_cents=3_000)
    vk = key.secret.get_secret_value()
    client = stripe_via_vault(key)
    replies: list[str] = []

    async def raw(method: str, path: str, **kwargs: object) -> None:
        url = URL(vault.url + path, encoded=True)  # sent as written, percent-escapes too
        async with http.request(method, url, **kwargs) as response:  # type: ignore[arg-type]
            replies.append(f"{response.status} {dict(response.headers)} {await response.text()}")

    await charge(client, customer, 1_000, "ok")
    with pytest.raises(stripe.CardError):
        await charge(client, declining_customer, 1_000, "declined")
    with pytest.raises(stripe.CardError):
        await charge(client, customer, 5_000, "over")
    await charge_in_doubt(emulator, client, customer, 1_000, "dropped")
    bearer = {"Authorization": f"Bearer {vk}"}
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    # Secrets sent where they do not belong: refused, and never stored or echoed.
    await raw(
        "POST",
        "/stripe/v1/payment_intents",
        headers=bearer | form | {"Idempotency-Key": vk},
        data="amount=1&currency=usd",
    )
    await raw(
        "POST",
        "/stripe/v1/payment_intents",
        headers=bearer | form | {"Idempotency-Key": "c"},
        data=f"amount=1&currency=usd&customer={UPSTREAM_SECRET}",
    )
    await raw("GET", f"/stripe/v1/payment_intents/{vk}", headers=bearer)
    # Glued to other text, or in a query string, percent-encoded or not.
    await raw("GET", f"/stripe/v1/payment_intents/X{vk}", headers=bearer)
    await raw("GET", f"/stripe/v1/payment_intents/pi{UPSTREAM_SECRET}", headers=bearer)
    await raw("GET", f"/stripe/v1/charges?customer={vk}", headers=bearer)
    encoded = UPSTREAM_SECRET.replace("_", "%5F")
    await raw("GET", f"/stripe/v1/charges?customer=x{encoded}", headers=bearer)
    # In a body a GET should not have, or a header the vault forwards.
    await raw("GET", "/stripe/v1/payment_intents/pi_1", headers=bearer | form, data=f"x={vk}")
    await raw("GET", "/stripe/v1/charges", headers=bearer | {"Stripe-Version": UPSTREAM_SECRET})
    await raw("GET", "/stripe/v1/charges", headers={"Authorization": f"Bearer {UPSTREAM_SECRET}"})
    await raw("GET", "/stripe/v1/charges", headers={"Authorization": f"Bearer {vk}x"})
    await raw("GET", f"/vault/keys/{key.id}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    await raw(
        "GET", f"/vault/keys/{key.id}/audit", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    await raw(
        "GET",
        f"/vault/keys/{key.id}/reservations",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    await raw("GET", "/vault/keys", headers={"Authorization": f"Bearer {vk}"})

    assert secrets_seen.found_in("\n".join(replies)) == []
    stored = await _table_text(db)
    assert secrets_seen.found_in(stored) == []
    assert [reply[:3] for reply in replies[3:9]] == ["400"] * 6, replies[3:9]
    # All but the two with no known key, which are counted per peer (vault/unauthenticated.py).
    assert await db.fetchval("SELECT count(*) FROM vault_audit WHERE actor IS NULL") == 13
    assert "[redacted key]" in stored  # the vk_ secret sent as a path and idempotency key


async def test_words_holding_sk_are_not_taken_for_keys(
    issue: Issue, vault: RunningVault, http: aiohttp.ClientSession, db: asyncpg.Pool
) -> None:
    key = await issue(allowed_endpoints=["GET /v1/charges"])
    async with http.get(
        vault.url + "/stripe/v1/charges?customer=cus_risky&starting_after=ch_task",
        headers={"Authorization": f"Bearer {key.secret.get_secret_value()}"},
    ):
        pass
    assert await db.fetchval("SELECT decision FROM vault_audit WHERE actor IS NULL") == "forwarded"


@pytest.fixture
async def echoing_upstream() -> AsyncIterator[str]:
    """A broken upstream that echoes the request's headers, as JSON, in its error message."""

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(
            {"error": {"type": "api_error", "message": json.dumps(dict(request.headers))}},
            status=500,
        )

    async with stand_in_upstream(echo) as url:
        yield url


async def _read_intent_through(
    vault_settings: VaultSettings,
    upstream: str,
    http: aiohttp.ClientSession,
    key: IssuedKey,
    extra_headers: Mapping[str, str] | None = None,
) -> tuple[int, str]:
    """A read of an intent with `key` through a vault in front of `upstream`, a redirect
    not followed: the status and body its caller gets."""
    headers = {"Authorization": f"Bearer {key.secret.get_secret_value()}", **(extra_headers or {})}
    in_front = vault_settings.model_copy(update={"upstream_stripe_base": upstream})
    async with (
        serve(in_front) as vault,
        http.get(
            f"{vault.url}/stripe/v1/payment_intents/pi_1", headers=headers, allow_redirects=False
        ) as response,
    ):
        return response.status, await response.text()


async def test_the_upstream_secret_is_scrubbed_from_what_the_upstream_echoes(
    vault_settings: VaultSettings,
    echoing_upstream: str,
    issue: Issue,
    http: aiohttp.ClientSession,
) -> None:
    key = await issue()
    status, body = await _read_intent_through(vault_settings, echoing_upstream, http, key)
    assert status == 500
    assert UPSTREAM_SECRET not in body
    assert "Bearer [redacted]" in body


async def test_only_the_headers_stripe_reads_reach_the_upstream(
    vault_settings: VaultSettings,
    echoing_upstream: str,
    issue: Issue,
    http: aiohttp.ClientSession,
) -> None:
    """The vault forwards its own secret and the headers a Stripe request needs, nothing else
    the caller sends: `Stripe-Account` or `Stripe-Context` would make a key's requests on a
    connected account (Connect), past what the key was issued for, and a cookie or the
    vault's own fencing token is no business of Stripe's."""
    key = await issue()
    extra = {
        "Stripe-Version": "2026-01-28",
        "Stripe-Account": "acct_other",
        "Stripe-Context": "acct_other",
        "Cookie": "session=abc",
        FENCE_HEADER: "3",
    }
    _, body = await _read_intent_through(vault_settings, echoing_upstream, http, key, extra)
    seen = json.loads(json.loads(body)["error"]["message"])
    assert (seen["Authorization"], seen["Stripe-Version"]) == ("Bearer [redacted]", "2026-01-28")
    sent = ["Authorization", *extra]
    assert [name for name in sent if name in seen] == ["Authorization", "Stripe-Version"]


async def test_a_redirect_from_the_upstream_is_answered_not_followed(
    vault_settings: VaultSettings, issue: Issue, http: aiohttp.ClientSession
) -> None:
    """Followed, a redirect would carry the vault's own secret to a path the key's allowlist
    never checked (a 307 would send a charge's body there too): the caller gets it as is."""
    asked: list[str] = []

    async def redirecting(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(status=307, headers={"Location": "/v1/customers"})

    key = await issue()
    async with stand_in_upstream(redirecting) as upstream:
        status, _ = await _read_intent_through(vault_settings, upstream, http, key)
    assert status == 307
    assert asked == ["/v1/payment_intents/pi_1"]


@pytest.mark.parametrize("token", [ADMIN_TOKEN, WORKER_TOKEN])
async def test_a_token_in_a_malformed_header_is_not_logged(
    vault: RunningVault, caplog: pytest.LogCaptureFixture, token: str
) -> None:
    """aiohttp's parser refuses a header line with a stray control byte (a token file ending
    in one, say) and quoted it, whole, in the error its server logged (helper-183). The
    autouse check finds any token in the log."""
    url = URL(vault.url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        writer.write(
            b"GET /vault/keys HTTP/1.1\r\nHost: vault\r\n"
            b"Authorization: Bearer " + token.encode() + b"\x0b\r\n\r\n"
        )
        await writer.drain()
        async with asyncio.timeout(10):
            answer = await reader.read()
    finally:
        writer.close()
    assert answer.split(b"\r\n")[0].endswith(b" 400 Bad Request")
    assert "refused a malformed request from 127.0.0.1 (BadHttpMessage, HTTP 400)" in caplog.text


@contextmanager
def unanswered_port() -> Iterator[int]:
    """A port whose connects hang, as to an address a firewall blackholes: its listener's
    queue is full and never accepted from, so Linux drops every further SYN."""
    with socket.socket() as listener, ExitStack() as fillers:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(3):
            filler = fillers.enter_context(socket.socket())
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        yield port


@pytest.mark.parametrize("upstream", [closed_port, unanswered_port], ids=["refused", "hangs"])
async def test_an_unreachable_upstream_frees_the_room_and_logs_no_secret(
    vault_settings: VaultSettings,
    issue: Issue,
    customer: str,
    db: asyncpg.Pool,
    caplog: pytest.LogCaptureFixture,
    upstream: Callable[[], AbstractContextManager[int]],
) -> None:
    """No connection made, nothing was sent: the reservation is released (it was held
    unknown, 900 of a 1,000 cap kept from every other charge until reconciliation settled a
    charge Stripe never saw: helper-183; a connect that hung ran into the whole request's
    timeout, read as a request that may have gone out: helper-184), the answer says nothing
    was sent, and the audit row says the request was not forwarded."""
    key = await issue(cap_cents=1000)
    secret = key.secret.get_secret_value()
    with upstream() as port:
        nowhere = vault_settings.model_copy(
            update={
                "upstream_stripe_base": f"http://127.0.0.1:{port}",
                "upstream_timeout_seconds": 4,
            }
        )
        async with serve(nowhere) as vault, aiohttp.ClientSession() as session:
            with pytest.raises(stripe.APIError) as failed:
                await charge(via_vault(secret, vault.url, session), customer, 900, "nowhere")
    assert failed.value.http_status == 503 and failed.value.error is not None
    assert failed.value.error.code == UPSTREAM_UNREACHABLE
    assert (failed.value.headers or {}).get("Stripe-Should-Retry") == "true"
    assert "could not connect to Stripe for POST /v1/payment_intents" in caplog.text
    assert await db.fetchval("SELECT state FROM vault_reservations") == "released"
    async with serve(vault_settings) as vault, aiohttp.ClientSession() as session:
        async with VaultAdmin(vault.url, ADMIN_TOKEN) as admin:
            [audited] = await proxied_calls(admin, key.id)
        assert (audited.decision, audited.refusal_code, audited.upstream_status) == (
            "refused_request",
            UPSTREAM_UNREACHABLE,
            None,
        )
        # 900 held unknown would leave no room for it.
        client = via_vault(secret, vault.url, session)
        assert (await charge(client, customer, 200, "elsewhere")).status == "succeeded"


async def test_a_read_that_could_not_connect_is_not_said_to_have_sent_nothing(
    vault_settings: VaultSettings, issue: Issue, http: aiohttp.ClientSession
) -> None:
    """aiohttp sends a GET again on a new connection when a reused one was dropped, so a
    failed connect may follow a read that went out: only a POST's is sure to have sent
    nothing (503 vault_upstream_unreachable); a read's is Stripe's silence (502)."""
    key = await issue()
    with closed_port() as port:
        nowhere = f"http://127.0.0.1:{port}"
        status, body = await _read_intent_through(vault_settings, nowhere, http, key)
    assert (status, json.loads(body)["error"]["code"]) == (502, "upstream_unavailable")


async def test_proxied_answers_carry_no_payment_intent_client_secret(
    issue: Issue,
    vault: RunningVault,
    http: aiohttp.ClientSession,
    customer: str,
    declining_customer: str,
    db: asyncpg.Pool,
) -> None:
    # A client_secret and the public publishable key confirm an intent straight with Stripe,
    # past the cap: none may leave the vault, in a charge, a decline, a read or a list.
    key = await issue(
        allowed_endpoints=[
            "POST /v1/payment_intents",
            "GET /v1/payment_intents",
            "GET /v1/payment_intents/*",
        ]
    )
    bearer = {"Authorization": f"Bearer {key.secret.get_secret_value()}"}
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    body = (
        "amount={amount}&currency=usd&customer={customer}&confirm=true&off_session=true"
        "&automatic_payment_methods[enabled]=true"
        "&automatic_payment_methods[allow_redirects]=never"
    )
    answers: dict[str, tuple[int, str]] = {}

    async def call(name: str, method: str, path: str, **kwargs: object) -> dict[str, object]:
        async with http.request(method, vault.url + "/stripe" + path, **kwargs) as r:  # type: ignore[arg-type]
            answers[name] = (r.status, await r.text())
            found: dict[str, object] = await r.json()
            return found

    paid = await call(
        "charged",
        "POST",
        "/v1/payment_intents",
        headers=bearer | form | {"Idempotency-Key": "paid-1"},
        data=body.format(amount=1_000, customer=customer),
    )
    await call(
        "declined",
        "POST",
        "/v1/payment_intents",
        headers=bearer | form | {"Idempotency-Key": "declined-1"},
        data=body.format(amount=90_000, customer=declining_customer),
    )
    await call("read", "GET", f"/v1/payment_intents/{paid['id']}", headers=bearer)
    await call("listed", "GET", "/v1/payment_intents", headers=bearer)

    assert {name: status for name, (status, _) in answers.items()} == {
        "charged": 200,
        "declined": 402,
        "read": 200,
        "listed": 200,
    }
    leaked = [name for name, (_, text) in answers.items() if "client_secret" in text]
    assert leaked == []
    assert paid["id"] and paid["status"] == "succeeded"  # the rest of the answer is intact
    states = await db.fetch(
        "SELECT state FROM vault_reservations WHERE vault_key_id = $1 ORDER BY id", key.id
    )
    assert [row["state"] for row in states] == ["committed", "released"]


def test_client_secrets_are_stripped_at_any_depth_and_other_bodies_pass_unchanged() -> None:
    nested = {
        "object": "list",
        "client_secret": "pi_1_secret_a",
        "data": [
            {"id": "pi_1", "client_secret": "pi_1_secret_b", "metadata": {"k": "v"}},
            [{"client_secret": "pi_2_secret_c", "amount": 5}],
        ],
        "error": {"payment_intent": {"id": "pi_3", "client_secret": "pi_3_secret_d"}},
    }
    stripped = json.loads(_without_client_secrets(json.dumps(nested).encode()))
    assert stripped == {
        "object": "list",
        "data": [{"id": "pi_1", "metadata": {"k": "v"}}, [{"amount": 5}]],
        "error": {"payment_intent": {"id": "pi_3"}},
    }
    # Not JSON: returned as it came, byte for byte.
    for body in (b"client_secret=pi_1_secret_a", b"<html>client_secret</html>", b"", b"\xff"):
        assert _without_client_secrets(body) == body
    # JSON without the field is not re-encoded.
    spaced = b'{ "id" : "pi_1" }'
    assert _without_client_secrets(spaced) is spaced


@pytest.mark.parametrize(
    ("path", "body"),
    [("fences/{vk}", {"below": 2}), ("reservations/{vk}/resolve", {"outcome": "failed"})],
    ids=["fence", "resolve"],
)
async def test_a_secret_given_as_a_paths_idempotency_key_is_refused_not_stored(
    issue: Issue,
    vault: RunningVault,
    db: asyncpg.Pool,
    http: aiohttp.ClientSession,
    secrets_seen: Secrets,
    path: str,
    body: dict[str, object],
) -> None:
    """A key pasted as the path's idempotency key is refused as the proxy refuses one sent
    as an Idempotency-Key, before the database: a fence stored it whole in vault_fences and
    in the audit's path and idempotency key, for good (helper-161 F2), and the admin API's
    error log printed the path (helper-162 F4)."""
    key = await issue()
    vk = key.secret.get_secret_value()
    async with http.post(
        f"{vault.url}/vault/keys/{key.id}/" + path.format(vk=vk),
        json=body,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as response:
        assert response.status == 422
        assert (await response.json())["error"]["code"] == "secret_in_parameter"
    rows = [
        str(tuple(row))
        for table in ("vault_audit", "vault_fences")
        for row in await db.fetch(f"SELECT * FROM {table}")
    ]
    stored = "\n".join(rows)
    assert secrets_seen.found_in(stored) == []


async def test_a_secret_given_as_a_paths_key_id_is_not_repeated_in_the_404(
    issue: Issue, vault: RunningVault, http: aiohttp.ClientSession
) -> None:
    """A key pasted where its id goes: the error names no key rather than echo the secret
    to the caller, whose exception and logs would keep it."""
    key = await issue()
    vk = key.secret.get_secret_value()
    async with http.get(
        f"{vault.url}/vault/keys/{vk}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ) as response:
        assert response.status == 404
        answer = await response.text()
    assert "resource_missing" in answer and vk not in answer


async def test_a_malformed_answer_to_an_issue_names_the_fields_not_the_secret_it_held(
    secrets_seen: Secrets,
) -> None:
    """An answer to an issue the client cannot read (a vault of another version, a proxy in
    front of it): its error, which callers log and Temporal records, names what was wrong,
    never the values, one of which is the new key's secret (not even the part of it that a
    validation error's shortened repr would show)."""
    secret = "vk_" + "Q7mZ2xK9pL4wR8tY1vB6nC3hJ5gF0dSaEuIoPkWqXrZ"
    secrets_seen.values.append(secret)

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"id": "vkey_0000000000000001", "secret": secret})

    async with stand_in_upstream(answer) as url, VaultAdmin(url, ADMIN_TOKEN) as client:
        with pytest.raises(VaultUnavailable, match="unexpected response") as refused:
            await client.issue_key(key_request())
    said = str(refused.value)
    assert "cap_cents" in said
    assert [i for i in range(len(secret) - 8) if secret[i : i + 8] in said] == []


async def test_an_answer_that_is_no_object_is_named_as_the_body() -> None:
    """A JSON array where an object was due fails the whole body, which has no field name."""

    async def answer(request: web.Request) -> web.Response:
        return web.json_response([])

    async with stand_in_upstream(answer) as url, VaultAdmin(url, ADMIN_TOKEN) as client:
        with pytest.raises(VaultUnavailable, match=r"unexpected response; bad: the body$"):
            await client.issue_key(key_request())


async def test_the_admin_client_shows_no_token(admin: VaultAdmin, worker: VaultAdmin) -> None:
    # A client in a log line or a traceback's locals.
    assert [token for token in (ADMIN_TOKEN, WORKER_TOKEN) if token in repr((admin, worker))] == []

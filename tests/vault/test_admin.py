"""The admin API: token, validation of issued keys, inspection, OpenAPI, health."""

from __future__ import annotations

import asyncio
import hmac
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import asyncpg
import pytest
from aiohttp import web
from jsonschema import Draft202012Validator

from vault import admin as admin_module
from vault import reservations
from vault.app import RunningVault
from vault.client import (
    VaultAdmin,
    VaultAdminError,
    VaultAuthError,
    VaultConflict,
    VaultInvalidRequest,
    VaultNotFound,
    VaultUnavailable,
)
from vault.models import new_key_id
from vault.reservations import Charge

from .conftest import Issue
from .support import (
    ADMIN_TOKEN,
    DEFAULT_ENDPOINTS,
    MAX_CAP_CENTS,
    assert_a_slow_body_is_refused,
    closed_port,
    key_request,
    refusals_counted,
    stand_in_upstream,
)


def _issue_body(**overrides: Any) -> dict[str, Any]:
    return {
        "label": "billing",
        "period": "2026-12",
        "cap_cents": 10_000,
        "currency": "usd",
        "allowed_endpoints": DEFAULT_ENDPOINTS,
        "expires_at": (datetime.now(UTC) + timedelta(days=1)).isoformat(),
    } | overrides


async def _admin_call(
    http: aiohttp.ClientSession,
    vault: RunningVault,
    method: str,
    path: str,
    body: Any = None,
    token: str | None = ADMIN_TOKEN,
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    kwargs: dict[str, Any] = {"data": body} if isinstance(body, str) else {"json": body}
    async with http.request(method, vault.url + path, headers=headers, **kwargs) as response:
        return response.status, await response.json()


async def test_admin_token_is_required_and_compared_in_constant_time(
    vault: RunningVault, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)  # vault.admin calls hmac.compare_digest
    before = refusals_counted("admin_token_invalid")
    for token in (None, "wrong", ADMIN_TOKEN + "x", ADMIN_TOKEN[:-1]):
        status, reply = await _admin_call(http, vault, "GET", "/vault/keys", token=token)
        assert (status, reply["error"]["code"]) == (401, "admin_token_invalid")
    async with VaultAdmin(vault.url, "not-the-token") as wrong:
        with pytest.raises(VaultAuthError):
            await wrong.find_keys()
    assert (await _admin_call(http, vault, "GET", "/vault/keys"))[0] == 200
    # Not audited (no key to audit them under), counted: probing shows.
    assert refusals_counted("admin_token_invalid") == before + 5
    # Digests are compared, so even a shorter or longer token takes the same comparison.
    assert compared and all(lengths == (32, 32) for lengths in compared)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"cap_cents": MAX_CAP_CENTS + 1}, "cap_cents"),
        ({"cap_cents": 0}, "cap_cents"),
        ({"cap_cents": "100"}, "cap_cents"),
        ({"cap_cents": 10.5}, "cap_cents"),
        ({"cap_cents": True}, "cap_cents"),
        ({"daily_cap_cents": MAX_CAP_CENTS + 1}, "daily_cap_cents"),
        ({"cap_cents": 1_000, "daily_cap_cents": 1_001}, "daily_cap_cents"),
        ({"cap_cents": 2**70}, "cap_cents"),
        ({"currency": "USD"}, "currency"),
        ({"currency": "xts"}, "currency"),
        ({"period": "2026-13"}, "period"),
        ({"period": "1999-12"}, "period"),
        ({"label": ""}, "label"),
        # A line break would forge lines in whatever prints the label.
        ({"label": "billing\nforged"}, "label"),
        (
            {"allowed_endpoints": [f"GET /v1/charges/ch_{i}" for i in range(51)]},
            "allowed_endpoints",
        ),
        ({"expires_at": "2020-01-01T00:00:00Z"}, "expires_at"),
        ({"expires_at": "2999-01-01T00:00:00"}, "expires_at"),
        ({"allowed_endpoints": []}, "allowed_endpoints"),
        ({"allowed_endpoints": ["POST /v1/customers"]}, "allowed_endpoints.0"),
        ({"allowed_endpoints": ["POST /v1/payment_intents/*/confirm"]}, "allowed_endpoints.0"),
        ({"allowed_endpoints": ["GET /v1/../x"]}, "allowed_endpoints.0"),
        ({"vendor": "paypal"}, "vendor"),
        ({"secret": "vk_mine"}, "secret"),
        ({"key_id": "vkey_NOT-HEX"}, "key_id"),
        ({"key_id": "../vkey_0000000000000000"}, "key_id"),
    ],
)
async def test_invalid_keys_are_refused_naming_the_field(
    vault: RunningVault, http: aiohttp.ClientSession, overrides: dict[str, Any], field: str
) -> None:
    status, reply = await _admin_call(http, vault, "POST", "/vault/keys", _issue_body(**overrides))
    assert status == 422, reply
    assert field in [problem["field"] for problem in reply["error"]["fields"]]
    # As Stripe's errors do, `param` names the (first) field at fault.
    assert reply["error"]["param"] == reply["error"]["fields"][0]["field"]


async def test_an_integral_number_is_an_integer(
    vault: RunningVault, http: aiohttp.ClientSession
) -> None:
    # JSON Schema's integer includes 10000.0, and the OpenAPI document promises JSON Schema.
    status, reply = await _admin_call(
        http, vault, "POST", "/vault/keys", _issue_body(cap_cents=10_000.0)
    )
    assert (status, reply["cap_cents"]) == (201, 10_000)


async def test_a_key_id_the_caller_chose_is_issued_once(
    vault: RunningVault, http: aiohttp.ClientSession, admin: VaultAdmin, db: asyncpg.Pool
) -> None:
    """A caller that lists the id before asking knows which key to revoke if the answer is
    lost; asked again, the vault refuses rather than show a second secret for it."""
    chosen = new_key_id()
    status, first = await _admin_call(
        http, vault, "POST", "/vault/keys", _issue_body(key_id=chosen)
    )
    assert (status, first["id"]) == (201, chosen)
    again = _issue_body(key_id=chosen, cap_cents=99)
    status, reply = await _admin_call(http, vault, "POST", "/vault/keys", again)
    assert (status, reply["error"]["code"]) == (409, "key_id_taken"), reply
    assert chosen in reply["error"]["message"] and "secret" not in reply
    kept = await admin.get_key(chosen)
    assert kept.cap_cents == 10_000 and not kept.revoked
    assert await db.fetchval("SELECT count(*) FROM vault_keys") == 1
    assert await db.fetchval("SELECT count(*) FROM vault_audit WHERE decision = 'issued'") == 1


async def test_malformed_json_is_a_400(vault: RunningVault, http: aiohttp.ClientSession) -> None:
    status, reply = await _admin_call(http, vault, "POST", "/vault/keys", "{not json")
    assert (status, reply["error"]["code"]) == (400, "body_invalid")


async def test_a_method_a_route_does_not_answer_is_a_405_naming_those_it_does(
    vault: RunningVault, http: aiohttp.ClientSession
) -> None:
    # aiohttp's own refusal, answered in the vault's error shape, keeps its Allow header, and
    # says, as every refusal does, that sending it again changes nothing.
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with http.request("PATCH", vault.url + "/vault/keys", headers=headers) as response:
        reply = await response.json()
        assert (response.status, response.headers["Allow"]) == (405, "GET,POST")
        assert response.headers["Stripe-Should-Retry"] == "false"
        # A refusal is no reason to drop the connection: the caller's next request reuses it.
        assert "close" not in response.headers.get("Connection", "").lower()
    assert reply["error"]["type"] == "invalid_request_error"


async def test_cap_up_to_the_ceiling_is_accepted(issue: Issue) -> None:
    # And a daily cap up to the cap.
    issued = await issue(cap_cents=MAX_CAP_CENTS, daily_cap_cents=MAX_CAP_CENTS)
    assert (issued.cap_cents, issued.daily_cap_cents) == (MAX_CAP_CENTS, MAX_CAP_CENTS)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        # A misspelt filter ignored would list every key as if they matched.
        ("GET", "/vault/keys?perod=2026-12", None),
        ("GET", "/vault/keys?limit=1001", None),
        # Past Postgres' bigint.
        ("GET", "/vault/keys/{key}/audit?before=9223372036854775808", None),
        ("GET", "/vault/keys/{key}/reservations?after=9223372036854775808", None),
        # Committed, a negative amount would hand room back to the cap.
        (
            "POST",
            "/vault/keys/{key}/reservations/in-doubt/resolve",
            {"outcome": "succeeded", "amount_cents": -5},
        ),
        (
            "POST",
            "/vault/keys/{key}/reservations/in-doubt/resolve",
            {"outcome": "succeeded", "attempt": 0},
        ),
        (
            "POST",
            "/vault/keys/{key}/reservations/in-doubt/resolve",
            {"outcome": "failed", "min_idle_seconds": 30 * 86400 + 1},
        ),
    ],
    ids=[
        "unknown-filter",
        "limit",
        "audit-before",
        "reservations-after",
        "negative-amount",
        "attempt-0",
        "idle-past-30-days",
    ],
)
async def test_an_admin_call_out_of_range_is_refused_before_anything_is_looked_up(
    vault: RunningVault,
    http: aiohttp.ClientSession,
    issue: Issue,
    method: str,
    path: str,
    body: Any,
) -> None:
    key = await issue()
    status, reply = await _admin_call(http, vault, method, path.format(key=key.id), body)
    assert (status, reply["error"]["code"]) == (422, "parameter_invalid"), reply


async def test_the_client_raises_the_vaults_message(admin: VaultAdmin) -> None:
    with pytest.raises(VaultInvalidRequest, match="VAULT_MAX_CAP_CENTS"):
        await admin.issue_key(key_request(cap_cents=MAX_CAP_CENTS + 1))
    with pytest.raises(VaultNotFound):
        await admin.get_key("vkey_0000000000000000")
    with pytest.raises(VaultNotFound):
        await admin.get_key("../../etc")


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, VaultInvalidRequest),
        (409, VaultConflict),
        (422, VaultInvalidRequest),
        (500, VaultUnavailable),
        (503, VaultUnavailable),
        (418, VaultAdminError),
    ],
)
async def test_the_client_raises_each_refusal_as_its_kind_with_the_vaults_words(
    status: int, kind: type[VaultAdminError]
) -> None:
    """Callers decide by the kind (a 409 is retried on the next run, a 400 needs a person, a
    5xx may be retried), and show the vault's message: a refusal read as a malformed answer
    would lose both."""

    async def refuse(request: web.Request) -> web.Response:
        error = {"type": "invalid_request_error", "code": "a_code", "message": "the words"}
        return web.json_response({"error": error}, status=status)

    async with stand_in_upstream(refuse) as url, VaultAdmin(url, ADMIN_TOKEN) as client:
        with pytest.raises(VaultAdminError) as refused:
            await client.get_key("vkey_0000000000000000")
    assert type(refused.value) is kind
    assert (refused.value.status, refused.value.code, refused.value.message) == (
        status,
        "a_code",
        "the words",
    )


async def test_a_vault_the_client_cannot_reach_is_unavailable() -> None:
    with closed_port() as port:
        async with VaultAdmin(f"http://127.0.0.1:{port}", ADMIN_TOKEN) as client:
            with pytest.raises(VaultUnavailable, match="ClientConnectorError"):
                await client.ready()


async def test_a_vault_that_does_not_answer_in_the_clients_time_is_unavailable() -> None:
    """A worker's call waits the client's timeout, not aiohttp's five minutes."""
    answered = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await answered.wait()
        return web.json_response({"status": "ok"})

    async with stand_in_upstream(hang) as url, VaultAdmin(url, ADMIN_TOKEN, timeout=0.2) as client:
        try:
            with pytest.raises(VaultUnavailable) as unavailable:
                async with asyncio.timeout(5):
                    await client.ready()
        finally:
            answered.set()
    assert unavailable.value.status == 0


async def test_a_client_closed_then_called_again_opens_a_new_session(admin: VaultAdmin) -> None:
    await admin.ready()
    await admin.close()
    await admin.ready()


async def test_keys_are_inspected_and_found_without_their_secret(
    issue: Issue,
    admin: VaultAdmin,
    vault: RunningVault,
    http: aiohttp.ClientSession,
    db: asyncpg.Pool,
) -> None:
    issued = await issue(label="billing", period="2026-11", daily_cap_cents=5_000)
    other = await issue(label="other", period="2026-11")
    await issue(label="billing", period="2026-12")
    secret = issued.secret.get_secret_value()
    assert secret.startswith("vk_") and len(secret) == 46
    stored = await db.fetchrow("SELECT * FROM vault_keys WHERE id = $1", issued.id)
    assert secret.encode() not in b"".join(str(v).encode() for v in stored.values())

    info = await admin.get_key(issued.id)
    assert (info.cap_cents, info.reserved_cents, info.spent_cents) == (100_000, 0, 0)
    assert (info.remaining_cents, info.daily_cap_cents, info.daily_used_cents) == (
        100_000,
        5_000,
        0,
    )
    assert (info.currency, info.period, info.label, info.revoked, info.expired) == (
        "usd",
        "2026-11",
        "billing",
        False,
        False,
    )
    assert info.allowed_endpoints == DEFAULT_ENDPOINTS
    # A key without a daily cap has no day's use to show.
    assert (await admin.get_key(other.id)).daily_used_cents is None
    status, raw = await _admin_call(http, vault, "GET", f"/vault/keys/{issued.id}")
    assert status == 200 and "secret" not in raw and secret not in str(raw)

    assert [k.id for k in await admin.find_keys(period="2026-11")] == [other.id, issued.id]
    assert [k.id for k in await admin.find_keys(period="2026-11", label="billing")] == [issued.id]
    await admin.revoke(issued.id)
    # Revoked keys are still found: the caller must not issue a new one behind the kill switch.
    found = await admin.find_keys(period="2026-11", label="billing")
    assert [(k.id, k.revoked) for k in found] == [(issued.id, True)]
    status, reply = await _admin_call(http, vault, "GET", "/vault/keys?period=11-2026")
    assert (status, reply["error"]["fields"][0]["field"]) == (422, "period")


async def test_a_search_past_a_page_reads_every_key(
    issue: Issue,
    admin: VaultAdmin,
    vault: RunningVault,
    http: aiohttp.ClientSession,
    db: asyncpg.Pool,
) -> None:
    """A vault in use for years holds more keys than one answer lists (a lookup key for each
    reconciliation): a search answers a page at a time and the client reads every page. It
    stopped at the newest 1,000, saying nothing, and a revoked key left out could be issued
    again behind (helper-206)."""
    newest = await issue(period="2026-10")
    async with db.acquire() as conn:
        # 1,000 older copies of it: issuing as many through the API would take a minute.
        await conn.execute(
            """
            INSERT INTO vault_keys
            SELECT (jsonb_populate_record(k, to_jsonb(k) || jsonb_build_object(
                'id', 'vkey_' || lpad(to_hex(g), 16, '0'),
                'secret_sha256', '\\x' || encode(sha256(int8send(g)), 'hex'),
                'created_at', k.created_at - g * interval '1 second'))).*
            FROM vault_keys k, generate_series(1, 1000) g WHERE k.id = $1
            """,
            newest.id,
        )
    found = [k.id for k in await admin.find_keys(period="2026-10")]
    older = [f"vkey_{n:016x}" for n in range(1, 1001)]
    assert found == [newest.id, *older]
    pages: list[list[str]] = []
    before = ""
    while before is not None:
        query = f"?period=2026-10&limit=400{before and f'&before={before}'}"
        status, reply = await _admin_call(http, vault, "GET", "/vault/keys" + query)
        assert status == 200, reply
        pages.append([k["id"] for k in reply["keys"]])
        before = reply["next_before"]
    assert [len(page) for page in pages] == [400, 400, 201]
    assert [key for page in pages for key in page] == found


async def test_a_keys_room_leaves_out_charges_in_doubt_and_its_daily_use_is_todays(
    issue: Issue, admin: VaultAdmin, db: asyncpg.Pool
) -> None:
    """What an operator reads before renewing a key or pulling it: a charge in doubt takes
    room as a committed one does, and the day's use is the current UTC day's alone."""
    key = await issue(cap_cents=10_000, daily_cap_cents=5_000)
    stale_after = timedelta(minutes=5)

    async def reserved(
        conn: asyncpg.Connection, idempotency_key: str, amount: int
    ) -> reservations.Reservation:
        sent = Charge("POST /v1/payment_intents", amount, "usd", "cus_room")
        return await reservations.reserve(conn, key.id, idempotency_key, sent, stale_after)

    async with db.acquire() as conn:
        await reservations.settle(conn, await reserved(conn, "yesterday", 1_000), "succeeded", 200)
        for table in ("vault_key_days", "vault_reservations"):
            await conn.execute(f"UPDATE {table} SET day = day - 1 WHERE vault_key_id = $1", key.id)
        await reservations.settle(conn, await reserved(conn, "today", 2_000), "succeeded", 200)
        await reservations.settle(conn, await reserved(conn, "in-doubt", 700), "unknown", None)
    info = await admin.get_key(key.id)
    assert (info.reserved_cents, info.spent_cents, info.remaining_cents) == (700, 3_000, 6_300)
    assert info.daily_used_cents == 2_700
    # One row per key, whatever days it was used on.
    assert [k.id for k in await admin.find_keys(period=info.period)] == [key.id]


async def test_a_full_audit_page_says_where_the_next_one_begins(
    issue: Issue, admin: VaultAdmin, vault: RunningVault, http: aiohttp.ClientSession
) -> None:
    key = await issue()
    other = await issue()
    for _ in range(2):  # revoking again is audited too: three entries with the issue
        await admin.revoke(key.id)
    await admin.revoke(other.id)
    entries = await admin.audit(key.id)
    assert {entry.vault_key_id for entry in entries} == {key.id}  # the key's own only
    ids = [entry.id for entry in entries]
    assert len(ids) == 3
    path = f"/vault/keys/{key.id}/audit?limit=2"
    status, first = await _admin_call(http, vault, "GET", path)
    assert status == 200
    assert ([e["id"] for e in first["entries"]], first["next_before"]) == (ids[:2], ids[1])
    status, last = await _admin_call(http, vault, "GET", f"{path}&before={ids[1]}")
    assert ([e["id"] for e in last["entries"]], last["next_before"]) == (ids[2:], None)
    # The client reads the same pages.
    assert [e.id for e in await admin.audit(key.id, limit=2)] == ids[:2]
    assert [e.id for e in await admin.audit(key.id, limit=2, before=ids[1])] == ids[2:]


@pytest.mark.parametrize("operation", ["audit", "reservations"])
async def test_an_unknown_keys_audit_or_reservations_are_a_404_not_an_empty_page(
    vault: RunningVault, http: aiohttp.ClientSession, operation: str
) -> None:
    # An operator or a reconciliation with a mistyped id must not read "nothing there".
    path = f"/vault/keys/vkey_0000000000000000/{operation}"
    status, reply = await _admin_call(http, vault, "GET", path)
    assert (status, reply["error"]["code"]) == (404, "resource_missing")


async def test_a_query_parameter_given_twice_is_refused(
    vault: RunningVault, http: aiohttp.ClientSession
) -> None:
    # Else one of the two would be answered, silently.
    path = "/vault/keys?period=2026-11&period=2026-12"
    status, reply = await _admin_call(http, vault, "GET", path)
    assert (status, reply["error"]["code"], reply["error"]["param"]) == (
        422,
        "parameter_repeated",
        "period",
    )


async def test_issued_key_masks_its_secret_outside_the_issue_response(issue: Issue) -> None:
    issued = await issue()
    secret = issued.secret.get_secret_value()
    assert secret not in repr(issued)
    assert secret not in issued.model_dump_json()
    assert secret not in str(issued.model_dump(mode="json"))


async def test_openapi_document_matches_the_routes(
    vault: RunningVault, http: aiohttp.ClientSession
) -> None:
    async with http.get(vault.url + "/vault/openapi.json") as response:
        assert response.status == 200
        document = await response.json()
    assert document["openapi"] == "3.1.0"
    documented = {
        (method.upper(), path) for path, item in document["paths"].items() for method in item
    }
    assert documented == {(op.method, op.path) for op in admin_module.OPERATIONS}

    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            own = [node["$ref"]] if "$ref" in node else []
            return own + [r for v in node.values() for r in refs(v)]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    schemas = document["components"]["schemas"]
    for ref in refs(document):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    issue_op = document["paths"]["/vault/keys"]["post"]
    assert issue_op["security"] == [{"adminToken": []}, {"workerToken": []}]
    assert set(issue_op["responses"]) == {
        "201",
        "400",
        "401",
        "403",
        "408",
        "409",
        "413",
        "422",
        "500",
    }
    audit_op = document["paths"]["/vault/keys/{key_id}/audit"]["get"]
    assert audit_op["security"] == [{"adminToken": []}]
    assert "403" in audit_op["responses"]
    # The worker token revokes its own keys only (403 for an admin's).
    revoke_op = document["paths"]["/vault/keys/{key_id}/revoke"]["post"]
    assert revoke_op["security"] == [{"adminToken": []}, {"workerToken": []}]
    assert "403" in revoke_op["responses"]
    request_schema = schemas["IssueKeyRequest"]
    assert request_schema["properties"]["cap_cents"]["maximum"] == MAX_CAP_CENTS
    # The daily cap has the same ceiling: past it the vault answers 422.
    assert request_schema["properties"]["daily_cap_cents"]["anyOf"][0]["maximum"] == MAX_CAP_CENTS
    # Every scheme named is defined; path parameters are required, query ones are not (the
    # vault answers without them); an issued key's id feeds the operations on a key.
    schemes = document["components"]["securitySchemes"]
    for item in document["paths"].values():
        for operation in item.values():
            assert all(set(scheme) <= set(schemes) for scheme in operation["security"])
            for parameter in operation.get("parameters", []):
                assert parameter["required"] is (parameter["in"] == "path"), parameter
    links = issue_op["responses"]["201"]["links"]
    on_a_key = {op.operation_id for op in admin_module.OPERATIONS if "{key_id}" in op.path}
    assert set(links) == on_a_key
    assert {link["parameters"]["key_id"] for link in links.values()} == {"$response.body#/id"}
    assert "id" in schemas["IssuedKey"]["properties"]
    resolve_body = document["paths"]["/vault/keys/{key_id}/reservations/{idempotency_key}/resolve"]
    resolve_schema = schemas[
        resolve_body["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].split(
            "/"
        )[-1]
    ]
    assert resolve_schema["discriminator"]["propertyName"] == "outcome"
    assert set(request_schema["required"]) == {
        "label",
        "period",
        "cap_cents",
        "currency",
        "allowed_endpoints",
        "expires_at",
    }
    assert request_schema["additionalProperties"] is False
    audit_params = {
        p["name"]: p for p in document["paths"]["/vault/keys/{key_id}/audit"]["get"]["parameters"]
    }
    assert audit_params["key_id"]["in"] == "path"
    assert audit_params["limit"]["schema"] == {
        "default": 100,
        "maximum": 500,
        "minimum": 1,
        "title": "Limit",
        "type": "integer",
    }
    assert audit_params["before"]["schema"]["type"] == "integer"
    assert "default" not in audit_params["before"]["schema"]  # omitted, never sent as null


async def test_health_and_readiness(
    vault: RunningVault, http: aiohttp.ClientSession, db: asyncpg.Pool
) -> None:
    for path, expected in (("/vault/health", "ok"), ("/vault/ready", "ready")):
        async with http.get(vault.url + path) as response:
            assert (response.status, (await response.json())["status"]) == (200, expected)
    # Not migrated (or not reachable): not ready.
    await db.execute("ALTER TABLE vault_keys RENAME TO vault_keys_away")
    try:
        async with http.get(vault.url + "/vault/ready") as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == "database_unavailable"
    finally:
        await db.execute("ALTER TABLE vault_keys_away RENAME TO vault_keys")


async def test_responses_match_the_openapi_schemas(
    vault: RunningVault, http: aiohttp.ClientSession, db: asyncpg.Pool
) -> None:
    async with http.get(vault.url + "/vault/openapi.json") as response:
        document = await response.json()
    for schema in document["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)

    def check(operation: dict[str, Any], status: int, body: Any) -> None:
        content = operation["responses"][str(status)]["content"]["application/json"]
        schema = {**content["schema"], "components": document["components"]}
        Draft202012Validator(schema).validate(body)

    paths = document["paths"]
    status, issued = await _admin_call(http, vault, "POST", "/vault/keys", _issue_body())
    check(paths["/vault/keys"]["post"], status, issued)
    key_id = issued["id"]
    async with http.get(  # one proxied request, so the audit page has an entry
        vault.url + "/stripe/v1/charges",
        headers={"Authorization": f"Bearer {issued['secret']}"},
    ) as response:
        assert response.status == 403
    calls = [
        ("/vault/keys", "get", "/vault/keys?period=2026-12"),
        ("/vault/keys/{key_id}", "get", f"/vault/keys/{key_id}"),
        ("/vault/keys/{key_id}/audit", "get", f"/vault/keys/{key_id}/audit"),
        ("/vault/keys/{key_id}/reservations", "get", f"/vault/keys/{key_id}/reservations"),
        ("/vault/keys/{key_id}/revoke", "post", f"/vault/keys/{key_id}/revoke"),
        ("/vault/keys/{key_id}", "get", "/vault/keys/vkey_0000000000000000"),
        ("/vault/keys/{key_id}/audit", "get", f"/vault/keys/{key_id}/audit?limit=0"),
        ("/vault/health", "get", "/vault/health"),
    ]
    for template, method, path in calls:
        status, body = await _admin_call(http, vault, method.upper(), path)
        check(paths[template][method], status, body)

    # The statuses no input in the document can cause are documented too.
    status, body = await _admin_call(http, vault, "POST", "/vault/keys", "[" + " " * 2**20 + "]")
    assert status == 413
    check(paths["/vault/keys"]["post"], status, body)
    await db.execute("ALTER TABLE vault_keys RENAME TO vault_keys_away")
    try:
        status, body = await _admin_call(http, vault, "GET", f"/vault/keys/{key_id}")
    finally:
        await db.execute("ALTER TABLE vault_keys_away RENAME TO vault_keys")
    assert status == 500
    check(paths["/vault/keys/{key_id}"]["get"], status, body)


@pytest.mark.vault_settings(body_timeout_seconds=1)
async def test_a_body_that_never_arrives_is_refused_with_408(
    vault: RunningVault, db: asyncpg.Pool
) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
    body = json.dumps(_issue_body()).encode()
    await assert_a_slow_body_is_refused(vault.url, "POST", "/vault/keys", headers, body)
    assert await db.fetchval("SELECT count(*) FROM vault_keys") == 0

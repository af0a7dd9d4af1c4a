"""Requests the vault refuses before forwarding, each raising the stripe-python class the worker
recognises; and the audit log's one row per request."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import asyncpg
import pytest
import stripe
from stripe.params import ChargeCreateParams
from yarl import URL

from activities.stripe_failures import KEY_REFUSED, UNRECOGNIZED_URL_CODE, to_temporal_failure
from stripe_emulator import RunningEmulator
from vault.app import RunningVault, serve
from vault.client import VaultAdmin
from vault.models import IssuedKey
from vault.settings import VaultSettings

from .conftest import Issue, Secrets
from .support import (
    ADMIN_TOKEN,
    MAX_CAP_CENTS,
    assert_a_slow_body_is_refused,
    assert_consistent,
    charge,
    emulator_ledger,
    emulator_requests,
    key_request,
    proxied_calls,
    via_vault,
)

StripeFor = Callable[[IssuedKey], stripe.StripeClient]


class _WithoutIdempotencyKey(stripe.AIOHTTPClient):
    """The SDK always adds a random Idempotency-Key to a POST; this one drops it."""

    async def request_stream_async(
        self, method: str, url: str, headers: Mapping[str, str], post_data: Any = None
    ) -> Any:
        kept = {name: value for name, value in headers.items() if name != "Idempotency-Key"}
        return await super().request_stream_async(method, url, kept, post_data)


async def _post(
    http: aiohttp.ClientSession,
    vault: RunningVault,
    key: IssuedKey,
    path: str,
    body: str | dict[str, str],
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    sent = {
        "Authorization": f"Bearer {key.secret.get_secret_value()}",
        "Idempotency-Key": "raw-1",
    }
    if isinstance(body, str):
        sent["Content-Type"] = "application/x-www-form-urlencoded"
    async with http.post(
        vault.url + "/stripe" + path, data=body, headers=sent | (headers or {})
    ) as response:
        return response.status, await response.json()


async def test_unknown_key_is_an_authentication_error(
    vault: RunningVault, customer: str, http: aiohttp.ClientSession
) -> None:
    client = via_vault("vk_" + "x" * 43, vault.url, http)
    with pytest.raises(stripe.AuthenticationError) as refused:
        await charge(client, customer, 100, "k")
    assert refused.value.http_status == 401
    assert refused.value.error is not None
    assert refused.value.error.code == "vault_key_invalid"


@pytest.mark.parametrize(
    "wrong",
    ["/x", "/stripe"],
    ids=["route-it-has-not", "path-it-does-not-forward"],
)
async def test_a_vault_url_set_wrong_pauses_the_period_not_each_customer(
    issue: Issue,
    vault: RunningVault,
    http: aiohttp.ClientSession,
    emulator: RunningEmulator,
    wrong: str,
) -> None:
    """A BILLING_VAULT_URL with a path too (`.../stripe`, which the worker adds itself) got the
    vault's 404 url_invalid, mapped as the customer's own refusal: every customer a worker so
    set took was recorded failed for good (helper-189). A route the vault has not answers a
    404 with no code, as Stripe's "Unrecognized request URL" does."""
    key = await issue()
    # As activities.stripe_access.VaultAccess builds it: BILLING_VAULT_URL + "/stripe".
    client = via_vault(key.secret.get_secret_value(), vault.url + wrong, http)
    with pytest.raises(stripe.InvalidRequestError) as refused:
        await charge(client, "cus_any", 100, "billing:misrouted:2026-12")
    assert refused.value.http_status == 404
    failure = to_temporal_failure(refused.value)
    assert (failure.type, failure.details[0].code) == (KEY_REFUSED, UNRECOGNIZED_URL_CODE)
    assert await emulator_ledger(emulator) == []


async def test_endpoint_allowlist(
    issue: Issue, stripe_via_vault: StripeFor, customer: str, emulator: RunningEmulator
) -> None:
    charges_only = await issue(allowed_endpoints=["POST /v1/charges"])
    with pytest.raises(stripe.PermissionError) as refused:
        await charge(stripe_via_vault(charges_only), customer, 100, "pi-1")
    assert refused.value.http_status == 403
    assert refused.value.error is not None
    assert refused.value.error.code == "endpoint_not_allowed"
    assert await emulator_ledger(emulator) == []

    key = await issue()  # POST payment_intents, POST charges, GET payment_intents/*
    client = stripe_via_vault(key)
    intent = await charge(client, customer, 100, "pi-2")
    # `*` matches one segment: retrieving an intent is allowed, listing them is not.
    assert (await client.v1.payment_intents.retrieve_async(intent.id)).id == intent.id
    with pytest.raises(stripe.PermissionError):
        await client.v1.payment_intents.list_async()
    with pytest.raises(stripe.PermissionError):
        await client.v1.customers.retrieve_async(customer)


async def test_a_read_reaches_stripe_with_its_query(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    declining_customer: str,
    emulator: RunningEmulator,
) -> None:
    """A lookup by customer (how the worker finds a charge after the fact) must be asked of
    Stripe as sent: without its query it would list the account's charges, another
    customer's first."""
    key = await issue(allowed_endpoints=["POST /v1/charges", "GET /v1/charges"])
    client = stripe_via_vault(key)
    for who, idempotency_key in ((customer, "mine"), (declining_customer, "theirs")):
        params: ChargeCreateParams = {
            "amount": 500,
            "currency": "usd",
            "customer": who,
        }
        with contextlib.suppress(stripe.CardError):
            await client.v1.charges.create_async(params, {"idempotency_key": idempotency_key})
    listed = await client.v1.charges.list_async({"customer": customer})
    assert [found.customer for found in listed.data] == [customer]


async def test_expired_key_is_refused(
    issue: Issue, stripe_via_vault: StripeFor, customer: str, db: asyncpg.Pool
) -> None:
    key = await issue()
    await db.execute(
        "UPDATE vault_keys SET expires_at = now() - interval '1 second' WHERE id = $1", key.id
    )
    with pytest.raises(stripe.AuthenticationError) as refused:
        await charge(stripe_via_vault(key), customer, 100, "late")
    assert refused.value.error is not None
    assert refused.value.error.code == "vault_key_expired"


async def test_an_expired_key_may_not_read_either(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
) -> None:
    """The reservation refuses an expired key's charge under the key's lock, but nothing
    else: a read (or a cancel) is stopped by the vault's own key check alone, and past its
    expiry a key must reach nothing of the account."""
    key = await issue()
    client = stripe_via_vault(key)
    intent = await charge(client, customer, 100, "before")
    await db.execute(
        "UPDATE vault_keys SET expires_at = now() - interval '1 second' WHERE id = $1", key.id
    )
    with pytest.raises(stripe.AuthenticationError) as refused:
        await client.v1.payment_intents.retrieve_async(intent.id)
    assert refused.value.error is not None
    assert refused.value.error.code == "vault_key_expired"
    sent = [r["path"] for r in await emulator_requests(emulator)]
    assert [path for path in sent if path.startswith("/v1/payment_intents")] == [
        "/v1/payment_intents"
    ]


# The worker token revokes the keys it issued that no run stores any more: as dead.
@pytest.mark.parametrize("by", ["admin", "worker"])
async def test_revoke_is_a_kill_switch(
    stripe_via_vault: StripeFor,
    customer: str,
    admin: VaultAdmin,
    worker: VaultAdmin,
    secrets_seen: Secrets,
    emulator: RunningEmulator,
    by: str,
) -> None:
    token = {"admin": admin, "worker": worker}[by]
    key = await token.issue_key(key_request())
    secrets_seen.values.append(key.secret.get_secret_value())
    client = stripe_via_vault(key)
    intent = await charge(client, customer, 100, "before")
    revoked = await token.revoke(key.id)
    assert revoked.revoked_by == by
    assert revoked.revoked and revoked.revoked_at is not None
    with pytest.raises(stripe.AuthenticationError) as refused:
        await charge(client, customer, 100, "after")
    assert refused.value.error is not None
    assert refused.value.error.code == "vault_key_revoked"
    # Reads too, and replays of what was charged before.
    with pytest.raises(stripe.AuthenticationError):
        await client.v1.payment_intents.retrieve_async(intent.id)
    with pytest.raises(stripe.AuthenticationError):
        await charge(client, customer, 100, "before")
    assert len(await emulator_ledger(emulator)) == 1
    # Revoking again keeps the first revocation time.
    assert (await token.revoke(key.id)).revoked_at == revoked.revoked_at


async def test_money_moving_request_without_idempotency_key_is_refused(
    issue: Issue,
    vault: RunningVault,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    http: aiohttp.ClientSession,
) -> None:
    key = await issue()
    client = stripe.StripeClient(
        key.secret.get_secret_value(),
        base_addresses={"api": vault.url + "/stripe"},
        http_client=_WithoutIdempotencyKey(session=http),
    )
    with pytest.raises(stripe.InvalidRequestError) as refused:
        await client.v1.payment_intents.create_async(
            params={"amount": 100, "currency": "usd", "customer": customer, "confirm": True}
        )
    assert refused.value.code == "idempotency_key_required"
    assert await emulator_ledger(emulator) == []
    assert await db.fetchval("SELECT count(*) FROM vault_reservations") == 0


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        ("currency=usd", {}, 400, "parameter_missing"),
        ("amount=10.5&currency=usd", {}, 400, "parameter_invalid_integer"),
        ("amount=-5&currency=usd", {}, 400, "parameter_invalid_integer"),
        ("amount=0&currency=usd", {}, 400, "parameter_invalid_integer"),
        ("amount=100000000&currency=usd", {}, 400, "parameter_invalid_integer"),
        ("amount=1&amount=99999&currency=usd", {}, 400, "parameter_repeated"),
        # A second amount only a laxer parser than the vault's would read (trimming a space
        # after '&', splitting on ';', mending brackets): refused, not reserved at 1.
        ("amount=1&currency=usd& amount=99999", {}, 400, "parameter_name_invalid"),
        ("amount=1&currency=usd&+amount=99999", {}, 400, "parameter_name_invalid"),
        ("amount=1&description=x;amount=99999&currency=usd", {}, 400, "parameter_name_invalid"),
        ("amount=1&currency=usd&amount]=99999", {}, 400, "parameter_name_invalid"),
        ("amount=1&currency=usd&[amount]=99999", {}, 400, "parameter_name_invalid"),
        ("amount=1&currency=usd&AMOUNT=99999", {}, 400, "parameter_name_invalid"),
        ("amount=100", {}, 400, "parameter_missing"),
        # What would send the money elsewhere, within the cap (on a Connect platform).
        (
            "amount=100&currency=usd&transfer_data[destination]=acct_1",
            {},
            400,
            "parameter_not_allowed",
        ),
        ("amount=100&currency=usd&on_behalf_of=acct_1", {}, 400, "parameter_not_allowed"),
        ("amount=100&currency=usd&application_fee_amount=90", {}, 400, "parameter_not_allowed"),
        (
            "amount=100&currency=usd&automatic_payment_methods[x]=1",
            {},
            400,
            "parameter_not_allowed",
        ),
        ("amount=100&currency=usd&customer=sk_test_oops", {}, 400, "secret_in_parameter"),
        *(
            ("amount=100&currency=usd", {"Idempotency-Key": bad}, 400, "idempotency_key_invalid")
            # A slash: its reservation could never be named in the admin API's paths to settle.
            for bad in ("has space", "a/../b")
        ),
        (
            {"amount": "100", "currency": "usd"},
            {"Content-Type": "application/json"},
            400,
            "content_type_invalid",
        ),
        # Hostile values: SQL, path and encoding tricks, digits Stripe would not read as ours.
        ("amount=100&currency=usd&customer=cus_x'%20OR%201=1--", {}, 400, "parameter_invalid"),
        ("amount=100&currency=usd&customer=..%2Fcus_x", {}, 400, "parameter_invalid"),
        ("amount=%2B100&currency=usd", {}, 400, "parameter_invalid_integer"),
        ("amount=1e3&currency=usd", {}, 400, "parameter_invalid_integer"),
        ("amount=%D9%A1%D9%A0%D9%A0&currency=usd", {}, 400, "parameter_invalid_integer"),
        ("amount=100&currency=us%24", {}, 400, "parameter_invalid"),
        ("amount=100&currency=usd%00", {}, 400, "parameter_invalid"),
        ("amount=100&currency=%FF%FE", {}, 400, "body_invalid"),
        ("amount=100&currency=usd" + "&metadata[k]=v" * 1000, {}, 400, "body_invalid"),
        (
            "amount=100&currency=usd",
            {"Idempotency-Key": "vk_" + "a" * 43},
            400,
            "secret_in_parameter",
        ),
        (
            "amount=100&currency=usd&description=X" + "vk_" + "a" * 43,
            {},
            400,
            "secret_in_parameter",
        ),
        (
            "amount=100&currency=usd&metadata[note]=Xsk_live_" + "a1" * 12,
            {},
            400,
            "secret_in_parameter",
        ),
    ],
)
async def test_malformed_charges_are_refused_before_anything_is_reserved(
    issue: Issue,
    vault: RunningVault,
    http: aiohttp.ClientSession,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    body: str | dict[str, str],
    headers: dict[str, str],
    status: int,
    code: str,
) -> None:
    key = await issue()
    sent: str | dict[str, str] = body
    if isinstance(body, dict):
        sent = "&".join(f"{k}={v}" for k, v in body.items())
    got_status, reply = await _post(http, vault, key, "/v1/payment_intents", sent, headers)
    assert (got_status, reply["error"]["code"]) == (status, code)
    assert await db.fetchval("SELECT count(*) FROM vault_reservations") == 0
    assert await emulator_ledger(emulator) == []


async def test_a_body_that_is_not_a_form_says_what_is_wrong(
    issue: Issue, vault: RunningVault, http: aiohttp.ClientSession
) -> None:
    key = await issue()
    for body, message in (
        ("amount=100&currency=%FF", "not a UTF-8 form"),
        ("amount=100&currency=usd" + "&x=1" * 1000, "more than 1000 fields"),
    ):
        status, reply = await _post(http, vault, key, "/v1/payment_intents", body)
        assert status == 400
        assert message in reply["error"]["message"]


async def test_parameters_in_the_query_string_and_odd_paths_are_refused(
    issue: Issue, vault: RunningVault, http: aiohttp.ClientSession, db: asyncpg.Pool
) -> None:
    key = await issue(allowed_endpoints=["POST /v1/payment_intents", "GET /v1/payment_intents/*"])
    status, reply = await _post(
        http, vault, key, "/v1/payment_intents?amount=1", "amount=100&currency=usd"
    )
    assert (status, reply["error"]["code"]) == (400, "parameters_in_query")
    for path in ("/v1/payment_intents/..%2Fcharges", "/v1/payment_intents/a%2Fb", "/v2/x"):
        async with http.get(
            vault.url + "/stripe" + path,
            headers={"Authorization": f"Bearer {key.secret.get_secret_value()}"},
        ) as response:
            assert response.status == 404, path
            assert (await response.json())["error"]["code"] == "url_invalid"
    # Dot segments, which the upstream would resolve to a path the allowlist never saw.
    for path in ("/v1/payment_intents/..", "/v1/payment_intents/../../v1/customers"):
        answer = await _raw(
            vault,
            f"GET /stripe{path} HTTP/1.1\r\nHost: vault\r\nConnection: close\r\n"
            f"Authorization: Bearer {key.secret.get_secret_value()}\r\n\r\n".encode(),
        )
        assert answer.startswith(b"HTTP/1.1 404") and b'"url_invalid"' in answer, path
    assert await db.fetchval("SELECT count(*) FROM vault_reservations") == 0


async def test_expanding_objects_the_allowlist_refuses_is_refused(
    issue: Issue,
    stripe_via_vault: StripeFor,
    vault: RunningVault,
    customer: str,
    admin: VaultAdmin,
    http: aiohttp.ClientSession,
) -> None:
    # A key that may read charges only: `expand` would put the customer, and its card, in
    # the answer, though the key may not read customers.
    key = await issue(allowed_endpoints=["POST /v1/charges", "GET /v1/charges"])
    await stripe_via_vault(key).v1.charges.create_async(
        {"amount": 500, "currency": "usd", "customer": customer}, {"idempotency_key": "setup"}
    )
    auth = {"Authorization": f"Bearer {key.secret.get_secret_value()}"}
    listing = f"{vault.url}/stripe/v1/charges?customer={customer}"
    async with http.get(listing, headers=auth) as response:
        assert response.status == 200
        assert isinstance((await response.json())["data"][0]["customer"], str)
    for query in ("&expand[]=data.customer", "&expand%5B0%5D=data.customer", "&expand=x"):
        async with http.get(listing + query, headers=auth) as response:
            reply = await response.json()
            assert (response.status, reply["error"]["code"]) == (400, "parameter_not_allowed")
            assert reply["error"]["message"].startswith("the query string asks Stripe to expand")
    # Names a laxer parser might still read as `expand`: encoded twice, after a space or ';'.
    for query in ("&expand%255B%255D=data.customer", "&+expand[]=data.customer", ";expand=x"):
        async with http.get(listing + query, headers=auth) as response:
            reply = await response.json()
            assert (response.status, reply["error"]["code"]) == (400, "parameter_name_invalid")
    body = f"amount=500&currency=usd&customer={customer}&expand[]=customer"
    status, reply = await _post(http, vault, key, "/v1/charges", body)
    assert (status, reply["error"]["code"]) == (400, "parameter_not_allowed")
    # Nor may a GET carry parameters in a body, where the URL's check would not see them.
    async with http.get(listing, headers=auth, data="expand[]=data.customer") as response:
        reply = await response.json()
        assert (response.status, reply["error"]["code"]) == (400, "body_not_allowed")
    refused = [e.refusal_code for e in await admin.audit(key.id) if e.refusal_code]
    assert refused == (
        ["body_not_allowed", "parameter_not_allowed"]
        + ["parameter_name_invalid"] * 3
        + ["parameter_not_allowed"] * 3
    )


async def test_a_request_with_bytes_that_are_not_utf8_in_a_header_is_audited(
    issue: Issue, vault: RunningVault, db: asyncpg.Pool
) -> None:
    key = await issue()
    body = b"amount=100&currency=usd"
    host = URL(vault.url)
    assert host.host is not None and host.port is not None
    reader, writer = await asyncio.open_connection(host.host, host.port)
    writer.write(
        b"POST /stripe/v1/payment_intents HTTP/1.1\r\nHost: vault\r\n"
        b"Authorization: Bearer " + key.secret.get_secret_value().encode() + b"\r\n"
        b"Content-Type: application/x-www-form-urlencoded\r\n"
        b"Idempotency-Key: charge-\xff\r\nConnection: close\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await writer.drain()
    answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 400")
    rows = await db.fetch(
        "SELECT decision, refusal_code, idempotency_key FROM vault_audit WHERE actor IS NULL"
    )
    assert [tuple(r) for r in rows] == [("refused_request", "idempotency_key_invalid", "charge-?")]


async def test_the_audit_log_has_one_row_per_request(
    issue: Issue,
    stripe_via_vault: StripeFor,
    vault: RunningVault,
    customer: str,
    admin: VaultAdmin,
    db: asyncpg.Pool,
    http: aiohttp.ClientSession,
) -> None:
    key = await issue(cap_cents=1_500)
    client = stripe_via_vault(key)
    intent = await charge(client, customer, 1_000, "a")  # forwarded
    await charge(client, customer, 1_000, "a")  # replayed
    with pytest.raises(stripe.CardError):
        await charge(client, customer, 1_000, "b")  # refused_cap
    await client.v1.payment_intents.retrieve_async(intent.id)  # forwarded, nothing reserved
    with pytest.raises(stripe.PermissionError):
        await client.v1.customers.retrieve_async(customer)  # refused_endpoint
    await _post(http, vault, key, "/v1/payment_intents", "amount=x&currency=usd")
    async with http.get(vault.url + "/stripe/v1/charges") as response:  # no key: counted apart
        assert response.status == 401

    assert await db.fetchval("SELECT count(*) FROM vault_audit WHERE actor IS NULL") == 6
    entries = await proxied_calls(admin, key.id)
    assert [(e.decision, e.refusal_code) for e in entries] == [
        ("refused_request", "parameter_invalid_integer"),
        ("refused_endpoint", "endpoint_not_allowed"),
        ("forwarded", None),
        ("refused_cap", "spend_cap_exceeded"),
        ("replayed", None),
        ("forwarded", None),
    ]
    first = entries[-1]
    assert (first.method, first.path, first.idempotency_key) == ("POST", "/v1/payment_intents", "a")
    assert (first.amount_cents, first.currency, first.customer) == (1_000, "usd", customer)
    assert (first.upstream_status, first.reservation_state) == (200, "committed")
    assert first.latency_ms > 0
    assert entries[2].path == f"/v1/payment_intents/{intent.id}"
    assert entries[2].reservation_state is None
    # A replay of a charge counted already says so: what it found, and left, committed.
    assert entries[4].reservation_state == "committed"

    # Pages of two, newest first, following `before`.
    pages, before = [], None
    while page := await admin.audit(key.id, limit=2, before=before):
        pages.append([e.id for e in page])
        before = page[-1].id
    # The key's issue comes first, beside its six requests.
    everything = await admin.audit(key.id)
    assert [e.decision for e in everything[6:]] == ["issued"]
    assert [i for p in pages for i in p] == [e.id for e in everything]
    assert [len(p) for p in pages] == [2, 2, 2, 1]
    await assert_consistent(db, key.id)


async def test_the_audit_row_names_a_reads_query_redacted_and_bounded(
    issue: Issue,
    vault: RunningVault,
    customer: str,
    admin: VaultAdmin,
    http: aiohttp.ClientSession,
) -> None:
    # Which customer or page a list read asked for is what an auditor of a key needs.
    key = await issue(allowed_endpoints=["GET /v1/charges"])
    bearer = {"Authorization": f"Bearer {key.secret.get_secret_value()}"}
    queries = [
        f"customer={customer}&limit=3",
        "customer=cus%5Fa+b&starting_after=" + "x" * 2_000,  # decoded, and clipped
        "customer=sk%5Ftest%5F" + "A" * 30,  # a percent-encoded key: refused, and redacted
        "customer=%2573k%255Ftest%255F" + "A" * 30,  # so is one encoded twice
    ]
    for query in queries:
        async with http.get(
            URL(f"{vault.url}/stripe/v1/charges?{query}", encoded=True), headers=bearer
        ):
            pass
    async with http.get(vault.url + "/stripe/v1/charges", headers=bearer):
        pass
    calls = list(reversed(await proxied_calls(admin, key.id)))
    plain, long, encoded_key, twice, bare = (e.path for e in calls)
    assert [e.refusal_code for e in calls[2:4]] == ["secret_in_parameter"] * 2
    assert plain == f"/v1/charges?customer={customer}&limit=3"
    assert long.startswith("/v1/charges?customer=cus_a b&starting_after=xxx")
    assert len(long) == len("/v1/charges?") + 500
    assert encoded_key == twice == "/v1/charges?customer=[redacted key]"
    assert bare == "/v1/charges"


async def _forge_key(
    db: asyncpg.Pool,
    secrets_seen: Secrets,
    *,
    cap_cents: int = 100_000,
    daily_cap_cents: int | None = None,
    allowed_endpoints: list[str] | None = None,
    issued_by: str = "admin",
) -> tuple[str, str]:
    """A key row written straight into vault_keys, past the admin API, as a role that can
    write the vault's tables could: (key id, secret)."""
    secret = "vk_" + secrets.token_urlsafe(32)
    secrets_seen.values.append(secret)
    key_id = "vkey_" + secrets.token_hex(8)
    await db.execute(
        """
        INSERT INTO vault_keys (id, secret_sha256, vendor, label, period, currency, cap_cents,
                                daily_cap_cents, allowed_endpoints, expires_at, issued_by)
        VALUES ($1, $2, 'stripe', 'billing', '2026-12', 'usd', $3, $4, $5,
                now() + interval '10 years', $6)
        """,
        key_id,
        hashlib.sha256(secret.encode()).digest(),
        cap_cents,
        daily_cap_cents,
        allowed_endpoints or ["POST /v1/payment_intents", "GET /v1/payment_intents/*"],
        issued_by,
    )
    return key_id, secret


@pytest.mark.parametrize(
    ("forged", "why"),
    [
        ({"cap_cents": 2**62}, "cap_cents"),
        ({"cap_cents": MAX_CAP_CENTS + 1}, "cap_cents"),
        ({"daily_cap_cents": MAX_CAP_CENTS + 1}, "daily_cap_cents"),
        ({"allowed_endpoints": ["POST /v1/payment_intents", "POST /v1/refunds"]}, "endpoint"),
        ({"allowed_endpoints": ["GET /v1/customers"], "issued_by": "worker"}, "worker token"),
    ],
    ids=["cap-2^62", "cap-past-ceiling", "daily-cap-past-ceiling", "refunds", "worker-reads"],
)
async def test_a_key_row_the_vault_could_never_have_issued_is_refused_and_audited(
    db: asyncpg.Pool,
    vault: RunningVault,
    http: aiohttp.ClientSession,
    customer: str,
    emulator: RunningEmulator,
    secrets_seen: Secrets,
    forged: dict[str, Any],
    why: str,
) -> None:
    # Whoever can write vault_keys (the ledger's role, today) must not get a key past
    # VAULT_MAX_CAP_CENTS, the entry pattern or the worker endpoints by writing the row.
    key_id, secret = await _forge_key(db, secrets_seen, **forged)
    headers = {
        "Authorization": f"Bearer {secret}",
        "Content-Type": "application/x-www-form-urlencoded",
        "Idempotency-Key": "forged-1",
    }
    async with http.post(
        vault.url + "/stripe/v1/payment_intents",
        data=f"amount={MAX_CAP_CENTS + 1_000_000}&currency=usd&customer={customer}"
        "&confirm=true&off_session=true&payment_method=pm_card_visa",
        headers=headers,
    ) as response:
        status, body = response.status, await response.json()
    async with http.get(vault.url + "/stripe/v1/customers", headers=headers) as response:
        read_status = response.status
    assert (status, read_status) == (403, 403)
    assert body["error"]["code"] == "vault_key_not_issuable"
    assert why in body["error"]["message"]
    assert secret not in str(body)
    assert await emulator_ledger(emulator) == []
    rows = await db.fetch(
        "SELECT decision, refusal_code, path FROM vault_audit WHERE vault_key_id = $1 ORDER BY id",
        key_id,
    )
    assert [tuple(row) for row in rows] == [
        ("refused_auth", "vault_key_not_issuable", "/v1/payment_intents"),
        ("refused_auth", "vault_key_not_issuable", "/v1/customers"),
    ]
    assert await db.fetchval("SELECT count(*) FROM vault_reservations") == 0


async def test_a_key_row_written_as_the_api_would_issue_it_is_honoured(
    db: asyncpg.Pool,
    vault: RunningVault,
    http: aiohttp.ClientSession,
    customer: str,
    secrets_seen: Secrets,
) -> None:
    # The check refuses what no issue could write, not rows as such: a worker key at the
    # ceiling with the worker endpoints is served (the budget is the issue's to enforce).
    _, secret = await _forge_key(
        db,
        secrets_seen,
        cap_cents=MAX_CAP_CENTS,
        daily_cap_cents=MAX_CAP_CENTS,
        allowed_endpoints=["GET /v1/charges", "POST /v1/payment_intents"],
        issued_by="worker",
    )
    async with http.get(
        vault.url + f"/stripe/v1/charges?customer={customer}",
        headers={"Authorization": f"Bearer {secret}"},
    ) as response:
        assert response.status == 200


@pytest.mark.vault_settings(header_timeout_seconds=1)
async def test_a_client_that_never_finishes_its_headers_is_dropped(vault: RunningVault) -> None:
    """Slowloris: a header line every so often, never the blank line that ends them. Each
    line that arrives does not restart the clock."""
    url = URL(vault.url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    started = time.monotonic()

    async def trickle() -> None:
        writer.write(b"GET /stripe/v1/charges HTTP/1.1\r\nHost: vault\r\n")
        for line in itertools.count():
            await asyncio.sleep(0.2)
            writer.write(b"X-Slow-%d: x\r\n" % line)

    trickling = asyncio.create_task(trickle())
    try:
        async with asyncio.timeout(5):
            answer = await reader.read()
    finally:
        trickling.cancel()
        writer.close()
    assert answer == b""  # closed with no answer: no request had arrived to answer
    assert time.monotonic() - started < 3


@pytest.mark.vault_settings(body_timeout_seconds=1)
async def test_a_body_that_never_arrives_is_refused_with_408_and_nothing_reserved(
    vault: RunningVault, issue: Issue, customer: str, db: asyncpg.Pool
) -> None:
    key = await issue()
    headers = {
        "Authorization": f"Bearer {key.secret.get_secret_value()}",
        "Idempotency-Key": "slow-body",
        "Content-Type": "application/x-www-form-urlencoded",
    }
    body = f"amount=1000&currency=usd&customer={customer}".encode()
    await assert_a_slow_body_is_refused(
        vault.url, "POST", "/stripe/v1/payment_intents", headers, body
    )
    assert await db.fetchval("SELECT count(*) FROM vault_reservations") == 0
    audited = await db.fetch(
        "SELECT decision, idempotency_key FROM vault_audit WHERE refusal_code = 'body_timeout'"
    )
    assert [tuple(row) for row in audited] == [("refused_request", "slow-body")]


async def _get_with(http: aiohttp.ClientSession, vault: RunningVault, token: str | None) -> int:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with http.get(vault.url + "/stripe/v1/payment_intents/pi_1", headers=headers) as r:
        return r.status


async def _raw(vault: RunningVault, request: bytes) -> bytes:
    host = URL(vault.url)
    assert host.host is not None and host.port is not None
    reader, writer = await asyncio.open_connection(host.host, host.port)
    writer.write(request)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


async def test_a_key_with_a_byte_that_is_not_utf8_is_counted_not_audited_nor_a_500(
    vault: RunningVault, db: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """A bearer token that starts `vk_` but holds a byte that is not UTF-8 is no known vault
    key: 401, counted per peer, no audit row. Hashed strictly, it raised: a 500 saying
    "retry", a traceback logged at ERROR and an audit row with no key, one per request, for
    anyone who can reach the port (helper-161 F1)."""
    for _ in range(3):
        answer = await _raw(
            vault,
            b"GET /stripe/v1/payment_intents/pi_1 HTTP/1.1\r\nHost: vault\r\n"
            b"Authorization: Bearer vk_abc\xff\r\nConnection: close\r\n\r\n",
        )
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert await db.fetchval("SELECT count(*) FROM vault_audit WHERE vault_key_id IS NULL") == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_requests_with_no_known_key_are_counted_per_peer_not_audited_one_by_one(
    vault_settings: VaultSettings, http: aiohttp.ClientSession, db: asyncpg.Pool
) -> None:
    tokens = [None, "not-a-vault-key"] * 50 + [
        f"vk_{secrets.token_urlsafe(32)}" for _ in range(100)
    ]
    async with serve(vault_settings) as vault, VaultAdmin(vault.url, ADMIN_TOKEN) as admin:
        revoked = await admin.issue_key(key_request())
        await admin.revoke(revoked.id)
        revoked_secret = revoked.secret.get_secret_value()
        assert await _get_with(http, vault, revoked_secret) == 401
        statuses = await asyncio.gather(*(_get_with(http, vault, token) for token in tokens))
        for _ in range(2):
            assert await _get_with(http, vault, revoked_secret) == 401
        # A key's refusals are still audited one by one.
        entries = await proxied_calls(admin, revoked.id)
        assert [e.refusal_code for e in entries] == ["vault_key_revoked"] * 3
        # A live key's requests are looked up and forwarded as ever.
        live = await admin.issue_key(key_request())
        assert await _get_with(http, vault, live.secret.get_secret_value()) == 404  # Stripe's
    # Stopped, the vault has written what this window counted.

    assert await db.fetchval("SELECT count(*) FROM vault_audit WHERE vault_key_id IS NULL") == 0
    assert set(statuses) == {401}
    counted = await db.fetch("SELECT peer, requests FROM vault_unauthenticated")
    assert [tuple(row) for row in counted] == [("127.0.0.1", len(tokens))]

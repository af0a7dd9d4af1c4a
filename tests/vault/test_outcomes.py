"""What the upstream's answer does to a reservation: success commits, a definite refusal
releases, no answer (dropped, timeout, 5xx) keeps it counted as unknown until a replay or
reconciliation settles it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import asyncpg
import pytest
import stripe
from aiohttp import web
from aiohttp.client_proto import ResponseHandler
from pydantic import SecretStr
from stripe.params import PaymentIntentCreateParams
from yarl import URL

from devstack.postgres import LocalPostgres
from stripe_emulator import RunningEmulator
from stripe_emulator.client import EmulatorClient
from tests.prometheus import metric_value
from tests.waiting import eventually, waits_on_a_lock
from vault import reservations, send_deadline, store
from vault import state as vault_state
from vault.app import RunningVault, serve
from vault.client import VaultAdmin, VaultConflict, VaultInvalidRequest, VaultNotFound
from vault.models import IssuedKey
from vault.proxy import _Answer, _outcome
from vault.reservations import Charge
from vault.settings import VaultSettings

from .conftest import Issue, Secrets
from .support import (
    ADMIN_TOKEN,
    UPSTREAM_SECRET,
    a_reservation_waits_for_a_lock,
    assert_consistent,
    charge,
    charge_in_doubt,
    emulator_ledger,
    key_request,
    proxied_calls,
    reserve_behind_a_lock,
    set_faults,
    stand_in_upstream,
    via_vault,
)

StripeFor = Callable[[IssuedKey], stripe.StripeClient]


async def _states(db: asyncpg.Pool, key_id: str) -> dict[str, str]:
    rows = await db.fetch(
        "SELECT idempotency_key, state FROM vault_reservations WHERE vault_key_id = $1", key_id
    )
    return {row["idempotency_key"]: row["state"] for row in rows}


async def test_dropped_response_keeps_the_reservation_until_a_replay_settles_it(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    admin: VaultAdmin,
) -> None:
    key = await issue(cap_cents=10_000)
    client = stripe_via_vault(key)
    await set_faults(emulator, drop_after_commit=1.0)
    with pytest.raises(stripe.APIError) as failed:
        await charge(client, customer, 6_000, "dropped")
    assert failed.value.http_status == 502
    # A retry with the key gets the answer (a replay) or makes the charge: the SDK, with
    # retries on, may send it.
    assert (failed.value.headers or {}).get("Stripe-Should-Retry") == "true"

    assert await _states(db, key.id) == {"dropped": "unknown"}
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (6_000, 0)
    assert [r.idempotency_key for r in await admin.unknown_reservations(key.id)] == ["dropped"]
    # Stripe may have charged: the room stays taken.
    with pytest.raises(stripe.CardError):
        await charge(client, customer, 6_000, "another")

    await set_faults(emulator, drop_after_commit=0.0)
    replayed = await charge(client, customer, 6_000, "dropped")
    assert replayed.status == "succeeded"
    assert await _states(db, key.id) == {"dropped": "committed"}
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 6_000)
    assert len(await emulator_ledger(emulator)) == 1
    decisions = [(e.decision, e.reservation_state) for e in await proxied_calls(admin, key.id)]
    assert decisions == [
        ("replayed", "committed"),
        ("refused_cap", None),
        ("forwarded", "unknown"),
    ]


async def test_a_retry_stripe_executes_anew_is_audited_as_forwarded_not_replayed(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    emulator: RunningEmulator,
    admin: VaultAdmin,
) -> None:
    # Stripe failed before executing anything and saved nothing: the retry takes the
    # reservation over and is the request that charges, which the audit must say.
    key = await issue()
    client = stripe_via_vault(key)
    await charge_in_doubt(emulator, client, customer, 1_500, "flaky", "error_before_commit")
    intent = await charge(client, customer, 1_500, "flaky")
    assert intent.last_response is not None
    assert intent.last_response.headers.get("Idempotent-Replayed") is None
    assert len(await emulator_ledger(emulator)) == 1
    decisions = [(e.decision, e.reservation_state) for e in await proxied_calls(admin, key.id)]
    assert decisions == [("forwarded", "committed"), ("forwarded", "unknown")]


async def test_a_committed_charge_stripe_executes_anew_is_audited_as_forwarded_and_warned(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    emulator: RunningEmulator,
    admin: VaultAdmin,
    db: asyncpg.Pool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Resolved as charged while Stripe had charged nothing: the next request with its key is
    # sent on the committed reservation, and Stripe executes it. The audit says so, and the
    # vault warns; the charge is counted once, by the commit, not again.
    key = await issue()
    client = stripe_via_vault(key)
    await charge_in_doubt(emulator, client, customer, 1_000, "k1", fault="error_before_commit")
    assert await emulator_ledger(emulator) == []
    await admin.resolve(key.id, "k1", "succeeded")
    await charge(client, customer, 1_000, "k1")  # executed by Stripe now
    await charge(client, customer, 1_000, "k1")  # and now replayed
    assert len(await emulator_ledger(emulator)) == 1
    decisions = [(e.decision, e.upstream_status) for e in await proxied_calls(admin, key.id)]
    assert decisions[:2] == [("replayed", 200), ("forwarded", 200)]
    warned = [r.getMessage() for r in caplog.records if "afresh" in r.getMessage()]
    assert len(warned) == 1 and key.id in warned[0] and "k1" in warned[0]
    spent = await db.fetchval("SELECT spent_cents FROM vault_keys WHERE id = $1", key.id)
    assert spent == 1_000
    await assert_consistent(db, key.id)


@pytest.mark.parametrize("in_doubt", [False, True], ids=["first", "after-a-500-in-doubt"])
async def test_decline_releases_the_reservation(
    issue: Issue,
    stripe_via_vault: StripeFor,
    declining_customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    in_doubt: bool,
) -> None:
    """A decline frees the room. After a first attempt met a 500 Stripe did not save (in
    doubt), its retry declined is one Stripe had saved nothing for: no charge was made, and
    the room is freed rather than held until reconciliation."""
    key = await issue(cap_cents=10_000)
    client = stripe_via_vault(key)
    if in_doubt:
        await charge_in_doubt(
            emulator, client, declining_customer, 10_000, "declined", "error_before_commit"
        )
        assert await _states(db, key.id) == {"declined": "unknown"}
    with pytest.raises(stripe.CardError) as declined:
        await charge(client, declining_customer, 10_000, "declined")
    assert declined.value.code == "card_declined"
    assert await _states(db, key.id) == {"declined": "released"}
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 0)

    # A retry is counted again while in flight, and Stripe replays the decline.
    with pytest.raises(stripe.CardError):
        await charge(client, declining_customer, 10_000, "declined")
    assert await _states(db, key.id) == {"declined": "released"}
    await assert_consistent(db, key.id)


async def test_error_before_commit_is_unknown_then_settled_by_the_replay(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
) -> None:
    key = await issue()
    client = stripe_via_vault(key)
    await set_faults(emulator, error_before_commit=1.0)
    with pytest.raises(stripe.APIError):
        await charge(client, customer, 1_500, "flaky")
    assert await _states(db, key.id) == {"flaky": "unknown"}
    await set_faults(emulator, error_before_commit=0.0)
    await charge(client, customer, 1_500, "flaky")
    assert await _states(db, key.id) == {"flaky": "committed"}
    assert (await assert_consistent(db, key.id))["spent_cents"] == 1_500


async def test_stripes_retry_advice_and_request_id_come_back_through_the_vault(
    issue: Issue, stripe_via_vault: StripeFor, customer: str, emulator: RunningEmulator
) -> None:
    """A 500 Stripe saved for the key is replayed on every retry, and Stripe says so
    (`Stripe-Should-Retry: false`): the SDK, with retries on, follows that, and its
    `Request-Id` is what Stripe's support asks for."""
    client = stripe_via_vault(await issue())
    await set_faults(emulator, error_saved_before_commit=1.0)
    with pytest.raises(stripe.APIError) as failed:
        await charge(client, customer, 1_500, "saved-500")
    assert (failed.value.headers or {}).get("Stripe-Should-Retry") == "false"
    assert (failed.value.request_id or "").startswith("req_")


async def test_reconciliation_resolves_an_unknown_reservation(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    admin: VaultAdmin,
) -> None:
    key = await issue()
    client = stripe_via_vault(key)
    # Stripe saved a 500 after charging: every replay gets the 500 again.
    await set_faults(emulator, error_after_commit=1.0)
    for _ in range(2):
        with pytest.raises(stripe.APIError):
            await charge(client, customer, 2_000, "charged-then-500")
        assert await _states(db, key.id) == {"charged-then-500": "unknown"}
    await set_faults(emulator, error_after_commit=0.0, error_before_commit=1.0)
    with pytest.raises(stripe.APIError):
        await charge(client, customer, 700, "never-charged")

    with pytest.raises(VaultInvalidRequest):
        await admin.resolve(key.id, "charged-then-500", "succeeded", amount_cents=2_001)
    # Found for the first attempt, but a retry (the second) has taken it over since.
    with pytest.raises(VaultConflict, match="retried since attempt 1"):
        await admin.resolve(key.id, "charged-then-500", "succeeded", attempt=1)
    resolved = await admin.resolve(key.id, "charged-then-500", "succeeded", attempt=2)
    assert (resolved.state, resolved.committed_cents) == ("committed", 2_000)
    # Repeating the same resolution is harmless; contradicting it is refused, another amount
    # too (taken for a repeat, a correction would be answered done and change nothing).
    await admin.resolve(key.id, "charged-then-500", "succeeded")
    await admin.resolve(key.id, "charged-then-500", "succeeded", amount_cents=2_000)
    with pytest.raises(VaultConflict):
        await admin.resolve(key.id, "charged-then-500", "failed")
    with pytest.raises(VaultConflict, match="already committed"):
        await admin.resolve(key.id, "charged-then-500", "succeeded", amount_cents=1_500)
    # Unknown only a moment ago, by the vault's clock: Stripe may still commit it.
    with pytest.raises(VaultConflict, match="Stripe may still commit it"):
        await admin.resolve(key.id, "never-charged", "failed", min_idle_seconds=600)
    # The wait counts past the vault's longest wait on Stripe (its 5 s upstream timeout and
    # a 10 s margin): a reservation found stale last changed when its attempt was sent.
    await db.execute(
        "UPDATE vault_reservations SET updated_at = now() - interval '601 seconds'"
        " WHERE idempotency_key = 'never-charged'"
    )
    with pytest.raises(VaultConflict, match="after the vault's 15 s wait on Stripe"):
        await admin.resolve(key.id, "never-charged", "failed", min_idle_seconds=600)
    await db.execute(
        "UPDATE vault_reservations SET updated_at = now() - interval '616 seconds'"
        " WHERE idempotency_key = 'never-charged'"
    )
    released = await admin.resolve(key.id, "never-charged", "failed", min_idle_seconds=600)
    assert released.state == "released"
    with pytest.raises(VaultNotFound):
        await admin.resolve(key.id, "no-such-key", "failed")

    assert await admin.unknown_reservations(key.id) == []
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 2_000)


@pytest.mark.parametrize("daily", [False, True], ids=["cap", "daily-cap"])
async def test_a_charge_in_doubt_found_for_less_frees_the_rest_of_its_room(
    issue: Issue, admin: VaultAdmin, customer: str, db: asyncpg.Pool, daily: bool
) -> None:
    """Reconciliation finds a charge in doubt made for less than was reserved: its whole
    reservation leaves reserved, only what Stripe took is spent, and the rest of the room
    (the key's, or the day's) takes another charge."""
    caps = {"cap_cents": 10_000, "daily_cap_cents": 2_000} if daily else {"cap_cents": 2_000}
    key = await issue(**caps)
    sent = Charge("POST /v1/payment_intents", 2_000, "usd", customer)
    async with db.acquire() as conn:
        lost = await reservations.reserve(conn, key.id, "in-doubt", sent, timedelta(minutes=5))
        assert await reservations.settle(conn, lost, "unknown", None) == "unknown"
    resolved = await admin.resolve(key.id, "in-doubt", "succeeded", amount_cents=1_500)
    assert (resolved.state, resolved.committed_cents) == ("committed", 1_500)
    # The audit says what the settlement committed, not what was reserved.
    [audited] = [e for e in await admin.audit(key.id) if e.decision == "resolved"]
    assert (audited.reservation_state, audited.amount_cents) == ("committed", 1_500)
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 1_500)
    rest = Charge("POST /v1/payment_intents", 500, "usd", customer)
    async with db.acquire() as conn:
        assert (await reservations.reserve(conn, key.id, "rest", rest, timedelta(minutes=5))).owned
    await assert_consistent(db, key.id)


async def postgres_stopped_mid_charge(
    client: stripe.StripeClient,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    postgres: LocalPostgres,
    key_id: str,
    idempotency_key: str,
    latency_ms: int,
) -> asyncio.Task[stripe.PaymentIntent]:
    """A charge of 2,500 cents through the vault, Stripe answering after `latency_ms`, and
    PostgreSQL stopped once the charge is reserved; returns the charge, still in flight."""
    await set_faults(emulator, latency_ms=latency_ms)
    charging = asyncio.create_task(charge(client, customer, 2_500, idempotency_key))

    async def reserved() -> bool:
        return await _states(db, key_id) == {idempotency_key: "pending"}

    await eventually(reserved, timeout=10)
    await asyncio.to_thread(postgres.stop)
    return charging


async def test_a_database_outage_while_stripe_charges_still_settles_the_reservation(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    admin: VaultAdmin,
    postgres: LocalPostgres,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """PostgreSQL stops while the charge is at Stripe and is back a moment after Stripe has
    answered: the vault keeps trying its writes, so the money is committed and audited
    instead of left pending until reconciliation."""
    key = await issue()
    charging = await postgres_stopped_mid_charge(
        stripe_via_vault(key), customer, db, emulator, postgres, key.id, "outage", 1_500
    )

    async def settle_met_the_outage() -> bool:
        return any(r.name == "vault.store" for r in caplog.records)

    # Stripe answers meanwhile, and the settle finds the database down; PostgreSQL is started
    # at once, so a slow start on a loaded machine still lands within the client's wait.
    await eventually(settle_met_the_outage, timeout=10)
    await asyncio.to_thread(postgres.start)

    intent = await charging
    assert intent.status == "succeeded"
    assert await _states(db, key.id) == {"outage": "committed"}
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 2_500)
    audited = [(e.decision, e.reservation_state) for e in await proxied_calls(admin, key.id)]
    assert audited == [("forwarded", "committed")]


async def test_a_key_not_checkable_in_a_database_outage_is_counted_not_audited(
    issue: Issue,
    vault: RunningVault,
    http: aiohttp.ClientSession,
    db: asyncpg.Pool,
    postgres: LocalPostgres,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """PostgreSQL away: a request whose key cannot be looked up is answered 503 "retry" and
    counted per peer, as one with no known key. It was a 500 with a traceback and a keyless
    audit row, which waited behind answers among the settles of charges sent before the
    outage and, in a flood, could crowd them out (helper-161 F1)."""
    key = await issue()
    await asyncio.to_thread(postgres.stop)
    try:
        async with http.get(
            f"{vault.url}/stripe/v1/payment_intents/pi_1",
            headers={"Authorization": f"Bearer {key.secret.get_secret_value()}"},
        ) as response:
            answer = (response.status, response.headers["Stripe-Should-Retry"])
            code = (await response.json())["error"]["code"]
    finally:
        await asyncio.to_thread(postgres.start)
    assert (answer, code) == ((503, "true"), "vault_database_unavailable")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert await db.fetchval("SELECT count(*) FROM vault_audit WHERE vault_key_id IS NULL") == 0


async def test_a_database_outage_past_the_retries_settles_the_reservation_once_it_ends(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    admin: VaultAdmin,
    postgres: LocalPostgres,
) -> None:
    """PostgreSQL stays down past the 5 s the client waits for each write: the answer goes
    back with the reservation pending, and its settle and audit row land once PostgreSQL is
    back, with no reconciliation."""
    key = await issue()
    landed = {kind: late_writes(kind, "landed") for kind in ("settle", "audit")}
    charging = await postgres_stopped_mid_charge(
        stripe_via_vault(key), customer, db, emulator, postgres, key.id, "long-outage", 1_000
    )
    try:
        intent = await charging
    finally:
        await asyncio.to_thread(postgres.start)
    assert intent.status == "succeeded"

    async def settled() -> bool:
        return await _states(db, key.id) == {"long-outage": "committed"}

    await eventually(settled, timeout=30)
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 2_500)

    async def audited() -> bool:
        return [(e.decision, e.reservation_state) for e in await proxied_calls(admin, key.id)] == [
            ("forwarded", "pending")
        ]

    await eventually(audited, timeout=30)

    async def counted() -> bool:
        # What an operator watches: each write went behind its answer, and landed.
        return {kind: late_writes(kind, "landed") - n for kind, n in landed.items()} == {
            "settle": 1,
            "audit": 1,
        }

    await eventually(counted, timeout=5)


def late_writes(kind: str, result: str) -> float:
    return metric_value("vault_late_writes_total", kind=kind, result=result)


async def test_an_answer_settled_late_still_settles_its_attempt_found_stale(
    issue: Issue, db: asyncpg.Pool
) -> None:
    key = await issue()
    charge = Charge("POST /v1/payment_intents", 900, "usd", None)
    async with db.acquire() as conn:
        reservation = await reservations.reserve(
            conn, key.id, "late", charge, timedelta(seconds=15)
        )
        # Found stale while its settle waited for the database: unknown now.
        await conn.execute(
            "UPDATE vault_reservations SET state = 'unknown' WHERE id = $1", reservation.id
        )
        assert await reservations.settle(conn, reservation, "succeeded", 200) == "committed"
        # An answer for an attempt a retry has since replaced settles nothing.
        stale = dataclasses.replace(reservation, attempt=reservation.attempt - 1)
        assert await reservations.settle(conn, stale, "failed", 402) == "committed"
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 900)


async def test_an_answer_settled_late_after_a_resolve_settled_its_attempt_counts_nothing(
    issue: Issue, db: asyncpg.Pool
) -> None:
    """Reconciliation resolved the attempt from Stripe while its own answer waited for the
    database: that answer, settled late, finds the attempt settled and counts its money
    neither a second time nor back out of another charge's reservation."""
    key = await issue()
    stale_after = timedelta(seconds=15)
    async with db.acquire() as conn:
        other = Charge("POST /v1/payment_intents", 2_000, "usd", None)
        await reservations.reserve(conn, key.id, "other", other, stale_after)
        late = Charge("POST /v1/payment_intents", 900, "usd", None)
        reservation = await reservations.reserve(conn, key.id, "late", late, stale_after)
        await conn.execute(
            "UPDATE vault_reservations SET state = 'unknown' WHERE id = $1", reservation.id
        )
        resolved = await reservations.resolve(
            conn, key.id, "late", "succeeded", None, None, None, stale_after
        )
        assert resolved.state == "committed"
        answers: tuple[reservations.Outcome, ...] = ("succeeded", "failed")
        for outcome in answers:
            assert await reservations.settle(conn, reservation, outcome, 200) == "committed"
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (2_000, 900)


async def test_an_audit_row_whose_connection_dropped_after_the_commit_is_written_once(
    db: asyncpg.Pool,
) -> None:
    """The vault retries its audit insert through an outage; when the first try committed
    and only the connection was lost, the retry must not audit the request a second time."""
    record = store.AuditRecord(method="POST", path="/v1/payment_intents", decision="forwarded")
    tries = 0

    async def insert_then_lose_the_connection(conn: asyncpg.Connection) -> None:
        nonlocal tries
        tries += 1
        await store.insert_audit(conn, record)
        if tries == 1:
            raise asyncpg.ConnectionDoesNotExistError("connection lost after the commit")

    await store.through_outage(db, timedelta(seconds=5), insert_then_lose_the_connection)
    assert tries == 2
    assert await db.fetchval("SELECT count(*) FROM vault_audit") == 1


async def test_a_connection_left_mid_statement_is_dropped_and_the_write_goes_on(
    db: asyncpg.Pool,
) -> None:
    """After a restart asyncpg can hand back a connection that still believes a statement
    is in progress (InternalClientError): the vault dropped the audit row and answered 500
    in place of the charge's own answer. The write now goes on through another connection."""
    record = store.AuditRecord(method="POST", path="/v1/payment_intents", decision="forwarded")
    backends: list[int] = []

    async def insert_after_a_broken_connection(conn: asyncpg.Connection) -> None:
        backends.append(conn.get_server_pid())
        if len(backends) == 1:
            raise asyncpg.InternalClientError(
                "cannot switch to state 12; another operation (2) is in progress"
            )
        await store.insert_audit(conn, record)

    await store.through_outage(db, timedelta(seconds=5), insert_after_a_broken_connection)
    assert len(backends) == 2
    assert await db.fetchval("SELECT count(*) FROM vault_audit") == 1

    async def broken_one_closed() -> bool:
        query = "SELECT count(*) FROM pg_stat_activity WHERE pid = $1"
        left: int = await db.fetchval(query, backends[0])
        return left == 0

    # Not handed back to the pool: its session is gone.
    await eventually(broken_one_closed, timeout=5)


async def test_upstream_timeout_is_unknown_and_a_later_replay_commits(
    vault_settings: VaultSettings,
    emulator: RunningEmulator,
    customer: str,
    db: asyncpg.Pool,
    issue: Issue,
) -> None:
    key = await issue()
    impatient = vault_settings.model_copy(update={"upstream_timeout_seconds": 0.3})
    await set_faults(emulator, latency_ms=600)
    async with serve(impatient) as vault, aiohttp.ClientSession() as session:
        client = via_vault(key.secret.get_secret_value(), vault.url, session)
        with pytest.raises(stripe.APIError) as failed:
            await charge(client, customer, 900, "slow")
        assert failed.value.http_status == 504
        assert await _states(db, key.id) == {"slow": "unknown"}
        await set_faults(emulator, latency_ms=0)
        # The emulator answers 409 while the first request still executes there; that proves
        # nothing about the money, so the reservation stays unknown until a real answer.
        while True:
            try:
                await charge(client, customer, 900, "slow")
                break
            except stripe.APIError as error:
                assert error.http_status == 409
                assert await _states(db, key.id) == {"slow": "unknown"}
                await asyncio.sleep(0.1)
    assert await _states(db, key.id) == {"slow": "committed"}
    assert (await assert_consistent(db, key.id))["spent_cents"] == 900


async def test_a_forward_that_fails_in_the_vault_leaves_the_reservation_unknown(
    vault_settings: VaultSettings,
    emulator: RunningEmulator,
    customer: str,
    db: asyncpg.Pool,
    issue: Issue,
) -> None:
    """A forward that fails for a reason neither Stripe's nor the network's (here a header
    aiohttp refuses to send; a bug would do the same) may or may not have gone out: the
    reservation is settled unknown, not left pending, so the retry is not refused as in
    flight and the cap does not hold the amount against it. Before, it stayed pending."""
    key = await issue()
    refused_header = vault_settings.model_copy(
        update={"upstream_stripe_secret": SecretStr(UPSTREAM_SECRET + "\n")}
    )
    async with serve(refused_header) as vault, aiohttp.ClientSession() as session:
        client = via_vault(key.secret.get_secret_value(), vault.url, session)
        with pytest.raises(stripe.APIError) as failed:
            await charge(client, customer, 900, "refused-header")
    assert failed.value.http_status == 500
    assert "retry with the same Idempotency-Key" in str(failed.value)
    assert await _states(db, key.id) == {"refused-header": "unknown"}
    async with serve(vault_settings) as vault, aiohttp.ClientSession() as session:
        client = via_vault(key.secret.get_secret_value(), vault.url, session)
        await charge(client, customer, 900, "refused-header")
    assert await _states(db, key.id) == {"refused-header": "committed"}
    assert (await assert_consistent(db, key.id))["spent_cents"] == 900
    assert len(await emulator_ledger(emulator)) == 1


async def test_a_reservation_left_pending_by_a_stopped_vault_is_taken_over_once_stale(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
) -> None:
    key = await issue()
    client = stripe_via_vault(key)
    await charge_in_doubt(emulator, client, customer, 1_200, "orphan")

    # As if a vault had stopped mid-request a moment ago: in flight, so a replay must wait.
    await db.execute(
        "UPDATE vault_reservations SET state = 'pending' WHERE vault_key_id = $1", key.id
    )
    with pytest.raises(stripe.APIError) as busy:
        await charge(client, customer, 1_200, "orphan")
    assert busy.value.http_status == 409
    # As Stripe answers a request whose key is in flight: retry once it has its answer.
    assert (busy.value.headers or {}).get("Stripe-Should-Retry") == "true"
    assert await _states(db, key.id) == {"orphan": "pending"}

    # Older than any request could take: taken over by the next replay.
    await db.execute(
        "UPDATE vault_reservations SET updated_at = now() - interval '1 hour'"
        " WHERE vault_key_id = $1",
        key.id,
    )
    await charge(client, customer, 1_200, "orphan")
    assert await _states(db, key.id) == {"orphan": "committed"}
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 1_200)
    assert len(await emulator_ledger(emulator)) == 1


async def test_a_charge_in_doubt_taken_over_is_in_flight_until_its_retry_is_answered(
    issue: Issue, admin: VaultAdmin, customer: str, db: asyncpg.Pool
) -> None:
    """A retry takes over a charge in doubt and is sent: until Stripe answers it the
    reservation is pending, so another retry is refused as in flight, not sent beside it,
    and reconciliation cannot release it while Stripe may still commit it."""
    key = await issue()
    sent = Charge("POST /v1/payment_intents", 700, "usd", customer)
    async with db.acquire() as conn:
        lost = await reservations.reserve(conn, key.id, "in-doubt", sent, timedelta(minutes=5))
        assert await reservations.settle(conn, lost, "unknown", None) == "unknown"
        retry = await reservations.reserve(conn, key.id, "in-doubt", sent, timedelta(minutes=5))
        assert (retry.attempt, retry.owned, retry.in_doubt) == (2, True, True)
        assert await _states(db, key.id) == {"in-doubt": "pending"}
        with pytest.raises(reservations.InFlight):
            await reservations.reserve(conn, key.id, "in-doubt", sent, timedelta(minutes=5))
        with pytest.raises(VaultConflict, match="in flight"):
            await admin.resolve(key.id, "in-doubt", "failed")
        assert await reservations.settle(conn, retry, "succeeded", 200) == "committed"
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 700)


@pytest.mark.parametrize("late_answer", ["unknown", "failed"])
async def test_a_taken_over_attempts_late_answer_leaves_the_newer_attempt_in_flight(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    late_answer: reservations.Outcome,
) -> None:
    """An older attempt's answer arriving after a newer one took the reservation over is not
    that attempt's: marked unknown by it, the newer one, still on its way to Stripe, would be
    released by a resolve or cancelled under it (helper-186's surviving mutant)."""
    key = await issue()
    await charge_in_doubt(emulator, stripe_via_vault(key), customer, 800, "twice-sent")
    row = await db.fetchrow(
        "UPDATE vault_reservations SET state = 'pending', attempt = attempt + 1,"
        " updated_at = now() WHERE vault_key_id = $1 RETURNING id, attempt",
        key.id,
    )
    older = reservations.Reservation(
        id=row["id"],
        attempt=row["attempt"] - 1,
        state="pending",
        owned=True,
        in_doubt=False,
    )
    async with db.acquire() as conn:
        assert await reservations.settle(conn, older, late_answer, 500) == "pending"
    assert await _states(db, key.id) == {"twice-sent": "pending"}
    assert (await assert_consistent(db, key.id))["reserved_cents"] == 800


async def test_a_retry_arriving_while_a_resolve_holds_the_reservation_waits_and_replays(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
) -> None:
    """Reconciliation settles a charge in doubt as succeeded while a retry of it arrives:
    the retry waits on the reservation row's lock and is then a replay, never a takeover
    that would send it again and count its money as reserved and spent at once."""
    key = await issue()
    await charge_in_doubt(emulator, stripe_via_vault(key), customer, 1_200, "resolving")
    async with db.acquire() as settler:
        resolving = settler.transaction()
        await resolving.start()
        # As resolve() takes them: the commit lock, then the reservation row.
        await settler.execute("SELECT vault_lock_commits($1)", "resolving")
        row = await settler.fetchrow(
            "SELECT id, attempt FROM vault_reservations"
            " WHERE vault_key_id = $1 AND idempotency_key = $2 FOR UPDATE",
            key.id,
            "resolving",
        )
        again = Charge("POST /v1/payment_intents", 1_200, "usd", customer)
        racing = await reserve_behind_a_lock(db, key.id, "resolving", again)
        await _commit_unknown(settler, row, None)
        await resolving.commit()
    replayed = await racing
    assert (replayed.state, replayed.owned) == ("committed", False)
    assert await _states(db, key.id) == {"resolving": "committed"}
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 1_200)


async def test_a_resolve_arriving_while_a_late_answer_commits_the_reservation_waits_for_it(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    admin: VaultAdmin,
) -> None:
    """Reconciliation resolves a charge in doubt as succeeded while its attempt's late answer
    commits it: the resolve takes the commit lock before the reservation row, as the
    answer's settle (vault_finish) does, so it waits and repeats the commit, rather than
    holding the row the settle waits on (a deadlock Postgres breaks by failing one)."""
    key = await issue()
    await charge_in_doubt(emulator, stripe_via_vault(key), customer, 1_200, "answered-late")
    row = await db.fetchrow(
        "SELECT id, attempt FROM vault_reservations WHERE vault_key_id = $1", key.id
    )
    async with db.acquire() as settler, settler.transaction():
        # As vault_finish takes them for a commit: the commit lock, then the row.
        await settler.execute("SELECT vault_lock_commits($1)", "answered-late")
        resolving = asyncio.create_task(admin.resolve(key.id, "answered-late", "succeeded"))
        await eventually(lambda: waits_on_a_lock(db, None, resolving), timeout=10)
        await _commit_unknown(settler, row, 200)
    resolved = await resolving
    assert (resolved.state, resolved.committed_cents) == ("committed", 1_200)
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 1_200)


async def _commit_unknown(
    conn: asyncpg.Connection, row: asyncpg.Record, upstream_status: int | None
) -> None:
    """Commit the reservation in doubt as its settle or a resolve does (vault_finish), in the
    caller's transaction."""
    finished = await conn.fetchval(
        "SELECT finished FROM vault_finish($1, $2, $3, $4, $5, $6)",
        row["id"],
        row["attempt"],
        ["unknown"],
        "committed",
        None,
        upstream_status,
    )
    assert finished == "committed"


async def test_a_wait_for_a_database_connection_does_not_count_against_the_send_deadline(
    vault_settings: VaultSettings,
    issue: Issue,
    customer: str,
    db: asyncpg.Pool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A busy pool delays the reservation, whose clock (its updated_at) starts only once it
    # runs: the deadline starts there too, or load alone would refuse charges.
    key = await issue(cap_cents=10_000)
    clock = VaultClock(monkeypatch)
    enter = asyncpg.pool.PoolAcquireContext.__aenter__

    async def busy_pool(context: asyncpg.pool.PoolAcquireContext) -> Any:
        clock.pass_send_limit()  # the wait outlasts the time a charge has to be sent
        return await enter(context)

    monkeypatch.setattr(asyncpg.pool.PoolAcquireContext, "__aenter__", busy_pool)
    async with serve(vault_settings) as vault, aiohttp.ClientSession() as session:
        client = via_vault(key.secret.get_secret_value(), vault.url, session)
        await charge(client, customer, 6_000, "busy")
    assert await _states(db, key.id) == {"busy": "committed"}


async def test_a_debit_replayed_as_processing_is_left_for_reconciliation(
    issue: Issue,
    stripe_via_vault: StripeFor,
    returned_debit_customer: tuple[str, str],
    db: asyncpg.Pool,
    emulator: RunningEmulator,
) -> None:
    # Stripe replays the processing intent it saved with the key for a day, though the bank
    # may have returned the debit since: committed, it would hold room the ledger frees.
    key = await issue(currency="eur")
    client = stripe_via_vault(key)
    customer, debit = returned_debit_customer
    await charge_in_doubt(
        emulator, client, customer, 1_200, "in-doubt", currency="eur", payment_method=debit
    )
    await EmulatorClient(emulator.url).settle_debits()
    replayed = await charge(client, customer, 1_200, "in-doubt", "eur", payment_method=debit)
    assert replayed.status == "processing"
    # Executed now, a debit processing is made: counted spent until reconciliation says not.
    fresh = await charge(client, customer, 1_300, "fresh", "eur", payment_method=debit)
    assert fresh.status == "processing"
    assert await _states(db, key.id) == {"in-doubt": "unknown", "fresh": "committed"}
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (1_200, 1_300)


@asynccontextmanager
async def _through_a_stand_in(
    vault_settings: VaultSettings,
    key: IssuedKey,
    answer: Callable[[web.Request], Awaitable[web.Response]],
) -> AsyncIterator[stripe.StripeClient]:
    """A Stripe client on `key` through a vault in front of a stand-in for Stripe answering
    with `answer`, for what the emulator never says."""
    async with stand_in_upstream(answer) as upstream:
        in_front = vault_settings.model_copy(update={"upstream_stripe_base": upstream})
        async with serve(in_front) as vault, aiohttp.ClientSession() as session:
            yield via_vault(key.secret.get_secret_value(), vault.url, session)


async def test_a_legacy_charge_replayed_as_pending_is_left_for_reconciliation(
    vault_settings: VaultSettings, issue: Issue, db: asyncpg.Pool
) -> None:
    """A bank debit through `/v1/charges` (ACH, say) is `pending` until its bank answers,
    and Stripe replays the charge as it saved it, up to a day before: the bank may have
    returned it since. The emulator takes debits through PaymentIntents only; a stand-in
    for Stripe replays one."""

    async def replays_pending(request: web.Request) -> web.Response:
        return web.json_response(
            {"id": "ch_debit", "object": "charge", "status": "pending"},
            headers={"Idempotent-Replayed": "true"},
        )

    key = await issue(cap_cents=1_000)
    async with _through_a_stand_in(vault_settings, key, replays_pending) as client:
        replayed = await client.v1.charges.create_async(
            {"amount": 700, "currency": "usd", "customer": "cus_debit"},
            {"idempotency_key": "debit"},
        )
    assert replayed.status == "pending"
    assert await _states(db, key.id) == {"debit": "unknown"}
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (700, 0)


class VaultClock:
    """The clocks the vault's send deadline reads (vault/send_deadline.py), both moved on by
    the test at will: time passes while the vault is held up without the test waiting it
    out, so whether a charge is past its limit does not depend on how loaded the machine is.
    A charge not held up has the vault's whole limit (vault.state._STALE_MARGIN) to be sent;
    one held up is past it, however fast the machine."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.skipped = 0.0
        # Time only the wall clock saw pass: a machine suspended, whose monotonic clock stops.
        self.suspended = 0.0
        monkeypatch.setattr(send_deadline, "time", self)

    def monotonic(self) -> float:
        return time.monotonic() + self.skipped

    def time(self) -> float:
        return time.time() + self.skipped + self.suspended

    def pass_send_limit(self) -> None:
        """Time enough passes for a charge reserved before to be past its send limit."""
        self.skipped += (vault_state._STALE_MARGIN + timedelta(seconds=1)).total_seconds()


@pytest.mark.parametrize("wall_seen", [True, False], ids=["suspended", "wall-clock-stepped-back"])
def test_a_machine_suspended_past_the_send_limit_holds_a_charge_up(
    monkeypatch: pytest.MonkeyPatch, wall_seen: bool
) -> None:
    """A machine suspended between a charge's reservation and its sending may stop the
    monotonic clock; the wall clock saw the time pass, and the charge is not sent. Nor is it
    when the monotonic clock saw the time pass and the wall clock, stepped back (NTP), did not."""
    clock = VaultClock(monkeypatch)
    send_by = send_deadline.SendBy(send_deadline.Stamp.now(), within_seconds=10)

    def passes(seconds: float) -> None:
        if wall_seen:
            clock.suspended = seconds
        else:
            clock.skipped, clock.suspended = seconds, -seconds

    passes(9.0)
    send_by.check()
    with send_deadline.sending(send_by):
        assert send_deadline._SENDING.get() is send_by
    # Held to its deadline only within: the next request this task sends has its own.
    assert send_deadline._SENDING.get() is None
    passes(11.0)
    with pytest.raises(send_deadline.HeldUpError):
        send_by.check()
    # Refused before the forward, before a connection to Stripe is asked for.
    with pytest.raises(send_deadline.HeldUpError), send_deadline.sending(send_by):
        pytest.fail("a charge past its send limit was let through to be sent")


class HeldUp:
    """Holds the vault up between a charge's reservation and its sending, as a frozen process
    (a paused container, a suspended machine) would, while `on`: right after reserving, or
    while aiohttp gets the upstream connection (every connection busy, a slow connect). The
    hold moves the vault's clock past the charge's send limit (VaultClock)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, where: str, upstream_port: int) -> None:
        self.on = True
        # The vault's connections to Stripe made while held up.
        self.upstream: list[ResponseHandler] = []
        self.clock = VaultClock(monkeypatch)
        if where == "reserving":
            reserve = reservations.reserve

            async def held_up(*args: Any, **kwargs: Any) -> reservations.Reservation:
                reservation = await reserve(*args, **kwargs)
                await self._hold()
                return reservation

            monkeypatch.setattr(reservations, "reserve", held_up)
            return
        # The test's own client connects through this too, before the vault's clock starts.
        create = aiohttp.TCPConnector._create_connection

        async def slow_connect(connector: aiohttp.TCPConnector, *args: Any, **kwargs: Any) -> Any:
            held = self.on
            await self._hold()
            made = await create(connector, *args, **kwargs)
            transport = made.transport
            if held and transport and transport.get_extra_info("peername")[1] == upstream_port:
                self.upstream.append(made)
            return made

        monkeypatch.setattr(aiohttp.TCPConnector, "_create_connection", slow_connect)

    async def _hold(self) -> None:
        if self.on:
            self.clock.pass_send_limit()
            await asyncio.sleep(0)  # as a wait would, lets the vault's other tasks run


@pytest.mark.parametrize("where", ["reserving", "connecting"])
@pytest.mark.parametrize("in_doubt", [False, True], ids=["new", "in-doubt"])
async def test_a_charge_held_up_after_its_reservation_is_not_sent(
    vault_settings: VaultSettings,
    issue: Issue,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    admin: VaultAdmin,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    in_doubt: bool,
    where: str,
) -> None:
    # Sent late, it could reach Stripe after Stripe forgot its key (its reservation released
    # as stale meanwhile, and a retry charged): a second charge.
    key = await issue(cap_cents=10_000)
    held = HeldUp(monkeypatch, where, URL(emulator.url).port or 0)
    async with serve(vault_settings) as vault, aiohttp.ClientSession() as session:
        client = via_vault(key.secret.get_secret_value(), vault.url, session)
        if in_doubt:  # Stripe made it, and its answer was lost
            held.on = False
            await charge_in_doubt(emulator, client, customer, 6_000, "frozen")
            held.on = True
        with pytest.raises(stripe.APIError) as refused:
            await charge(client, customer, 6_000, "frozen")
        assert refused.value.http_status == 503
        assert refused.value.error is not None and refused.value.error.code == "vault_held_up"
        assert "retry with the same Idempotency-Key" in str(refused.value.user_message)
        assert (refused.value.headers or {}).get("Stripe-Should-Retry") == "true"
        # The vault's connection made too late is closed, not left open for nothing to track
        # (looked at before the ledger's own connection to the emulator).
        assert len(held.upstream) == (1 if where == "connecting" else 0)
        assert all(not made.is_connected() for made in held.upstream)
        # Closed by the vault, not left for the garbage collector to find unclosed.
        assert [r for r in caplog.records if "Unclosed connection" in r.getMessage()] == []
        assert len(await emulator_ledger(emulator)) == (1 if in_doubt else 0)
        # Nothing of the attempt was sent: its room is freed, or stays in doubt.
        left = "unknown" if in_doubt else "released"
        assert await _states(db, key.id) == {"frozen": left}
        audited = [
            (e.refusal_code, e.reservation_state) for e in await proxied_calls(admin, key.id)
        ]
        assert audited[0] == ("vault_held_up", left)
        totals = await assert_consistent(db, key.id)
        assert (totals["reserved_cents"], totals["spent_cents"]) == (6_000 if in_doubt else 0, 0)

        held.on = False
        await charge(client, customer, 6_000, "frozen")
    assert await _states(db, key.id) == {"frozen": "committed"}
    assert (await assert_consistent(db, key.id))["spent_cents"] == 6_000
    assert len(await emulator_ledger(emulator)) == 1


async def test_a_reservation_found_stale_is_idle_since_its_attempt_was_sent(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    admin: VaultAdmin,
) -> None:
    key = await issue()
    client = stripe_via_vault(key)
    await set_faults(emulator, error_before_commit=1.0)
    with pytest.raises(stripe.APIError):
        await charge(client, customer, 700, "cut-off")
    # As if its settle had been cut off by a database restart an hour ago: left pending.
    await db.execute(
        "UPDATE vault_reservations SET state = 'pending', updated_at = now() - interval '1 hour'"
        " WHERE vault_key_id = $1",
        key.id,
    )
    # Found stale now, it shows no answer: the 500 it kept was an earlier attempt's (a
    # release skips its wait for a failure only on an answer to the last attempt).
    [stale] = await admin.unknown_reservations(key.id)
    assert (stale.state, stale.upstream_status) == ("unknown", None)
    # But Stripe has had an hour to commit it: a release need not wait another ten minutes
    # (a chaos run left one unknown so, right after its period).
    released = await admin.resolve(key.id, "cut-off", "failed", min_idle_seconds=600)
    assert released.state == "released"
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 0)


async def test_a_pending_reservation_is_found_stale_only_past_the_vaults_wait_on_stripe(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    admin: VaultAdmin,
) -> None:
    """Within the vault's longest wait on Stripe (its 5 s upstream timeout and a 10 s margin)
    the request may still be on its way: released then, by a person or reconciliation, its
    room would be charged again while Stripe makes it. Past it, it is unknown, and a resolve
    finds it so without a listing first."""
    key = await issue()
    await charge_in_doubt(
        emulator, stripe_via_vault(key), customer, 700, "on-its-way", "error_before_commit"
    )

    async def sent_ago(seconds: int) -> None:
        await db.execute(
            "UPDATE vault_reservations SET state = 'pending', upstream_status = NULL,"
            " updated_at = now() - make_interval(secs => $2) WHERE vault_key_id = $1",
            key.id,
            seconds,
        )

    await sent_ago(10)
    assert await admin.unknown_reservations(key.id) == []
    with pytest.raises(VaultConflict, match="in flight"):
        await admin.resolve(key.id, "on-its-way", "failed")
    await sent_ago(20)
    released = await admin.resolve(key.id, "on-its-way", "failed")
    assert released.state == "released"
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 0)


# A retry after its first attempt's answer was lost (in doubt, counted as reserved) or
# came back charged (a replay, counted as spent), and the state it leaves the reservation in.
RETRIED_AFTER = pytest.mark.parametrize(
    ("first_answer", "state", "counted"),
    [("lost", "unknown", "reserved_cents"), ("charged", "committed", "spent_cents")],
)


async def _first_sent(
    issue: Issue,
    client_for: StripeFor,
    emulator: RunningEmulator,
    customer: str,
    first_answer: str,
) -> IssuedKey:
    """A key through which "retried" was sent for 1,200 cents, its answer `first_answer`
    (RETRIED_AFTER)."""
    key = await issue()
    if first_answer == "lost":
        await charge_in_doubt(emulator, client_for(key), customer, 1_200, "retried")
    else:
        await charge(client_for(key), customer, 1_200, "retried")
    return key


@RETRIED_AFTER
async def test_a_revoke_between_the_key_check_and_the_reservation_stops_a_retry(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    first_answer: str,
    state: str,
    counted: str,
) -> None:
    """A takeover of a charge in doubt is forwarded, and so is a replay of a charged one (its
    commit may be a resolve's, for a charge Stripe never made): a key revoked since the
    vault's own key check stops both, and leaves the reservation as it was (one in doubt
    still counted, for reconciliation to settle from Stripe)."""
    key = await _first_sent(issue, stripe_via_vault, emulator, customer, first_answer)
    assert await _states(db, key.id) == {"retried": state}

    # The retry passed the vault's key check; the revoke commits before its reservation.
    await db.execute("UPDATE vault_keys SET revoked_at = now() WHERE id = $1", key.id)
    retry = Charge("POST /v1/payment_intents", 1_200, "usd", customer)
    async with db.acquire() as conn:
        with pytest.raises(reservations.KeyUnusable, match="revoked"):
            await reservations.reserve(conn, key.id, "retried", retry, timedelta(minutes=5))
    assert await _states(db, key.id) == {"retried": state}
    assert (await assert_consistent(db, key.id))[counted] == 1_200


async def test_a_revoke_between_the_key_check_and_the_reservation_stops_a_new_charge(
    issue: Issue, customer: str, db: asyncpg.Pool
) -> None:
    """The kill switch holds for a new charge too: one that passed the vault's key check
    before the revoke committed is refused when its reservation reads the key under its lock,
    and leaves nothing reserved."""
    key = await issue()
    await db.execute("UPDATE vault_keys SET revoked_at = now() WHERE id = $1", key.id)
    fresh = Charge("POST /v1/payment_intents", 1_200, "usd", customer)
    async with db.acquire() as conn:
        with pytest.raises(reservations.KeyUnusable, match="revoked"):
            await reservations.reserve(conn, key.id, "fresh", fresh, timedelta(minutes=5))
    assert await _states(db, key.id) == {}
    assert (await assert_consistent(db, key.id))["reserved_cents"] == 0


async def test_an_intent_created_without_confirming_frees_its_room(
    issue: Issue, stripe_via_vault: StripeFor, direct_stripe: stripe.StripeClient, db: asyncpg.Pool
) -> None:
    """Created but not confirmed, a PaymentIntent moved no money, and no vault key may
    confirm it: its room is freed, not spent for good."""
    key = await issue(cap_cents=1_000)
    client = stripe_via_vault(key)
    method = "pm_card_visa"
    created = await direct_stripe.v1.customers.create_async(
        params={"payment_method": method, "invoice_settings": {"default_payment_method": method}}
    )
    customer = created.id
    attached = created.invoice_settings and created.invoice_settings.default_payment_method
    assert isinstance(attached, str)
    for payment_method, status in (
        (None, "requires_payment_method"),
        (attached, "requires_confirmation"),
    ):
        params: PaymentIntentCreateParams = {
            "amount": 1_000,
            "currency": "usd",
            "customer": customer,
        }
        if payment_method is not None:
            params["payment_method"] = payment_method
        unconfirmed = await client.v1.payment_intents.create_async(
            params=params, options={"idempotency_key": status}
        )
        assert unconfirmed.status == status
    assert await _states(db, key.id) == {
        "requires_payment_method": "released",
        "requires_confirmation": "released",
    }
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 0)
    # The whole cap is left for a charge that moves money.
    charged = await charge(client, customer, 1_000, "charged", payment_method=attached)
    assert charged.status == "succeeded"
    assert (await assert_consistent(db, key.id))["spent_cents"] == 1_000


async def test_an_intent_waiting_on_the_customer_stays_spent(
    issue: Issue, stripe_via_vault: StripeFor, direct_stripe: stripe.StripeClient, db: asyncpg.Pool
) -> None:
    """requires_action is not freed: the customer may still authenticate it, and pay."""
    key = await issue(cap_cents=1_000)
    method = "pm_card_authenticationRequired"
    created = await direct_stripe.v1.customers.create_async(
        params={"payment_method": method, "invoice_settings": {"default_payment_method": method}}
    )
    attached = created.invoice_settings and created.invoice_settings.default_payment_method
    assert isinstance(attached, str)
    waiting = await stripe_via_vault(key).v1.payment_intents.create_async(
        params={
            "amount": 1_000,
            "currency": "usd",
            "customer": created.id,
            "payment_method": attached,
            "confirm": True,  # on session: 3-D Secure is asked of the customer
            "automatic_payment_methods": {"enabled": True, "allow_redirects": "never"},
        },
        options={"idempotency_key": "waits"},
    )
    assert waiting.status == "requires_action"
    assert await _states(db, key.id) == {"waits": "committed"}
    assert (await assert_consistent(db, key.id))["spent_cents"] == 1_000


@pytest.mark.parametrize("status", ["requires_payment_method", "requires_confirmation"])
async def test_an_intent_asked_to_confirm_that_stripe_left_unconfirmed_stays_spent(
    vault_settings: VaultSettings, issue: Issue, db: asyncpg.Pool, status: str
) -> None:
    """Asked to confirm, an intent Stripe left unconfirmed may yet be rolled forward
    (activities/stripe_gateway.py), and charge: unlike one created without `confirm`, its
    room stays spent. The emulator never answers so; a stand-in for Stripe does."""

    async def left_unconfirmed(request: web.Request) -> web.Response:
        return web.json_response({"id": "pi_left", "object": "payment_intent", "status": status})

    key = await issue(cap_cents=1_000)
    async with _through_a_stand_in(vault_settings, key, left_unconfirmed) as client:
        assert (await charge(client, "cus_left", 1_000, "left")).status == status
    assert await _states(db, key.id) == {"left": "committed"}
    assert (await assert_consistent(db, key.id))["spent_cents"] == 1_000


@pytest.mark.parametrize(
    ("status", "confirms", "outcome"),
    [
        ("requires_payment_method", False, "failed"),
        ("requires_confirmation", False, "failed"),
        # Asked to confirm, left so by Stripe, which may yet roll it forward.
        ("requires_payment_method", True, "succeeded"),
        ("requires_confirmation", True, "succeeded"),
        ("requires_action", True, "succeeded"),
        ("succeeded", True, "succeeded"),
    ],
)
def test_what_a_2xx_intent_says_of_its_money(status: str, confirms: bool, outcome: str) -> None:
    answer = _Answer(200, json.dumps({"object": "payment_intent", "status": status}).encode(), {})
    assert _outcome(answer, in_doubt=False, confirms=confirms) == outcome


async def _expires_while_it_waits(
    db: asyncpg.Pool, key_id: str, idempotency_key: str, sent: Charge
) -> None:
    """A reservation kept waiting for the key row's lock while the key (expiring within 2 s)
    expires is refused as expired."""
    async with db.acquire() as holder:
        holding = holder.transaction()
        await holding.start()
        await holder.execute("SELECT 1 FROM vault_keys WHERE id = $1 FOR UPDATE", key_id)
        waiting = await reserve_behind_a_lock(db, key_id, idempotency_key, sent)
        await asyncio.sleep(2.5)  # the key expires meanwhile
        await holding.commit()
    with pytest.raises(reservations.KeyUnusable, match="expired"):
        await waiting


async def test_a_key_that_expires_while_a_reservation_waits_for_its_lock_is_refused(
    issue: Issue, customer: str, db: asyncpg.Pool
) -> None:
    """Expiry is judged when the key row's lock is granted, not when the transaction began:
    a reservation begun just before the key expired, and kept waiting past it, is refused."""
    key = await issue(expires_at=datetime.now(UTC) + timedelta(seconds=2))
    late = Charge("POST /v1/payment_intents", 500, "usd", customer)
    await _expires_while_it_waits(db, key.id, "late", late)
    assert await _states(db, key.id) == {}
    assert (await assert_consistent(db, key.id))["reserved_cents"] == 0


@pytest.mark.parametrize("stopped", ["revoked", "expired"])
async def test_a_charge_whose_key_stops_while_it_waits_for_the_key_says_why(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    stopped: str,
) -> None:
    """A charge past the vault's key check whose reservation then finds the key revoked or
    expired answers as the key check would: the worker pauses the period for good on a
    revoke (the kill switch), and renews its key on an expiry."""
    key = await issue()
    async with db.acquire() as holder:
        holding = holder.transaction()
        await holding.start()
        await holder.execute("SELECT 1 FROM vault_keys WHERE id = $1 FOR UPDATE", key.id)
        charging = asyncio.create_task(charge(stripe_via_vault(key), customer, 500, "waits"))
        await a_reservation_waits_for_a_lock(db)
        column = "revoked_at" if stopped == "revoked" else "expires_at"
        await holder.execute(f"UPDATE vault_keys SET {column} = now() WHERE id = $1", key.id)
        await holding.commit()
    with pytest.raises(stripe.AuthenticationError) as refused:
        await charging
    assert refused.value.error is not None
    assert refused.value.error.code == f"vault_key_{stopped}"
    assert await emulator_ledger(emulator) == []
    assert await _states(db, key.id) == {}


@RETRIED_AFTER
async def test_a_key_that_expires_while_a_retry_waits_for_its_lock_stops_the_retry(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    first_answer: str,
    state: str,
    counted: str,
) -> None:
    """A takeover of a charge in doubt and a replay of a charged one are forwarded, so an
    expired key stops them as it stops a new charge: judged when the key row's lock is
    granted, and leaving the reservation as it was."""
    key = await _first_sent(issue, stripe_via_vault, emulator, customer, first_answer)
    await db.execute(
        "UPDATE vault_keys SET expires_at = now() + interval '2 seconds' WHERE id = $1", key.id
    )
    again = Charge("POST /v1/payment_intents", 1_200, "usd", customer)
    await _expires_while_it_waits(db, key.id, "retried", again)
    assert await _states(db, key.id) == {"retried": state}
    assert (await assert_consistent(db, key.id))[counted] == 1_200


async def test_an_in_doubt_retry_refused_before_stripe_reads_its_key_stays_unknown(
    vault_settings: VaultSettings,
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    secrets_seen: Secrets,
) -> None:
    key = await issue(cap_cents=10_000)
    await charge_in_doubt(emulator, stripe_via_vault(key), customer, 6_000, "in-doubt")

    # The Stripe secret was rolled badly: Stripe answers the retry 401 before it looks at the
    # idempotency key, which says nothing about the first attempt's money.
    rolled = "rk_live_rolled_badly_0000"
    secrets_seen.values.append(rolled)
    broken = vault_settings.model_copy(update={"upstream_stripe_secret": SecretStr(rolled)})
    async with serve(broken) as vault, aiohttp.ClientSession() as session:
        client = via_vault(key.secret.get_secret_value(), vault.url, session)
        with pytest.raises(stripe.AuthenticationError):
            await charge(client, customer, 6_000, "in-doubt")
    assert await _states(db, key.id) == {"in-doubt": "unknown"}
    assert (await assert_consistent(db, key.id))["reserved_cents"] == 6_000
    assert len(await emulator_ledger(emulator)) == 1

    # A replay through the mended vault settles it from Stripe's saved answer.
    await charge(stripe_via_vault(key), customer, 6_000, "in-doubt")
    assert await _states(db, key.id) == {"in-doubt": "committed"}
    assert (await assert_consistent(db, key.id))["spent_cents"] == 6_000


async def test_a_charge_first_sent_23_hours_ago_is_neither_replayed_nor_taken_over(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    admin: VaultAdmin,
) -> None:
    key = await issue(cap_cents=10_000)
    client = stripe_via_vault(key)
    await charge(client, customer, 6_000, "committed")
    await charge_in_doubt(emulator, client, customer, 3_000, "in-doubt")
    # As if both were first sent 23 hours ago: Stripe forgets keys at 24, so a retry would
    # charge again, and neither a replay nor a takeover counts anything.
    await db.execute(
        "UPDATE vault_reservations SET created_at = now() - interval '23 hours'"
        " WHERE vault_key_id = $1",
        key.id,
    )
    for idempotency_key, amount in (("committed", 6_000), ("in-doubt", 3_000)):
        with pytest.raises(stripe.APIError) as refused:
            await charge(client, customer, amount, idempotency_key)
        error = refused.value.json_body["error"]  # type: ignore[index]
        assert (refused.value.http_status, error["code"]) == (409, "idempotency_key_expired")
        # Only the one in doubt can go on, once reconciliation releases it.
        retry = "true" if idempotency_key == "in-doubt" else "false"
        assert (refused.value.headers or {}).get("Stripe-Should-Retry") == retry
    assert await _states(db, key.id) == {"committed": "committed", "in-doubt": "unknown"}
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (3_000, 6_000)
    assert len(await emulator_ledger(emulator)) == 2

    # Reconciliation settles the one in doubt from Stripe; a retry is still refused, and the
    # caller's lookup finds the charge instead.
    await admin.resolve(key.id, "in-doubt", "succeeded", 3_000)
    with pytest.raises(stripe.APIError, match="it was charged: look the charge up on Stripe"):
        await charge(client, customer, 3_000, "in-doubt")
    assert (await assert_consistent(db, key.id))["spent_cents"] == 9_000
    assert len(await emulator_ledger(emulator)) == 2


async def test_a_charge_first_sent_23_hours_ago_through_another_key_is_not_sent_again(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    admin: VaultAdmin,
) -> None:
    """The period's key renewed (or replaced by a rerun): a retry through the new key of a
    charge the old key first sent a day ago is refused as through the old one, since Stripe
    keeps one idempotency key per account, whichever vault key carried it."""
    old, new = await issue(cap_cents=10_000), await issue(cap_cents=10_000)
    await charge(stripe_via_vault(old), customer, 6_000, "committed")
    await charge_in_doubt(emulator, stripe_via_vault(old), customer, 3_000, "in-doubt")
    await charge_in_doubt(
        emulator, stripe_via_vault(old), customer, 1_000, "never-made", "error_before_commit"
    )
    await db.execute(
        "UPDATE vault_reservations SET created_at = now() - interval '23 hours'"
        " WHERE vault_key_id = $1",
        old.id,
    )
    for idempotency_key, amount in (("committed", 6_000), ("in-doubt", 3_000)):
        with pytest.raises(stripe.APIError) as refused:
            await charge(stripe_via_vault(new), customer, amount, idempotency_key)
        error = refused.value.json_body["error"]  # type: ignore[index]
        assert (refused.value.http_status, error["code"]) == (409, "idempotency_key_expired")
        assert f"(through vault key {old.id})" in error["message"]
    # Neither was counted against the new key, nor sent.
    assert await _states(db, new.id) == {}
    assert (await assert_consistent(db, new.id))["reserved_cents"] == 0
    assert len(await emulator_ledger(emulator)) == 2

    # Reconciliation found nothing on Stripe for the one never made and released it: it goes.
    await admin.resolve(old.id, "never-made", "failed")
    await charge(stripe_via_vault(new), customer, 1_000, "never-made")
    assert await _states(db, new.id) == {"never-made": "committed"}
    assert len(await emulator_ledger(emulator)) == 3
    # Sent through another key within Stripe's day, a key is forwarded: Stripe replays it.
    await db.execute(
        "UPDATE vault_reservations SET created_at = now() WHERE vault_key_id = $1", old.id
    )
    await charge(stripe_via_vault(new), customer, 6_000, "committed")
    assert len(await emulator_ledger(emulator)) == 3


@pytest.mark.parametrize("retried_through", ["a third key", "the key that charged it"])
async def test_a_charge_sent_through_two_keys_a_day_ago_is_refused_as_charged_if_one_was(
    issue: Issue, db: asyncpg.Pool, retried_through: str
) -> None:
    """In doubt under the period's first key, then charged through the key a renewal issued:
    a retry a day later, through a third key or the one that charged it, is refused as
    charged (look it up on Stripe), not as in doubt, which would have the caller wait on a
    release that never lets it through, since the charged one stays."""
    first, second, third = [await issue(cap_cents=10_000) for _ in range(3)]
    retry = third if retried_through == "a third key" else second
    sent = Charge("POST /v1/payment_intents", 3_000, "usd", None)
    async with db.acquire() as conn:
        lost = await reservations.reserve(conn, first.id, "renewed", sent, timedelta(minutes=5))
        assert await reservations.settle(conn, lost, "unknown", None) == "unknown"
        made = await reservations.reserve(conn, second.id, "renewed", sent, timedelta(minutes=5))
        assert await reservations.settle(conn, made, "succeeded", 200) == "committed"
        for key, age in ((first, timedelta(hours=24)), (second, timedelta(hours=23, minutes=30))):
            await conn.execute(
                "UPDATE vault_reservations SET created_at = now() - $2::interval"
                " WHERE vault_key_id = $1",
                key.id,
                age,
            )
        with pytest.raises(reservations.ReplayExpired) as refused:
            await reservations.reserve(conn, retry.id, "renewed", sent, timedelta(minutes=5))
    assert refused.value.committed
    assert "it was charged: look the charge up on Stripe" in str(refused.value)
    # It names another key that first sent it: the charging one, if the retry is not its.
    assert f"(through vault key {(second if retry is third else first).id})" in str(refused.value)
    assert await _states(db, third.id) == {}
    assert await _states(db, second.id) == {"renewed": "committed"}


async def _counted(db: asyncpg.Pool, key_id: str) -> dict[str, tuple[str, str | None]]:
    rows = await db.fetch(
        "SELECT idempotency_key, state, counted_under FROM vault_reservations"
        " WHERE vault_key_id = $1",
        key_id,
    )
    return {row["idempotency_key"]: (row["state"], row["counted_under"]) for row in rows}


async def test_a_charge_retried_through_another_key_is_counted_under_one(
    worker: VaultAdmin,
    secrets_seen: Secrets,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
) -> None:
    """A charge in doubt under the period's old key, retried through the key a renewal
    issued: Stripe replays it, and its spend is counted under the key that committed it
    first, not under both (two caps' room held, and the worker budget counting it twice).
    Both reservations stay committed, so a retry through either is a replay."""
    old, new = [
        await worker.issue_key(key_request(cap_cents=10_000, daily_cap_cents=10_000))
        for _ in range(2)
    ]
    secrets_seen.values += [old.secret.get_secret_value(), new.secret.get_secret_value()]

    # Replayed through the new key first: reconciliation's "succeeded" on the old one.
    await charge_in_doubt(emulator, stripe_via_vault(old), customer, 3_000, "replayed-first")
    await charge(stripe_via_vault(new), customer, 3_000, "replayed-first")
    for _ in range(2):  # the same resolution again is the same
        info = await worker.resolve(old.id, "replayed-first", "succeeded", 3_000)
        assert (info.state, info.counted_under) == ("committed", new.id)
    # Resolved under the old key first, then replayed through the new key, twice.
    await charge_in_doubt(emulator, stripe_via_vault(old), customer, 2_000, "resolved-first")
    await worker.resolve(old.id, "resolved-first", "succeeded", 2_000)
    for _ in range(2):
        await charge(stripe_via_vault(new), customer, 2_000, "resolved-first")
    # Stripe's answer for the request is a success, whichever key carried it.
    with pytest.raises(VaultConflict, match="already committed"):
        await worker.resolve(old.id, "replayed-first", "failed")

    assert await _counted(db, old.id) == {
        "replayed-first": ("committed", new.id),
        "resolved-first": ("committed", None),
    }
    assert await _counted(db, new.id) == {
        "replayed-first": ("committed", None),
        "resolved-first": ("committed", old.id),
    }
    old_totals, new_totals = (
        await assert_consistent(db, old.id),
        await assert_consistent(db, new.id),
    )
    assert (old_totals["reserved_cents"], old_totals["spent_cents"]) == (0, 2_000)
    assert (new_totals["reserved_cents"], new_totals["spent_cents"]) == (0, 3_000)
    assert len(await emulator_ledger(emulator)) == 2


async def test_two_keys_committing_one_charge_at_once_count_it_once(
    issue: Issue, db: asyncpg.Pool
) -> None:
    """Commits of one idempotency key wait for each other, so the second sees the first."""
    old, new = await issue(cap_cents=10_000), await issue(cap_cents=10_000)
    sent = Charge("POST /v1/payment_intents", 3_000, "usd", None)
    async with db.acquire() as first, db.acquire() as second:
        taken = [
            await reservations.reserve(conn, key.id, "both", sent, timedelta(minutes=5))
            for conn, key in ((first, old), (second, new))
        ]
        async with first.transaction():
            assert await reservations.settle(first, taken[0], "succeeded", 200) == "committed"
            racing = asyncio.create_task(reservations.settle(second, taken[1], "succeeded", 200))
            await asyncio.sleep(0.3)
            assert not racing.done()
        assert await racing == "committed"
    assert await _counted(db, new.id) == {"both": ("committed", old.id)}
    assert (await assert_consistent(db, old.id))["spent_cents"] == 3_000
    assert (await assert_consistent(db, new.id))["spent_cents"] == 0


async def test_another_request_under_the_same_key_is_counted_where_it_is_committed(
    issue: Issue, db: asyncpg.Pool
) -> None:
    """Stripe refuses an idempotency key reused with other parameters, so a success for
    another amount is no replay: a wrong "succeeded" for 1 cent under one key must not hide
    a charge of 5,000 under another from its cap."""
    old, new = await issue(cap_cents=10_000), await issue(cap_cents=10_000)
    async with db.acquire() as conn:
        for key, cents in ((old, 1), (new, 5_000)):
            sent = Charge("POST /v1/payment_intents", cents, "usd", None)
            taken = await reservations.reserve(conn, key.id, "reused", sent, timedelta(minutes=5))
            assert await reservations.settle(conn, taken, "succeeded", 200) == "committed"
    assert await _counted(db, new.id) == {"reused": ("committed", None)}
    assert (await assert_consistent(db, new.id))["spent_cents"] == 5_000


@pytest.mark.parametrize(
    ("endpoint", "customer"),
    [("POST /v1/payment_intents", "cus_other"), ("POST /v1/charges", "cus_one")],
)
async def test_another_customer_or_endpoint_under_the_same_key_is_counted_where_committed(
    issue: Issue, db: asyncpg.Pool, endpoint: str, customer: str
) -> None:
    """As for another amount: a success under one vault key for the same idempotency key but
    another customer or endpoint is no replay of this request, whose spend stays counted
    under its own key."""
    old, new = await issue(cap_cents=10_000), await issue(cap_cents=10_000)
    first = Charge("POST /v1/payment_intents", 5_000, "usd", "cus_one")
    second = Charge(endpoint, 5_000, "usd", customer)
    async with db.acquire() as conn:
        for key, sent in ((old, first), (new, second)):
            taken = await reservations.reserve(conn, key.id, "reused", sent, timedelta(minutes=5))
            assert await reservations.settle(conn, taken, "succeeded", 200) == "committed"
    assert await _counted(db, new.id) == {"reused": ("committed", None)}
    assert (await assert_consistent(db, new.id))["spent_cents"] == 5_000


async def test_a_request_refused_under_one_key_is_released_though_another_committed_it(
    issue: Issue, db: asyncpg.Pool
) -> None:
    """Only a commit is counted under another key: a definite refusal of the same request
    through a second key (a 429, say) releases that key's reservation, names no key, and
    frees its room."""
    old, new = await issue(cap_cents=10_000), await issue(cap_cents=10_000)
    sent = Charge("POST /v1/payment_intents", 3_000, "usd", None)
    async with db.acquire() as conn:
        charged = await reservations.reserve(conn, old.id, "both", sent, timedelta(minutes=5))
        assert await reservations.settle(conn, charged, "succeeded", 200) == "committed"
        refused = await reservations.reserve(conn, new.id, "both", sent, timedelta(minutes=5))
        assert await reservations.settle(conn, refused, "failed", 429) == "released"
    assert await _counted(db, new.id) == {"both": ("released", None)}
    totals = await assert_consistent(db, new.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 0)
    assert (await assert_consistent(db, old.id))["spent_cents"] == 3_000


async def test_unknown_reservations_are_read_page_by_page_to_the_last(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    emulator: RunningEmulator,
    admin: VaultAdmin,
    http: aiohttp.ClientSession,
    vault: RunningVault,
) -> None:
    key = await issue(cap_cents=10_000)
    client = stripe_via_vault(key)
    await set_faults(emulator, drop_after_commit=1.0)
    for n in range(5):
        with pytest.raises(stripe.APIError):
            await charge(client, customer, 100, f"dropped-{n}")
    await set_faults(emulator, drop_after_commit=0.0)
    await charge(client, customer, 100, "settled")
    found = await admin.unknown_reservations(key.id, page_size=2)
    assert [r.idempotency_key for r in found] == [f"dropped-{n}" for n in range(5)]
    # The API itself: a full page says where the next one starts; the last says none.
    pages = []
    after: int | None = None
    while True:
        query = {"state": "unknown", "limit": "2"} | ({"after": str(after)} if after else {})
        async with http.get(
            f"{vault.url}/vault/keys/{key.id}/reservations",
            params=query,
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        ) as response:
            page = await response.json()
        pages.append(len(page["reservations"]))
        after = page["next_after"]
        if after is None:
            break
    assert pages == [2, 2, 1]

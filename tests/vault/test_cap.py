"""I4: money accepted through a key never exceeds its cap, under any concurrency, and a replay
of an idempotency key already counted is not counted again."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from datetime import timedelta

import aiohttp
import asyncpg
import pytest
import stripe
from stripe.params import ChargeCreateParams

from stripe_emulator import RunningEmulator
from vault import reservations
from vault.app import serve
from vault.models import IssuedKey
from vault.reservations import Charge
from vault.settings import VaultSettings

from .conftest import Issue
from .support import (
    assert_consistent,
    charge,
    charge_in_doubt,
    emulator_ledger,
    emulator_requests,
    reserve_behind_a_lock,
    set_faults,
    via_vault,
)

StripeFor = Callable[[IssuedKey], stripe.StripeClient]


async def _charge_all(
    client: stripe.StripeClient, customer: str, amounts: list[int], prefix: str
) -> list[stripe.PaymentIntent | BaseException]:
    return await asyncio.gather(
        *(charge(client, customer, amount, f"{prefix}-{i}") for i, amount in enumerate(amounts)),
        return_exceptions=True,
    )


def _cap_refusal(result: object) -> bool:
    return isinstance(result, stripe.CardError) and result.code == "spend_cap_exceeded"


async def test_200_concurrent_charges_accept_exactly_what_fits(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
) -> None:
    key = await issue(cap_cents=57_500)
    results = await _charge_all(stripe_via_vault(key), customer, [1_000] * 200, "equal")

    accepted = [r for r in results if isinstance(r, stripe.PaymentIntent)]
    refused = [r for r in results if _cap_refusal(r)]
    assert len(accepted) == 57  # 57 x 1,000 fits under 57,500; a 58th would not
    assert len(refused) == 143
    totals = await assert_consistent(db, key.id)
    assert (totals["spent_cents"], totals["reserved_cents"]) == (57_000, 0)
    ledger = await emulator_ledger(emulator)
    assert len(ledger) == 57
    assert sum(c["amount"] for c in ledger) == 57_000


async def test_mixed_amounts_through_two_vaults_never_pass_the_cap(
    issue: Issue,
    vault_settings: VaultSettings,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
) -> None:
    rng = random.Random(7)
    amounts = [rng.randint(100, 5_000) for _ in range(200)]
    cap = sum(amounts) // 3
    key = await issue(cap_cents=cap)
    # Two vault processes share the database: the cap lives there, not in either process.
    async with (
        serve(vault_settings) as first,
        serve(vault_settings) as second,
        aiohttp.ClientSession() as session,
    ):
        clients = [
            via_vault(key.secret.get_secret_value(), vault.url, session)
            for vault in (first, second)
        ]
        results = await asyncio.gather(
            *(
                charge(clients[i % 2], customer, amount, f"mixed-{i}")
                for i, amount in enumerate(amounts)
            ),
            return_exceptions=True,
        )

    accepted = sum(a for a, r in zip(amounts, results, strict=True) if not _cap_refusal(r))
    assert all(isinstance(r, stripe.PaymentIntent) or _cap_refusal(r) for r in results)
    assert accepted <= cap
    assert sum(map(_cap_refusal, results)) > 100  # the cap fits about a third of the money
    # Nothing was released, so the room only shrank: each refused amount exceeded even the
    # room left at the end.
    room = cap - accepted
    assert all(a > room for a, r in zip(amounts, results, strict=True) if _cap_refusal(r))
    totals = await assert_consistent(db, key.id)
    assert totals["spent_cents"] == accepted
    assert sum(c["amount"] for c in await emulator_ledger(emulator)) == accepted


@pytest.mark.parametrize("daily", [False, True])
async def test_a_reservation_waits_for_one_in_progress_and_counts_it(
    issue: Issue, customer: str, db: asyncpg.Pool, daily: bool
) -> None:
    """Two reservations of one key are decided one after the other, under the key row's
    lock: one begun while another's transaction has not committed yet waits for it, and is
    judged with its amount counted. The daily cap has no table constraint behind it, so that
    lock alone holds it."""
    caps = {"cap_cents": 10_000, "daily_cap_cents": 1_000} if daily else {"cap_cents": 1_000}
    key = await issue(**caps)
    sent = Charge("POST /v1/payment_intents", 600, "usd", customer)
    async with db.acquire() as first:
        held = first.transaction()
        await held.start()
        await reservations.reserve(first, key.id, "first", sent, timedelta(minutes=5))
        racing = await reserve_behind_a_lock(db, key.id, "second", sent)
        await held.commit()
    with pytest.raises(reservations.CapExceeded) as refused:
        await racing
    assert refused.value.daily == daily
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (600, 0)


async def test_replays_are_not_counted_twice(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
) -> None:
    key = await issue(cap_cents=2_500)
    client = stripe_via_vault(key)
    first = await charge(client, customer, 2_000, "same-key")
    # Sequential and concurrent replays: the first result again, never a second charge.
    again = await charge(client, customer, 2_000, "same-key")
    burst = await asyncio.gather(
        *(charge(client, customer, 2_000, "same-key") for _ in range(20)), return_exceptions=True
    )
    assert again.id == first.id
    assert all(r.id == first.id for r in burst if isinstance(r, stripe.PaymentIntent))
    totals = await assert_consistent(db, key.id)
    assert (totals["spent_cents"], totals["reserved_cents"]) == (2_000, 0)
    assert len(await emulator_ledger(emulator)) == 1
    # Only 500 cents of room remain, so a new key is still refused.
    with pytest.raises(stripe.CardError) as refused:
        await charge(client, customer, 2_000, "other-key")
    assert refused.value.code == "spend_cap_exceeded"
    assert "usd 20.00 would pass this key's cap: usd 5.00 of usd 25.00 remain" in str(
        refused.value.user_message
    )


async def test_concurrent_requests_with_one_key_forward_one_at_a_time(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
) -> None:
    key = await issue(cap_cents=10_000)
    # Stripe answers late, so requests arrive while the first is in flight: the vault refuses
    # them, and Stripe sees one (it would refuse the others itself, 409 too). One that a busy
    # machine delays past the first's answer gets that answer replayed: the same intent.
    await set_faults(emulator, latency_ms=2_000)
    results = await asyncio.gather(
        *(charge(stripe_via_vault(key), customer, 3_000, "racing") for _ in range(30)),
        return_exceptions=True,
    )
    intents = [r for r in results if isinstance(r, stripe.PaymentIntent)]
    refused = [r for r in results if isinstance(r, stripe.APIError)]
    assert len(intents) + len(refused) == 30 and refused
    assert len({intent.id for intent in intents}) == 1
    assert {(r.http_status, r.error and r.error.code, r.user_message) for r in refused} == {
        (
            409,
            "idempotency_key_in_use",
            "a request with this Idempotency-Key is in flight; retry when it has finished",
        )
    }
    sent = [
        r
        for r in await emulator_requests(emulator)
        if r["method"] == "POST" and r["path"] == "/v1/payment_intents"
    ]
    assert [r["status"] for r in sent] == [200]
    totals = await assert_consistent(db, key.id)
    assert (totals["spent_cents"], totals["reserved_cents"]) == (3_000, 0)
    assert len(await emulator_ledger(emulator)) == 1


@pytest.mark.parametrize("changed", ["amount", "customer"])
async def test_replay_with_another_amount_or_customer_is_refused_not_forwarded(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    declining_customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
    changed: str,
) -> None:
    key = await issue()
    client = stripe_via_vault(key)
    await charge(client, customer, 1_000, "reused")
    other, amount = (customer, 9_000) if changed == "amount" else (declining_customer, 1_000)
    with pytest.raises(stripe.IdempotencyError) as refused:
        await charge(client, other, amount, "reused")
    assert refused.value.error is not None
    assert refused.value.error.code == "idempotency_key_reused"
    assert f"customer {customer})" in str(refused.value.user_message)
    # Requests, not charges: the declining customer's, had it been sent, would have none.
    sent = [r for r in await emulator_requests(emulator) if r["path"] == "/v1/payment_intents"]
    assert len(sent) == 1
    assert (await assert_consistent(db, key.id))["spent_cents"] == 1_000


async def _a_utc_day_passes(db: asyncpg.Pool, key_id: str) -> None:
    """Move the key's use so far to the day before: today starts with the whole daily cap."""
    async with db.acquire() as conn, conn.transaction():
        await conn.execute(
            "UPDATE vault_key_days SET day = day - 1 WHERE vault_key_id = $1", key_id
        )
        await conn.execute(
            "UPDATE vault_reservations SET day = day - 1 WHERE vault_key_id = $1", key_id
        )


async def test_daily_cap_per_utc_day(
    issue: Issue, stripe_via_vault: StripeFor, customer: str, db: asyncpg.Pool
) -> None:
    key = await issue(cap_cents=100_000, daily_cap_cents=5_000)
    client = stripe_via_vault(key)
    await charge(client, customer, 3_000, "day-1")
    with pytest.raises(stripe.CardError) as refused:
        await charge(client, customer, 2_500, "day-2")
    assert refused.value.code == "spend_cap_exceeded"
    assert (
        "usd 25.00 would pass this key's daily cap (UTC day): usd 20.00 of usd 50.00 remain"
        in str(refused.value.user_message)
    )
    # The audit tells a refusal by the daily cap from one by the whole cap.
    audited = "SELECT decision FROM vault_audit WHERE idempotency_key = 'day-2'"
    assert await db.fetchval(audited) == "refused_daily_cap"
    await charge(client, customer, 2_000, "day-3")  # exactly fills the day
    await assert_consistent(db, key.id)

    # Move today's usage to yesterday: a new UTC day has the whole daily cap again.
    await _a_utc_day_passes(db, key.id)
    await charge(client, customer, 5_000, "day-4")
    totals = await assert_consistent(db, key.id)
    assert totals["spent_cents"] == 10_000


async def test_a_retry_in_doubt_from_an_earlier_utc_day_counts_against_today(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
) -> None:
    key = await issue(cap_cents=10_000, daily_cap_cents=1_000)
    client = stripe_via_vault(key)
    # Sent at 23:59 and answered 500 before Stripe executed anything: in doubt, counted.
    await charge_in_doubt(emulator, client, customer, 1_000, "late-evening", "error_before_commit")
    await _a_utc_day_passes(db, key.id)  # midnight passes
    await charge(client, customer, 1_000, "after-midnight")  # fills today's cap
    # The retry would move its money today, past today's cap: refused, left in doubt.
    with pytest.raises(stripe.CardError) as refused:
        await charge(client, customer, 1_000, "late-evening")
    assert refused.value.code == "spend_cap_exceeded"
    assert (
        "usd 10.00 would pass this key's daily cap (UTC day): usd 0.00 of usd 10.00 remain"
        in str(refused.value.user_message)
    )
    assert len(await emulator_ledger(emulator)) == 1
    await assert_consistent(db, key.id)
    # Another day with room: the retry goes, and is counted on that day.
    await _a_utc_day_passes(db, key.id)
    await charge(client, customer, 1_000, "late-evening")
    await assert_consistent(db, key.id)
    used_today = await db.fetchval(
        "SELECT spent_cents FROM vault_key_days WHERE vault_key_id = $1"
        " AND day = (now() AT TIME ZONE 'UTC')::date",
        key.id,
    )
    assert used_today == 1_000


async def test_a_retry_of_a_charge_declined_on_an_earlier_utc_day_counts_on_today(
    issue: Issue, customer: str, db: asyncpg.Pool
) -> None:
    """Declined at 23:59 (released), retried after midnight: the retry may move money
    today, so it is counted on today, and its commit moves it from today's reserved to
    today's spent; the day before keeps nothing of it."""
    key = await issue(cap_cents=10_000, daily_cap_cents=1_000)
    sent = Charge("POST /v1/payment_intents", 600, "usd", customer)
    async with db.acquire() as conn:
        declined = await reservations.reserve(conn, key.id, "declined", sent, timedelta(minutes=5))
        assert await reservations.settle(conn, declined, "failed", 402) == "released"
        await _a_utc_day_passes(db, key.id)  # midnight passes
        retry = await reservations.reserve(conn, key.id, "declined", sent, timedelta(minutes=5))
        assert (retry.attempt, retry.owned) == (2, True)
        await assert_consistent(db, key.id)
        assert await reservations.settle(conn, retry, "succeeded", 200) == "committed"
        await assert_consistent(db, key.id)
        days = await conn.fetch(
            "SELECT day = (now() AT TIME ZONE 'UTC')::date AS today, reserved_cents,"
            " spent_cents FROM vault_key_days WHERE vault_key_id = $1 ORDER BY day",
            key.id,
        )
        assert [tuple(day) for day in days] == [(False, 0, 0), (True, 0, 600)]
        # Today's cap holds it once: 400 cents of the day remain.
        with pytest.raises(reservations.CapExceeded) as refused:
            await reservations.reserve(
                conn,
                key.id,
                "next",
                Charge(sent.endpoint, 500, "usd", customer),
                timedelta(minutes=5),
            )
    assert refused.value.daily


async def test_currency_other_than_the_keys_is_refused(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
) -> None:
    key = await issue(currency="usd")
    with pytest.raises(stripe.InvalidRequestError) as refused:
        await charge(stripe_via_vault(key), customer, 1_000, "eur-1", currency="eur")
    assert refused.value.code == "currency_mismatch"
    assert refused.value.param == "currency"
    assert await emulator_ledger(emulator) == []
    assert (await assert_consistent(db, key.id))["reserved_cents"] == 0


async def test_a_legacy_charge_is_capped_as_a_payment_intent_is(
    issue: Issue,
    stripe_via_vault: StripeFor,
    customer: str,
    db: asyncpg.Pool,
    emulator: RunningEmulator,
) -> None:
    """`POST /v1/charges` (what many billing systems still call) moves money too: reserved
    before it is sent, counted once it charged, and refused past the cap."""
    key = await issue(cap_cents=1_000, allowed_endpoints=["POST /v1/charges"])
    charges = stripe_via_vault(key).v1.charges
    params: ChargeCreateParams = {"amount": 800, "currency": "usd", "customer": customer}
    await charges.create_async(params, {"idempotency_key": "first"})
    with pytest.raises(stripe.CardError) as refused:
        await charges.create_async(params, {"idempotency_key": "second"})
    assert refused.value.code == "spend_cap_exceeded"
    assert len(await emulator_ledger(emulator)) == 1
    totals = await assert_consistent(db, key.id)
    assert (totals["reserved_cents"], totals["spent_cents"]) == (0, 800)

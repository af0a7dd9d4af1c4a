"""`ledger.reopen_refused_charge` on the real ledger: a refused attempt reopens its claim only
when no attempt of it can have reached Stripe."""

from __future__ import annotations

from datetime import timedelta

import asyncpg

from billing import ledger
from billing.keys import idempotency_key
from billing.models import ChargeResult, Claim
from billing.periods import Period
from tests.integration.harness import Harness

PERIOD = Period(2026, 12)


async def claimed(harness: Harness) -> Claim:
    (customer,) = await harness.seed(1)
    key = idempotency_key("test", customer.customer_id, PERIOD)
    async with harness.pool.acquire() as conn:
        return await ledger.claim(
            conn, customer.customer_id, str(PERIOD), key, "run-1", charge_api="payment_intents"
        )


async def key_made(conn: asyncpg.Connection, claim: Claim, since_first_attempt: timedelta) -> None:
    """The period's vault key, made `since_first_attempt` after the claim's first attempt."""
    await conn.execute(
        """
        INSERT INTO period_vault_keys (billing_period, currency, vault_key_id, secret, cap_cents,
                                       created_at)
        SELECT billing_period, currency, 'vkey_0000000000000001', 'vk_test', 100, $2
        FROM billing_runs WHERE idempotency_key = $1
        ON CONFLICT (billing_period, currency) DO UPDATE SET created_at = EXCLUDED.created_at
        """,
        claim.idempotency_key,
        await conn.fetchval(
            "SELECT charge_started_at FROM billing_runs WHERE idempotency_key = $1",
            claim.idempotency_key,
        )
        + since_first_attempt,
    )


async def attempts(conn: asyncpg.Connection, claim: Claim) -> tuple[bool, int]:
    row = await conn.fetchrow(
        "SELECT charge_started_at IS NOT NULL AS started, attempts FROM billing_runs"
        " WHERE idempotency_key = $1",
        claim.idempotency_key,
    )
    return row["started"], row["attempts"]


async def test_a_first_attempt_refused_before_stripe_is_reopened(harness: Harness) -> None:
    claim = await claimed(harness)
    async with harness.pool.acquire() as conn:
        assert await ledger.begin_charge(conn, claim) == "go"
        assert await ledger.reopen_refused_charge(conn, claim.idempotency_key, proven=False)
        assert await attempts(conn, claim) == (False, 0)


async def test_a_retry_is_reopened_only_by_a_cap_refusal_under_the_key_it_began_with(
    harness: Harness,
) -> None:
    claim = await claimed(harness)
    async with harness.pool.acquire() as conn:
        await ledger.begin_charge(conn, claim)
        await ledger.begin_charge(conn, claim)
        # The key was replaced after the first attempt (it expired, the next run issued
        # another): the new key's cap knows nothing of what went through the old one.
        await key_made(conn, claim, timedelta(seconds=1))
        for proven in (False, True):
            assert not await ledger.reopen_refused_charge(
                conn, claim.idempotency_key, proven=proven
            )
        assert await attempts(conn, claim) == (True, 2)
        # Every attempt went through one key. A refused key proves only that the retry did
        # not reach Stripe; its cap refusal proves nothing is in doubt, since it checks the
        # key's own earlier reservations first.
        await key_made(conn, claim, -timedelta(seconds=1))
        assert not await ledger.reopen_refused_charge(conn, claim.idempotency_key, proven=False)
        assert await ledger.reopen_refused_charge(conn, claim.idempotency_key, proven=True)
        assert await attempts(conn, claim) == (False, 0)


async def test_a_finished_claim_is_never_reopened(harness: Harness) -> None:
    claim = await claimed(harness)
    async with harness.pool.acquire() as conn:
        await ledger.begin_charge(conn, claim)
        result = ChargeResult(
            charge_id="ch_1",
            payment_intent_id="pi_1",
            amount_cents=claim.amount_cents,
            currency=claim.currency,
        )
        await ledger.record_charge(conn, claim.idempotency_key, result)
        assert not await ledger.reopen_refused_charge(conn, claim.idempotency_key, proven=True)
        assert await attempts(conn, claim) == (True, 1)

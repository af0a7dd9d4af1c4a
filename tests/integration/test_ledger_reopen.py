"""The vault keys a claim's attempts went through, and their fencing tokens, on the real
ledger: a refused attempt reopens its claim only when no attempt of it can have reached
Stripe or still be sent, and a run's opening counts what its key has yet to send."""

from __future__ import annotations

import asyncpg
import pytest

from billing import ledger
from billing.errors import ClaimClosedError
from billing.keys import idempotency_key
from billing.models import ChargeFailure, Claim
from billing.periods import Period
from tests.integration.harness import Harness
from tests.integration.test_ledger_claim import record_charged

PERIOD = Period(2026, 12)
K1 = "vkey_0000000000000001"
K2 = "vkey_0000000000000002"


async def claimed(harness: Harness, count: int = 1) -> list[Claim]:
    claims = []
    await harness.open_period_by_hand(PERIOD)
    async with harness.pool.acquire() as conn:
        for customer in await harness.seed(count):
            key = idempotency_key("test", customer.customer_id, PERIOD)
            claims.append(
                await ledger.claim(
                    conn,
                    customer.customer_id,
                    str(PERIOD),
                    key,
                    "run-1",
                    charge_api="payment_intents",
                )
            )
    return claims


async def stored(conn: asyncpg.Connection, claim: Claim, vault_key_id: str) -> None:
    """The period's stored key is now `vault_key_id`, as a rerun's preparation leaves it."""
    await conn.execute(
        """
        INSERT INTO period_vault_keys (billing_period, currency, vault_key_id, secret, cap_cents)
        VALUES ($1, $2, $3, 'vk_test', 100)
        ON CONFLICT (billing_period, currency) DO UPDATE
        SET vault_key_id = EXCLUDED.vault_key_id, created_at = now()
        """,
        claim.period,
        claim.currency,
        vault_key_id,
    )


async def passed(conn: asyncpg.Connection, claim: Claim, route: str | None) -> int:
    """An attempt through `route` passes the gate; returns its fencing token."""
    passage = await ledger.begin_charge(conn, claim, route)
    assert passage.gate == "go" and passage.fencing_token is not None
    return passage.fencing_token


async def attempts(conn: asyncpg.Connection, claim: Claim) -> tuple[bool, int]:
    row = await conn.fetchrow(
        "SELECT charge_started_at IS NOT NULL AS started, attempts FROM billing_runs"
        " WHERE idempotency_key = $1",
        claim.idempotency_key,
    )
    return row["started"], row["attempts"]


async def sent_through(conn: asyncpg.Connection, claim: Claim) -> list[str] | None:
    keys: list[str] | None = await conn.fetchval(
        "SELECT sent_through FROM billing_runs WHERE idempotency_key = $1", claim.idempotency_key
    )
    return keys


async def test_a_first_attempt_refused_before_stripe_is_reopened(harness: Harness) -> None:
    (claim,) = await claimed(harness)
    async with harness.pool.acquire() as conn:
        token = await passed(conn, claim, K1)
        assert await sent_through(conn, claim) == [K1]
        assert await ledger.reopen_refused_charge(conn, claim.idempotency_key, token)
        assert await attempts(conn, claim) == (False, 0)
        assert await sent_through(conn, claim) is None


async def test_a_retry_is_reopened_by_a_cap_refusal_of_the_one_key_every_attempt_used(
    harness: Harness,
) -> None:
    (claim,) = await claimed(harness)
    async with harness.pool.acquire() as conn:
        assert await passed(conn, claim, K1) == 1
        retry = await passed(conn, claim, K1)
        assert await sent_through(conn, claim) == [K1]
        # A refusal that is not the cap's proves only that this retry did not reach Stripe,
        # and another key's cap knows nothing of what went through K1.
        assert not await ledger.reopen_refused_charge(conn, claim.idempotency_key, retry)
        assert not await ledger.reopen_refused_charge(
            conn, claim.idempotency_key, retry, fenced_by=K2
        )
        assert await attempts(conn, claim) == (True, 2)
        # K1's cap refusal proves nothing is in doubt: it checks K1's earlier reservations,
        # and fences off the first attempt, which may still be on its way.
        assert await ledger.reopen_refused_charge(conn, claim.idempotency_key, retry, fenced_by=K1)
        assert await attempts(conn, claim) == (False, 0)
        # Fencing tokens are never reused: the vault fenced off everything up to this one.
        assert await passed(conn, claim, K1) == retry + 1


async def test_a_cap_refusal_of_an_attempt_that_is_not_the_latest_proves_nothing(
    harness: Harness,
) -> None:
    """Three attempts through K1 at once (a terminated run's child still running, a timed-out
    local activity): the second is refused on K1's cap. The vault fenced off the first, but
    not the third, which may yet be sent once room is freed: the claim stays started, and K1
    stays named, until the latest attempt's own refusal."""
    (claim,) = await claimed(harness)
    async with harness.pool.acquire() as conn:
        await passed(conn, claim, K1)
        second = await passed(conn, claim, K1)
        third = await passed(conn, claim, K1)
        assert not await ledger.reopen_refused_charge(
            conn, claim.idempotency_key, second, fenced_by=K1
        )
        assert await attempts(conn, claim) == (True, 3)
        assert await sent_through(conn, claim) == [K1]
        assert await ledger.reopen_refused_charge(conn, claim.idempotency_key, third, fenced_by=K1)
        assert await attempts(conn, claim) == (False, 0)


async def test_a_late_reopen_leaves_alone_an_attempt_that_passed_the_gate_since(
    harness: Harness,
) -> None:
    """Attempt 1 is refused (Stripe's rate limit, a refused key) and its reopen is held up;
    meanwhile attempt 2 is refused on K1's cap and reopens the claim, and attempt 3 passes the
    gate and is sent. Attempt 1's reopen, arriving now, must not reopen the claim under
    attempt 3: a cancel would then record nothing charged while attempt 3 charges."""
    (claim,) = await claimed(harness)
    async with harness.pool.acquire() as conn:
        first = await passed(conn, claim, K1)
        second = await passed(conn, claim, K1)
        assert await ledger.reopen_refused_charge(conn, claim.idempotency_key, second, fenced_by=K1)
        await passed(conn, claim, K1)
        assert await attempts(conn, claim) == (True, 1)
        for late in (first, second):
            assert not await ledger.reopen_refused_charge(conn, claim.idempotency_key, late)
            assert not await ledger.reopen_refused_charge(
                conn, claim.idempotency_key, late, fenced_by=K1
            )
        assert await attempts(conn, claim) == (True, 1)
        assert await sent_through(conn, claim) == [K1]


async def test_a_cap_refusal_proves_nothing_once_an_attempt_went_through_another_key(
    harness: Harness,
) -> None:
    """A worker still holding K1 after a rerun stored K2 sends the first attempt through K1
    (it may have charged); a retry through K2 is refused on K2's cap. That refusal says
    nothing of K1's charge, however new K2 is, so the claim stays started."""
    (claim,) = await claimed(harness)
    async with harness.pool.acquire() as conn:
        await stored(conn, claim, K2)
        await ledger.begin_charge(conn, claim, K1)
        await ledger.begin_charge(conn, claim, K2)
        retry = await passed(conn, claim, K2)
        assert await sent_through(conn, claim) == [K1, K2]
        for fenced_by in (None, K2):
            assert not await ledger.reopen_refused_charge(
                conn, claim.idempotency_key, retry, fenced_by=fenced_by
            )
        assert await attempts(conn, claim) == (True, 3)
        # K2 holds nothing of the claim now: its refusal proved that much.
        assert await sent_through(conn, claim) == [K1]


async def test_an_attempt_without_the_vault_is_never_proven_by_a_key(harness: Harness) -> None:
    (claim,) = await claimed(harness)
    async with harness.pool.acquire() as conn:
        await ledger.begin_charge(conn, claim, ledger.SENT_DIRECT)
        # A period switched to the vault since: the direct attempt may have charged.
        retry = await passed(conn, claim, K1)
        assert await sent_through(conn, claim) == [ledger.SENT_DIRECT, K1]
        # Only vault keys are named to the vault, to fence off the attempts through them.
        assert await ledger.vault_keys_sent_through(conn, claim.idempotency_key) == [K1]
        assert not await ledger.reopen_refused_charge(
            conn, claim.idempotency_key, retry, fenced_by=K1
        )
        assert await attempts(conn, claim) == (True, 2)


async def test_an_attempt_that_sends_nothing_names_nothing(harness: Harness) -> None:
    """No key for the period: the attempt passes the gate (so a pause still reaches the
    claim after) but sends nothing, and names nothing."""
    (claim,) = await claimed(harness)
    async with harness.pool.acquire() as conn:
        await ledger.begin_charge(conn, claim, None)
        assert await sent_through(conn, claim) is None
        assert await attempts(conn, claim) == (True, 1)


async def test_a_finished_claim_is_never_reopened(harness: Harness) -> None:
    (claim,) = await claimed(harness)
    async with harness.pool.acquire() as conn:
        token = await passed(conn, claim, K1)
        await record_charged(conn, claim)
        assert not await ledger.reopen_refused_charge(
            conn, claim.idempotency_key, token, fenced_by=K1
        )
        assert await attempts(conn, claim) == (True, 1)


async def test_a_run_counts_as_unsent_what_went_only_through_a_replaced_key(
    harness: Harness,
) -> None:
    """A rerun stored K2; a worker still holding K1 sent one claim through it, another worker
    sent one through K2, a third went through K1 and was refused on K2's cap, and one
    customer is not claimed yet. K2's spend and reservations hold only the second: the
    others are what K2 must still have room for."""
    stale, current, refused, unclaimed = await claimed(harness, 4)
    async with harness.pool.acquire() as conn:
        await conn.execute(
            "DELETE FROM billing_runs WHERE idempotency_key = $1", unclaimed.idempotency_key
        )
        await stored(conn, current, K2)
        await ledger.begin_charge(conn, stale, K1)
        await ledger.begin_charge(conn, current, K2)
        # Sent through K1, then refused on K2's cap: K2 holds nothing of it.
        await ledger.begin_charge(conn, refused, K1)
        retry = await passed(conn, refused, K2)
        await ledger.reopen_refused_charge(conn, refused.idempotency_key, retry, fenced_by=K2)
        unsent = await ledger.unsent_totals(conn, str(PERIOD))
    assert unsent == {"usd": stale.amount_cents + refused.amount_cents + unclaimed.amount_cents}


async def test_a_stored_key_counts_as_charged_only_the_charges_that_went_through_it_alone(
    harness: Harness,
) -> None:
    """What the preview reads a key's room from (a key too small for a rerun is named): a
    charge through it counts, a failure through it does not, nor does a charge that went
    through another key too. A key no worker of this ledger issued is said so."""
    charged, failed, both = await claimed(harness, 3)
    async with harness.pool.acquire() as conn:
        await stored(conn, charged, K1)
        for claim in (charged, failed, both):
            await passed(conn, claim, K1)
        await passed(conn, both, K2)
        await record_charged(conn, charged)
        await ledger.record_unbilled(
            conn, failed.idempotency_key, "failed", ChargeFailure(code="card_declined", message="")
        )
        await record_charged(conn, both, number=2)
        [key] = await ledger.stored_keys(conn, str(PERIOD))
    assert (key.vault_key_id, key.issued_here, key.charged_cents) == (
        K1,
        False,
        charged.amount_cents,
    )


async def test_a_finished_claim_is_closed_at_the_gate_though_an_attempt_passed(
    harness: Harness,
) -> None:
    """A retry passes the gate once a first attempt has (it may be at Stripe), but only while
    the claim is open: a stale attempt of a claim charged or failed since (a terminated
    run's child, a re-drive) stops there, or it charges the customer again, under a key
    Stripe may have forgotten."""
    charged, failed = await claimed(harness, 2)
    async with harness.pool.acquire() as conn:
        for claim in (charged, failed):
            await passed(conn, claim, K1)
        await record_charged(conn, charged)
        declined = ChargeFailure(code="card_declined", message="declined")
        await ledger.record_unbilled(conn, failed.idempotency_key, "failed", declined)
        for claim, status in ((charged, "charged"), (failed, "failed")):
            with pytest.raises(ClaimClosedError) as closed:
                await ledger.begin_charge(conn, claim, K1)
            assert closed.value.status == status
            assert await attempts(conn, claim) == (True, 1)

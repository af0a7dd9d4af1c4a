"""The gate an attempt of a claim passes before it may reach Stripe, and its reopening when
the attempt was refused before Stripe, or held behind an error Stripe saved for its key."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import asyncpg

from billing.errors import ClaimClosedError
from billing.models import Claim, Gate, LedgerStatus


@dataclass(frozen=True, slots=True)
class Passage:
    """The gate's answer to one attempt of a claim."""

    gate: Gate
    # The attempt's number among all that passed the claim's gate, never reused (for one
    # stopped at the gate, the last one's). It goes to the vault with the request
    # (vault.endpoints.FENCE_HEADER), whose cap refusal then fences off every attempt below it,
    # and it names the attempt a reopen is for (see reopen_refused_charge).
    fencing_token: int


async def begin_charge(conn: asyncpg.Connection, claim: Claim, route: str | None) -> Passage:
    """Decide, atomically with pause, cancel and skip, whether this attempt may call Stripe:
    one call of billing_begin_charge (migrations/018_fencing_tokens.sql). An attempt that
    passes names its `route`, the vault key it sends through (SENT_DIRECT without the vault,
    None if it will send nothing); the claim keeps every route (see reopen_refused_charge).

    Once a first attempt has passed, every retry passes too: that charge may already be at
    Stripe, and only a retry with the same key can learn its outcome.
    """
    row = await conn.fetchrow(
        "SELECT gate, status, fencing_token FROM billing_begin_charge($1, $2, $3)",
        claim.idempotency_key,
        claim.period,
        route,
    )
    if row["gate"] == "closed":
        raise ClaimClosedError(
            row["status"],
            f"claim {claim.idempotency_key[:8]}... is no longer open ({row['status']});"
            " not charging",
        )
    return Passage(row["gate"], row["fencing_token"])


async def reopen_refused_charge(
    conn: asyncpg.Connection, key: str, fencing_token: int, *, fenced_by: str | None = None
) -> bool:
    """Undo begin_charge for the attempt `fencing_token`, refused before it reached Stripe
    (the vault's cap, a refused key, Stripe's rate limit), so the claim waits at the gate
    again. Only if no other attempt passed the gate since, and none can still reach Stripe:
    this was the only attempt since the claim was last reopened (`attempts` counts requests
    that may have reached Stripe), or the vault key `fenced_by` refused it on its cap and
    fenced off the attempts before it. The vault checks a key's earlier reservations before
    its cap, so that refusal proves that no attempt through that key is charged, in doubt or
    still to be sent: it reopens the claim if every attempt went through that key
    (`sent_through`), not through a key replaced since that a worker may still hold.
    Otherwise that key leaves `sent_through`, which then still names every key holding a part
    of the claim (see unsent_totals)."""
    async with conn.transaction():
        reopened = await conn.fetchval(
            """
            UPDATE billing_runs r
            SET charge_started_at = NULL, attempts = 0, sent_through = NULL, updated_at = now()
            WHERE r.idempotency_key = $1 AND r.status = 'claimed' AND r.gate_passes = $2
                AND (r.attempts = 1 OR r.sent_through = ARRAY[$3::text])
            RETURNING 1
            """,
            key,
            fencing_token,
            fenced_by,
        )
        if reopened is None and fenced_by is not None:
            await conn.execute(
                """
                UPDATE billing_runs SET sent_through = array_remove(sent_through, $3)
                WHERE idempotency_key = $1 AND status = 'claimed' AND gate_passes = $2
                """,
                key,
                fencing_token,
                fenced_by,
            )
    return reopened is not None


# Stripe forgets a key 24 hours after its first request, which came after the claim: until 22
# hours after the claim, a request with the key still on its way (a worker's, the vault's)
# can only meet the saved answer.
SAVED_ERROR_HOLDS_FOR = timedelta(hours=22)
# A skip of such a claim is accepted an hour less: its next try, minutes away, must come while
# the stop still can.
SKIP_BEHIND_SAVED_ERROR_FOR = SAVED_ERROR_HOLDS_FOR - timedelta(hours=1)


async def stop_behind_saved_error(
    conn: asyncpg.Connection, key: str, fencing_token: int, *, record: bool
) -> LedgerStatus | None:
    """After the claim's attempt `fencing_token` met a 500 Stripe saved for the key and found
    no charge made with it: note that (so that a skip may still reach the claim, see
    request_skip), and return the stop that applies, if the customer was skipped or the
    period's run cancelled; record it only if `record`. Stripe executes no request with the
    key until it forgets it a day later, so nothing of the charge is at Stripe or can still
    get there. Only for the claim's latest attempt, and only while the key is young enough
    (SAVED_ERROR_HOLDS_FOR)."""
    stopped: LedgerStatus | None = await conn.fetchval(
        """
        WITH held AS (
            SELECT r.idempotency_key,
                   CASE WHEN r.skip_reason IS NOT NULL THEN 'skipped'
                        WHEN p.control = 'cancelled' THEN 'cancelled' END AS stop,
                   coalesce(r.skip_reason, p.control_reason) AS why,
                   coalesce(r.skip_by, p.control_by) AS who
            FROM billing_runs r JOIN billing_periods p USING (billing_period)
            WHERE r.idempotency_key = $1 AND r.status = 'claimed' AND r.gate_passes = $2
                AND r.claimed_at > now() - $3::interval
            FOR UPDATE OF r
        ), recorded AS (
            SELECT *, CASE WHEN $4 THEN stop END AS status FROM held
        )
        UPDATE billing_runs r
        SET saved_error_at = now(), updated_at = now(), status = coalesce(h.status, r.status),
            reason = CASE WHEN h.status IS NULL THEN r.reason ELSE h.why END,
            decided_by = CASE WHEN h.status IS NULL THEN r.decided_by ELSE h.who END,
            completed_at = CASE WHEN h.status IS NULL THEN r.completed_at ELSE now() END
        FROM recorded h WHERE r.idempotency_key = h.idempotency_key
        RETURNING h.stop
        """,
        key,
        fencing_token,
        SAVED_ERROR_HOLDS_FOR,
        record,
    )
    return stopped

"""The hard cap: money is reserved in Postgres before a request is forwarded, then settled.

Per key, after every transaction here:
  reserved_cents == sum(amount_cents) of its pending and unknown reservations
  spent_cents    == sum(committed_cents) of its committed reservations not counted_under
                    another key
  spent_cents + reserved_cents <= cap_cents, and the same per UTC day under a daily cap.
Across keys, a request's spend is counted under one vault key: Stripe keeps one idempotency
key per account, so a retry through another key (after a renewal) replays the same charge,
and its reservation, committed, names the key that counts it (counted_under).

A reservation is keyed by (vault key, idempotency key). Only one request at a time forwards
it: the one that moved it to `pending` (its `attempt`), and only that request settles it.
Locks are always taken in the order: the idempotency key's commit lock (vault_lock_commits),
reservation row, key row, day row, so no two of these transactions can deadlock. (The worker
budget's currency lock comes after a reservation row, before the key row: budget.py.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import asyncpg

from billing.money import describe_amount
from vault import budget, store
from vault.models import DAILY_CAP, ReservationInfo, ReservationState

Outcome = Literal["succeeded", "failed", "unknown"]
# An attempt's answer settles its reservation while it is pending, or unknown (found stale).
_OPEN: tuple[ReservationState, ...] = ("pending", "unknown")


@dataclass(frozen=True, slots=True)
class Charge:
    """The money a metered request asks for, as parsed from its body."""

    endpoint: str
    amount_cents: int
    currency: str
    customer: str | None


@dataclass(frozen=True, slots=True)
class Reservation:
    id: int
    attempt: int
    state: ReservationState
    # This request holds the reservation pending: it forwards, then settles it.
    owned: bool
    # An earlier attempt's outcome is unknown, so only a success, a decline or a replayed
    # answer settles it; any other refusal proves only that this attempt did not execute.
    in_doubt: bool


class Refused(Exception):
    """The reservation was not made; the request must not be forwarded."""


class CapExceeded(Refused):
    def __init__(self, message: str, *, daily: bool, fenced_below: int | None) -> None:
        super().__init__(message)
        self.daily = daily
        # The fence this refusal left, when the request carried a fencing token.
        self.fenced_below = fenced_below


class KeyUnusable(Refused):
    """Revoked or expired after the request was authenticated."""

    def __init__(self, message: str, *, revoked: bool) -> None:
        super().__init__(message)
        self.revoked = revoked


class InFlight(Refused):
    """Another request with this idempotency key is being forwarded right now."""


class Mismatch(Refused):
    """The idempotency key was first used for a different request."""


class Superseded(Refused):
    """A later attempt of this request fenced this one off: refused on the cap, or behind a
    500 Stripe saved for the key (through the admin API's fence)."""

    def __init__(self, message: str, *, fenced_below: int) -> None:
        super().__init__(message)
        self.fenced_below = fenced_below


class ReplayExpired(Refused):
    """The key's reservation is older than Stripe keeps idempotency keys: a retry would
    execute as a new charge."""

    def __init__(self, message: str, *, committed: bool) -> None:
        super().__init__(message)
        self.committed = committed


class NotFound(Exception):
    pass


class Conflict(Exception):
    """A resolution that contradicts the reservation's state."""


async def reserve(
    conn: asyncpg.Connection,
    key_id: str,
    idempotency_key: str,
    charge: Charge,
    stale_after: timedelta,
    fencing_token: int | None = None,
) -> Reservation:
    """Count `charge` against the key's caps, or find the reservation this key already has.
    The decision is the SQL function vault_reserve
    (migrations/034_replay_window_own_commit.sql): one round trip. A key revoked or expired
    since the proxy checked it refuses any request it would forward (KeyUnusable), a replay
    included. A cap refusal of a request
    with a `fencing_token` fences the idempotency key under this vault key: any later request
    below that token, or without one, is refused (Superseded). A request whose idempotency key
    any vault key first sent 23 hours ago or more is refused (ReplayExpired)."""
    row = await conn.fetchrow(
        "SELECT * FROM vault_reserve($1, $2, $3, $4, $5, $6, $7, $8)",
        key_id,
        idempotency_key,
        charge.endpoint,
        charge.amount_cents,
        charge.currency,
        charge.customer,
        stale_after,
        fencing_token,
    )
    decision, detail = row["decision"], row["detail"]
    if decision == "reserved":
        return Reservation(row["reservation_id"], row["attempt"], "pending", True, False)
    if decision == "taken_over":
        return Reservation(row["reservation_id"], row["attempt"], "pending", True, True)
    if decision == "replay":
        # Stripe replays the saved result; nothing to count or settle.
        return Reservation(row["reservation_id"], row["attempt"], "committed", False, False)
    if decision == "in_flight":
        raise InFlight(
            "a request with this Idempotency-Key is in flight; retry when it has finished"
        )
    if decision == "replay_expired":
        committed = detail == "committed"
        settles = (
            "it was charged: look the charge up on Stripe"
            if committed
            else "its outcome is unknown: reconciliation settles it from Stripe, and a retry"
            " goes on once it is released"
        )
        through = row["first_sent_through"]
        via = "" if through == key_id else f" (through vault key {through})"
        raise ReplayExpired(
            f"this Idempotency-Key was first sent 23 hours ago or more{via}, and Stripe keeps"
            f" keys for 24, so a retry could charge again; {settles}. A new charge needs a new"
            " key",
            committed=committed,
        )
    if decision == "mismatch":
        raise Mismatch(
            f"this Idempotency-Key was first used for a different request ({detail});"
            " use a new key for a new request"
        )
    if decision == "superseded":
        raise Superseded(
            f"a later attempt of this request fenced this one off (every attempt below"
            f" fencing token {row['fenced_below']}: it was refused on this key's cap, or met"
            " an error Stripe saved for the key), so it is not sent: retry it with a new token",
            fenced_below=row["fenced_below"],
        )
    if decision in ("revoked", "expired"):
        revoked = decision == "revoked"
        raise KeyUnusable(
            f"this vault key has {'been revoked' if revoked else 'expired'}", revoked=revoked
        )
    if decision not in ("cap", "daily_cap"):
        # A database migrated past this vault's code: refuse rather than guess.
        raise RuntimeError(f"vault_reserve answered {decision!r}, which this vault does not know")
    daily = decision == "daily_cap"
    cap = DAILY_CAP if daily else "cap"
    left, of = (describe_amount(charge.currency, int(c)) for c in detail.split(" of "))
    raise CapExceeded(
        f"{describe_amount(charge.currency, charge.amount_cents)} would pass this key's {cap}:"
        f" {left} of {of} remain",
        daily=daily,
        fenced_below=row["fenced_below"],
    )


async def settle(
    conn: asyncpg.Connection,
    reservation: Reservation,
    outcome: Outcome,
    upstream_status: int | None,
) -> ReservationState:
    """Record what the upstream answered this request's attempt; returns the state after.
    The attempt may have been found stale meanwhile (its settle held up by a database
    outage): unknown, it still takes this answer, which is what reconciliation would seek."""
    if outcome == "unknown":
        state: ReservationState | None = await conn.fetchval(
            """
            UPDATE vault_reservations
            SET state = 'unknown', upstream_status = $3, updated_at = now()
            WHERE id = $1 AND attempt = $2 AND state = ANY($4::text[])
            RETURNING state
            """,
            reservation.id,
            reservation.attempt,
            upstream_status,
            list(_OPEN),
        )
    else:
        target: Literal["committed", "released"] = (
            "committed" if outcome == "succeeded" else "released"
        )
        state = await _finish(
            conn, reservation.id, reservation.attempt, _OPEN, target, None, upstream_status
        )
    if state is None:
        # Taken over meanwhile (this attempt was found stale), or settled: the new owner or
        # reconciliation has it.
        state = await conn.fetchval(
            "SELECT state FROM vault_reservations WHERE id = $1", reservation.id
        )
    return state


async def _finish(
    conn: asyncpg.Connection,
    reservation_id: int,
    attempt: int,
    from_states: Sequence[ReservationState],
    to_state: Literal["committed", "released"],
    committed_cents: int | None,
    upstream_status: int | None,
) -> Literal["committed", "released"] | None:
    """Move the attempt's amount out of reserved, into spent if committed and no other vault
    key counts the same request; returns the state reached, None when the attempt no longer
    holds the reservation in `from_states`. One round trip: the SQL function vault_finish
    (migrations/020_spend_counted_once.sql), which takes the locks reservation, key, day."""
    finished: Literal["committed", "released"] | None = await conn.fetchval(
        "SELECT finished FROM vault_finish($1, $2, $3, $4, $5, $6)",
        reservation_id,
        attempt,
        list(from_states),
        to_state,
        committed_cents,
        upstream_status,
    )
    return finished


async def mark_stale_unknown(conn: asyncpg.Connection, key_id: str, stale_after: timedelta) -> None:
    """Pending reservations older than any request could be were left by a vault that stopped
    mid-request (or whose settle a database outage cut off): their outcome is unknown. Their
    `updated_at` stays the time the attempt was sent: how long Stripe has had to commit it,
    which a release waits on, did not start again when it was found stale. Its
    `upstream_status` is cleared: no answer to this attempt was recorded, and one left from
    an attempt before a takeover must not speak for it."""
    await conn.execute(
        """
        UPDATE vault_reservations SET state = 'unknown', upstream_status = NULL
        WHERE vault_key_id = $1 AND state = 'pending' AND updated_at <= now() - $2::interval
        """,
        key_id,
        stale_after,
    )


async def resolve(
    conn: asyncpg.Connection,
    key_id: str,
    idempotency_key: str,
    outcome: Literal["succeeded", "failed"],
    amount_cents: int | None,
    attempt: int | None,
    min_idle: timedelta | None,
    stale_after: timedelta,
    worker_policy: budget.WorkerPolicy | None = None,
) -> ReservationInfo:
    """Settle an unknown reservation with what reconciliation found on Stripe for its
    `attempt` (any, if None); a release only once it has not changed for `min_idle` past
    `stale_after`, the longest the vault waits on Stripe.
    Repeating the same resolution is a no-op; contradicting a settled one, settling an
    attempt a retry has replaced, or releasing one that changed too lately is refused. A
    success another vault key has already committed is counted there (`counted_under`).
    With `worker_policy` (the worker token's call), cents it frees count against the worker
    budget (budget.WorkerKeyRefused past it)."""
    target: Literal["committed", "released"] = "committed" if outcome == "succeeded" else "released"
    async with conn.transaction():
        # Before any row's lock, as vault_finish takes it.
        await conn.execute("SELECT vault_lock_commits($1)", idempotency_key)
        await mark_stale_unknown(conn, key_id, stale_after)
        row = await conn.fetchrow(
            """
            SELECT id, attempt, state, amount_cents, committed_cents, now() - updated_at AS idle
            FROM vault_reservations
            WHERE vault_key_id = $1 AND idempotency_key = $2 FOR UPDATE
            """,
            key_id,
            idempotency_key,
        )
        if row is None:
            raise NotFound(f"key {key_id} has no reservation for this idempotency key")
        if attempt is not None and attempt != row["attempt"]:
            raise Conflict(
                f"the reservation was retried since attempt {attempt} was looked up (it is at"
                f" attempt {row['attempt']}): look it up on Stripe again"
            )
        if amount_cents is not None and amount_cents > row["amount_cents"]:
            raise ValueError(
                f"amount_cents {amount_cents} exceeds the {row['amount_cents']} cents reserved"
            )
        state: ReservationState = row["state"]
        same = state == target and (amount_cents is None or amount_cents == row["committed_cents"])
        if not same:
            if state == "pending":
                raise Conflict("the reservation is in flight; resolve it when it is not")
            if state != "unknown":
                raise Conflict(f"the reservation is already {state}")
            # A reservation found stale last changed when its attempt was sent, and with a
            # long upstream timeout Stripe may take the request late in the vault's wait.
            if (
                target == "released"
                and min_idle is not None
                and row["idle"] < min_idle + stale_after
            ):
                raise Conflict(
                    f"the reservation changed {row['idle'].total_seconds():.0f} s ago, less than"
                    f" {min_idle.total_seconds():.0f} s after the vault's"
                    f" {stale_after.total_seconds():.0f} s wait on Stripe: Stripe may still"
                    " commit it; later"
                )
            # A charge settled as failed, or for less, frees cap it may have taken after all.
            kept = 0 if target == "released" else amount_cents or row["amount_cents"]
            freed = row["amount_cents"] - kept
            if worker_policy is not None and freed > 0:
                await budget.count_release(conn, key_id, freed, worker_policy)
            await _finish(conn, row["id"], row["attempt"], ("unknown",), target, amount_cents, None)
        info = await conn.fetchrow(
            f"SELECT {store.RESERVATION_COLUMNS} FROM vault_reservations WHERE id = $1",
            row["id"],
        )
    return store.reservation_info(info)


async def charge_state_for(
    conn: asyncpg.Connection, key_id: str, idempotency_key: str, charge: Charge
) -> ReservationState | None:
    """Where a key of this key's period and label stands with this charge (endpoint,
    customer, amount and currency) reserved under `idempotency_key`: `unknown` (sent, with no
    answer to say what Stripe did) if any such reservation is, else `pending` (being sent) if
    any is, else the state of one of them; None if no key of the period reserved it."""
    found: ReservationState | None = await conn.fetchval(
        """
        SELECT r.state
        FROM vault_keys mine
        JOIN vault_keys k ON k.period = mine.period AND k.label = mine.label
        JOIN vault_reservations r ON r.vault_key_id = k.id
        WHERE mine.id = $1 AND r.idempotency_key = $2
              AND r.endpoint = $3 AND r.customer = $4 AND r.amount_cents = $5
              AND r.currency = $6
        ORDER BY r.state = 'unknown' DESC, r.state = 'pending' DESC
        LIMIT 1
        """,
        key_id,
        idempotency_key,
        charge.endpoint,
        charge.customer,
        charge.amount_cents,
        charge.currency,
    )
    return found

"""What the worker token may issue: keys within a rolling budget per currency.

Workers hold the worker token, not the admin token, so a worker taken over cannot mint keys
without limit. A worker key may allow only the billing workers' endpoints, in the currencies
listed, and lives at most the window (a longer expiry is shortened to it). Per currency, what
worker keys could have moved stays within the budget: the cap of each live worker key, what
each worker key dead within the window took (spent, and reserved while unresolved), except
that one the admin token revoked keeps counting its cap (the operator's kill switch on a worker
that may be taken over hands it no room back), and the
cents the worker token freed on them by settling a reservation as failed or for less, since a
charge it called failed may have gone through and the freed room be charged again. Keys with
no metered endpoint (lookup keys) move no money and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

from billing.money import describe_amount
from vault.endpoints import METERED, WORKER_ENDPOINTS, beyond_worker_endpoints
from vault.models import IssueKeyRequest


class WorkerKeyRefused(Exception):
    """The worker token may not issue this key; the message says why and what to do."""


@dataclass(frozen=True)
class WorkerPolicy:
    budget_cents: int
    window: timedelta
    currencies: frozenset[str]


async def _lock(conn: asyncpg.Connection, currency: str) -> None:
    # Held to the end of the caller's transaction: two issues (or an issue and a release)
    # cannot both take the last room of a currency.
    await conn.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended('vault-worker-budget:' || $1, 0))",
        currency,
    )


async def _room(conn: asyncpg.Connection, currency: str, policy: WorkerPolicy) -> int:
    """Cents of the budget left in the currency; takes the currency's lock first."""
    await _lock(conn, currency)
    used: int = await conn.fetchval(
        """
        SELECT coalesce(sum(worker_released_cents + CASE
                   WHEN revoked_at IS NULL AND expires_at > now() THEN cap_cents
                   WHEN revoked_by = 'admin' THEN cap_cents
                   ELSE spent_cents + reserved_cents END), 0)::bigint
        FROM vault_keys
        WHERE issued_by = 'worker' AND currency = $1 AND allowed_endpoints && $3::text[]
              AND (revoked_at IS NULL AND expires_at > now()
                   OR least(revoked_at, expires_at) > now() - $2::interval)
        """,
        currency,
        policy.window,
        sorted(METERED),
    )
    return policy.budget_cents - used


def _past_budget(
    what: str, currency: str, short: int, policy: WorkerPolicy, otherwise: str
) -> WorkerKeyRefused:
    return WorkerKeyRefused(
        f"{what} would take worker keys {describe_amount(currency, short)} past"
        f" VAULT_WORKER_BUDGET_CENTS={policy.budget_cents}"
        f" ({describe_amount(currency, policy.budget_cents)}) for the last {policy.window.days}"
        " days: revoke unused worker keys with the worker token (GET /vault/keys lists them;"
        " a key it revoked counts only what it took, one the admin token revoked its whole"
        " cap for the window),"
        f" raise the budget, or {otherwise}"
    )


async def admit(
    conn: asyncpg.Connection, request: IssueKeyRequest, policy: WorkerPolicy
) -> IssueKeyRequest:
    """The key to issue for a worker: `request`, its expiry shortened to the window if need
    be; refused past the policy. Call inside the transaction that inserts the key."""
    if request.currency not in policy.currencies:
        raise WorkerKeyRefused(
            f"currency {request.currency} is not in VAULT_WORKER_CURRENCIES"
            f" ({','.join(sorted(policy.currencies))}): add it, or issue with the admin token"
        )
    outside = beyond_worker_endpoints(request.allowed_endpoints)
    if outside:
        raise WorkerKeyRefused(
            f"a worker key may allow only {', '.join(WORKER_ENDPOINTS)}; not {outside[0]}"
        )
    now: datetime = await conn.fetchval("SELECT now()")
    latest = now + policy.window
    admitted = request.model_copy(update={"expires_at": min(request.expires_at, latest)})
    if not METERED.isdisjoint(request.allowed_endpoints):
        room = await _room(conn, request.currency, policy)
        if request.cap_cents > room:
            short = request.cap_cents - room
            raise _past_budget(
                f"a cap of {describe_amount(request.currency, request.cap_cents)}",
                request.currency,
                short,
                policy,
                "wait for a key of the window to expire",
            )
    return admitted


async def count_release(
    conn: asyncpg.Connection, key_id: str, cents: int, policy: WorkerPolicy
) -> None:
    """The worker token frees `cents` of its key's cap (a reservation settled as failed, or
    for less): counted against the budget, and refused past it while the key is live (a
    dead key's total is the same either way). Call inside the transaction that frees them."""
    key = await conn.fetchrow(
        "SELECT currency, revoked_at IS NULL AND expires_at > now() AS live"
        " FROM vault_keys WHERE id = $1",
        key_id,
    )
    room = await _room(conn, key["currency"], policy)
    if key["live"] and cents > room:
        raise _past_budget(
            f"freeing {describe_amount(key['currency'], cents)} reserved",
            key["currency"],
            cents - room,
            policy,
            "settle it with the admin token",
        )
    await conn.execute(
        "UPDATE vault_keys SET worker_released_cents = worker_released_cents + $2 WHERE id = $1",
        key_id,
        cents,
    )

"""What the worker token may issue: keys within a rolling budget per currency.

Workers hold the worker token, not the admin token, so a worker taken over cannot mint keys
without limit. Per currency, the caps of live worker keys plus what expired or revoked ones
took (spent, and reserved while unresolved) over the last VAULT_WORKER_BUDGET_DAYS stay
within VAULT_WORKER_BUDGET_CENTS. No worker key lives longer than that window, so every live
one is counted; a key with no metered endpoint (a lookup key) moves no money and is free.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import asyncpg

from vault.endpoints import METERED
from vault.models import IssueKeyRequest


class WorkerKeyRefused(Exception):
    """The worker token may not issue this key; the message says why and what to do."""


def moves_money(request: IssueKeyRequest) -> bool:
    return not METERED.isdisjoint(request.allowed_endpoints)


async def check(
    conn: asyncpg.Connection, request: IssueKeyRequest, budget_cents: int, window: timedelta
) -> None:
    """Refuse a worker's key that outlives the window or overruns the budget. Call inside the
    transaction that inserts the key: it holds the currency's lock until then, so two issues
    cannot both take the last room."""
    now: datetime = await conn.fetchval("SELECT now()")
    if request.expires_at > now + window:
        raise WorkerKeyRefused(
            f"a worker key may live at most {window.days} days (VAULT_WORKER_BUDGET_DAYS);"
            f" this one expires {request.expires_at.isoformat()}: raise the window, or issue a"
            " key that expires sooner"
        )
    if not moves_money(request):
        return
    await conn.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended('vault-worker-budget:' || $1, 0))",
        request.currency,
    )
    used: int = await conn.fetchval(
        """
        SELECT coalesce(sum(CASE WHEN revoked_at IS NULL AND expires_at > $3 THEN cap_cents
                                 ELSE spent_cents + reserved_cents END), 0)
        FROM vault_keys
        WHERE issued_by = 'worker' AND currency = $1 AND created_at > $3 - $2::interval
              AND allowed_endpoints && $4::text[]
        """,
        request.currency,
        window,
        now,
        sorted(METERED),
    )
    if used + request.cap_cents > budget_cents:
        raise WorkerKeyRefused(
            f"a cap of {request.cap_cents} {request.currency} would take worker keys to"
            f" {used + request.cap_cents}, past VAULT_WORKER_BUDGET_CENTS={budget_cents} for the"
            f" last {window.days} days: revoke unused worker keys (GET /vault/keys lists them;"
            " a revoked key counts only what it took) or raise the budget"
        )

"""Each period charges through its own vault key: capped at the expected total times
BILLING_CAP_MULTIPLIER, limited to the charge endpoints, expiring after the period.

Issued (or found) when a run is prepared; the secret, shown once by the vault, is kept
sealed in `period_vault_keys` for the workers (billing/sealing.py) and never passes through
workflow history.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
from pydantic import SecretStr

from billing.errors import BillingError
from billing.models import Record
from billing.money import describe_amount
from billing.periods import Period
from billing.sealing import SecretBox
from vault.client import VaultAdmin
from vault.endpoints import WORKER_ENDPOINTS
from vault.models import IssuedKey, IssueKeyRequest, new_key_id

LABEL = "billing"
ALLOWED_ENDPOINTS = list(WORKER_ENDPOINTS)
# Reconciliation reads a period's charges for weeks after the period (the daily schedule
# checks the period it would bill), past its key's expiry: it then reads with a key of its
# own that moves no money and lives an hour, kept in the worker's memory only.
LOOKUP_LABEL = "billing-lookup"
LOOKUP_ENDPOINTS = [entry for entry in ALLOWED_ENDPOINTS if entry.startswith("GET ")]
LOOKUP_LIFETIME = timedelta(hours=1)
# A run takes minutes to hours, and may be paused for a while: a stored key with less life
# left than this is not reused, or the run would stop part-billed when it expires.
REUSE_MIN_LIFE = timedelta(days=1)


class NoPeriodKeyError(BillingError):
    """No key is stored for the period and currency: the run was not prepared for it."""


class KeyRevokedError(BillingError):
    """The period's key was revoked (the kill switch): no new key is issued behind it."""


class KeyTooSmallError(BillingError):
    """The period's stored key has less room left than the run expects to charge."""


class PeriodKey(Record):
    """What a run may record about its key: never the secret."""

    period: str
    currency: str
    vault_key_id: str
    cap_cents: int


class RenewedKey(PeriodKey):
    """A key issued in place of `replaced`, the period's key until then, or of none."""

    replaced: str | None


class KeyRenewal(Record):
    period: str
    keys: list[RenewedKey]


def key_expiry(period: Period, now: datetime, grace: timedelta) -> datetime:
    """After the period plus grace; a period billed late (a backfill) gets grace from now."""
    return max(period.ends_at, now) + grace


async def stored_key_id(
    db: asyncpg.Pool | asyncpg.Connection, period: str, currency: str
) -> str | None:
    key_id: str | None = await db.fetchval(
        "SELECT vault_key_id FROM period_vault_keys WHERE billing_period = $1 AND currency = $2",
        period,
        currency,
    )
    return key_id


async def kept_key(
    db: asyncpg.Pool | asyncpg.Connection,
    admin: VaultAdmin,
    period: Period,
    currency: str,
    unsent_cents: int,
    *,
    renewing: bool = False,
) -> PeriodKey | None:
    """The period's stored key for the currency, if a run keeps it: usable for another
    REUSE_MIN_LIFE, with room for `unsent_cents`, what the run has yet to send (charges
    already sent with it are in its spend or reservations). None when there is none, or it
    is to be replaced by issue_key.

    A key with too little room (a rerun after customers were added would stop part-billed
    at the cap) is replaced if this ledger's workers issued it (its cap was theirs, for the
    customers of then) or when `renewing` (an operator asked); an operator's key fails the
    opening instead, as its cap is theirs to change. A revoked key (the kill switch) is
    always refused."""
    stored = await stored_key_id(db, str(period), currency)
    if stored is None:
        return None
    info = await admin.get_key(stored)
    if info.revoked:
        raise KeyRevokedError(
            f"the vault key for {period} ({currency}) was revoked at {info.revoked_at};"
            " nothing more is charged. Delete its row in period_vault_keys to allow a new key."
        )
    if info.expires_at - datetime.now(UTC) < REUSE_MIN_LIFE:
        return None
    room = info.cap_cents - info.spent_cents - info.reserved_cents
    if room >= unsent_cents:
        return PeriodKey(
            period=str(period), currency=currency, vault_key_id=info.id, cap_cents=info.cap_cents
        )
    if renewing or await issued_here(db, stored):
        return None
    left, cap, owed = (describe_amount(currency, c) for c in (room, info.cap_cents, unsent_cents))
    raise KeyTooSmallError(
        f"its stored key {info.id}, which this ledger's workers did not issue (issued with the"
        f" {info.issued_by} token), has {left} left of its cap of {cap}, less than the {owed}"
        " this run has yet to charge (customers added since it was issued?), so the run would"
        " stop part-billed at the cap; nothing was charged. Reconcile the period if charges in"
        " doubt hold part of the cap; otherwise revoke it with the"
        f" {info.issued_by} token (workers holding it would still charge through its"
        " room), delete its row (DELETE FROM period_vault_keys WHERE billing_period ="
        f" '{period}' AND currency = '{currency}') and run the period again, which issues a"
        " key capped for what is left"
    )


async def issued_here(db: asyncpg.Pool | asyncpg.Connection, key_id: str) -> bool:
    """Whether this ledger's workers issued the key (issue_key lists every one)."""
    return bool(
        await db.fetchval("SELECT true FROM issued_vault_keys WHERE vault_key_id = $1", key_id)
    )


async def issue_key(
    db: asyncpg.Pool | asyncpg.Connection,
    admin: VaultAdmin,
    box: SecretBox,
    period: Period,
    currency: str,
    cap_cents: int,
    grace: timedelta,
    *,
    known_in: asyncpg.Pool,
) -> PeriodKey:
    """A new key for the period and currency, capped at `cap_cents`, stored (through `db`,
    perhaps in a transaction) in place of any other. Its id is listed in `known_in` before
    the vault is asked, whatever becomes of that transaction or of the vault's answer, for
    revoke_unstored."""
    key_id = new_key_id()
    await known_in.execute(
        "INSERT INTO issued_vault_keys (vault_key_id, billing_period, currency)"
        " VALUES ($1, $2, $3)",
        key_id,
        str(period),
        currency,
    )
    issued = await admin.issue_key(
        IssueKeyRequest(
            key_id=key_id,
            label=LABEL,
            period=str(period),
            cap_cents=cap_cents,
            currency=currency,
            allowed_endpoints=ALLOWED_ENDPOINTS,
            expires_at=key_expiry(period, datetime.now(UTC), grace),
        )
    )
    await db.execute(
        """
        INSERT INTO period_vault_keys
            (billing_period, currency, vault_key_id, sealed_secret, cap_cents)
        VALUES ($1, $2, $3, $4, $5)
        ON CONFLICT (billing_period, currency) DO UPDATE SET
            vault_key_id = EXCLUDED.vault_key_id, secret = NULL,
            sealed_secret = EXCLUDED.sealed_secret, cap_cents = EXCLUDED.cap_cents,
            created_at = now()
        """,
        str(period),
        currency,
        issued.id,
        box.seal(issued.secret),
        issued.cap_cents,
    )
    return PeriodKey(
        period=str(period), currency=currency, vault_key_id=issued.id, cap_cents=issued.cap_cents
    )


async def revoke_unstored(
    db: asyncpg.Pool | asyncpg.Connection, admin: VaultAdmin, period: Period
) -> list[str]:
    """Revoke the keys this ledger's workers issued for the period (issue_key lists them)
    that no row stores any more; returns their ids. Call it under the opening's lock only:
    a key another opening just issued is stored by its commit. An opening that failed after
    the vault issued a key (a later currency refused, its transaction rolled back, or the
    vault's answer lost to a timeout or a crash) left such a key, which counted its whole cap
    against the vault's worker budget until it expired: a few failed openings could refuse
    every new key. An id listed whose issue the vault never made is not found, and stays.
    A key replaced is revoked once the new one is stored; one whose revoke failed then is
    revoked here, as a worker that cached it could still charge through its room. Keys
    this ledger did not issue (another deployment's on the same vault) are left alone."""
    rows = await db.fetch(
        """
        SELECT i.vault_key_id FROM issued_vault_keys i
        WHERE i.billing_period = $1
          AND NOT EXISTS (SELECT 1 FROM period_vault_keys p WHERE p.vault_key_id = i.vault_key_id)
        """,
        str(period),
    )
    unstored = {row["vault_key_id"] for row in rows}
    if not unstored:
        return []
    live = [
        key.id
        for key in await admin.find_keys(period=str(period), label=LABEL)
        if key.id in unstored and not (key.revoked or key.expired)
    ]
    for key_id in live:
        await admin.revoke(key_id)
    return live


async def issue_lookup_key(admin: VaultAdmin, period: str, currency: str) -> IssuedKey:
    """A key that can only read the period's charges in the currency."""
    return await admin.issue_key(
        IssueKeyRequest(
            label=LOOKUP_LABEL,
            period=period,
            # The vault needs a cap; with no endpoint that moves money it is never reached.
            cap_cents=1,
            currency=currency,
            allowed_endpoints=LOOKUP_ENDPOINTS,
            expires_at=datetime.now(UTC) + LOOKUP_LIFETIME,
        )
    )


class StoredKey(Record):
    """The period's key as the ledger stores it: which vault key, and its secret."""

    vault_key_id: str
    secret: SecretStr


async def read_key(pool: asyncpg.Pool, box: SecretBox, period: str, currency: str) -> StoredKey:
    async with pool.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT vault_key_id, secret, sealed_secret FROM period_vault_keys"
            " WHERE billing_period = $1 AND currency = $2",
            period,
            currency,
        )
    if row is None:
        raise NoPeriodKeyError(f"no vault key stored for {period} ({currency}): was it prepared?")
    if row["sealed_secret"] is not None:
        secret = box.open(row["sealed_secret"], f"the vault key for {period} ({currency})")
    else:
        await reseal_secrets(pool, box)
        secret = SecretStr(row["secret"])
    return StoredKey(vault_key_id=row["vault_key_id"], secret=secret)


async def reseal_secrets(pool: asyncpg.Pool, box: SecretBox) -> tuple[int, int]:
    """Seal every stored key with the first of the box's keys: one kept in plain text
    (before migrations/013_sealed_period_keys.sql, or by an older worker), or sealed with an
    older key (rotation); a worker does at start-up. Returns how many rows it sealed, and
    how many no key of the box opens (left as they are)."""
    sealed = unopened = 0
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT billing_period, currency, secret, sealed_secret FROM period_vault_keys"
        )
        for row in rows:
            if row["secret"] is not None:
                again: bytes | None = box.seal(SecretStr(row["secret"]))
            else:
                again = box.reseal(row["sealed_secret"])
                if again is None:
                    unopened += 1
                if again is None or again == row["sealed_secret"]:
                    continue
            # Only if the row still holds what was read: a key replaced meanwhile is sealed.
            sealed += await conn.fetchval(
                """
                WITH done AS (
                    UPDATE period_vault_keys SET sealed_secret = $3, secret = NULL
                    WHERE billing_period = $1 AND currency = $2
                      AND secret IS NOT DISTINCT FROM $4
                      AND sealed_secret IS NOT DISTINCT FROM $5
                    RETURNING 1)
                SELECT count(*) FROM done
                """,
                row["billing_period"],
                row["currency"],
                again,
                row["secret"],
                row["sealed_secret"],
            )
    return sealed, unopened

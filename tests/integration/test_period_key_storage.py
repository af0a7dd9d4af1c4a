"""How the ledger keeps a period key's secret: sealed, and sealed again with the first
encryption key (a row from before sealing, or after a rotation) when a worker starts, or
first reads it in plain text."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg
import pytest
from pydantic import SecretStr

from billing.period_keys import issue_key, read_key, reseal_secrets
from billing.periods import parse_period
from billing.sealing import SecretBox, UnsealError, new_key
from tests.integration.harness import Harness
from tests.waiting import eventually, waits_on_a_lock

SECRET = SecretStr("vk_" + "plain0" * 8)


async def stored(db: asyncpg.Pool) -> asyncpg.Record:
    row: asyncpg.Record = await db.fetchrow("SELECT secret, sealed_secret FROM period_vault_keys")
    return row


async def test_a_key_stored_in_plain_text_is_sealed_when_first_read(db: asyncpg.Pool) -> None:
    # As migrations before 013 left it.
    await db.execute(
        "INSERT INTO period_vault_keys (billing_period, currency, vault_key_id, secret, cap_cents)"
        " VALUES ('2026-12', 'usd', 'vkey_00000000000000aa', $1, 100)",
        SECRET.get_secret_value(),
    )
    box = SecretBox(SecretStr(new_key()))
    assert (await read_key(db, box, "2026-12", "usd")).secret == SECRET
    row = await stored(db)
    assert row["secret"] is None and SECRET.get_secret_value().encode() not in row["sealed_secret"]
    assert (await read_key(db, box, "2026-12", "usd")).secret == SECRET


async def test_a_row_needs_one_secret_plain_or_sealed(db: asyncpg.Pool) -> None:
    with pytest.raises(asyncpg.CheckViolationError):
        await db.execute(
            "INSERT INTO period_vault_keys (billing_period, currency, vault_key_id, cap_cents)"
            " VALUES ('2026-12', 'usd', 'vkey_00000000000000ab', 100)"
        )


async def test_a_key_sealed_with_a_key_since_removed_says_so(db: asyncpg.Pool) -> None:
    await db.execute(
        "INSERT INTO period_vault_keys"
        " (billing_period, currency, vault_key_id, sealed_secret, cap_cents)"
        " VALUES ('2026-12', 'eur', 'vkey_00000000000000ac', $1, 100)",
        SecretBox(SecretStr(new_key())).seal(SECRET),
    )
    with pytest.raises(UnsealError, match=r"the vault key for 2026-12 \(eur\) cannot be") as err:
        await read_key(db, SecretBox(SecretStr(new_key())), "2026-12", "eur")
    assert "plain0" not in str(err.value)


async def test_a_worker_seals_every_key_stored_in_plain_text_when_it_starts(
    vaulted: Harness,
) -> None:
    # Keys of earlier periods that no run will read again.
    for index, currency in enumerate(("usd", "eur")):
        await vaulted.pool.execute(
            "INSERT INTO period_vault_keys"
            " (billing_period, currency, vault_key_id, secret, cap_cents)"
            " VALUES ('2026-10', $1, $2, $3, 100)",
            currency,
            f"vkey_00000000000000b{index}",
            SECRET.get_secret_value(),
        )
    vaulted.worker_process()

    async def sealed() -> bool:
        plain: int = await vaulted.pool.fetchval(
            "SELECT count(*) FROM period_vault_keys WHERE secret IS NOT NULL"
        )
        return plain == 0

    await eventually(sealed, timeout=60)
    box = vaulted.settings.secret_box()
    for currency in ("usd", "eur"):
        assert (await read_key(vaulted.pool, box, "2026-10", currency)).secret == SECRET


async def test_a_rotation_reseals_every_key_the_old_key_sealed(db: asyncpg.Pool) -> None:
    old, new = new_key(), new_key()
    for index, (currency, key) in enumerate((("usd", old), ("eur", new), ("gbp", new_key()))):
        await db.execute(
            "INSERT INTO period_vault_keys"
            " (billing_period, currency, vault_key_id, sealed_secret, cap_cents)"
            " VALUES ('2026-11', $1, $2, $3, 100)",
            currency,
            f"vkey_00000000000000c{index}",
            SecretBox(SecretStr(key)).seal(SECRET),
        )
    # The new key first, the old one kept: the usd key moves, the eur one is there already,
    # and the gbp one was sealed with a key this worker does not have.
    assert await reseal_secrets(db, SecretBox(SecretStr(f"{new},{old}"))) == (1, 1)
    only_new = SecretBox(SecretStr(new))
    for currency in ("usd", "eur"):
        assert (await read_key(db, only_new, "2026-11", currency)).secret == SECRET


async def test_a_rolling_rotation_keeps_every_worker_able_to_read_the_keys(
    db: asyncpg.Pool,
) -> None:
    # Workers restart one at a time: first every one gets the new key last, then first.
    old, new = new_key(), new_key()
    await db.execute(
        "INSERT INTO period_vault_keys"
        " (billing_period, currency, vault_key_id, sealed_secret, cap_cents)"
        " VALUES ('2026-12', 'usd', 'vkey_00000000000000r1', $1, 100)",
        SecretBox(SecretStr(old)).seal(SECRET),
    )
    not_yet_restarted = SecretBox(SecretStr(f"{old},{new}"))
    assert await reseal_secrets(db, not_yet_restarted) == (0, 0)  # nothing sealed anew
    # The first worker restarted with the new key first seals with it; the others still read.
    await reseal_secrets(db, SecretBox(SecretStr(f"{new},{old}")))
    assert (await read_key(db, not_yet_restarted, "2026-12", "usd")).secret == SECRET
    # Put first at once, that worker would have locked out those holding the old key only.
    with pytest.raises(UnsealError, match="cannot be decrypted"):
        await read_key(db, SecretBox(SecretStr(old)), "2026-12", "usd")


async def test_a_key_replaced_keeps_only_the_new_keys_id_cap_and_sealed_secret(
    vaulted: Harness,
) -> None:
    """An opening replacing a stored key (a rerun, a renewal) leaves nothing of the old one
    in its row: the preview reads the row's cap as the key's, and a plain secret left beside
    the new sealed one would be sealed over it when a worker starts."""
    assert vaulted.vault is not None
    # As migrations before 013 left it.
    await vaulted.pool.execute(
        "INSERT INTO period_vault_keys (billing_period, currency, vault_key_id, secret, cap_cents)"
        " VALUES ('2026-12', 'usd', 'vkey_00000000000000e0', $1, 100)",
        SECRET.get_secret_value(),
    )
    box = vaulted.settings.secret_box()
    new = await issue_key(
        vaulted.pool,
        vaulted.vault.worker,
        box,
        parse_period("2026-12"),
        "usd",
        5_000,
        timedelta(days=1),
        known_in=vaulted.pool,
    )
    row = await vaulted.pool.fetchrow(
        "SELECT vault_key_id, secret, cap_cents FROM period_vault_keys"
    )
    assert tuple(row) == (new.vault_key_id, None, 5_000)
    assert await reseal_secrets(vaulted.pool, box) == (0, 0)
    stored = await read_key(vaulted.pool, box, "2026-12", "usd")
    assert stored.vault_key_id == new.vault_key_id and stored.secret != SECRET


@pytest.mark.parametrize("kept", ["plain", "sealed-with-the-old-key"])
async def test_a_key_replaced_while_a_worker_seals_the_keys_keeps_the_new_secret(
    db: asyncpg.Pool, kept: str
) -> None:
    """A worker starting seals every stored secret while an opening may be replacing one:
    a row replaced between the worker's read and its write keeps the new key's secret, or
    the period would charge with the old key (and be refused, or charge past the new cap)."""
    old, new = new_key(), new_key()
    box = SecretBox(SecretStr(f"{new},{old}"))
    plain = kept == "plain"
    await db.execute(
        "INSERT INTO period_vault_keys"
        " (billing_period, currency, vault_key_id, secret, sealed_secret, cap_cents)"
        " VALUES ('2026-12', 'usd', 'vkey_00000000000000d0', $1, $2, 100)",
        SECRET.get_secret_value() if plain else None,
        None if plain else SecretBox(SecretStr(old)).seal(SECRET),
    )
    replacement = SecretStr("vk_" + "newkey" * 8)
    async with db.acquire() as opening, opening.transaction():
        await opening.execute(
            "UPDATE period_vault_keys SET vault_key_id = 'vkey_00000000000000d1', secret = NULL,"
            " sealed_secret = $1",
            box.seal(replacement),
        )
        sealing = asyncio.create_task(reseal_secrets(db, box))
        await eventually(lambda: waits_on_a_lock(db, None, sealing), timeout=15)
    assert await sealing == (0, 0)
    stored = await read_key(db, box, "2026-12", "usd")
    assert (stored.vault_key_id, stored.secret) == ("vkey_00000000000000d1", replacement)

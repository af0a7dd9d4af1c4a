"""Migration 016 on a ledger with claims sent before it: which keys they went through is
unknown, so no cap refusal may reopen them, and a run's opening credits them to a key as the
rule before it did."""

from __future__ import annotations

import shutil
from pathlib import Path

import asyncpg

from billing.migrations import MIGRATIONS_DIR, migrate
from devstack.postgres import LocalPostgres
from tests.conftest import new_database


async def test_claims_sent_before_the_migration_name_no_key_a_refusal_matches(
    postgres: LocalPostgres, tmp_path: Path
) -> None:
    for sql in sorted(MIGRATIONS_DIR.glob("*.sql")):
        if sql.name < "016":
            shutil.copy(sql, tmp_path)
    dsn = await new_database(postgres)
    await migrate(dsn, tmp_path)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            """
            INSERT INTO customers (customer_id, stripe_customer_id, payment_method, amount_cents,
                                   currency)
            SELECT 'c-' || i, 'cus_' || i, 'pm_1', 100, 'usd' FROM generate_series(1, 4) i;
            INSERT INTO period_vault_keys (billing_period, currency, vault_key_id, secret,
                                           cap_cents, created_at)
            VALUES ('2026-12', 'usd', 'vkey_2', 'vk_test', 1000, now() - interval '1 hour');
            INSERT INTO billing_runs (customer_id, billing_period, idempotency_key, amount_cents,
                                      currency, stripe_customer_id, charge_started_at, attempts)
            VALUES
                -- Sent before the stored key was: through a key it replaced.
                ('c-1', '2026-12', repeat('1', 32), 100, 'usd', 'cus_1',
                 now() - interval '2 hours', 1),
                -- Sent after: through it, by the old rule.
                ('c-2', '2026-12', repeat('2', 32), 100, 'usd', 'cus_2', now(), 2),
                -- Not sent.
                ('c-3', '2026-12', repeat('3', 32), 100, 'usd', 'cus_3', NULL, 0);
            """
        )
        await migrate(dsn)
        rows = await conn.fetch(
            "SELECT customer_id, sent_through FROM billing_runs ORDER BY customer_id"
        )
    finally:
        await conn.close()
    assert [(r["customer_id"], r["sent_through"]) for r in rows] == [
        ("c-1", ["before-016"]),
        ("c-2", ["before-016", "vkey_2"]),
        ("c-3", None),
    ]

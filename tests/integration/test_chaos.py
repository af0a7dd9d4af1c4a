"""The chaos run of bench/chaos_run.py, small, on the test session's Temporal and PostgreSQL:
two worker kills, a PostgreSQL restart, the emulator's faults and two more starts of the
period, then the same checks from Stripe's ledger, Postgres and the vault."""

from __future__ import annotations

from datetime import UTC, datetime

from billing.periods import period_for
from billing.schedules import MonthlySchedule
from chaos import scenario
from chaos.invariants import Expected, collect
from devstack.postgres import LocalPostgres
from tests.integration.harness import Harness

CUSTOMERS = 100


async def test_a_period_under_chaos_charges_every_customer_once(
    vaulted: Harness, postgres: LocalPostgres
) -> None:
    assert vaulted.vault is not None
    seeded = await scenario.seed(vaulted.stripe, vaulted.pool, CUSTOMERS, "chaos")
    assert seeded.declined, "the demo cards decline one customer in 97"
    schedule = MonthlySchedule(schedule_id="chaos-monthly", paused=True)
    period = period_for(datetime.now(UTC), schedule.billing)
    targets = scenario.Targets(
        client=vaulted.client,
        task_queue=vaulted.task_queue,
        database_url=vaulted.database_url,
        emulator=vaulted.emulator,
        start_worker=vaulted.worker_process,
        # The session's server: no other test runs meanwhile, and each reconnects anyway.
        restart_postgres=postgres.restart,
    )
    # Seed 4 draws every kind of fault over a hundred customers (shortfalls() checks); they
    # pass Stripe's 25/s only now and then, 15/s on a quiet machine (80-120 429s), and lower
    # limits make the retries' backoff the test's length. A loaded one may pass neither: the
    # emulator's drawn 429s (scenario.FAULTS) come all the same.
    plan = scenario.Plan(
        seed=4, kill_every=(3.0, 6.0), max_kills=2, rate_limit_rps=15.0, timeout=240
    )

    figures = await scenario.run(targets, period, CUSTOMERS, plan, schedule)

    assert figures.shortfalls() == [], figures
    assert (figures.kills, figures.postgres_restarts, figures.duplicate_starts) == (2, 1, 2)
    expected = Expected(str(period), seeded.customers, seeded.declined)
    found = await collect(
        expected,
        vaulted.emulator,
        vaulted.pool,
        vaulted.vault.admin,
        figures.summary,
        figures.reconcile,
    )
    assert found.violations == []
    assert (found.duplicates, found.lost) == (0, 0)

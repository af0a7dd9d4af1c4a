"""The billing worker: runs the workflows and activities until SIGINT or SIGTERM.

    python worker.py

Configuration comes from the environment (see billing/config.py); migrations are applied at
start-up, so a new database is ready before the first task.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from datetime import timedelta

import asyncpg
import stripe
from temporalio.client import Client
from temporalio.worker import Worker

import workflows
from activities.charging import ChargingActivities
from activities.period import PeriodActivities, scheduled_period
from activities.stripe_gateway import StripeGateway
from billing import logs, metrics
from billing.config import (
    BillingSettings,
    DatabaseSettings,
    ObservabilitySettings,
    TemporalSettings,
)
from billing.db import create_pool
from billing.migrations import migrate
from billing.stripe_client import stripe_session
from billing.temporal_client import connect

log = logging.getLogger("billing.worker")


def create_worker(
    client: Client,
    task_queue: str,
    pool: asyncpg.Pool,
    stripe_api: stripe.StripeClient,
    settings: BillingSettings,
) -> Worker:
    gateway = StripeGateway(stripe_api, settings.billing_charge_api)
    charging = ChargingActivities(pool, gateway, settings)
    period = PeriodActivities(pool, settings)
    return Worker(
        client,
        task_queue=task_queue,
        workflows=workflows.ALL,
        activities=[
            charging.claim,
            charging.charge,
            charging.record_charge,
            charging.record_unbilled,
            period.prepare,
            period.due_customers,
            period.ledger_outcomes,
            period.set_control,
            period.skip_customer,
            period.cancel_unstarted,
            period.close,
            scheduled_period,
        ],
        # In-flight Stripe calls get this long to finish and be recorded on shutdown.
        graceful_shutdown_timeout=timedelta(seconds=30),
    )


async def main() -> None:
    logs.configure()
    temporal = TemporalSettings()
    database = DatabaseSettings()
    settings = BillingSettings()
    observability = ObservabilitySettings()
    applied = await migrate(database.database_url)
    if applied:
        log.info("applied migrations %s", ", ".join(applied))
    metrics.serve(observability)
    client = await connect(temporal, metrics.temporal_runtime(observability))
    pool = await create_pool(database.database_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with (
            stripe_session(settings) as stripe_api,
            create_worker(client, temporal.task_queue, pool, stripe_api, settings),
        ):
            log.info(
                "worker polling task queue %r in namespace %r",
                temporal.task_queue,
                temporal.namespace,
            )
            await stop.wait()
            log.info("shutting down: finishing in-flight activities")
    finally:
        await pool.close()
    log.info("worker stopped")


if __name__ == "__main__":
    asyncio.run(main())

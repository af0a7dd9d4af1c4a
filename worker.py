"""The billing worker: runs the workflows and activities until SIGINT or SIGTERM.

    python worker.py

Configuration comes from the environment (see billing/config.py). Migrations are checked at
start-up, and applied when DATABASE_URL's role may (the schema's owner); the workers' own
role (billing/db_roles.py) stops with what to run instead.
"""

from __future__ import annotations

import asyncio
import compileall
import logging
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import stripe
import uvloop
from temporalio.client import Client
from temporalio.worker import (
    Interceptor,
    PollerBehaviorAutoscaling,
    UnsandboxedWorkflowRunner,
    Worker,
)
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from activities.charging import ChargingActivities
from activities.period import PeriodActivities, scheduled_period
from activities.reconcile import ReconcileActivities
from activities.schedule_checks import ScheduleCheckActivities
from activities.stripe_access import DirectAccess, StripeAccess, VaultAccess
from activities.stripe_gateway import StripeGateway
from billing import logs, metrics, payload_walks, period_keys
from billing.config import (
    BillingSettings,
    DatabaseSettings,
    ObservabilitySettings,
    TemporalSettings,
    load_settings,
)
from billing.db import create_pool
from billing.errors import BillingError, ServiceUnavailableError
from billing.liveness import Heartbeat
from billing.migrations import migrate
from billing.periods import period_for
from billing.sealing import SETTING
from billing.stripe_client import stripe_client, stripe_http
from billing.temporal_client import connect
from vault.client import VaultAdmin, VaultAdminError, VaultAuthError
from workflows.billing_period import BillingPeriodWorkflow
from workflows.customer_charge import CustomerChargeWorkflow
from workflows.reconcile import ReconcileWorkflow
from workflows.scheduled_billing import ScheduledBillingWorkflow

log = logging.getLogger("billing.worker")

WORKFLOWS = [
    BillingPeriodWorkflow,
    CustomerChargeWorkflow,
    ScheduledBillingWorkflow,
    ReconcileWorkflow,
]
WORKFLOWS_DIR = Path(__file__).resolve().parent / "workflows"
WORKFLOW_TASK_SLOTS = 2000
# Workflows a worker keeps in memory: a whole window of children (up to MAX_IN_FLIGHT) and its
# period, with room. A child keeps its place while its local activity runs, so with the SDK's
# default of 1,000 a window of 1,500 would push the period out, to be replayed from its whole
# history at every task; with a cache of 1 or 2 a period never finished at all.
WORKFLOW_CACHE = WORKFLOW_TASK_SLOTS
# Workflow-task pollers that scale with the tasks waiting (Temporal's recommended setting; the
# SDK's default is a fixed 5, one in five on the shared queue). A child's first workflow task
# goes to the shared queue: with a poller waiting there the server hands it over at once; with
# none it writes the task to the queue's backlog and reads it back, which nine in ten children
# met with the default. Over 10,000 customers the period billed 53.9 and 56.0/s this way
# against 53.9 and 53.2/s with the default, the machine spending 4% less CPU per customer; the
# no-op ceiling, its worker polling alike, gained more (bench/FINDINGS.md).
WORKFLOW_TASK_POLLING = PollerBehaviorAutoscaling()
# The ratio the measured runs used. The SDK documents it for a fixed maximum, where it puts half
# the pollers on the shared queue (its default, 0.2, one in five); what autoscaling makes of it
# is not documented.
NONSTICKY_TO_STICKY_POLL_RATIO = 1.0


def compile_workflows() -> None:
    """Write the workflows' bytecode beside their source, as Python does by default. The
    sandbox imports a workflow's module afresh for every run and, with no bytecode on disk
    (PYTHONDONTWRITEBYTECODE, a fresh checkout), compiles the source every time: half the
    worker's event-loop time when the children still ran in it. A read-only tree is skipped
    quietly: the image compiles at build."""
    compileall.compile_dir(WORKFLOWS_DIR, quiet=2)


def direct_access(stripe_api: stripe.StripeClient, settings: BillingSettings) -> StripeAccess:
    return DirectAccess(StripeGateway(stripe_api, settings.billing_charge_api))


def create_worker(
    client: Client,
    task_queue: str,
    pool: asyncpg.Pool,
    access: StripeAccess,
    settings: BillingSettings,
    admin: VaultAdmin | None = None,
    *,
    sandbox_all: bool = False,
    interceptors: Sequence[Interceptor] = (),
) -> Worker:
    """`sandbox_all` runs the period and its children inside the sandbox too, as the tests
    do: slower, but its checks then cover every path the tests take through them.
    `interceptors` are the SDK's (tracing, or a test holding a workflow at a chosen step)."""
    compile_workflows()
    payload_walks.skip_identity_walks()
    charging = ChargingActivities(pool, access, settings)
    period = PeriodActivities(pool, settings, admin)
    reconcile = ReconcileActivities(pool, access, settings, admin)
    schedule_checks = ScheduleCheckActivities(pool)
    return Worker(
        client,
        task_queue=task_queue,
        workflows=WORKFLOWS,
        activities=[
            charging.bill,
            charging.stop,
            period.prepare,
            period.due_customers,
            period.await_outcomes,
            period.set_control,
            period.skip_customer,
            period.cancel_unstarted,
            period.close,
            period.close_if_all_listed,
            period.close_if_all_reached,
            period.close_if_all_marked,
            period.completed,
            period.latest_billed,
            period.periods_to_recheck,
            period.renew_keys,
            scheduled_period,
            schedule_checks.billing_firings,
            reconcile.open_claims,
            reconcile.settle_claim,
            reconcile.settle_reservations,
            reconcile.compare_charges,
            reconcile.record_verdict,
        ],
        # A child holds a workflow-task slot while its local activities run. With the SDK's
        # 100 slots a fan-out of 500 took them all, and the period's own task waited on the
        # sticky queue until it timed out (10 s, at the start of half the period's runs).
        # More slots than children in flight (RunOptions.max_in_flight <= 1,500) leave the
        # period one.
        max_concurrent_workflow_tasks=WORKFLOW_TASK_SLOTS,
        max_cached_workflows=WORKFLOW_CACHE,
        workflow_task_poller_behavior=WORKFLOW_TASK_POLLING,
        nonsticky_to_sticky_poll_ratio=NONSTICKY_TO_STICKY_POLL_RATIO,
        # In-flight Stripe calls get this long to finish and be recorded on shutdown.
        graceful_shutdown_timeout=timedelta(seconds=30),
        interceptors=interceptors,
        unsandboxed_workflow_runner=(
            SandboxedWorkflowRunner() if sandbox_all else UnsandboxedWorkflowRunner()
        ),
    )


async def _check_vault(admin: VaultAdmin, url: str, token_setting: str) -> None:
    """A wrong BILLING_VAULT_URL shows only as runs waiting at their opening, and a wrong
    token as the next opening's failure (a schedule's, perhaps at night): say so at the
    start. The worker starts anyway, as the vault may come up, or be given the token, after
    it."""
    try:
        await admin.ready()
    except VaultAdminError as exc:
        log.warning(
            "the vault at %s did not answer as ready (%s): runs wait at their opening until it"
            " does; check BILLING_VAULT_URL if it stays so",
            url,
            exc,
        )
        return
    try:
        # `ready` asks for no token: a read that does (this month's keys) tries this one.
        await admin.find_keys(
            label=period_keys.LABEL, period=str(period_for(datetime.now(UTC), "advance"))
        )
    except VaultAuthError:
        log.error(
            "the vault at %s refused %s: every period's opening fails until the worker has"
            " the token the vault's VAULT_WORKER_TOKEN holds",
            url,
            token_setting,
        )
    except VaultAdminError as exc:
        log.warning("the vault at %s refused to list this month's keys: %s", url, exc)


async def main() -> None:
    logs.configure()
    temporal = load_settings(TemporalSettings)
    database = load_settings(DatabaseSettings)
    settings = load_settings(BillingSettings)
    observability = load_settings(ObservabilitySettings)
    applied = await migrate(database.database_url)
    if applied:
        log.info("applied migrations %s", ", ".join(applied))
    heartbeat = Heartbeat()
    metrics.serve(observability, heartbeat)
    # Held, so that it is not collected; cancelled when the worker stops.
    beating = asyncio.create_task(heartbeat.run())
    client = await connect(temporal, metrics.temporal_runtime(observability))
    pool = await create_pool(database.database_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    admin: VaultAdmin | None = None
    try:
        async with stripe_http(settings.billing_stripe_timeout_seconds) as http:
            token = settings.vault_token()
            # The settings refuse a token without a URL, and a URL without a token.
            if settings.billing_vault_url and token is not None:
                if settings.billing_vault_worker_token is None:
                    log.warning(
                        "calling the vault with its admin token: set BILLING_VAULT_WORKER_TOKEN"
                        " (the vault's VAULT_WORKER_TOKEN) instead, so a worker taken over can"
                        " issue keys only within the vault's worker budget"
                    )
                admin = VaultAdmin(settings.billing_vault_url, token)
                await _check_vault(
                    admin, settings.billing_vault_url, settings.vault_token_setting()
                )
                box = settings.secret_box()
                sealed, unopened = await period_keys.reseal_secrets(pool, box)
                log.info("sealed %d period keys with the first encryption key", sealed)
                if unopened:
                    log.warning(
                        "%d period keys are sealed with a key not in %s: their periods"
                        " cannot charge or be reconciled until it is put back",
                        unopened,
                        SETTING,
                    )
                access: StripeAccess = VaultAccess(
                    pool,
                    box,
                    settings.billing_vault_url,
                    settings.billing_charge_api,
                    http,
                    admin,
                )
                log.info("charging through the vault at %s", settings.billing_vault_url)
            else:
                api_key = settings.stripe_api_key.get_secret_value()
                direct = stripe_client(api_key, settings.stripe_api_base, http)
                access = direct_access(direct, settings)
                log.info(
                    "charging Stripe directly at %s, with no vault and no spend cap",
                    settings.stripe_api_base,
                )
            worker = create_worker(client, temporal.task_queue, pool, access, settings, admin)
            await _run(worker, client, temporal.task_queue, stop)
    finally:
        if admin is not None:
            await admin.close()
        await pool.close()
        beating.cancel()
    log.info("worker stopped")


async def _run(worker: Worker, client: Client, task_queue: str, stop: asyncio.Event) -> None:
    async with worker:
        log.info("worker polling task queue %r in namespace %r", task_queue, client.namespace)
        await stop.wait()
        log.info("shutting down: finishing in-flight activities")


if __name__ == "__main__":
    # uvloop: a faster event loop under asyncpg, aiohttp and the SDK's own callbacks; the
    # worker's CPU per customer fell by 5-15% (bench/FINDINGS.md).
    try:
        uvloop.run(main())
    except ServiceUnavailableError as error:
        print(f"worker: {error}", file=sys.stderr)
        sys.exit(1)
    except BillingError as error:  # settings, configuration
        print(f"worker: {error}", file=sys.stderr)
        sys.exit(2)

"""A billing stack for one test: its database, namespace, emulator and worker(s)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest
from stripe import HTTPClient, StripeClient
from temporalio.api.enums.v1 import EventType, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.update.v1 import Request as UpdateRequest
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client, WorkflowHandle, WorkflowHistory
from temporalio.worker import Interceptor, Worker
from temporalio.worker import _workflow as sdk_workflow
from temporalio.worker._workflow_instance import _WorkflowLogicFlag

from activities.stripe_access import StripeAccess, VaultAccess
from billing import ledger
from billing.config import BillingSettings
from billing.customers import CustomerRow, upsert_customers
from billing.data_converter import DATA_CONVERTER
from billing.keys import customer_workflow_id, idempotency_key
from billing.models import Claim, CustomerChargeInput, CustomerOutcome
from billing.periods import Period
from billing.runs import period_status
from billing.seeding import create_demo_customers
from chaos.invariants import ledger_rows
from stripe_emulator.client import EmulatorClient
from tests import forked_cli
from tests.waiting import eventually
from vault.client import VaultAdmin
from worker import create_worker, direct_access
from workflows.customer_charge import CustomerChargeWorkflow

ModelT = TypeVar("ModelT")

PROJECT_ROOT = Path(__file__).resolve().parents[2]
VAULT_ADMIN_TOKEN = "admin-token-for-tests-only"  # noqa: S105
VAULT_WORKER_TOKEN = "worker-token-for-tests-only"  # noqa: S105
# What worker keys may hold at once in the tests' vault: far past any test's periods.
VAULT_WORKER_BUDGET = 10**10
# A Fernet key for the tests only: it seals the period keys' secrets in the ledger.
KEY_ENCRYPTION_KEYS = "dGVzdHMtb25seS1rZXktZW5jcnlwdGlvbi1rZXktMzI="


# A task queue no worker polls: workflows started there hold their ID and do nothing.
IDLE_QUEUE = "nobody-polls"


@dataclass
class VaultHandle:
    url: str
    # The operator's client; workers get `worker`, with the worker token, as in production.
    admin: VaultAdmin
    worker: VaultAdmin


# Seconds a `starter.py` call may take in a test.
STARTER_TIMEOUT = 120


async def at_least(count: Awaitable[int], n: int) -> bool:
    return await count >= n


async def _accepted_requests(
    handle: WorkflowHandle[Any, Any], name: str | None = None
) -> list[UpdateRequest]:
    """The updates (of `name`, if given) the workflow's run has accepted, in order."""
    history = await handle.fetch_history()
    accepted = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
    requests = [
        e.workflow_execution_update_accepted_event_attributes.accepted_request
        for e in history.events
        if e.event_type == accepted
    ]
    return [r for r in requests if name in (None, r.input.name)]


async def accepted_updates(handle: WorkflowHandle[Any, Any], name: str | None = None) -> int:
    """How many updates (of `name`, if given) the workflow's run has accepted."""
    return len(await _accepted_requests(handle, name))


async def accepted_update_inputs(
    handle: WorkflowHandle[Any, Any], name: str, model: type[ModelT]
) -> list[ModelT]:
    """What each update of `name` the run accepted was given: who asked, and why."""
    converter = DATA_CONVERTER.payload_converter
    return [
        converter.from_payloads(r.input.args.payloads, [model])[0]
        for r in await _accepted_requests(handle, name)
    ]


async def update_taken(
    handle: WorkflowHandle[Any, Any], call: asyncio.Future[Any], accepted_before: int
) -> None:
    """Until the run has taken an update sent by `call` (an operator's word, started as a
    task): accepted (past the `accepted_before` updates it had), or answered. A test that
    then lets the run go on must not guess how long a loaded machine takes to deliver it."""

    async def taken() -> bool:
        return call.done() or await accepted_updates(handle) > accepted_before

    await eventually(taken)


async def cancel_taken(handle: WorkflowHandle[Any, Any]) -> None:
    """Until the run has seen Temporal's cancel request: a workflow task completed after it."""

    async def taken() -> bool:
        requested = False
        for event in (await handle.fetch_history()).events:
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED:
                requested = True
            elif requested and event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                return True
        return False

    await eventually(taken)


async def open_period_by_hand(pool: asyncpg.Pool, period: Period | str) -> None:
    """Record a run of the period as open, as its run's opening does, with no workflow:
    a customer's claim needs one (ledger.claim)."""
    async with pool.acquire() as conn:
        await ledger.open_period(conn, str(period), f"by-hand-{period}")


def always_visa(_: int) -> str:
    return "pm_card_visa"


@dataclass
class Harness:
    client: Client
    pool: asyncpg.Pool
    database_url: str
    emulator_url: str
    settings: BillingSettings
    task_queue: str
    # Named `stripe`, this field hides the module in the class body: hence the bare names.
    stripe: StripeClient
    http: HTTPClient
    vault: VaultHandle | None = None
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    async def chain_of_runs(
        self, workflow_id: str, *, bound: int, after_run: str | None = None
    ) -> list[WorkflowHistory]:
        """The histories of the workflow ID's runs, oldest first (those after `after_run`,
        an earlier start of the ID, if given), after checking that each stayed under `bound`
        events and all but the last continued as new."""
        histories = []
        async for run in self.client.list_workflows(f'WorkflowId = "{workflow_id}"'):
            handle = self.client.get_workflow_handle(workflow_id, run_id=run.run_id)
            histories.append(await handle.fetch_history())
        histories.sort(key=lambda h: h.events[0].event_time.ToDatetime())
        if after_run is not None:
            runs = [h.run_id for h in histories]
            histories = histories[runs.index(after_run) + 1 :]
        assert len(histories) > 1, "the run never continued as new"
        for history in histories:
            assert len(history.events) < bound
        endings = [h.events[-1].event_type for h in histories]
        assert endings[-1] == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED
        assert set(endings[:-1]) == {EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW}
        return histories

    async def idle_child(
        self, period: Period, customer_id: str
    ) -> WorkflowHandle[CustomerChargeWorkflow, CustomerOutcome]:
        """A run of the customer's own workflow on a task queue nobody polls: it holds the
        workflow ID and does nothing (e.g. another run's child whose worker was lost)."""
        return await self.client.start_workflow(
            CustomerChargeWorkflow.run,
            CustomerChargeInput(period=str(period), customer_id=customer_id),
            id=customer_workflow_id(period, customer_id),
            task_queue=IDLE_QUEUE,
        )

    async def open_period_by_hand(self, period: Period | str) -> None:
        await open_period_by_hand(self.pool, period)

    async def claim_by_hand(self, period: Period, customer_id: str) -> Claim:
        """The customer's claim of the period, made as a bill's first attempt makes it (run
        "test-run"), with nothing sent."""
        key = idempotency_key(self.settings.billing_key_namespace, customer_id, period)
        async with self.pool.acquire() as conn:
            return await ledger.claim(
                conn,
                customer_id,
                str(period),
                key,
                "test-run",
                charge_api=self.settings.billing_charge_api,
            )

    async def seed(
        self, count: int, card_for: Callable[[int], str] = always_visa, prefix: str = "cust"
    ) -> list[CustomerRow]:
        rows = await create_demo_customers(self.stripe, count, prefix=prefix, card_for=card_for)
        await upsert_customers(self.pool, rows)
        return rows

    @property
    def emulator(self) -> EmulatorClient:
        return EmulatorClient(self.emulator_url)

    async def charges(self) -> list[dict[str, Any]]:
        return await self.emulator.charges()

    async def requests(self) -> list[dict[str, Any]]:
        return await self.emulator.requests()

    async def succeeded(self) -> int:
        """Successful charges in Stripe's (the emulator's) ledger."""
        return sum(c["status"] == "succeeded" for c in await self.charges())

    async def money_requests(self) -> int:
        """Charge requests Stripe received, refused or not."""
        return sum(
            r["method"] == "POST" and r["path"] == "/v1/payment_intents"
            for r in await self.requests()
        )

    async def started_charges_sent(self, period: Period | str) -> bool:
        """Whether every charge that passed the ledger's gate has reached Stripe (the
        emulator): after a pause, those that passed before it still go out, however long a
        loaded machine takes to send them; none may after."""
        started = {
            r["idempotency_key"]
            for r in await self.ledger_rows(str(period))
            if r["charge_started_at"] is not None
        }
        sent = {
            r["idempotency_key"]
            for r in await self.requests()
            if r["method"] == "POST" and r["path"] == "/v1/payment_intents"
        }
        return started <= sent

    async def in_state(self, period: Period, state: str) -> bool:
        return (await period_status(self.client, period)).state == state

    async def faults_injected(self) -> dict[str, int]:
        return await self.emulator.faults_injected()

    async def set_faults(self, **faults: Any) -> None:
        await self.emulator.configure(**faults)

    async def stripe_forgets_keys(self) -> None:
        """Stripe's day passes for every idempotency key sent so far: none is replayed."""
        await self.set_faults(idempotency_ttl_seconds=0.001)
        await asyncio.sleep(0.01)

    async def day_passes(self) -> None:
        """A day passes for everyone, not only Stripe (stripe_forgets_keys): every claim and
        vault reservation made so far is a day older, as the vault's and the ledger's checks
        of a key's age read them."""
        await self.stripe_forgets_keys()
        async with self.pool.acquire() as conn:
            await conn.execute("UPDATE billing_runs SET claimed_at = claimed_at - interval '1 day'")
            if self.vault is not None:
                await conn.execute(
                    "UPDATE vault_reservations SET created_at = created_at - interval '1 day',"
                    " updated_at = updated_at - interval '1 day'"
                )

    def worker(self, interceptors: Sequence[Interceptor] = ()) -> Worker:
        """A worker charging directly, or through the vault when the harness has one."""
        access: StripeAccess
        admin: VaultAdmin | None = None
        if self.vault is None:
            access = direct_access(self.stripe, self.settings)
        else:
            admin = self.vault.worker
            access = self.vault_access()
        # Every workflow inside the sandbox, whose checks then cover every path tested.
        return create_worker(
            self.client,
            self.task_queue,
            self.pool,
            access,
            self.settings,
            admin,
            sandbox_all=True,
            interceptors=interceptors,
        )

    def vault_access(self) -> VaultAccess:
        """Stripe through the harness's vault, as a worker holds it (the worker token)."""
        assert self.vault is not None
        return VaultAccess(
            self.pool,
            self.settings.secret_box(),
            self.vault.url,
            self.settings.billing_charge_api,
            self.http,
            self.vault.worker,
        )

    @asynccontextmanager
    async def running_worker(
        self, interceptors: Sequence[Interceptor] = ()
    ) -> AsyncIterator[Worker]:
        async with self.worker(interceptors) as worker:
            yield worker

    def cli_env(self, **extra_env: str) -> dict[str, str]:
        """What the CLI reads to reach the test's Temporal namespace, task queue and ledger;
        `extra_env` comes last."""
        return {
            "TEMPORAL_ADDRESS": self.client.service_client.config.target_host,
            "TEMPORAL_NAMESPACE": self.client.namespace,
            "TEMPORAL_TASK_QUEUE": self.task_queue,
            "DATABASE_URL": self.database_url,
            **extra_env,
        }

    def use_cli_env(self, monkeypatch: pytest.MonkeyPatch, **extra_env: str) -> None:
        """cli_env set in this process, for a command run in it (to patch what it calls)."""
        for name, value in self.cli_env(**extra_env).items():
            monkeypatch.setenv(name, value)

    async def starter_process(self, *args: str, **extra_env: str) -> asyncio.subprocess.Process:
        """`starter.py` started in its own process against the test's namespace and task
        queue, its output piped; `extra_env` comes last."""
        return await asyncio.create_subprocess_exec(
            sys.executable,
            str(PROJECT_ROOT / "starter.py"),
            *args,
            env={**os.environ, **self.cli_env(**extra_env)},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    async def starter(self, *args: str) -> tuple[int, str, str]:
        """`starter.py` run to its end: exit code, stdout and stderr."""
        return await forked_cli.run(
            PROJECT_ROOT / "starter.py", args, {**os.environ, **self.cli_env()}, STARTER_TIMEOUT
        )

    def worker_process(self, **extra_env: str) -> subprocess.Popen[bytes]:
        """worker.py in its own process, so a test can SIGKILL it; `extra_env` comes last."""
        config = self.client.service_client.config
        env = {
            **os.environ,
            "TEMPORAL_ADDRESS": config.target_host,
            "TEMPORAL_NAMESPACE": self.client.namespace,
            "TEMPORAL_TASK_QUEUE": self.task_queue,
            "DATABASE_URL": self.database_url,
            "STRIPE_API_BASE": self.settings.stripe_api_base,
            "STRIPE_API_KEY": self.settings.stripe_api_key.get_secret_value(),
            "BILLING_CHARGE_API": self.settings.billing_charge_api,
            "BILLING_KEY_NAMESPACE": self.settings.billing_key_namespace,
        }
        if self.vault is not None:
            # As in production: the worker charges through the vault, without the Stripe key.
            del env["STRIPE_API_KEY"]
            env["BILLING_VAULT_URL"] = self.vault.url
            env["BILLING_VAULT_WORKER_TOKEN"] = VAULT_WORKER_TOKEN
            env["BILLING_KEY_ENCRYPTION_KEYS"] = KEY_ENCRYPTION_KEYS
        if self.settings.billing_stripe_rps is not None:
            env["BILLING_STRIPE_RPS"] = str(self.settings.billing_stripe_rps)
        env.update(extra_env)
        process = subprocess.Popen(
            [sys.executable, str(PROJECT_ROOT / "worker.py")],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.processes.append(process)
        return process

    async def workers_polling(self, count: int) -> None:
        """Wait until `count` workers poll the task queue for workflow tasks: a process just
        started needs a few seconds, and work started before then all goes to the others."""

        async def polling() -> bool:
            described = await self.client.workflow_service.describe_task_queue(
                DescribeTaskQueueRequest(
                    namespace=self.client.namespace,
                    task_queue=TaskQueue(name=self.task_queue),
                    task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
                )
            )
            return len({poller.identity for poller in described.pollers}) >= count

        await eventually(polling)

    async def ledger_rows(self, period: str) -> list[asyncpg.Record]:
        return await ledger_rows(self.pool, period)

    async def period_control(self, period: Period) -> tuple[str, str | None, str | None]:
        """The period's word in the ledger, which charges already scheduled read: the
        control, why, and by whom."""
        row = await self.pool.fetchrow(
            "SELECT control, control_reason, control_by FROM billing_periods"
            " WHERE billing_period = $1",
            str(period),
        )
        assert row is not None, f"the ledger has no run of {period}"
        return row["control"], row["control_reason"], row["control_by"]

    def stop_processes(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def single_batch_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers run workflows under the activation rule the SDK means to make its default
    (its logic flag 2), which raises a Temporal cancel in every task whose wait it ends."""
    flag = _WorkflowLogicFlag.PROCESS_WORKFLOW_ACTIVATION_JOBS_AS_SINGLE_BATCH
    monkeypatch.setattr(sdk_workflow, "_DEFAULT_ENABLED_WORKFLOW_LOGIC_FLAGS", frozenset({flag}))

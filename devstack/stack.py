"""Bring the whole local stack up and down, and describe it in `.devstack/env`."""

from __future__ import annotations

import asyncio
import os
import secrets
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import asyncpg
from pydantic import BaseModel

from billing import search_attributes
from billing.db_roles import DatabaseRoles
from billing.migrations import migrate
from billing.sealing import new_key
from devstack.postgres import LocalPostgres
from devstack.processes import Service, StackError, ensure_port_free, spawn, wait_for_http

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ROOT = PROJECT_ROOT / ".devstack"
DATABASE = "billing"
# The workers' and CLI's role, and the vault's (billing/db_roles.py): the stack migrates as the
# superuser, the schema's owner, and grants each role its own tables. The embedded server
# trusts local connections, so here the roles show the wiring a deployment uses (whose
# server checks the passwords) rather than keep a local user out.
LEDGER_ROLE = "billing_ledger"
VAULT_ROLE = "billing_vault"
ROLES = DatabaseRoles(ledger=LEDGER_ROLE, vault=VAULT_ROLE)
# A test-mode key: the emulator accepts any sk_test_ key; never a real one here.
LOCAL_STRIPE_KEY = "sk_test_local_emulator"
# The worker charges through the vault and never sees the Stripe secret, nor the vault's admin
# token: not from the stack's settings, nor from a shell that sourced `.devstack/env`.
WITHHELD_FROM_WORKER = frozenset({"STRIPE_API_KEY", "BILLING_VAULT_ADMIN_TOKEN"})
# No local period key may be capped above $100M.
LOCAL_MAX_CAP_CENTS = 10_000_000_000
# Room for many periods' keys: the local stack bills what benchmarks and demos ask for.
LOCAL_WORKER_BUDGET_CENTS = 100 * LOCAL_MAX_CAP_CENTS
LOCAL_WORKER_CURRENCIES = "usd,eur,gbp,jpy"
# One partition per task queue (the server's default is four). A single dev server serves
# every partition itself, so more only cost it matching across them: in alternating runs
# over 4,000 customers it spent 16-17 ms of CPU per customer with one against 20-21 with
# four, and the period billed 54-60/s against 48-50/s (bench/FINDINGS.md). A cluster
# spreads its partitions over its matching hosts and keeps its own setting.
DEV_SERVER_TUNING = (
    "--dynamic-config-value",
    "matching.numTaskqueueReadPartitions=1",
    "--dynamic-config-value",
    "matching.numTaskqueueWritePartitions=1",
)

# The dev server's Go garbage collector lets the heap grow to five times what is live before
# it collects (GOGC=400; Go's default is 100). In alternating runs over 4,000 customers the
# dev server spent 15.6-17.6 ms of CPU per customer against 18.6-20.1, for a resident size of
# up to 1.3 GB against 0.5 GB without a limit (bench/FINDINGS.md). GOMEMLIMIT, a soft
# limit, makes it collect harder as its heap nears 1 GiB: 0.98 GB resident at most over 4,000.
DEV_SERVER_ENV = {"GOGC": "400", "GOMEMLIMIT": "1GiB"}
# glibc gives each thread that allocates an arena of its own (up to 8 per core), and the
# SDK core's threads and the workflow activations' leave free memory in theirs that RSS keeps:
# over 25,000 customers on one worker the free memory grew 11.2 -> 20.3 MiB with live memory
# flat; with two arenas it stayed flat (bench/FINDINGS.md). As in the Dockerfile.
WORKER_ENV = {"MALLOC_ARENA_MAX": "2"}


class StackConfig(BaseModel):
    root: Path = DEFAULT_ROOT
    temporal_port: int = 7233
    ui_port: int = 8233
    postgres_port: int = 5433
    emulator_port: int = 12111
    vault_port: int = 8180
    namespace: str = "default"
    task_queue: str = "billing"
    worker: bool = True

    @property
    def env_file(self) -> Path:
        return self.root / "env"

    @property
    def pid_file(self) -> Path:
        return self.root / "stack.pid"

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    @property
    def key_encryption_file(self) -> Path:
        return self.root / "key-encryption-key"

    def password_file(self, role: str) -> Path:
        return self.root / f"db-password-{role}"


def venv_binary(name: str) -> str:
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise StackError(f"{path} is missing: install the project first (pip install -e .)")
    return str(path)


class LocalStack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.postgres = LocalPostgres(config.root / "postgres", config.postgres_port)
        self.services: list[Service] = []
        # Fresh tokens per start: the vault only compares them, it stores nothing.
        self._vault_token = secrets.token_urlsafe(24)
        self._worker_token = secrets.token_urlsafe(24)

    @property
    def environment(self) -> dict[str, str]:
        c = self.config
        emulator = f"http://127.0.0.1:{c.emulator_port}"
        return {
            "TEMPORAL_ADDRESS": f"127.0.0.1:{c.temporal_port}",
            "TEMPORAL_NAMESPACE": c.namespace,
            "TEMPORAL_TASK_QUEUE": c.task_queue,
            "TEMPORAL_UI_URL": f"http://127.0.0.1:{c.ui_port}",
            # The ledger's role: workers and the CLI (`source .devstack/env`) never reach
            # the vault's tables.
            "DATABASE_URL": self.role_dsn(LEDGER_ROLE),
            "STRIPE_API_BASE": emulator,
            "STRIPE_API_KEY": LOCAL_STRIPE_KEY,
            "STRIPE_EMULATOR_URL": emulator,
            "BILLING_CHARGE_API": "payment_intents",
            "BILLING_KEY_NAMESPACE": "local",
            "BILLING_VAULT_URL": f"http://127.0.0.1:{c.vault_port}",
            "BILLING_VAULT_WORKER_TOKEN": self._worker_token,
            # For operators' tools (revoke, audit); the worker is not given it.
            "BILLING_VAULT_ADMIN_TOKEN": self._vault_token,
            "BILLING_KEY_ENCRYPTION_KEYS": self._key_encryption_key(),
        }

    def _key_encryption_key(self) -> str:
        """Kept with the database it seals keys in: a new one per start could not open the
        period keys stored by the last."""
        return _kept_secret(self.config.key_encryption_file, new_key)

    def _password(self, role: str) -> str:
        """Kept with the database, as the sealing key is: made once, readable by this user
        alone, never printed."""
        return _kept_secret(self.config.password_file(role), lambda: secrets.token_urlsafe(24))

    def role_dsn(self, role: str) -> str:
        return self.postgres.dsn(DATABASE, role, self._password(role))

    @property
    def owner_dsn(self) -> str:
        """The superuser's, who migrates: for tools that read both the ledger's and the
        vault's tables, as the chaos run's checks do."""
        return self.postgres.dsn(DATABASE)

    @property
    def worker_environment(self) -> dict[str, str]:
        """The stack's settings a worker needs, over WORKER_ENV (an operator's own wins)."""
        tuning = {name: os.environ.get(name, value) for name, value in WORKER_ENV.items()}
        own = {k: v for k, v in self.environment.items() if k not in WITHHELD_FROM_WORKER}
        return {**tuning, **own}

    def spawn_worker(self) -> Service:
        """A worker on the stack, with none of WITHHELD_FROM_WORKER from the shell either."""
        return spawn(
            "worker",
            [sys.executable, str(PROJECT_ROOT / "worker.py")],
            self.config.log_dir,
            self.worker_environment,
            withhold=WITHHELD_FROM_WORKER,
        )

    @property
    def vault_environment(self) -> dict[str, str]:
        """The vault's own: its database role, the Stripe secret, the admin token."""
        c = self.config
        return {
            "VAULT_DATABASE_URL": self.role_dsn(VAULT_ROLE),
            "VAULT_ADMIN_TOKEN": self._vault_token,
            "VAULT_UPSTREAM_STRIPE_BASE": f"http://127.0.0.1:{c.emulator_port}",
            "VAULT_UPSTREAM_STRIPE_SECRET": LOCAL_STRIPE_KEY,
            "VAULT_MAX_CAP_CENTS": str(LOCAL_MAX_CAP_CENTS),
            "VAULT_WORKER_TOKEN": self._worker_token,
            "VAULT_WORKER_BUDGET_CENTS": str(LOCAL_WORKER_BUDGET_CENTS),
            "VAULT_WORKER_CURRENCIES": LOCAL_WORKER_CURRENCIES,
        }

    async def start(self) -> None:
        c = self.config
        c.log_dir.mkdir(parents=True, exist_ok=True)
        for port, what in (
            (c.temporal_port, "Temporal"),
            (c.ui_port, "the Temporal Web UI"),
            (c.postgres_port, "PostgreSQL"),
            (c.emulator_port, "the Stripe emulator"),
            (c.vault_port, "the vault proxy"),
        ):
            ensure_port_free(port, what)
        try:
            await self._start_postgres()
            await self._start_temporal()
            await self._start_emulator()
            await self._start_vault()
            self.write_env()
            if c.worker:
                self.services.append(self.spawn_worker())
        except BaseException:
            self.stop()
            raise

    async def _start_postgres(self) -> None:
        await asyncio.to_thread(self.postgres.start)
        conn = await asyncpg.connect(self.postgres.dsn())
        try:
            if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", DATABASE):
                await conn.execute(f"CREATE DATABASE {DATABASE}")
            await self._ensure_roles(conn)
        finally:
            await conn.close()
        await migrate(self.owner_dsn, roles=ROLES)

    async def _ensure_roles(self, conn: asyncpg.Connection) -> None:
        """Each role, created if missing (a `.devstack` from before roles has none), with
        the password its file holds, set on every start so the two never disagree."""
        for role in (LEDGER_ROLE, VAULT_ROLE):
            if not await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
                await conn.execute(f"CREATE ROLE {role} LOGIN")
            # No parameters in ALTER ROLE: a literal, from token_urlsafe's alphabet (no quote).
            await conn.execute(f"ALTER ROLE {role} LOGIN PASSWORD '{self._password(role)}'")

    async def _start_temporal(self) -> None:
        c = self.config
        argv = [
            venv_binary("temporal"),
            "server",
            "start-dev",
            "--ip",
            "127.0.0.1",
            "--port",
            str(c.temporal_port),
            "--ui-port",
            str(c.ui_port),
            "--namespace",
            c.namespace,
            "--log-level",
            "warn",
            "--db-filename",
            str(c.root / "temporal.db"),
            # WAL without an fsync per commit: history survives a restart of the stack without
            # the dev server waiting on the disk for every event.
            "--sqlite-pragma",
            "journal_mode=wal",
            "--sqlite-pragma",
            "synchronous=off",
            *DEV_SERVER_TUNING,
        ]
        for key in search_attributes.ALL:
            argv += ["--search-attribute", f"{key.name}=Keyword"]
        # An operator's own GOGC or GOMEMLIMIT wins.
        env = {name: os.environ.get(name, value) for name, value in DEV_SERVER_ENV.items()}
        service = spawn("temporal", argv, c.log_dir, env=env)
        self.services.append(service)
        await wait_for_http(service, f"http://127.0.0.1:{c.ui_port}/", timeout=90)

    async def _start_emulator(self) -> None:
        c = self.config
        service = spawn(
            "stripe-emulator",
            [
                sys.executable,
                "-m",
                "stripe_emulator",
                "--host",
                "127.0.0.1",
                "--port",
                str(c.emulator_port),
            ],
            c.log_dir,
        )
        self.services.append(service)
        await wait_for_http(service, f"http://127.0.0.1:{c.emulator_port}/_emulator/health")

    async def _start_vault(self) -> None:
        c = self.config
        service = spawn(
            "vault",
            [sys.executable, "-m", "vault", "--host", "127.0.0.1", "--port", str(c.vault_port)],
            c.log_dir,
            self.vault_environment,
        )
        self.services.append(service)
        await wait_for_http(service, f"http://127.0.0.1:{c.vault_port}/vault/health")

    async def restart_vault(self) -> None:
        """SIGKILL the vault and start it again on its port: a crash mid-request (chaos)."""
        self._kill("vault")
        await self._start_vault()

    async def restart_temporal(self) -> None:
        """SIGKILL the dev server and start it again on its database and ports: an outage of
        Temporal, its history kept (chaos)."""
        self._kill("temporal")
        await self._start_temporal()

    def _kill(self, name: str) -> None:
        service = next(s for s in self.services if s.name == name)
        service.kill()
        self.services.remove(service)

    def write_env(self) -> None:
        lines = [f"export {k}={shlex.quote(v)}" for k, v in self.environment.items()]
        # It holds the vault's tokens and the sealing key: readable by this user alone.
        env_file = self.config.env_file
        env_file.touch(mode=0o600)
        env_file.chmod(0o600)
        env_file.write_text("\n".join(lines) + "\n")

    def stop(self) -> None:
        # Worker first, so in-flight charges finish and are recorded before their services go.
        for service in reversed(self.services):
            service.stop()
        self.services.clear()
        self.postgres.stop()
        self.config.env_file.unlink(missing_ok=True)

    def exited(self) -> list[Service]:
        return [s for s in self.services if not s.alive()]


def _kept_secret(path: Path, make: Callable[[], str]) -> str:
    """The secret in `path`, made by `make` the first time; the file is this user's alone."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(make())
    return path.read_text().strip()


def read_env(env_file: Path) -> dict[str, str]:
    """Parse the `export K=V` lines written by write_env."""
    values: dict[str, str] = {}
    for line in env_file.read_text().splitlines():
        parts = shlex.split(line)
        if len(parts) == 2 and parts[0] == "export" and "=" in parts[1]:
            key, value = parts[1].split("=", 1)
            values[key] = value
    return values

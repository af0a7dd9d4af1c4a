"""The local stack's own files: a stale pid file never stops another process, the
environment file that holds its tokens is this user's alone, and its database roles."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest

from billing.migrations import migrate
from devstack.__main__ import down
from devstack.processes import spawn
from devstack.stack import (
    DATABASE,
    LEDGER_ROLE,
    VAULT_ROLE,
    WITHHELD_FROM_WORKER,
    LocalStack,
    StackConfig,
    read_env,
)
from tests.conftest import free_port


@pytest.fixture
def other_process() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_down_leaves_alone_a_process_that_took_a_stale_pid(
    tmp_path: Path, other_process: subprocess.Popen[bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    """After a reboot the saved pid may be any process's: it is not sent SIGTERM."""
    config = StackConfig(root=tmp_path)
    config.pid_file.write_text(str(other_process.pid))
    assert down(config, timeout=1) == 0
    assert "no local stack is running" in capsys.readouterr().out
    assert other_process.poll() is None
    assert not config.pid_file.exists()


def test_the_environment_file_is_readable_by_its_owner_alone(tmp_path: Path) -> None:
    config = StackConfig(root=tmp_path)
    config.env_file.write_text("stale\n")
    config.env_file.chmod(0o644)
    LocalStack(config).write_env()
    assert stat.S_IMODE(config.env_file.stat().st_mode) == 0o600
    assert "BILLING_VAULT_WORKER_TOKEN" in config.env_file.read_text()


def test_workers_and_the_cli_get_the_ledgers_role_and_the_vault_its_own(tmp_path: Path) -> None:
    config = StackConfig(root=tmp_path)
    stack = LocalStack(config)
    stack.write_env()
    written = read_env(config.env_file)
    ledger = urlsplit(written["DATABASE_URL"])
    vault = urlsplit(stack.vault_environment["VAULT_DATABASE_URL"])
    assert (ledger.username, vault.username) == (LEDGER_ROLE, VAULT_ROLE)
    assert stack.worker_environment["DATABASE_URL"] == written["DATABASE_URL"]
    # Passwords kept beside the sealing key, this user's alone, and the same on every read.
    for role, url in ((LEDGER_ROLE, ledger), (VAULT_ROLE, vault)):
        kept = config.password_file(role)
        assert stat.S_IMODE(kept.stat().st_mode) == 0o600
        assert url.password == kept.read_text().strip()
    assert ledger.password != vault.password
    assert LocalStack(config).environment["DATABASE_URL"] == written["DATABASE_URL"]


def test_a_worker_gets_two_malloc_arenas_unless_the_operator_says_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    stack = LocalStack(StackConfig(root=tmp_path))
    assert stack.worker_environment["MALLOC_ARENA_MAX"] == "2"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert stack.worker_environment["MALLOC_ARENA_MAX"] == "8"


async def test_a_stack_from_before_roles_gets_them_and_their_grants(tmp_path: Path) -> None:
    """A `.devstack` whose database was migrated by the superuser alone, as before roles:
    the next start creates the roles and grants them, keeping the data."""
    config = StackConfig(root=tmp_path, postgres_port=free_port())
    stack = LocalStack(config)
    stack.postgres.start()
    try:
        conn = await asyncpg.connect(stack.postgres.dsn())
        await conn.execute(f"CREATE DATABASE {DATABASE}")
        await conn.close()
        await migrate(stack.owner_dsn)
        stack.postgres.stop()
        await stack._start_postgres()
        stack.postgres.stop()
        await stack._start_postgres()  # and again: idempotent
        ledger = await asyncpg.connect(stack.environment["DATABASE_URL"])
        vault = await asyncpg.connect(stack.vault_environment["VAULT_DATABASE_URL"])
        try:
            assert await ledger.fetchval("SELECT count(*) FROM customers") == 0
            assert await vault.fetchval("SELECT count(*) FROM vault_keys") == 0
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await ledger.fetchval("SELECT count(*) FROM vault_keys")
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await vault.fetchval("SELECT count(*) FROM customers")
        finally:
            await ledger.close()
            await vault.close()
    finally:
        stack.postgres.stop()


def test_the_worker_gets_no_admin_token_or_stripe_key_from_a_shell_that_sourced_the_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in WITHHELD_FROM_WORKER:
        monkeypatch.setenv(name, "from-the-shell")
    monkeypatch.setenv("KEPT_FROM_THE_SHELL", "yes")
    probe = "import json, os; print(json.dumps(dict(os.environ)))"
    service = spawn(
        "probe",
        [sys.executable, "-c", probe],
        tmp_path,
        {"BILLING_VAULT_ADMIN_TOKEN": "from-the-stack", "GIVEN": "yes"},
        withhold=WITHHELD_FROM_WORKER,
    )
    assert service.process.wait(timeout=30) == 0
    seen = json.loads(service.log.read_text())
    assert not WITHHELD_FROM_WORKER & set(seen)
    assert (seen["KEPT_FROM_THE_SHELL"], seen["GIVEN"]) == ("yes", "yes")

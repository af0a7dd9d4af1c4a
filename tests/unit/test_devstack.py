"""The local stack's own files: a stale pid file never stops another process, and the
environment file that holds its tokens is this user's alone."""

from __future__ import annotations

import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.__main__ import down
from devstack.stack import LocalStack, StackConfig


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

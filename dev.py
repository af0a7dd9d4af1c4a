#!/usr/bin/env python3
"""Set up and run the project with nothing but Python 3.11+ installed.

    python3 dev.py demo     # virtualenv + install, then bill 1,000 demo customers locally
    python3 dev.py test     # virtualenv + install, then the whole test suite
    python3 dev.py lint     # ruff and mypy
    python3 dev.py setup    # only the virtualenv and install

Extra arguments go to the command: `python3 dev.py test -k replay`, `python3 dev.py test -n 0`
(one process), `python3 dev.py demo --customers 200`.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".installed"
# What mypy checks, tests and benchmarks included.
PACKAGES = [
    "billing",
    "cli",
    "workflows",
    "activities",
    "stripe_emulator",
    "devstack",
    "vault",
    "chaos",
    "bench",
    "tests",
]

# The suite waits on timers and services more than it computes: two processes per core, up to
# four (each starts its own PostgreSQL and Temporal dev server), take about 6 minutes here on
# 2 cores, against 9-10 with one per core. `python3 dev.py test -n 0` runs it in one process.
TEST_PROCESSES = min(4, 2 * (os.cpu_count() or 1))
PARALLEL = ["--numprocesses", str(TEST_PROCESSES), "--dist", "worksteal"]


def setup() -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 - run by any python3 a machine has
        sys.exit(f"Python 3.11 or newer is needed; this is {sys.version.split()[0]}")
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted:
        return
    if not _has_pip():
        # Also one left without pip (a system whose venv module lacks ensurepip, since
        # installed): it is made again from scratch.
        print(f"creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    print("installing the project and its dev tools (a minute or two the first time)", flush=True)
    pip = [str(PYTHON), "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "install", "-e", f"{ROOT}[dev]"], check=True)
    STAMP.write_text(wanted)


def _has_pip() -> bool:
    if not PYTHON.exists():
        return False
    check = [str(PYTHON), "-m", "pip", "--version"]
    return subprocess.run(check, capture_output=True).returncode == 0


def run(*argv: str) -> int:
    return subprocess.run([str(PYTHON), *argv], cwd=ROOT).returncode


def main() -> int:
    command, extra = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if command not in {"setup", "demo", "test", "lint"}:
        print(__doc__)
        return 2
    setup()
    if command == "demo":
        return run("starter.py", "demo", "--keep-running", *extra)
    if command == "test":
        return run("-m", "pytest", *PARALLEL, *extra)
    if command == "lint":
        packages = [p for p in PACKAGES if (ROOT / p).is_dir()]
        checks = [
            ("-m", "ruff", "check", "."),
            ("-m", "ruff", "format", "--check", "."),
            ("-m", "mypy", *packages, "worker.py", "starter.py", "dev.py"),
        ]
        return max(run(*check) for check in checks)
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())

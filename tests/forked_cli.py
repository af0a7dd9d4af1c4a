"""`starter.py` run to its end in a process of its own, forked from a server process that has
imported the CLI once. Each run is still a real process, with its own environment, output
and exit code, and runs the script's own `__main__`; it saves the second or so of CPU that a
fresh interpreter spends importing the CLI's dependencies, over a hundred times a suite."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import runpy
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

# Not "fork": the test process runs threads (Temporal's core, asyncio's executor), which a
# fork would copy mid-flight. The fork server is a fresh interpreter that only imports.
_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(["cli.main"])


def _run(
    script: str, args: Sequence[str], env: Mapping[str, str], cwd: Path, out: Path, err: Path
) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        with open(path, "wb") as file:
            os.dup2(file.fileno(), fd)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


async def run(
    script: Path,
    args: Sequence[str],
    env: Mapping[str, str],
    timeout: float,
    cwd: Path | None = None,
) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `script` with `args` and `env` (the whole
    environment), in `cwd` (this process's working directory if None). One that does not exit
    within `timeout` seconds (`run --wait` on a run that paused, say) is killed, and fails the
    test rather than hang the suite."""
    with tempfile.TemporaryDirectory(prefix="starter-") as directory:
        out, err = Path(directory, "stdout"), Path(directory, "stderr")
        process = _SERVER.Process(
            target=_run, args=(str(script), args, dict(env), cwd or Path.cwd(), out, err)
        )
        process.start()
        try:
            await asyncio.to_thread(process.join, timeout)
            code = process.exitcode
        finally:
            if process.exitcode is None:  # timed out, or the test was cancelled
                process.kill()
                process.join()
            process.close()
        if code is None:
            raise AssertionError(
                f"{script.name} {' '.join(args)} did not exit within {timeout:g} s"
            )
        stdout, stderr = await asyncio.to_thread(lambda: (out.read_text(), err.read_text()))
        return code, stdout, stderr

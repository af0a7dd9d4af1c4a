"""Operator's command line: run, watch and steer billing periods, schedules and customers.

python starter.py run 2026-12 --wait
python starter.py status 2026-12 --json
python starter.py watch 2026-12
python starter.py pause 2026-12 --reason "amounts look wrong"
python starter.py skip 2026-12 cust-42 --reason "disputed"
python starter.py preview 2026-12
python starter.py reconcile 2026-12
python starter.py handled 2026-12 duplicate ch_3Nx --reason "customer agreed"
python starter.py schedule create --day 1 --hour 2 --time-zone Europe/Berlin
python starter.py customers import customers.csv
python starter.py demo --customers 1000 --keep-running

The commands live in the `cli` package.
"""

from __future__ import annotations

import os
import sys

from cli.main import main

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: the Temporal client's Rust threads can abort a finalizing
    # interpreter (temporalio sdk-python issue 300), turning a clean exit into SIGABRT.
    os._exit(code)

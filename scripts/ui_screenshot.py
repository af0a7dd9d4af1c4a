"""Screenshot the Temporal Web UI listing one period's runs, as an operator sees it.

    python scripts/ui_screenshot.py [--period 2026-10] [--out ui.png] [--customers 20]

Uses the running local stack (`.devstack/env`), or starts one and stops it after. Bills the
period with a few demo customers if it has no run yet, then renders
`.../workflows?query=BillingPeriod="P"` in headless Chromium (Debian's `chromium` package:
`apt-get install -y chromium`). The image is for looking at, not for committing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from billing.config import TemporalSettings
from billing.periods import parse_period
from billing.runs import period_status, start_period
from billing.seeding import seed_demo
from billing.temporal_client import connect
from devstack.demo import ensure_stack

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,900",
    "--virtual-time-budget=10000",
]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    sys.exit("headless Chromium is needed: apt-get install -y chromium")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--period", default="2026-10")
    parser.add_argument("--out", type=Path, default=Path("ui-billing-period.png"))
    parser.add_argument("--customers", type=int, default=20)
    args = parser.parse_args()
    period = parse_period(args.period)
    browser = chromium()
    async with ensure_stack(quiet=False, keep_running=False):
        temporal = TemporalSettings()
        client = await connect(temporal)
        if (await period_status(client, period)).state == "not_started":
            await seed_demo(args.customers)
            await (await start_period(client, period, temporal.task_queue)).result()
        query = quote(f'BillingPeriod="{period}"')
        url = f"{temporal.ui_url}/namespaces/{temporal.namespace}/workflows?query={query}"
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [
                    browser,
                    *CHROMIUM_FLAGS,
                    f"--user-data-dir={profile}",
                    f"--screenshot={args.out.resolve()}",
                    url,
                ],
                check=True,
                capture_output=True,
                env={**os.environ, "HOME": profile},
                timeout=120,
            )
    print(f"{args.out} shows {url}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

"""What the benchmark scripts share: where their figures are written."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def write_result(kind: str, result: dict[str, Any]) -> Path:
    """bench/results/{kind}-{UTC time}-{customers}.json, pretty-printed."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"{kind}-{stamp}-{result['customers']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path

"""Reading this process's Prometheus samples in tests."""

from __future__ import annotations

from prometheus_client import REGISTRY


def metric_value(name: str, **labels: str) -> float:
    """The sample `name` with `labels`, 0 where nothing was counted yet."""
    return REGISTRY.get_sample_value(name, labels) or 0.0

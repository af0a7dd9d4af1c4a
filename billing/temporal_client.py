"""One way to reach Temporal, with the data converter every part of the project uses."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import Runtime

from billing.config import TemporalSettings
from billing.errors import ServiceUnavailableError


async def connect(settings: TemporalSettings, runtime: Runtime | None = None) -> Client:
    """`runtime` carries the worker's telemetry (SDK metrics); None is the default runtime."""
    try:
        return await Client.connect(
            settings.address,
            namespace=settings.namespace,
            data_converter=pydantic_data_converter,
            runtime=runtime,
        )
    except RuntimeError as exc:
        raise ServiceUnavailableError(
            f"cannot reach Temporal at {settings.address} (TEMPORAL_ADDRESS): {exc};"
            " for the local stack run `python -m devstack up`"
        ) from None

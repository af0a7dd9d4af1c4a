"""The billing worker's workflow tasks skip the SDK's payload walks (billing/payload_walks.py)."""

from __future__ import annotations

from typing import Any

import pytest
import temporalio.bridge.worker as sdk_bridge

from billing import payload_walks
from billing.periods import Period
from billing.runs import start_period
from tests.integration.harness import Harness
from tests.integration.invariants import assert_billed_once


async def test_a_period_runs_without_the_sdk_walks(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    walks: list[str] = []

    def counted(sdk_walk: Any) -> Any:
        async def walk(*args: Any) -> Any:
            walks.append(sdk_walk.__name__)
            return await sdk_walk(*args)

        return walk

    monkeypatch.setattr(
        payload_walks, "_sdk_decode_activation", counted(payload_walks._sdk_decode_activation)
    )
    monkeypatch.setattr(
        payload_walks, "_sdk_encode_completion", counted(payload_walks._sdk_encode_completion)
    )
    # The SDK's walks (counted) until the worker is created, whatever an earlier test installed.
    monkeypatch.setattr(sdk_bridge, "decode_activation", payload_walks._sdk_decode_activation)
    monkeypatch.setattr(sdk_bridge, "encode_completion", payload_walks._sdk_encode_completion)
    customers = await harness.seed(5)
    async with harness.running_worker():
        assert sdk_bridge.decode_activation is payload_walks.decode_activation
        assert sdk_bridge.encode_completion is payload_walks.encode_completion
        summary = await (
            await start_period(harness.client, Period(2026, 12), harness.task_queue)
        ).result()

    assert summary.charged == 5
    await assert_billed_once(harness, "2026-12", customers)
    # Every activation of the period and its children went past the SDK's walks: counted
    # only if the skip were installed but declined them.
    assert walks == []

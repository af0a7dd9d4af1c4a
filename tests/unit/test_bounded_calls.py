"""Reconciliation's calls to Stripe and Temporal, a few at a time (activities.reconcile)."""

from __future__ import annotations

import asyncio
from functools import partial

import pytest

from activities import reconcile


async def test_the_first_failure_stops_the_calls_still_running_or_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rest went on calling Stripe, taking turns of its rate, while the activity was
    tried again (helper-151 F6)."""
    monkeypatch.setattr(reconcile, "CONCURRENCY", 2)
    started: list[int] = []
    finished: list[int] = []

    async def call(n: int) -> int:
        started.append(n)
        if n == 0:
            raise LookupError("refused")
        await asyncio.sleep(0.2)
        finished.append(n)
        return n

    with pytest.raises(LookupError, match="refused"):
        await reconcile._bounded([partial(call, n) for n in range(6)])
    await asyncio.sleep(0.4)
    # Those running beside the failure were stopped, and those still waiting never began
    # (but one, which took the failed call's turn as it ended).
    assert finished == [] and len(started) <= 3


async def test_every_result_comes_back_in_order() -> None:
    async def call(n: int) -> int:
        await asyncio.sleep(0.01 * (5 - n))
        return n

    assert await reconcile._bounded([partial(call, n) for n in range(5)]) == list(range(5))

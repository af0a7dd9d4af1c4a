"""The token buckets per API key and per endpoint: 429 with code rate_limit, mapped to
RateLimitError."""

from __future__ import annotations

import pytest
import stripe

from stripe_emulator import RunningEmulator
from stripe_emulator import emulator as emulator_module

from .support import Clock, Raw


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(emulator_module, "time", clock)
    return clock


async def test_over_the_rate_is_429_per_api_key(
    emulator: RunningEmulator, raw: Raw, clock: Clock
) -> None:
    emulator.configure(rate_limit_rps=5)
    replies = [await raw.get("/v1/customers") for _ in range(8)]
    statuses = [r.status for r in replies]
    assert statuses[:5] == [200] * 5
    assert 429 in statuses[5:]
    limited = next(r for r in replies if r.status == 429)
    assert limited.body["error"]["code"] == "rate_limit"
    assert limited.body["error"]["type"] == "invalid_request_error"
    assert limited.headers["Stripe-Should-Retry"] == "true"
    assert (await raw.get("/v1/customers", key="sk_test_another_account")).status == 200
    assert (await raw.ledger())["faults_injected"]["rate_limited"] == statuses.count(429)
    clock.advance(0.25)  # a token per 0.2 s
    assert (await raw.get("/v1/customers")).status == 200


async def test_sdk_raises_rate_limit_error(
    emulator: RunningEmulator, sdk: stripe.StripeClient
) -> None:
    emulator.configure(rate_limit_rps=1)
    await sdk.v1.customers.list_async()
    with pytest.raises(stripe.RateLimitError) as caught:
        await sdk.v1.customers.list_async()
    assert caught.value.http_status == 429


async def test_a_rate_limited_request_is_not_saved(
    emulator: RunningEmulator, raw: Raw, clock: Clock
) -> None:
    customer = await raw.customer()
    emulator.configure(rate_limit_rps=4)
    for _ in range(4):
        await raw.get("/v1/customers")
    assert (await raw.charge(customer, "limited")).status == 429
    clock.advance(0.3)
    retried = await raw.charge(customer, "limited")
    assert retried.status == 200
    assert "Idempotent-Replayed" not in retried.headers


async def test_turning_the_limit_off(emulator: RunningEmulator, raw: Raw) -> None:
    emulator.configure(rate_limit_rps=1)
    await raw.get("/v1/customers")
    assert (await raw.get("/v1/customers")).status == 429
    emulator.configure(rate_limit_rps=None)
    assert all([(await raw.get("/v1/customers")).status == 200 for _ in range(5)])


async def test_each_endpoint_has_a_limit_of_its_own(emulator: RunningEmulator, raw: Raw) -> None:
    """A method and path template is one endpoint (any id), counted per API key, beside the
    key's own limit."""
    first, second = (await raw.customer())["id"], (await raw.customer())["id"]
    emulator.configure(endpoint_rate_limit_rps=2)
    reads = [await raw.get(f"/v1/customers/{c}") for c in (first, second, first)]
    assert [r.status for r in reads] == [200, 200, 429]
    assert reads[-1].body["error"]["code"] == "rate_limit"
    assert (await raw.get("/v1/customers")).status == 200
    assert (await raw.get(f"/v1/customers/{first}", key="sk_test_another_account")).status == 200
    assert (await raw.ledger())["faults_injected"]["rate_limited"] == 1
    emulator.configure(endpoint_rate_limit_rps=None, rate_limit_rps=2)
    assert [(await raw.get(f"/v1/customers/{first}")).status for _ in range(3)] == [200, 200, 429]


async def test_no_more_than_the_rate_passes_after_an_idle_spell_or_under_steady_pressure(
    emulator: RunningEmulator, raw: Raw, clock: Clock
) -> None:
    """Idle time fills the bucket to one second's worth, no more; a client calling twice as
    fast as the rate gets the rate through, every other call. An emulator letting more through
    would hide a worker that goes past Stripe's limit."""
    emulator.configure(rate_limit_rps=4)
    await raw.get("/v1/customers")
    clock.advance(10)
    burst = [(await raw.get("/v1/customers")).status for _ in range(6)]
    assert burst == [200] * 4 + [429] * 2
    steady = []
    for _ in range(6):
        clock.advance(0.125)  # half a token at 4 per second
        steady.append((await raw.get("/v1/customers")).status)
    assert steady == [429, 200] * 3

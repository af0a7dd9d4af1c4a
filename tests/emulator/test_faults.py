"""Fault injection: each kind, what a retry with the same key sees, seeds, the config API."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import stripe

from stripe_emulator import EmulatorConfig, RunningEmulator, serve

from .support import Raw, method_of, response_headers


def _params(customer: dict[str, Any]) -> dict[str, object]:
    return {
        "amount": 4200,
        "currency": "usd",
        "customer": customer["id"],
        "payment_method": method_of(customer),
        "confirm": True,
        "off_session": True,
        "automatic_payment_methods": {"enabled": True, "allow_redirects": "never"},
        "metadata": {"billing_key": "cus:2026-12"},
    }


async def _create(
    sdk: stripe.StripeClient, customer: dict[str, Any], key: str
) -> stripe.PaymentIntent:
    return await sdk.v1.payment_intents.create_async(
        params=_params(customer),  # type: ignore[arg-type]
        options={"idempotency_key": key},
    )


async def test_dropped_response_then_retry_returns_the_first_charge(
    emulator: RunningEmulator, sdk: stripe.StripeClient, raw: Raw
) -> None:
    customer = await raw.customer()
    emulator.configure(drop_after_commit=1)
    with pytest.raises(stripe.APIConnectionError):
        await _create(sdk, customer, "dropped")
    [committed] = (await raw.ledger())["charges"]
    assert (committed["status"], committed["idempotency_key"]) == ("succeeded", "dropped")
    emulator.configure(drop_after_commit=0)
    retried = await _create(sdk, customer, "dropped")
    assert retried.latest_charge == committed["id"]
    assert response_headers(retried)["Idempotent-Replayed"] == "true"
    ledger = await raw.ledger()
    assert len(ledger["charges"]) == 1
    assert ledger["faults_injected"]["drop_after_commit"] == 1
    attempts = [e for e in await raw.request_log() if e["idempotency_key"] == "dropped"]
    assert [(e["status"], e["fault"], e["replayed"]) for e in attempts] == [
        (None, "drop_after_commit", False),
        (200, None, True),
    ]
    assert attempts[0]["params"] == attempts[1]["params"]


async def test_dropped_response_with_the_requests_client(
    emulator: RunningEmulator, sync_sdk: stripe.StripeClient, raw: Raw
) -> None:
    customer = await raw.customer()
    emulator.configure(drop_after_commit=1)

    def create() -> stripe.PaymentIntent:
        return sync_sdk.v1.payment_intents.create(
            params=_params(customer),  # type: ignore[arg-type]
            options={"idempotency_key": "dropped-sync"},
        )

    with pytest.raises(stripe.APIConnectionError):
        await asyncio.to_thread(create)
    emulator.configure(drop_after_commit=0)
    intent = await asyncio.to_thread(create)
    [charge] = (await raw.ledger())["charges"]
    assert intent.latest_charge == charge["id"]


async def test_error_after_commit_is_saved_and_replayed(
    emulator: RunningEmulator, sdk: stripe.StripeClient, raw: Raw
) -> None:
    customer = await raw.customer()
    emulator.configure(error_after_commit=1)
    with pytest.raises(stripe.APIError) as caught:
        await _create(sdk, customer, "after")
    assert caught.value.http_status == 500
    assert caught.value.headers is not None
    assert caught.value.headers["Stripe-Should-Retry"] == "false"
    [committed] = (await raw.ledger())["charges"]
    assert committed["status"] == "succeeded"
    emulator.configure(error_after_commit=0)
    replay = await raw.charge(
        customer, "after", amount="4200", **{"metadata[billing_key]": "cus:2026-12"}
    )
    assert replay.status == 500
    assert replay.headers["Idempotent-Replayed"] == "true"
    ledger = await raw.ledger()
    assert len(ledger["charges"]) == 1
    assert ledger["faults_injected"]["error_after_commit"] == 1


async def test_error_before_commit_stores_nothing_and_a_retry_executes(
    emulator: RunningEmulator, sdk: stripe.StripeClient, raw: Raw
) -> None:
    customer = await raw.customer()
    emulator.configure(error_before_commit=1)
    with pytest.raises(stripe.APIError) as caught:
        await _create(sdk, customer, "before")
    assert caught.value.http_status == 500
    assert caught.value.headers is not None
    assert caught.value.headers["Stripe-Should-Retry"] == "true"
    assert (await raw.ledger())["charges"] == []
    emulator.configure(error_before_commit=0)
    await _executes_afresh(sdk, raw, customer, "before", "error_before_commit")


async def test_error_saved_before_commit_is_replayed_until_the_key_is_forgotten(
    emulator: RunningEmulator, sdk: stripe.StripeClient, raw: Raw
) -> None:
    """A 500 saved before anything was charged: every retry with the key replays it, and
    nothing is charged until Stripe forgets the key; then a retry executes afresh."""
    customer = await raw.customer()
    emulator.configure(error_saved_before_commit=1)
    with pytest.raises(stripe.APIError) as first:
        await _create(sdk, customer, "saved")
    emulator.configure(error_saved_before_commit=0)
    with pytest.raises(stripe.APIError) as replayed:
        await _create(sdk, customer, "saved")
    for caught in (first, replayed):
        assert caught.value.http_status == 500
        assert caught.value.headers is not None
        assert caught.value.headers["Stripe-Should-Retry"] == "false"
    assert replayed.value.headers is not None
    assert replayed.value.headers["Idempotent-Replayed"] == "true"
    assert (await raw.ledger())["charges"] == []
    emulator.configure(idempotency_ttl_seconds=0.001)  # Stripe's day has passed
    await asyncio.sleep(0.01)
    await _executes_afresh(sdk, raw, customer, "saved", "error_saved_before_commit")


async def _executes_afresh(
    sdk: stripe.StripeClient, raw: Raw, customer: dict[str, Any], key: str, fault: str
) -> None:
    """A retry with `key` charges, not replayed: the one charge, after the one `fault`."""
    intent = await _create(sdk, customer, key)
    assert intent.status == "succeeded"
    assert "Idempotent-Replayed" not in response_headers(intent)
    ledger = await raw.ledger()
    assert len(ledger["charges"]) == 1
    assert ledger["faults_injected"][fault] == 1


async def test_faults_only_hit_money_moving_requests(emulator: RunningEmulator, raw: Raw) -> None:
    emulator.configure(error_before_commit=1, drop_after_commit=1)
    customer = await raw.customer()
    assert (await raw.get(f"/v1/customers/{customer['id']}")).status == 200
    assert (await raw.ledger())["faults_injected"]["error_before_commit"] == 0


async def _fault_pattern(raw: Raw, customer: dict[str, Any], run: str) -> list[int | str]:
    pattern: list[int | str] = []
    for i in range(30):
        try:
            pattern.append((await raw.charge(customer, f"{run}-{i}")).status)
        except aiohttp.ServerDisconnectedError:
            pattern.append("dropped")
    return pattern


async def test_a_seed_reproduces_the_faults(emulator: RunningEmulator, raw: Raw) -> None:
    faults = {"drop_after_commit": 0.2, "error_before_commit": 0.2, "error_after_commit": 0.2}
    patterns: list[list[int | str]] = []
    for seed in (7, 7, 8):
        emulator.state.reset({**faults, "seed": seed})
        customer = await raw.customer()
        patterns.append(await _fault_pattern(raw, customer, f"seed-{seed}-{len(patterns)}"))
    assert patterns[0] == patterns[1]
    assert patterns[0] != patterns[2]
    assert {200, 500, "dropped"} <= set(patterns[0])


async def test_faults_api_partial_update_and_validation(raw: Raw) -> None:
    defaults = await raw.faults()
    assert defaults.body == EmulatorConfig().model_dump()
    updated = await raw.faults(drop_after_commit=0.25, seed=3)
    assert updated.status == 200
    assert (updated.body["drop_after_commit"], updated.body["seed"]) == (0.25, 3)
    again = await raw.faults(latency_ms=5)
    assert (again.body["drop_after_commit"], again.body["latency_ms"]) == (0.25, 5)
    assert (await raw.request("GET", "/_emulator/faults", key=None)).body == again.body
    for bad in ({"drop_after_commit": 1.5}, {"latency_ms": -1}, {"no_such_fault": 1}):
        reply = await raw.faults(**bad)
        assert reply.status == 400, bad
    assert (await raw.faults()).body == again.body


async def test_serve_takes_a_config() -> None:
    config = EmulatorConfig(error_before_commit=0.5, seed=1)
    async with serve(config) as running:
        assert running.url.startswith("http://127.0.0.1:") and not running.url.endswith("/")
        assert running.config == config


async def test_faults_also_hit_requests_without_a_key(emulator: RunningEmulator, raw: Raw) -> None:
    emulator.configure(error_after_commit=1)
    reply = await raw.post(
        "/v1/charges",
        {"amount": "100", "currency": "usd", "source": "tok_visa"},
        headers={"Idempotency-Key": ""},  # empty: no key at all
    )
    assert reply.status == 500
    assert [c["idempotency_key"] for c in (await raw.ledger())["charges"]] == [None]


async def test_a_drawn_429_comes_at_any_rate_and_saves_nothing(
    emulator: RunningEmulator, sdk: stripe.StripeClient, raw: Raw
) -> None:
    """With no rate limit passed, as a slow client never passes it: a chaos run's 429s did
    not come on a loaded machine."""
    customer = await raw.customer()
    emulator.configure(rate_limited=1)
    with pytest.raises(stripe.RateLimitError):
        await _create(sdk, customer, "drawn")
    assert (await raw.get("/v1/customers")).status == 429
    emulator.configure(rate_limited=0)
    retried = await _create(sdk, customer, "drawn")
    assert "Idempotent-Replayed" not in response_headers(retried)
    ledger = await raw.ledger()
    assert len(ledger["charges"]) == 1
    assert ledger["faults_injected"]["rate_limited"] == 2


async def test_faults_injected_counts_the_faults_that_hit_and_no_miss(
    emulator: RunningEmulator, raw: Raw
) -> None:
    """A chaos run reports, and requires, the faults it injected from these counts: a miss
    counted would show faults that never happened."""
    customer = await raw.customer()
    emulator.configure(error_before_commit=0.5, rate_limited=0.3, seed=11)
    statuses = [(await raw.charge(customer, f"counted-{i}")).status for i in range(20)]
    counts = (await raw.ledger())["faults_injected"]
    assert (counts["rate_limited"], counts["error_before_commit"]) == (
        statuses.count(429),
        statuses.count(500),
    )
    assert {200, 429, 500} <= set(statuses)

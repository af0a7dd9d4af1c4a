"""Stripe's idempotency: replay, mismatch, in-flight conflicts, what is saved, expiry, scope."""

from __future__ import annotations

import asyncio

import pytest
import stripe

from stripe_emulator import RunningEmulator
from stripe_emulator import emulator as emulator_module

from .support import Clock, HeldLatency, Raw, method_of, response_headers


async def test_same_key_and_params_replay_the_first_response(raw: Raw) -> None:
    customer = await raw.customer()
    first = await raw.charge(customer, "replay-1")
    second = await raw.charge(customer, "replay-1")
    assert first.status == second.status == 200
    assert second.body == first.body
    assert "Idempotent-Replayed" not in first.headers
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.headers["Original-Request"] == first.headers["Request-Id"]
    assert second.headers["Request-Id"] != first.headers["Request-Id"]
    assert len((await raw.ledger())["charges"]) == 1
    log = [e for e in await raw.request_log() if e["idempotency_key"] == "replay-1"]
    assert [e["replayed"] for e in log] == [False, True]


async def test_sdk_sees_the_replayed_object(sdk: stripe.StripeClient, raw: Raw) -> None:
    customer = await raw.customer()
    params = {
        "amount": 100,
        "currency": "usd",
        "customer": customer["id"],
        "payment_method": method_of(customer),
        "confirm": True,
        "allowed_payment_method_types": ["card"],
    }
    first = await sdk.v1.payment_intents.create_async(
        params=params,  # type: ignore[arg-type]
        options={"idempotency_key": "sdk-replay"},
    )
    again = await sdk.v1.payment_intents.create_async(
        params=params,  # type: ignore[arg-type]
        options={"idempotency_key": "sdk-replay"},
    )
    assert again.id == first.id and again.latest_charge == first.latest_charge
    assert response_headers(again)["Idempotent-Replayed"] == "true"


async def test_other_params_with_the_same_key_are_an_idempotency_error(
    sdk: stripe.StripeClient, raw: Raw
) -> None:
    customer = await raw.customer()
    await raw.charge(customer, "mismatch")
    with pytest.raises(stripe.IdempotencyError) as caught:
        await sdk.v1.payment_intents.create_async(
            params={"amount": 2000, "currency": "usd", "customer": customer["id"], "confirm": True},
            options={"idempotency_key": "mismatch"},
        )
    assert caught.value.http_status == 400
    assert caught.value.error is not None and caught.value.error.type == "idempotency_error"
    assert len((await raw.ledger())["charges"]) == 1


async def test_another_endpoint_with_the_same_key_is_an_idempotency_error(raw: Raw) -> None:
    customer = await raw.customer()
    await raw.charge(customer, "endpoint")
    reply = await raw.post(
        "/v1/charges",
        {"amount": "1999", "currency": "usd", "customer": customer["id"]},
        idempotency_key="endpoint",
    )
    assert reply.status == 400
    assert reply.body["error"]["type"] == "idempotency_error"
    assert "same endpoint" in reply.body["error"]["message"]


async def test_concurrent_same_key_one_executes_the_other_gets_409(
    emulator: RunningEmulator,
    sdk: stripe.StripeClient,
    raw: Raw,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    customer = await raw.customer()
    # The first request stays in flight until the others have been refused.
    latency = HeldLatency()
    monkeypatch.setattr(emulator_module, "asyncio", latency)
    emulator.configure(latency_ms=300)
    first = asyncio.create_task(raw.charge(customer, "in-flight"))
    await latency.entered.wait()
    second = await raw.charge(customer, "in-flight")
    assert second.status == 409
    assert second.body["error"]["code"] == "idempotency_key_in_use"
    # stripe-python raises APIError for a 409 (it has no class of its own).
    with pytest.raises(stripe.APIError) as caught:
        await sdk.v1.payment_intents.create_async(
            params={
                "amount": 1999,
                "currency": "usd",
                "customer": customer["id"],
                "payment_method": method_of(customer),
                "confirm": True,
                "off_session": True,
                "automatic_payment_methods": {"enabled": True, "allow_redirects": "never"},
            },
            options={"idempotency_key": "in-flight"},
        )
    assert caught.value.http_status == 409
    assert caught.value.error is not None
    assert caught.value.error.code == "idempotency_key_in_use"
    latency.go.set()
    assert (await first).status == 200
    emulator.configure(latency_ms=0)
    after = await raw.charge(customer, "in-flight")
    assert after.headers["Idempotent-Replayed"] == "true"
    assert len((await raw.ledger())["charges"]) == 1


async def test_many_concurrent_same_key_requests_charge_once(
    emulator: RunningEmulator, raw: Raw
) -> None:
    customer = await raw.customer()
    emulator.configure(latency_ms=50)
    replies = await asyncio.gather(*(raw.charge(customer, "stampede") for _ in range(20)))
    assert sorted(r.status for r in replies).count(200) == 1
    assert {r.status for r in replies} == {200, 409}
    assert len((await raw.ledger())["charges"]) == 1


async def test_a_402_is_saved_and_replayed(raw: Raw) -> None:
    customer = await raw.customer("pm_card_chargeCustomerFail")
    first = await raw.charge(customer, "declined")
    second = await raw.charge(customer, "declined")
    assert first.status == second.status == 402
    assert second.body == first.body
    assert second.headers["Idempotent-Replayed"] == "true"
    assert len((await raw.ledger())["charges"]) == 1


async def test_an_emulator_fault_after_a_charge_is_stored_is_saved_and_replayed(
    raw: Raw, monkeypatch: pytest.MonkeyPatch
) -> None:
    customer = await raw.customer()

    def broken_expand(*_args: object) -> None:
        raise RuntimeError("a bug after the charge was stored")

    # Forgetting the key here would let the retry charge a second time.
    monkeypatch.setattr(emulator_module, "expand", broken_expand)
    failed = await raw.charge(customer, "stored-then-failed")
    monkeypatch.undo()
    again = await raw.charge(customer, "stored-then-failed")
    assert failed.status == again.status == 500
    assert failed.headers["Stripe-Should-Retry"] == "false"
    assert "injected" not in failed.body["error"]["message"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len((await raw.ledger())["charges"]) == 1


async def test_validation_failures_are_not_saved(raw: Raw) -> None:
    customer = await raw.customer()
    refused = await raw.charge(customer, "fix-and-retry", currency="usdx")
    assert refused.status == 400
    fixed = await raw.charge(customer, "fix-and-retry")
    assert fixed.status == 200
    assert "Idempotent-Replayed" not in fixed.headers


async def test_keys_expire_after_the_ttl(
    emulator: RunningEmulator, raw: Raw, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    monkeypatch.setattr(emulator_module, "time", clock)
    emulator.configure(idempotency_ttl_seconds=0.2)
    customer = await raw.customer()
    first = await raw.charge(customer, "short-lived")
    clock.advance(0.1)
    assert (await raw.charge(customer, "short-lived")).headers["Idempotent-Replayed"] == "true"
    clock.advance(0.2)
    fresh = await raw.charge(customer, "short-lived")
    assert "Idempotent-Replayed" not in fresh.headers
    assert fresh.body["id"] != first.body["id"]
    # After expiry the key may even carry other parameters: it starts a new request.
    clock.advance(0.3)
    other = await raw.charge(customer, "short-lived", amount="500")
    assert other.status == 200
    assert len((await raw.ledger())["charges"]) == 3


async def test_a_shorter_ttl_forgets_the_keys_saved_before_it(
    emulator: RunningEmulator, raw: Raw
) -> None:
    customer = await raw.customer()
    first = await raw.charge(customer, "day-old")
    emulator.configure(idempotency_ttl_seconds=0.001)
    await asyncio.sleep(0.01)
    again = await raw.charge(customer, "day-old")
    assert "Idempotent-Replayed" not in again.headers
    assert again.body["id"] != first.body["id"]


async def test_key_length_limit(raw: Raw) -> None:
    customer = await raw.customer()
    assert (await raw.charge(customer, "k" * 255)).status == 200
    too_long = await raw.charge(customer, "k" * 256)
    assert too_long.status == 400
    assert "255" in too_long.body["error"]["message"]
    assert len((await raw.ledger())["charges"]) == 1


async def test_keys_are_scoped_per_api_key(raw: Raw) -> None:
    customer = await raw.customer()
    params = {
        "amount": "100",
        "currency": "usd",
        "customer": customer["id"],
        "payment_method": method_of(customer),
        "confirm": "true",
        "allowed_payment_method_types[0]": "card",
    }
    mine = await raw.post("/v1/payment_intents", params, idempotency_key="shared")
    theirs = await raw.post(
        "/v1/payment_intents", params, idempotency_key="shared", key="sk_test_someone_else"
    )
    assert mine.status == theirs.status == 200
    assert "Idempotent-Replayed" not in theirs.headers
    assert mine.body["id"] != theirs.body["id"]


async def test_get_requests_ignore_the_key(raw: Raw) -> None:
    first = await raw.get("/v1/customers", idempotency_key="read")
    await raw.post("/v1/customers", {})
    second = await raw.get("/v1/customers", idempotency_key="read")
    assert len(second.body["data"]) == len(first.body["data"]) + 1


@pytest.mark.parametrize(
    "changed",
    [{"amount": "2000"}, {"metadata[customer_id]": "cust-000002"}],
    ids=["amount", "metadata"],
)
@pytest.mark.parametrize(
    ("card", "answered"), [("pm_card_visa", 200), ("pm_card_chargeCustomerFail", 402)]
)
async def test_a_key_sent_again_with_one_parameter_changed_is_an_idempotency_error(
    raw: Raw, changed: dict[str, str], card: str, answered: int
) -> None:
    """The same parameter names with one value changed, a nested one too, after a charge or
    a decline: replaying the first answer would hide a retry that changed what it charges
    (I3)."""
    customer = await raw.customer(card)
    sent = {"metadata[customer_id]": "cust-000001"}
    assert (await raw.charge(customer, "one-changed", **sent)).status == answered
    again = await raw.charge(customer, "one-changed", **{**sent, **changed})
    assert (again.status, again.body["error"]["type"]) == (400, "idempotency_error")
    assert len((await raw.ledger())["charges"]) == 1


async def test_every_key_past_the_ttl_is_forgotten_and_no_younger_one(
    emulator: RunningEmulator, raw: Raw, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two keys saved together expire together, whichever comes back first, and a key saved
    after them is still replayed: forgetting it would let its retry charge again."""
    clock = Clock()
    monkeypatch.setattr(emulator_module, "time", clock)
    emulator.configure(idempotency_ttl_seconds=0.2)
    customer = await raw.customer()
    await raw.charge(customer, "older-1")
    await raw.charge(customer, "older-2")
    clock.advance(0.15)
    younger = await raw.charge(customer, "younger")
    clock.advance(0.1)
    for key in ("older-2", "older-1"):
        assert "Idempotent-Replayed" not in (await raw.charge(customer, key)).headers, key
    again = await raw.charge(customer, "younger")
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.body["id"] == younger.body["id"]
    assert len((await raw.ledger())["charges"]) == 5

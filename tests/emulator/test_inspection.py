"""/_emulator: health, ledger, request log (I3 evidence, no secrets) and reset."""

from __future__ import annotations

import asyncio
import json

from stripe_emulator import RunningEmulator

from .support import API_KEY, Raw, method_of


async def test_health(raw: Raw) -> None:
    reply = await raw.request("GET", "/_emulator/health", key=None)
    assert (reply.status, reply.body) == (200, {"ok": True})


async def test_ledger_lists_every_charge_in_creation_order(raw: Raw) -> None:
    good = await raw.customer()
    bad = await raw.customer("pm_card_chargeCustomerFail")
    first = await raw.charge(good, "ledger-1", **{"metadata[billing_key]": "a"})
    await raw.charge(bad, "ledger-2")
    legacy = await raw.post(
        "/v1/charges",
        {"amount": "1000", "currency": "gbp", "customer": good["id"], "source": method_of(good)},
    )
    charges = (await raw.ledger())["charges"]
    assert [c["status"] for c in charges] == ["succeeded", "failed", "succeeded"]
    assert charges[0] == {
        "id": first.body["latest_charge"],
        "object": "charge",
        "status": "succeeded",
        "amount": 1999,
        "currency": "usd",
        "customer": good["id"],
        "payment_intent": first.body["id"],
        "payment_method": first.body["payment_method"],
        "metadata": {"billing_key": "a"},
        "idempotency_key": "ledger-1",
        "refunded": False,
        "amount_refunded": 0,
        "failure_code": None,
        "created": charges[0]["created"],
    }
    assert charges[1]["failure_code"] == "card_declined"
    assert charges[2]["id"] == legacy.body["id"]
    assert charges[2]["payment_intent"] is None
    assert charges[2]["idempotency_key"] is None


async def test_request_log_records_every_v1_request_without_the_key(raw: Raw) -> None:
    customer = await raw.customer()
    await raw.charge(customer, "logged", **{"metadata[billing_key]": "cus:2026-12"})
    await raw.get("/v1/customers", {"limit": "1"})
    await raw.get("/v1/customers", key=None)
    log = await raw.request_log()
    assert [(e["method"], e["path"], e["status"]) for e in log] == [
        ("POST", "/v1/customers", 200),
        ("POST", "/v1/payment_intents", 200),
        ("GET", "/v1/customers", 200),
        ("GET", "/v1/customers", 401),
    ]
    charge = log[1]
    assert charge["idempotency_key"] == "logged"
    assert charge["api_key_suffix"] == API_KEY[-4:]
    assert charge["params"]["metadata"] == {"billing_key": "cus:2026-12"}
    assert charge["params"]["amount"] == "1999"
    assert log[2]["params"] == {"limit": "1"}
    assert log[3]["api_key_suffix"] is None
    assert API_KEY not in json.dumps(log)


async def test_reset_clears_state_and_keeps_the_config(emulator: RunningEmulator, raw: Raw) -> None:
    customer = await raw.customer()
    await raw.charge(customer, "before-reset")
    emulator.configure(error_before_commit=1, seed=5)
    await raw.charge(customer, "faulted")
    emulator.configure(error_before_commit=0)
    reply = await raw.request("POST", "/_emulator/reset", key=None)
    assert reply.status == 200
    assert reply.body["config"]["seed"] == 5
    assert (await raw.get(f"/v1/customers/{customer['id']}")).status == 404
    ledger = await raw.ledger()
    assert ledger["charges"] == []
    assert set(ledger["faults_injected"].values()) == {0}
    assert [e["path"] for e in await raw.request_log()] == [f"/v1/customers/{customer['id']}"]
    fresh = await raw.customer()
    again = await raw.charge(fresh, "before-reset")
    assert again.status == 200 and "Idempotent-Replayed" not in again.headers


async def test_reset_body_changes_the_config(raw: Raw) -> None:
    await raw.faults(latency_ms=7)
    async with raw.session.post(
        raw.url + "/_emulator/reset", json={"latency_ms": 0, "rate_limit_rps": 50}
    ) as response:
        body = await response.json()
    assert (body["config"]["latency_ms"], body["config"]["rate_limit_rps"]) == (0, 50)
    async with raw.session.post(raw.url + "/_emulator/reset", data=b"[1]") as response:
        assert response.status == 400


async def test_reset_while_a_request_is_executing(emulator: RunningEmulator, raw: Raw) -> None:
    customer = await raw.customer()
    emulator.configure(latency_ms=200)
    in_flight = asyncio.create_task(raw.charge(customer, "across-reset"))
    await asyncio.sleep(0.05)
    emulator.state.reset({"latency_ms": 0})
    assert (await in_flight).status == 200
    # The new state knows nothing of the old request: neither its key nor its charge.
    assert (await raw.ledger())["charges"] == []
    assert (await raw.charge(customer, "across-reset")).status == 400  # customer is gone

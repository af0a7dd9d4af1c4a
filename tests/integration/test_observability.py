"""A real run, observed as an operator would: the worker's metrics endpoints scraped over HTTP,
and its log lines read as JSON."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from temporalio import workflow
from temporalio.client import Client
from temporalio.worker import Replayer, Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from billing import logs, metrics, operations
from billing.config import ObservabilitySettings, TemporalSettings
from billing.models import OperatorRequest
from billing.periods import Period
from billing.redact import redact
from billing.runs import start_period
from billing.stripe_client import stripe_session
from billing.temporal_client import connect
from tests.conftest import free_port
from tests.integration.harness import Harness
from tests.waiting import eventually
from worker import create_worker, direct_access

PERIOD = Period(2026, 11)
# Shaped like a vault key, so the vault's refusal path runs against the emulator (which only
# accepts sk_test_ keys) and the log guard has something to catch.
PLANTED_KEY = "vk_planted0secret0key_do_not_log"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def declines_second(index: int) -> str:
    return "pm_card_chargeCustomerFail" if index == 2 else "pm_card_visa"


async def scrape(url: str) -> tuple[Samples, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        response.raise_for_status()
        text = await response.text()
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return samples, text


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """Every record of the process at INFO, formatted as the worker's LOG_FORMAT=json."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.formatter("json"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield stream
    root.removeHandler(handler)
    root.setLevel(level)


def json_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@asynccontextmanager
async def billing_endpoint() -> AsyncIterator[str]:
    port = free_port()
    server = metrics.serve(ObservabilitySettings(billing_metrics_port=port))
    assert server is not None
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        server.shutdown()
        server.server_close()


async def test_metrics_endpoints_move_with_a_run(harness: Harness) -> None:
    customers = await harness.seed(6, card_for=declines_second)
    charged = [c for i, c in enumerate(customers, start=1) if i != 2]
    temporal_port = free_port()
    runtime = metrics.temporal_runtime(ObservabilitySettings(temporal_metrics_port=temporal_port))
    address = harness.client.service_client.config.target_host
    client = await connect(
        TemporalSettings(address=address, namespace=harness.client.namespace), runtime
    )
    async with billing_endpoint() as billing_url:
        before, _ = await scrape(billing_url)
        async with create_worker(
            client,
            harness.task_queue,
            harness.pool,
            direct_access(harness.stripe, harness.settings),
            harness.settings,
        ):
            handle = await start_period(client, PERIOD, harness.task_queue)
            during = asyncio.create_task(scrape(billing_url))
            summary = await handle.result()
            await during  # the endpoint answers while the worker charges
            temporal, temporal_text = await scrape(f"http://127.0.0.1:{temporal_port}/metrics")
        after, _ = await scrape(billing_url)
    assert (summary.charged, summary.failed) == (5, 1)
    assert delta(before, after, "billing_charges_total", outcome="charged") == 5
    assert delta(before, after, "billing_charges_total", outcome="declined") == 1
    assert delta(before, after, "billing_charged_amount_cents_total", currency="usd") == sum(
        c.amount_cents for c in charged
    )
    assert delta(before, after, "billing_claim_to_charge_seconds_count") == 5
    assert delta(before, after, "billing_vault_refusals_total", code="http_401") == 0
    # The SDK's own metrics, with Prometheus's suffixes, for this worker's task queue.
    assert any(name.startswith("temporal_") and name.endswith("_total") for name, _ in temporal)
    assert f'task_queue="{harness.task_queue}"' in temporal_text
    assert "temporal_activity_execution_latency_seconds_bucket" in temporal_text
    assert "\ntemporal_workflow_completed_total{" in temporal_text


async def test_a_charge_retried_after_its_record_failed_counts_its_money_once(
    harness: Harness,
) -> None:
    (customer,) = await harness.seed(1)
    # The ledger refuses the first record of a charge: the attempt fails after Stripe took
    # the charge, and its retry gets the same charge back from Stripe's replay.
    await harness.pool.execute(
        """
        CREATE SEQUENCE charge_records;
        CREATE FUNCTION refuse_first_charge_record() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF nextval('charge_records') = 1 THEN
                RAISE EXCEPTION 'the ledger is briefly unavailable';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER refuse_first_charge_record BEFORE UPDATE ON billing_runs FOR EACH ROW
            WHEN (NEW.status = 'charged') EXECUTE FUNCTION refuse_first_charge_record();
        """
    )
    async with billing_endpoint() as billing_url:
        before, _ = await scrape(billing_url)
        async with harness.running_worker():
            handle = await start_period(harness.client, PERIOD, harness.task_queue)
            summary = await handle.result()
        after, _ = await scrape(billing_url)
    assert summary.charged == 1
    assert await harness.pool.fetchval("SELECT last_value FROM charge_records") == 2
    assert len(await harness.charges()) == 1
    assert delta(before, after, "billing_charges_total", outcome="charged") == 2
    assert (
        delta(before, after, "billing_charged_amount_cents_total", currency="usd")
        == customer.amount_cents
    )
    assert delta(before, after, "billing_claim_to_charge_seconds_count") == 1


async def test_a_refused_key_is_counted_and_never_logged(
    harness: Harness, json_log: io.StringIO
) -> None:
    (customer,) = await harness.seed(1)
    settings = harness.settings.model_copy(update={"stripe_api_key": SecretStr(PLANTED_KEY)})
    async with billing_endpoint() as billing_url, stripe_session(settings) as refused_api:
        before, _ = await scrape(billing_url)
        worker = create_worker(
            harness.client,
            harness.task_queue,
            harness.pool,
            direct_access(refused_api, settings),
            settings,
        )
        async with worker:
            handle = await start_period(harness.client, PERIOD, harness.task_queue)
            # A refused key stops the whole period (it pauses itself) instead of failing it.
            await eventually(lambda: harness.in_state(PERIOD, "paused"), timeout=30)
            after, _ = await scrape(billing_url)
            await operations.control(
                harness.client, PERIOD, "cancel", OperatorRequest(reason="bad key", operator="ops")
            )
            summary = await handle.result()
    assert (summary.charged, summary.failed, summary.cancelled) == (0, 0, 1)
    assert delta(before, after, "billing_charges_total", outcome="refused") >= 1
    assert delta(before, after, "billing_vault_refusals_total", code="http_401") >= 1
    text = json_log.getvalue()
    assert PLANTED_KEY not in text and redact(text) == text
    (refusal,) = [line for line in json_lines(json_log) if line.get("event") == "refusal"]
    assert (refusal["customer_id"], refusal["outcome"]) == (customer.customer_id, "refused")
    assert refusal["code"] == "authentication_failed"


async def test_claim_charge_and_record_are_json_lines_with_their_fields(
    harness: Harness, json_log: io.StringIO
) -> None:
    customers = await harness.seed(3)
    async with harness.running_worker():
        await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    lines = json_lines(json_log)  # every line parses
    api_key = harness.settings.stripe_api_key.get_secret_value()
    assert all(api_key not in json.dumps(line) for line in lines)
    assert all(redact(json.dumps(line)) == json.dumps(line) for line in lines)
    keys = {r["customer_id"]: r["idempotency_key"] for r in await harness.ledger_rows(str(PERIOD))}
    for customer in customers:
        events = [line for line in lines if line.get("customer_id") == customer.customer_id]
        assert [e["event"] for e in events] == ["claim", "charge", "record"]
        for event in events:
            assert event["period"] == str(PERIOD)
            assert event["workflow_id"] == f"billing-{PERIOD}-{customer.customer_id}"
            assert event["key_prefix"] == keys[customer.customer_id][:8]
            assert {"time", "level", "logger", "message"} <= set(event)
        assert events[1]["outcome"] == "charged" and events[1]["charge_id"]
        assert events[2]["status"] == "charged"


@workflow.defn(name="SignalLogProbe")
class SignalLogProbe:
    def __init__(self) -> None:
        self._reason: str | None = None

    @workflow.signal
    def stop(self, reason: str) -> None:
        logs.log_signal("stop", period=str(PERIOD), reason=reason)
        self._reason = reason

    @workflow.run
    async def run(self) -> str:
        await workflow.wait_condition(lambda: self._reason is not None)
        return self._reason or ""


async def test_a_signal_is_logged_once_not_on_replay(
    temporal_client: Client, json_log: io.StringIO
) -> None:
    runner = SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules("billing", "tests")
    )
    async with Worker(
        temporal_client,
        task_queue="signal-probe",
        workflows=[SignalLogProbe],
        workflow_runner=runner,
    ):
        handle = await temporal_client.start_workflow(
            SignalLogProbe.run, id="signal-probe", task_queue="signal-probe"
        )
        await handle.signal(SignalLogProbe.stop, "operator asked")
        assert await handle.result() == "operator asked"
    # Logged as it was received, not when its history is replayed.
    received = [line for line in json_lines(json_log) if line.get("event") == "signal"]
    history = await handle.fetch_history()
    await Replayer(workflows=[SignalLogProbe], workflow_runner=runner).replay_workflow(history)
    signals = [line for line in json_lines(json_log) if line.get("event") == "signal"]
    assert len(signals) == 1 and signals == received
    assert signals[0]["signal"] == "stop" and signals[0]["workflow_id"] == "signal-probe"
    assert signals[0]["logger"] == "billing.signals"
    assert (signals[0]["period"], signals[0]["reason"]) == (str(PERIOD), "operator asked")

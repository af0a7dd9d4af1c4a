"""billing.metrics: Prometheus names and what each helper counts."""

from __future__ import annotations

import re
import socket
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import stripe
from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric

from billing import metrics
from billing.config import ObservabilitySettings
from tests.conftest import free_port
from tests.prometheus import metric_value

SNAKE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")


def billing_metrics() -> list[Metric]:
    return [m for m in REGISTRY.collect() if m.name.startswith("billing_")]


def test_names_follow_prometheus_conventions() -> None:
    families = {m.name: m for m in billing_metrics()}
    assert set(families) == {
        "billing_charges",
        "billing_charged_amount_cents",
        "billing_vault_refusals",
        "billing_claim_to_charge_seconds",
        "billing_worker_event_loop_lag_seconds",
        "billing_unbilled_firings",
        "billing_followed_schedule_gone",
        "billing_runs_ended_unclosed",
        "billing_schedule_checked_timestamp_seconds",
    }
    for family in families.values():
        assert SNAKE.fullmatch(family.name) and family.documentation
        for sample in family.samples:
            assert all(SNAKE.fullmatch(label) for label in sample.labels if label != "le")
        if family.type == "counter":
            exposed = {s.name for s in family.samples}
            assert f"{family.name}_total" in exposed or not family.samples
        else:
            assert family.type in ("histogram", "gauge") and family.name.endswith("_seconds")


def charge_samples() -> list[float]:
    return [
        metric_value("billing_charges_total", outcome="charged"),
        metric_value("billing_charged_amount_cents_total", currency="eur"),
        metric_value("billing_claim_to_charge_seconds_count"),
        metric_value("billing_claim_to_charge_seconds_bucket", le="5.0"),
        metric_value("billing_claim_to_charge_seconds_bucket", le="2.5"),
    ]


def moved(before: list[float]) -> list[float]:
    return [a - b for a, b in zip(charge_samples(), before, strict=True)]


def test_an_attempt_counts_no_money() -> None:
    before = charge_samples()
    metrics.charge_attempted("charged")
    assert moved(before) == [1, 0, 0, 0, 0]


def test_a_recorded_charge_counts_its_money_once() -> None:
    before = charge_samples()
    metrics.charge_recorded(1250, "EUR", datetime.now(UTC) - timedelta(seconds=3))
    # Observed as the 3 s it took: not 0 (in every bucket), as a reversed difference would be.
    assert moved(before) == [0, 1250, 1, 1, 0]


def refusal(kind: type[stripe.StripeError], status: int, code: str | None) -> stripe.StripeError:
    """The error stripe-python raises for this answer: only 400s and 402s carry `code`."""
    body = {"error": {"type": "invalid_request_error", "code": code, "message": "refused"}}
    if issubclass(kind, stripe.CardError | stripe.InvalidRequestError):
        return kind("refused", None, code, http_status=status, json_body=body)
    return kind("refused", http_status=status, json_body=body)


@pytest.mark.parametrize(
    ("error", "label", "counted"),
    [
        (refusal(stripe.CardError, 402, "spend_cap_exceeded"), "spend_cap_exceeded", True),
        (refusal(stripe.AuthenticationError, 401, "vault_key_revoked"), "vault_key_revoked", True),
        (refusal(stripe.AuthenticationError, 401, None), "http_401", True),
        (
            refusal(stripe.PermissionError, 403, "endpoint_not_allowed"),
            "endpoint_not_allowed",
            True,
        ),
        (refusal(stripe.CardError, 402, "card_declined"), "card_declined", False),
        (refusal(stripe.InvalidRequestError, 400, "parameter_invalid"), "parameter_invalid", False),
        (refusal(stripe.APIError, 500, None), "http_500", False),
        # A label value is bounded, whatever code an answer carries.
        (refusal(stripe.AuthenticationError, 401, "long" * 40), ("long" * 40)[:64], True),
    ],
)
def test_vault_refusals_count_401_403_and_the_spend_cap(
    error: stripe.StripeError, label: str, counted: bool
) -> None:
    before = metric_value("billing_vault_refusals_total", code=label)
    metrics.count_vault_refusal(error)
    assert metric_value("billing_vault_refusals_total", code=label) - before == int(counted)


@pytest.fixture
def served() -> Iterator[str]:
    port = free_port()
    server = metrics.serve(ObservabilitySettings(billing_metrics_port=port))
    assert server is not None
    yield f"http://127.0.0.1:{port}/metrics"
    server.shutdown()
    server.server_close()


def test_the_endpoint_serves_the_exposition_format(served: str) -> None:
    metrics.charge_attempted("declined")
    with urllib.request.urlopen(served, timeout=5) as response:  # noqa: S310 - http only
        text = response.read().decode()
    assert 'billing_charges_total{outcome="declined"}' in text
    assert "# TYPE billing_claim_to_charge_seconds histogram" in text


def test_both_endpoints_listen_on_metrics_host_only() -> None:
    """Bound to every interface, they would show the worker's metrics to its whole network
    whatever METRICS_HOST says. 127.0.0.2 is loopback too, but not 127.0.0.1."""
    billing_port, temporal_port = free_port(), free_port()
    settings = ObservabilitySettings(
        metrics_host="127.0.0.2",
        billing_metrics_port=billing_port,
        temporal_metrics_port=temporal_port,
    )
    server = metrics.serve(settings)
    assert server is not None
    try:
        runtime = metrics.temporal_runtime(settings)  # serves while it is referenced
        for port in (billing_port, temporal_port):
            url = f"http://127.0.0.2:{port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                assert response.status == 200
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert runtime is not None
    finally:
        server.shutdown()
        server.server_close()


def test_ports_left_unset_serve_nothing() -> None:
    fields = ObservabilitySettings.model_fields
    assert fields["billing_metrics_port"].default is None
    assert fields["temporal_metrics_port"].default is None
    settings = ObservabilitySettings(billing_metrics_port=None, temporal_metrics_port=None)
    assert metrics.serve(settings) is None


def test_a_schedule_watched_shows_its_alert_counters_at_0_before_they_count() -> None:
    """A series first seen at 1 is no increase to Prometheus: the first alert would be lost."""
    names = ("billing_unbilled_firings_total", "billing_followed_schedule_gone_total")
    labels = {"schedule": "watched-monthly"}
    assert [REGISTRY.get_sample_value(n, labels) for n in names] == [None, None]
    metrics.watch_schedule("watched-monthly")
    assert [REGISTRY.get_sample_value(n, labels) for n in names] == [0.0, 0.0]
    metrics.count_unbilled_firing("watched-monthly")
    assert REGISTRY.get_sample_value(names[0], labels) == 1.0


def test_a_schedule_id_made_by_hand_is_labelled_redacted_and_cut() -> None:
    """A reconciliation made with Temporal's own tools may follow any text: a key-shaped id
    reached the label as it was (helper-139's F1)."""
    key = "sk_live_" + "A1b2C3d4E5f6G7h8J9k0"
    metrics.watch_schedule(f"made-by-hand-{key}")
    labels = {"schedule": "made-by-hand-[redacted key]"}
    assert REGISTRY.get_sample_value("billing_unbilled_firings_total", labels) == 0.0
    metrics.count_followed_schedule_gone(f"made-by-hand-{key}")
    assert REGISTRY.get_sample_value("billing_followed_schedule_gone_total", labels) == 1.0
    assert not [s for m in billing_metrics() for s in m.samples if key in str(s.labels)]
    metrics.schedule_checked("x" * 5_000)
    cut = {"schedule": "x" * metrics.SCHEDULE_LABEL_MAX + "..."}
    assert REGISTRY.get_sample_value("billing_schedule_checked_timestamp_seconds", cut)

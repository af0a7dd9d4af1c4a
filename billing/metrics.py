"""The worker's Prometheus metrics: its own on BILLING_METRICS_PORT, Temporal's SDK metrics on
TEMPORAL_METRICS_PORT. Each port is off while unset.

Two endpoints, because the SDK's exporter lives in Temporal's Rust core and serves only what the
core records; our counters are plain prometheus_client ones that work (and are tested) without a
Temporal runtime. Counters count events in this process: Prometheus sums them across workers.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from wsgiref.simple_server import WSGIServer

import stripe
from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app, start_http_server
from temporalio.runtime import (
    LogForwardingConfig,
    LoggingConfig,
    PrometheusConfig,
    Runtime,
    TelemetryConfig,
    TelemetryFilter,
)

from billing.config import ObservabilitySettings
from billing.liveness import Heartbeat, with_health
from billing.models import SPEND_CAP_EXCEEDED_CODE
from billing.redact import shown_cut
from billing.stripe_client import error_code

CHARGES = Counter(
    "billing_charges_total",
    "Charge attempts by outcome: charged, declined, refused (by Stripe or the vault) or"
    " error (no definitive answer; Temporal retries with the same key).",
    ["outcome"],
)
CHARGED_AMOUNT = Counter(
    "billing_charged_amount_cents_total",
    "Money charged, in the currency's minor unit: at most once per charge, when the ledger"
    " records it (by the bill or by reconciliation), however many attempts Stripe answered"
    " for it. A record whose commit's answer was lost is not counted.",
    ["currency"],
)
VAULT_REFUSALS = Counter(
    "billing_vault_refusals_total",
    "Charges the vault refused: 402 spend_cap_exceeded, 401 (unknown, revoked or expired key)"
    " and 403 (endpoint not allowed), by the refusal's code.",
    ["code"],
)
CLAIM_TO_CHARGE = Histogram(
    "billing_claim_to_charge_seconds",
    "From a customer's claim to the ledger's record of its charge, retries included.",
    # Most charges land within seconds; retries, pauses and resumed claims take far longer.
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600, 6 * 3600, 24 * 3600),
)
UNBILLED_FIRINGS = Counter(
    "billing_unbilled_firings_total",
    "Daily reconciliations that found a firing of their billing schedule, an hour to two"
    " months past, left its month with no run: paused, missed in a Temporal outage past the"
    " catch-up window, or its launch ended early. Alert on any increase.",
    ["schedule"],
)
FOLLOWED_SCHEDULE_GONE = Counter(
    "billing_followed_schedule_gone_total",
    "Daily reconciliations whose billing schedule is gone (deleted, or replaced by one that"
    " does not bill): nothing bills the months it billed. Alert on any increase.",
    ["schedule"],
)
RUNS_ENDED_UNCLOSED = Counter(
    "billing_runs_ended_unclosed_total",
    "Reconciliations that found due customers of a period no run claimed, its last run having"
    " ended before its close (terminated, failed, timed out, gone from Temporal) with no"
    " cancel: no run bills them until it is run again. Alert on any increase.",
)
SCHEDULE_CHECKED = Gauge(
    "billing_schedule_checked_timestamp_seconds",
    "When a daily reconciliation of this worker process last checked its billing schedule's"
    " firings (Unix time). The two counters above stay at 0 when no check runs at all (the"
    " launcher's workflow broken, the reconciliation schedule paused or gone, no worker):"
    " alert when the newest across workers is more than a day and a few hours old.",
    ["schedule"],
)
# A label value is bounded: a code comes from the vault or Stripe, not from our callers.
_MAX_CODE_LENGTH = 64


def charge_attempted(outcome: str) -> None:
    """One attempt's answer; a retry that Stripe replays is counted again."""
    CHARGES.labels(outcome=outcome).inc()


def charge_recorded(amount_cents: int, currency: str, claimed_at: datetime) -> None:
    """A charge the ledger has just recorded: its money, counted once."""
    CHARGED_AMOUNT.labels(currency=currency.lower()).inc(amount_cents)
    since_claim = datetime.now(UTC) - claimed_at
    CLAIM_TO_CHARGE.observe(max(since_claim.total_seconds(), 0.0))


# Characters of a schedule's id kept in a label.
SCHEDULE_LABEL_MAX = 200


def _schedule(schedule_id: str) -> str:
    """A schedule's id as a label: `schedule create` checks the ids it makes, but one made
    with Temporal's own tools may be followed under any text, a key's too."""
    return shown_cut(schedule_id, SCHEDULE_LABEL_MAX)


def watch_schedule(schedule_id: str) -> None:
    """Show the schedule's alert counters at 0 before they count anything: a series first
    seen at 1 is no increase to Prometheus (`increase()`), and its first alert is lost."""
    UNBILLED_FIRINGS.labels(schedule=_schedule(schedule_id))
    FOLLOWED_SCHEDULE_GONE.labels(schedule=_schedule(schedule_id))


def count_run_ended_unclosed() -> None:
    RUNS_ENDED_UNCLOSED.inc()


def schedule_checked(schedule_id: str) -> None:
    SCHEDULE_CHECKED.labels(schedule=_schedule(schedule_id)).set_to_current_time()


def count_unbilled_firing(schedule_id: str) -> None:
    UNBILLED_FIRINGS.labels(schedule=_schedule(schedule_id)).inc()


def count_followed_schedule_gone(schedule_id: str) -> None:
    FOLLOWED_SCHEDULE_GONE.labels(schedule=_schedule(schedule_id)).inc()


def count_vault_refusal(exc: stripe.StripeError) -> None:
    """Count a 401, a 403 or a 402 spend_cap_exceeded: what the vault answers when it refuses
    a request before forwarding it."""
    code = error_code(exc)
    if exc.http_status in (401, 403) or (
        exc.http_status == 402 and code == SPEND_CAP_EXCEEDED_CODE
    ):
        VAULT_REFUSALS.labels(code=(code or f"http_{exc.http_status}")[:_MAX_CODE_LENGTH]).inc()


def serve(settings: ObservabilitySettings, heartbeat: Heartbeat | None = None) -> WSGIServer | None:
    """Serve the billing metrics on BILLING_METRICS_PORT from a daemon thread, with `/health`
    when given the loop's `heartbeat`; the server is returned for shutdown(), None while the
    port is unset."""
    if settings.billing_metrics_port is None:
        return None
    server, _ = start_http_server(settings.billing_metrics_port, settings.metrics_host)
    if heartbeat is not None:
        server.set_app(with_health(make_wsgi_app(), heartbeat))
    return server


def temporal_runtime(settings: ObservabilitySettings, core_level: str = "WARN") -> Runtime:
    """The process's Temporal runtime: the SDK core's log lines from `core_level` up go
    through Python's logging (the project's format and redaction; by default the core prints
    coloured text to stdout), and its metrics are exported on TEMPORAL_METRICS_PORT while
    that is set."""
    core_logs = LoggingConfig(
        filter=TelemetryFilter(core_level=core_level, other_level="ERROR"),
        forwarding=LogForwardingConfig(logger=logging.getLogger("temporalio.core")),
    )
    prometheus = None
    if settings.temporal_metrics_port is not None:
        prometheus = PrometheusConfig(
            bind_address=f"{settings.metrics_host}:{settings.temporal_metrics_port}",
            # Prometheus conventions: `_total` counters, units as suffixes, seconds.
            counters_total_suffix=True,
            unit_suffix=True,
            durations_as_seconds=True,
        )
    return Runtime(telemetry=TelemetryConfig(logging=core_logs, metrics=prometheus))

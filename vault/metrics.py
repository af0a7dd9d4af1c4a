"""The vault's Prometheus metrics, served at GET /metrics: one count per audited request."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

from vault.store import AuditRecord

REQUESTS = Counter(
    "vault_requests_total",
    "Proxied requests by decision (forwarded, or the refusal's kind), as in the audit log.",
    ["decision"],
)
REFUSALS = Counter(
    "vault_refusals_total",
    "Requests the vault answered itself, by refusal code (e.g. spend_cap_exceeded); the"
    " admin API's refused tokens too.",
    ["code"],
)
LATE_WRITES = Counter(
    "vault_late_writes_total",
    "Writes (settle, audit) a database outage held past the client's wait, by how they"
    " ended: deferred behind the answer, then landed or lost.",
    ["kind", "result"],
)
DURATION = Histogram(
    "vault_request_duration_seconds",
    "Time the vault spent on a proxied request, the upstream call included.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


def observe(record: AuditRecord) -> None:
    REQUESTS.labels(decision=record.decision).inc()
    if record.refusal_code is not None:
        REFUSALS.labels(code=record.refusal_code).inc()
    DURATION.observe(record.latency_ms / 1000)


async def handle(request: web.Request) -> web.Response:
    response = web.Response(body=generate_latest())
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return response

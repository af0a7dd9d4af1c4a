"""Reaching Temporal over TLS, as Temporal Cloud asks: the worker and the starter find the
server's CA and their client certificate in Temporal's own TEMPORAL_TLS_* variables."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme

from billing.config import TemporalSettings
from billing.errors import ServiceUnavailableError
from billing.periods import Period
from billing.runs import start_period
from billing.temporal_client import connect
from tests.integration.harness import Harness
from tests.integration.invariants import assert_billed_once
from tests.integration.tls_front import SERVER_NAME, tls_front

PERIOD = Period(2026, 12)


def trust(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, server_ca: trustme.CA) -> None:
    ca = tmp_path / "server-ca.pem"
    server_ca.cert_pem.write_to_path(str(ca))
    monkeypatch.setenv("TEMPORAL_TLS_SERVER_CA_CERT_PATH", str(ca))
    monkeypatch.setenv("TEMPORAL_TLS_SERVER_NAME", SERVER_NAME)


def present(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, client_ca: trustme.CA) -> None:
    leaf = client_ca.issue_cert("billing-worker")
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    monkeypatch.setenv("TEMPORAL_TLS_CLIENT_CERT_PATH", str(cert))
    monkeypatch.setenv("TEMPORAL_TLS_CLIENT_KEY_PATH", str(key))


async def test_a_period_is_billed_over_mutual_tls(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    customers = await harness.seed(5)
    server_ca, client_ca = trustme.CA(), trustme.CA()
    trust(monkeypatch, tmp_path, server_ca)
    present(monkeypatch, tmp_path, client_ca)
    plain = harness.client.service_client.config.target_host
    async with tls_front(plain, server_ca, client_ca) as front:
        client = await connect(TemporalSettings(address=front, namespace=harness.client.namespace))
        # worker.py reads the same variables from its environment.
        harness.worker_process(TEMPORAL_ADDRESS=front)
        summary = await (await start_period(client, PERIOD, harness.task_queue)).result()
    assert summary.charged == 5
    await assert_billed_once(harness, str(PERIOD), customers)


async def test_without_a_client_certificate_the_server_is_not_reached(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    server_ca, client_ca = trustme.CA(), trustme.CA()
    trust(monkeypatch, tmp_path, server_ca)
    plain = harness.client.service_client.config.target_host
    async with tls_front(plain, server_ca, client_ca) as front:
        with pytest.raises(ServiceUnavailableError, match=f"cannot reach Temporal at {front}"):
            await connect(TemporalSettings(address=front, namespace=harness.client.namespace))

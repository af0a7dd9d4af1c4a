"""One way to reach Temporal, with the data converter every part of the project uses.

Credentials are read the way Temporal's CLI and SDKs read them (`temporalio.envconfig`), so a
Temporal Cloud namespace needs no code: `TEMPORAL_API_KEY`, or mTLS with
`TEMPORAL_TLS_CLIENT_CERT_PATH` and `TEMPORAL_TLS_CLIENT_KEY_PATH` (and
`TEMPORAL_TLS_SERVER_CA_CERT_PATH`, `TEMPORAL_TLS_SERVER_NAME` for a private CA), or a profile
(`TEMPORAL_PROFILE`, default "default") of the TOML file `TEMPORAL_CONFIG_FILE` names. Unlike
the CLI, a profile file is read only when one of those two is set: a developer's own profile
in their home directory must not point a billing worker at another server.
"""

from __future__ import annotations

import functools
import os
import re
from datetime import timedelta
from typing import Any

from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import (
    Client,
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
    WorkflowHandle,
)
from temporalio.envconfig import ClientConfigProfile, ClientConnectConfig
from temporalio.runtime import Runtime
from temporalio.service import RPCError, RPCStatusCode

from billing.config import ObservabilitySettings, TemporalSettings, host_port, namespace_name
from billing.data_converter import DATA_CONVERTER
from billing.errors import ConfigurationError, ServiceUnavailableError
from billing.metrics import temporal_runtime

NAMESPACE_CHECK_TIMEOUT = timedelta(seconds=10)
# How a workflow ends without completing (nor continuing as new): the ends after which a
# start under ALLOW_DUPLICATE_FAILED_ONLY may run its ID again.
ENDED_UNCOMPLETED = frozenset(
    {
        WorkflowExecutionStatus.FAILED,
        WorkflowExecutionStatus.TERMINATED,
        WorkflowExecutionStatus.CANCELED,
        WorkflowExecutionStatus.TIMED_OUT,
    }
)


def connect_config(settings: TemporalSettings) -> ClientConnectConfig:
    """Where and how to connect. `settings` (given, or TEMPORAL_ADDRESS and
    TEMPORAL_NAMESPACE) name the server and namespace; a profile's address and namespace
    serve when neither is set, and the local dev server's when nothing is."""
    named = any(os.environ.get(name) for name in ("TEMPORAL_CONFIG_FILE", "TEMPORAL_PROFILE"))
    try:
        profile = ClientConfigProfile.load(disable_file=not named)
        config = profile.to_client_connect_config()
    except FileNotFoundError as exc:
        raise ConfigurationError(
            f"Temporal TLS file {exc.filename} does not exist (TEMPORAL_TLS_*_PATH or the"
            " profile's tls section)"
        ) from None
    except RuntimeError as exc:
        # Only the first line: a TOML error goes on to quote the file, and it may hold a key.
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigurationError(
            f"cannot load the Temporal client profile (TEMPORAL_PROFILE, TEMPORAL_CONFIG_FILE):"
            f" {first_line}"
        ) from None
    chosen = settings.model_fields_set
    if "address" in chosen or "target_host" not in config:
        config["target_host"] = settings.address
    if "namespace" in chosen or "namespace" not in config:
        config["namespace"] = settings.namespace
    # A profile's are checked as the settings' are: errors name them.
    for name, check, value in (
        ("address", host_port, config["target_host"]),
        ("namespace", namespace_name, config["namespace"]),
    ):
        try:
            check(value)
        except ValueError as exc:
            raise ConfigurationError(f"the Temporal {name} {exc}") from None
    return config


@functools.cache
def _tools_runtime() -> Runtime:
    """The runtime of the CLI and other tools: the SDK core's errors go to stderr through
    Python's logging, rather than to stdout, where the core's default prints them and would
    corrupt a `--json` answer. Its warnings are left out: while Temporal is away they are
    its retries, about 30 a minute, and a waiting command says so itself. No metrics: the
    worker exports them on its port."""
    return temporal_runtime(ObservabilitySettings(temporal_metrics_port=None), "ERROR")


async def connect(settings: TemporalSettings, runtime: Runtime | None = None) -> Client:
    """`runtime` carries the worker's telemetry (SDK metrics); None is the tools' runtime."""
    config = connect_config(settings)
    address = config["target_host"]
    try:
        client = await Client.connect(
            data_converter=DATA_CONVERTER, runtime=runtime or _tools_runtime(), **config
        )
    except RuntimeError as exc:
        raise ServiceUnavailableError(
            f"cannot reach Temporal at {address} (TEMPORAL_ADDRESS, or the profile's address):"
            f" {unreachable_because(exc)};"
            " for the local stack run `python -m devstack up`"
        ) from None
    except ValueError as exc:  # e.g. `[1::2::3]:7233`, shaped as host:port
        raise ConfigurationError(
            f"the Temporal address {address!r} (TEMPORAL_ADDRESS, or the profile's address): {exc}"
        ) from None
    await _check_namespace(client, address)
    return client


# The SDK core's connect error ends in a debug dump of its causes; the innermost reason is
# the operating system's (`message: "Connection refused"`) or the resolver's (`error: "..."`).
_ROOT_CAUSE = re.compile(r'(?:message|error): "([^"]+)"')


def unreachable_because(exc: RuntimeError) -> str:
    """Why the SDK could not connect, in the words of the root cause."""
    text = str(exc)
    found = _ROOT_CAUSE.findall(text)
    if found:
        return str(found[-1])
    return text.split(": tonic::", 1)[0]


async def _check_namespace(client: Client, address: str) -> None:
    """In a namespace that does not exist every workflow reads as never started, so a status
    would say a billed period never ran, and a cancel that there is no run to cancel."""
    try:
        await client.workflow_service.describe_namespace(
            DescribeNamespaceRequest(namespace=client.namespace),
            retry=True,
            timeout=NAMESPACE_CHECK_TIMEOUT,
        )
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise ConfigurationError(
                f"Temporal at {address} has no namespace {client.namespace!r}"
                " (TEMPORAL_NAMESPACE, or the profile's namespace): check its name"
            ) from None
        if exc.status != RPCStatusCode.PERMISSION_DENIED:
            raise
        # A key scoped to its namespace may not describe it; its own calls say what is wrong.


async def described(
    handle: WorkflowHandle[Any, Any], rpc_timeout: timedelta | None = None
) -> WorkflowExecutionDescription | None:
    """The workflow's latest run (or the handle's run), described; None if Temporal holds no
    run of it (never started, or gone past the namespace's retention)."""
    try:
        return await handle.describe(rpc_timeout=rpc_timeout)
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return None
        raise


async def workflow_status(handle: WorkflowHandle[Any, Any]) -> WorkflowExecutionStatus | None:
    """The workflow's status; None if Temporal holds no run of it."""
    description = await described(handle)
    return None if description is None else description.status

"""The worker skips the SDK's payload walks only where they change nothing."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from collections.abc import Sequence
from typing import cast

import pytest
import temporalio.bridge.worker as sdk_bridge
from temporalio.api.common.v1 import Payload
from temporalio.bridge.proto.workflow_activation import WorkflowActivation
from temporalio.bridge.proto.workflow_completion import WorkflowActivationCompletion
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, ExternalStorage, PayloadCodec

from billing import payload_walks


class Tagging(PayloadCodec):
    """Marks what it encodes and decodes, so a test sees which payloads went through it."""

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [_tagged(p, b"encoded") for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [_tagged(p, b"decoded") for p in payloads]


def _tagged(payload: Payload, tag: bytes) -> Payload:
    out = Payload()
    out.CopyFrom(payload)
    out.metadata["tag"] = tag
    return out


def _json(data: bytes) -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=data)


def _activation() -> WorkflowActivation:
    activation = WorkflowActivation(run_id="run")
    init = activation.jobs.add().initialize_workflow
    init.workflow_type = "CustomerChargeWorkflow"
    init.arguments.append(_json(b'{"period": "2026-12"}'))
    init.headers["h"].CopyFrom(_json(b'"header"'))
    init.memo.fields["m"].CopyFrom(_json(b'"memo"'))
    child = activation.jobs.add().resolve_child_workflow_execution
    child.result.completed.result.CopyFrom(_json(b"1"))
    local = activation.jobs.add().resolve_activity
    local.result.completed.result.CopyFrom(_json(b'{"outcome": "charged"}'))
    activation.jobs.add().signal_workflow.input.append(_json(b"2"))
    return activation


def _completion() -> WorkflowActivationCompletion:
    completion = WorkflowActivationCompletion(run_id="run")
    commands = completion.successful.commands
    start = commands.add()
    start.start_child_workflow_execution.input.append(_json(b'{"customer_id": "c1"}'))
    start.user_metadata.summary.CopyFrom(_json(b'"Charge customer c1"'))
    commands.add().schedule_local_activity.arguments.append(_json(b"3"))
    commands.add().complete_workflow_execution.result.CopyFrom(_json(b"2"))
    return completion


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Restored after the test, whatever it installs.
    monkeypatch.setattr(sdk_bridge, "decode_activation", sdk_bridge.decode_activation)
    monkeypatch.setattr(sdk_bridge, "encode_completion", sdk_bridge.encode_completion)
    assert payload_walks.skip_identity_walks()


async def test_without_codec_or_storage_the_sdk_walks_change_nothing() -> None:
    # What the skip rests on: the SDK's own walks hand every payload back as it was.
    activation, completion = _activation(), _completion()
    sdk_decode, sdk_encode = (
        payload_walks._sdk_decode_activation,
        payload_walks._sdk_encode_completion,
    )

    await sdk_decode(activation, pydantic_data_converter, True, 4)
    await sdk_encode(completion, pydantic_data_converter, True, 4)

    assert activation.SerializeToString() == _activation().SerializeToString()
    assert completion.SerializeToString() == _completion().SerializeToString()


async def test_without_codec_or_storage_the_walks_are_skipped(
    installed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    walked: list[str] = []

    async def sdk_walk(message: object, *args: object) -> None:
        walked.append(type(message).__name__)

    monkeypatch.setattr(payload_walks, "_sdk_decode_activation", sdk_walk)
    monkeypatch.setattr(payload_walks, "_sdk_encode_completion", sdk_walk)
    activation, completion = _activation(), _completion()

    await sdk_bridge.decode_activation(activation, pydantic_data_converter, True, 1)
    await sdk_bridge.encode_completion(completion, pydantic_data_converter, True, 1)

    assert walked == []


async def test_with_a_codec_the_sdk_walks_run(installed: None) -> None:
    converter = dataclasses.replace(pydantic_data_converter, payload_codec=Tagging())
    activation, completion = _activation(), _completion()

    await sdk_bridge.decode_activation(activation, converter, True, 1)
    await sdk_bridge.encode_completion(completion, converter, True, 1)

    decoded = activation.jobs[1].resolve_child_workflow_execution.result.completed.result
    encoded = completion.successful.commands[2].complete_workflow_execution.result
    assert decoded.metadata["tag"] == b"decoded"
    assert encoded.metadata["tag"] == b"encoded"


def test_another_sdk_version_keeps_its_walks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    sdk_decode = payload_walks._sdk_decode_activation
    sdk_encode = payload_walks._sdk_encode_completion
    monkeypatch.setattr(sdk_bridge, "decode_activation", sdk_decode)
    monkeypatch.setattr(sdk_bridge, "encode_completion", sdk_encode)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.0.0")

    with caplog.at_level(logging.WARNING, logger="billing.payload_walks"):
        assert not payload_walks.skip_identity_walks()

    assert sdk_bridge.decode_activation is sdk_decode
    assert sdk_bridge.encode_completion is sdk_encode
    assert "temporalio 9.0.0 is not 1.35.0" in caplog.text


def test_a_converter_with_storage_or_codec_is_walked() -> None:
    assert payload_walks.walks_change_nothing(pydantic_data_converter)
    assert payload_walks.walks_change_nothing(DataConverter.default)
    with_codec = dataclasses.replace(pydantic_data_converter, payload_codec=Tagging())
    assert not payload_walks.walks_change_nothing(with_codec)
    # Only whether storage is set matters here, not what it is.
    storage = cast(ExternalStorage, object())
    with_storage = dataclasses.replace(pydantic_data_converter, external_storage=storage)
    assert not payload_walks.walks_change_nothing(with_storage)

"""Skip the Temporal SDK's payload walks over workflow activations and completions when they
can change nothing.

temporalio walks every workflow activation three times (storage references, storage
retrieval, codec decode) and every completion three times (codec encode, storage, storage
references), in Python, whether or not a payload codec or external storage is configured
(the generic walks came with sdk-python #1075; older versions decoded only with a codec set).
With neither configured, every walk hands each payload back as it was (Nexus system
payloads aside, which the walks open and check; we use no Nexus). The billing worker
spent a seventh of its CPU per customer on them (bench/FINDINGS.md), so a worker whose data
converter has neither skips them; with a codec or storage configured the SDK's own walks run.

What is lost with the walks: the SDK's own error for a payload stored externally reaching a
worker with no storage configured; such a payload then fails only where the converter cannot
decode it. No client of ours stores payloads externally.

Checked against one SDK version: any other keeps its walks, with a warning, until this is
checked against it (or the SDK skips them itself).
"""

from __future__ import annotations

import importlib.metadata
import logging

import temporalio.bridge.worker as sdk_bridge
from temporalio.bridge.proto.workflow_activation import WorkflowActivation
from temporalio.bridge.proto.workflow_completion import WorkflowActivationCompletion
from temporalio.converter import DataConverter
from temporalio.converter._extstore import StorageOperationMetrics

# The version whose walks were read and found to be the identity without codec or storage.
CHECKED_SDK_VERSION = "1.35.0"

log = logging.getLogger("billing.payload_walks")

_sdk_decode_activation = sdk_bridge.decode_activation
_sdk_encode_completion = sdk_bridge.encode_completion


def walks_change_nothing(data_converter: DataConverter) -> bool:
    return data_converter.payload_codec is None and data_converter.external_storage is None


async def decode_activation(
    activation: WorkflowActivation,
    data_converter: DataConverter,
    decode_headers: bool,
    storage_concurrency_limit: int,
) -> StorageOperationMetrics:
    if walks_change_nothing(data_converter):
        return StorageOperationMetrics()
    return await _sdk_decode_activation(
        activation, data_converter, decode_headers, storage_concurrency_limit
    )


async def encode_completion(
    completion: WorkflowActivationCompletion,
    data_converter: DataConverter,
    encode_headers: bool,
    storage_concurrency_limit: int,
) -> StorageOperationMetrics:
    if walks_change_nothing(data_converter):
        return StorageOperationMetrics()
    return await _sdk_encode_completion(
        completion, data_converter, encode_headers, storage_concurrency_limit
    )


def skip_identity_walks() -> bool:
    """Make this process's workflow workers skip the walks that can change nothing (the SDK
    looks its functions up at every activation, so this holds for workers created before
    too); False, with a warning, for an SDK version this was not checked against."""
    version = importlib.metadata.version("temporalio")
    if version != CHECKED_SDK_VERSION:
        log.warning(
            "temporalio %s is not %s, the version billing/payload_walks.py was checked"
            " against: its payload walks run for every workflow activation; check the new"
            " version's walks, then update CHECKED_SDK_VERSION",
            version,
            CHECKED_SDK_VERSION,
        )
        return False
    sdk_bridge.decode_activation = decode_activation
    sdk_bridge.encode_completion = encode_completion
    return True

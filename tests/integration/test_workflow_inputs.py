"""Workflows started by hand (Temporal's CLI or Web UI, a schedule made by hand) with an input
their model refuses: each fails at once, saying which field and why, charges nothing and
holds no ID. Before, the SDK's "Failed decoding arguments" failed the workflow task, retried
for as long as the workflow lived, holding the period's ID (helper-118's F3)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from billing.data_converter import INVALID_WORKFLOW_INPUT
from billing.keys import customer_workflow_id, period_workflow_id, reconcile_workflow_id
from billing.periods import Period
from billing.runs import start_period
from tests.integration.harness import Harness
from tests.integration.invariants import assert_billed_once

PERIOD = Period(2026, 12)


async def _refused(
    harness: Harness, workflow_type: str, workflow_id: str, *payloads: dict[str, Any] | None
) -> ApplicationError:
    """Start the workflow with `payloads` as its input (none, or the one it takes); the
    failure it ends in at once, with no workflow task failed on the way."""
    handle = await harness.client.start_workflow(
        workflow_type, args=payloads, id=workflow_id, task_queue=harness.task_queue
    )
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(handle.result(), timeout=30)
    history = await handle.fetch_history()
    assert not [
        e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
    ]
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError), cause
    assert (cause.type, cause.non_retryable) == (INVALID_WORKFLOW_INPUT, True)
    return cause


@pytest.mark.parametrize(
    ("workflow_type", "workflow_id", "payload", "message"),
    [
        pytest.param(
            "BillingPeriodWorkflow",
            period_workflow_id(PERIOD),
            {"period": "2026-12", "options": {"max_in_flight": 0}},
            "not a valid BillingPeriodInput: options.max_in_flight: Input should be greater"
            " than or equal to 1",
            id="period-out-of-range-option",
        ),
        pytest.param(
            "BillingPeriodWorkflow",
            period_workflow_id(PERIOD),
            {"period": 202612},
            "not a valid BillingPeriodInput: period: Input should be a valid string",
            id="period-wrong-type",
        ),
        pytest.param(
            "BillingPeriodWorkflow",
            period_workflow_id(PERIOD),
            {"period": "2026-12", "amount_cents": 10**9},
            "not a valid BillingPeriodInput: amount_cents: Extra inputs are not permitted",
            id="period-extra-field",
        ),
        pytest.param(
            "BillingPeriodWorkflow",
            period_workflow_id(PERIOD),
            {},
            "not a valid BillingPeriodInput: period: Field required",
            id="period-missing-period",
        ),
        pytest.param(
            "ReconcileWorkflow",
            reconcile_workflow_id(PERIOD),
            {"period": "2026-12", "redrive_timeout_seconds": 10**12},
            "not a valid ReconcileInput: redrive_timeout_seconds: Input should be less than"
            " or equal to 86400",
            id="reconcile-redrive-timeout-past-a-day",
        ),
        pytest.param(
            "ScheduledBillingWorkflow",
            "scheduled-by-hand",
            {"options": {"billing": "sometimes"}},
            "not a valid ScheduledBillingInput: options.billing: Input should be 'arrears' or"
            " 'advance'",
            id="scheduled-bad-mode",
        ),
    ],
)
async def test_a_workflow_started_with_an_input_its_model_refuses_fails_saying_why(
    harness: Harness,
    workflow_type: str,
    workflow_id: str,
    payload: dict[str, Any],
    message: str,
) -> None:
    await harness.seed(2)
    async with harness.running_worker():
        cause = await _refused(harness, workflow_type, workflow_id, payload)
    assert cause.message == f"the workflow's input is {message}; nothing was done"
    assert await harness.money_requests() == 0


async def test_worker_py_fails_a_refused_input_at_once_too(harness: Harness) -> None:
    """worker.py takes its data converter from its client (billing.temporal_client.connect):
    the SDK's own would fail the workflow's task for as long as it lived, holding its ID."""
    harness.worker_process()
    cause = await _refused(
        harness, "BillingPeriodWorkflow", period_workflow_id(PERIOD), {"period": 202612}
    )
    assert "period: Input should be a valid string" in cause.message
    assert await harness.money_requests() == 0


@pytest.mark.parametrize(
    ("workflow_type", "workflow_id", "model", "payload"),
    [
        ("BillingPeriodWorkflow", period_workflow_id(PERIOD), "BillingPeriodInput", {}),
        (
            "CustomerChargeWorkflow",
            customer_workflow_id(PERIOD, "cust-000001"),
            "CustomerChargeInput",
            {"customer_id": "cust-000001"},
        ),
        ("ReconcileWorkflow", reconcile_workflow_id(PERIOD), "ReconcileInput", {}),
        ("ScheduledBillingWorkflow", "scheduled-by-hand", "ScheduledBillingInput", None),
    ],
)
async def test_a_workflow_started_with_two_inputs_fails_saying_it_takes_one(
    harness: Harness,
    workflow_type: str,
    workflow_id: str,
    model: str,
    payload: dict[str, Any] | None,
) -> None:
    """A second input (two `--input`s to `temporal workflow start`, or the Web UI's form)
    failed every workflow task with the call's TypeError, for as long as the workflow lived,
    holding its ID (helper-139's F3)."""
    await harness.seed(2)
    first = None if payload is None else {"period": str(PERIOD), **payload}
    async with harness.running_worker():
        cause = await _refused(harness, workflow_type, workflow_id, first, {})
    assert cause.message == (
        f"the workflow takes one input, a {model}, and 2 were given; nothing was done"
    )
    assert await harness.money_requests() == 0


async def test_a_refused_input_names_a_few_problems_and_counts_the_rest(harness: Harness) -> None:
    """An input with many wrong fields fails with a message of bounded length, which shows
    none of the values given (one may be anything, a key too)."""
    payload = {"period": "2026-12", **{f"field_{n}": "sk_live_" + "x" * 30 for n in range(40)}}
    async with harness.running_worker():
        cause = await _refused(
            harness, "BillingPeriodWorkflow", period_workflow_id(PERIOD), payload
        )
    assert cause.message.endswith("; and 35 more; nothing was done"), cause.message
    assert "sk_live_" not in cause.message
    assert len(cause.message) < 600


async def test_a_customer_workflow_with_a_refused_input_does_not_hold_its_period(
    harness: Harness,
) -> None:
    """A child started by hand under its customer's real ID with a field its model forbids
    (here an amount) fails at once; the period's run then starts the customer's child again
    and bills it once."""
    customers = await harness.seed(2)
    hand_started = customers[0].customer_id
    async with harness.running_worker():
        cause = await _refused(
            harness,
            "CustomerChargeWorkflow",
            customer_workflow_id(PERIOD, hand_started),
            {"period": str(PERIOD), "customer_id": hand_started, "amount_cents": 1},
        )
        assert "amount_cents: Extra inputs are not permitted" in cause.message
        summary = await (await start_period(harness.client, PERIOD, harness.task_queue)).result()
    assert (summary.due, summary.charged) == (2, 2)
    await assert_billed_once(harness, str(PERIOD), customers)


@pytest.mark.parametrize("payloads", [(), (None,)], ids=["no-payload", "null"])
@pytest.mark.parametrize(
    ("workflow_type", "model", "workflow_id"),
    [
        ("BillingPeriodWorkflow", "BillingPeriodInput", period_workflow_id(PERIOD)),
        ("CustomerChargeWorkflow", "CustomerChargeInput", customer_workflow_id(PERIOD, "c-1")),
        ("ReconcileWorkflow", "ReconcileInput", reconcile_workflow_id(PERIOD)),
        ("ScheduledBillingWorkflow", "ScheduledBillingInput", "scheduled-by-hand"),
    ],
)
async def test_a_workflow_started_with_no_input_fails_saying_so(
    harness: Harness,
    workflow_type: str,
    model: str,
    workflow_id: str,
    payloads: tuple[None, ...],
) -> None:
    """`temporal workflow start` without `--input`, or the Web UI's start form left empty,
    sends no payload at all, which the data converter never sees (`--input null` is taken
    alike). Before, the workflow's task
    failed for as long as it lived (the period's constructor takes its input), holding its ID:
    a `starter.py run` of that period then joined it and waited for ever."""
    customers = await harness.seed(2)
    async with harness.running_worker():
        cause = await _refused(harness, workflow_type, workflow_id, *payloads)
        assert cause.message == (
            f"the workflow's input is missing: {workflow_type} takes one {model}; nothing was done"
        )
        if workflow_type == "BillingPeriodWorkflow":
            handle = await start_period(harness.client, PERIOD, harness.task_queue)
            summary = await asyncio.wait_for(handle.result(), timeout=60)
            assert (summary.due, summary.charged) == (2, 2)
    if workflow_type == "BillingPeriodWorkflow":
        await assert_billed_once(harness, str(PERIOD), customers)
    else:
        assert await harness.money_requests() == 0


async def test_a_scheduled_launch_started_by_hand_fails_at_once_starting_nothing(
    harness: Harness,
) -> None:
    """ScheduledBillingWorkflow takes its month from its schedule's nominal time: started by
    hand (Temporal's CLI or Web UI) with a valid input it has none, and fails at once saying
    what to run instead, starting no run. Past that check, its local activity would fail on
    the missing time and be retried for as long as the launch lived."""
    await harness.seed(2)
    async with harness.running_worker():
        handle = await harness.client.start_workflow(
            "ScheduledBillingWorkflow",
            {"action": "bill"},
            id="scheduled-by-hand",
            task_queue=harness.task_queue,
        )
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(handle.result(), timeout=30)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError), cause
    assert (cause.type, cause.non_retryable) == ("NotScheduled", True)
    assert "use `starter.py run PERIOD`" in cause.message
    history = await handle.fetch_history()
    kinds = {e.event_type for e in history.events}
    assert EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED not in kinds
    assert EventType.EVENT_TYPE_MARKER_RECORDED not in kinds  # no local activity either
    assert await harness.money_requests() == 0

"""I6: recorded histories of the workflows replay against the current code.

`tests/histories/*.json` were recorded from real runs (RECORD_HISTORIES=1 pytest -k replay
writes them anew). A workflow change that breaks determinism fails here.
"""

from __future__ import annotations

import pytest
from temporalio.client import WorkflowHistory

from billing.models import RunOptions
from billing.periods import Period
from billing.runs import start_period
from tests.integration.harness import Harness
from tests.integration.replay import HISTORIES, keep, replay

KEPT_CHILDREN = ("-cust-000001--", "-cust-000002--")


def _declines_second(index: int) -> str:
    return "pm_card_chargeCustomerFail" if index == 2 else "pm_card_visa"


# One history, recorded before the period answered its updates on closing, ends with a skip
# still in flight on purpose: replayed as it was, the SDK warns of it.
@pytest.mark.filterwarnings("ignore::temporalio.workflow.UnfinishedUpdateHandlersWarning")
async def test_recorded_histories_replay() -> None:
    files = sorted(HISTORIES.glob("*.json"))
    assert {f.name.split("--")[0] for f in files} >= {
        "BillingPeriodWorkflow",
        "CustomerChargeWorkflow",
        "ReconcileWorkflow",
    }
    await replay(WorkflowHistory.from_json(f.stem.split("--")[1], f.read_text()) for f in files)


async def test_fresh_run_replays(harness: Harness) -> None:
    await harness.seed(45, card_for=_declines_second)
    period = Period(2027, 1)
    # At most 2 starts unacknowledged in a window of 4: the histories wait for the server.
    options = RunOptions(max_in_flight=4, max_starting=2, page_size=10, history_event_limit=200)
    async with harness.running_worker():
        handle = await start_period(harness.client, period, harness.task_queue, options)
        await handle.result()
    histories: dict[str, WorkflowHistory] = {}
    async for execution in harness.client.list_workflows():
        history = await harness.client.get_workflow_handle(
            execution.id, run_id=execution.run_id
        ).fetch_history()
        histories[f"{execution.workflow_type}--{execution.id}--{execution.run_id}"] = history
    assert any(name.startswith("CustomerChargeWorkflow") for name in histories)
    await replay(histories.values())
    assert sum(name.startswith("BillingPeriodWorkflow") for name in histories) > 1
    # Every period run, and the children of a charged and a declined customer.
    keep(
        history
        for name, history in histories.items()
        if name.startswith("BillingPeriodWorkflow") or any(c in name for c in KEPT_CHILDREN)
    )

"""What a customer's charge workflow for a period is started with: by the period's run, as
its child, and again by a run for one an earlier run started that a cancel stopped before its
claim (activities.period)."""

from __future__ import annotations

from dataclasses import dataclass

from temporalio.common import TypedSearchAttributes

from billing import search_attributes
from billing.keys import customer_workflow_id
from billing.models import CustomerChargeInput
from billing.periods import parse_period

CUSTOMER_CHARGE_WORKFLOW = "CustomerChargeWorkflow"


@dataclass(frozen=True, slots=True)
class CustomerStart:
    workflow_id: str
    input: CustomerChargeInput
    summary: str
    search_attributes: TypedSearchAttributes


def customer_start(
    period: str, customer_id: str, parent_workflow_id: str | None, history_event_limit: int
) -> CustomerStart:
    return CustomerStart(
        workflow_id=customer_workflow_id(parse_period(period), customer_id),
        input=CustomerChargeInput(
            period=period,
            customer_id=customer_id,
            parent_workflow_id=parent_workflow_id,
            history_event_limit=history_event_limit,
        ),
        summary=f"Charge customer {customer_id} for {period}",
        search_attributes=search_attributes.for_customer(period, customer_id),
    )

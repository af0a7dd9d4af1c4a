"""Workflows: orchestration only; every piece of I/O is an activity."""

from workflows.billing_period import BillingPeriodWorkflow
from workflows.customer_charge import CustomerChargeWorkflow
from workflows.reconcile import ReconcileWorkflow
from workflows.scheduled_billing import ScheduledBillingWorkflow

ALL = [BillingPeriodWorkflow, CustomerChargeWorkflow, ScheduledBillingWorkflow, ReconcileWorkflow]

__all__ = [
    "ALL",
    "BillingPeriodWorkflow",
    "CustomerChargeWorkflow",
    "ReconcileWorkflow",
    "ScheduledBillingWorkflow",
]

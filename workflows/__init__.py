"""Workflows: orchestration only; every piece of I/O is an activity."""

from workflows.billing_period import BillingPeriodWorkflow
from workflows.customer_charge import CustomerChargeWorkflow

ALL = [BillingPeriodWorkflow, CustomerChargeWorkflow]

__all__ = ["ALL", "BillingPeriodWorkflow", "CustomerChargeWorkflow"]

"""Custom search attributes that let an operator filter runs in the Web UI."""

from temporalio.common import SearchAttributeKey

BILLING_PERIOD = SearchAttributeKey.for_keyword("BillingPeriod")
CUSTOMER_ID = SearchAttributeKey.for_keyword("CustomerId")
BILLING_STATUS = SearchAttributeKey.for_keyword("BillingStatus")

ALL = (BILLING_PERIOD, CUSTOMER_ID, BILLING_STATUS)

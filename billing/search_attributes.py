"""Custom search attributes that let an operator filter runs in the Web UI."""

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import (
    AddSearchAttributesRequest,
    ListSearchAttributesRequest,
)
from temporalio.client import Client
from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

BILLING_PERIOD = SearchAttributeKey.for_keyword("BillingPeriod")
CUSTOMER_ID = SearchAttributeKey.for_keyword("CustomerId")
BILLING_STATUS = SearchAttributeKey.for_keyword("BillingStatus")

ALL = (BILLING_PERIOD, CUSTOMER_ID, BILLING_STATUS)


async def register(client: Client) -> list[str]:
    """Add the attributes to the client's namespace on a cluster; returns those added."""
    existing = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=client.namespace)
    )
    missing = {key.name for key in ALL} - set(existing.custom_attributes)
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(
                namespace=client.namespace,
                search_attributes=dict.fromkeys(
                    missing, IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
                ),
            )
        )
    return sorted(missing)


def for_customer(period: str, customer_id: str) -> TypedSearchAttributes:
    """What a customer's charge workflow is found by in the Web UI."""
    return TypedSearchAttributes(
        [SearchAttributePair(BILLING_PERIOD, period), SearchAttributePair(CUSTOMER_ID, customer_id)]
    )

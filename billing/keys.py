"""Identifiers derived from the billing intent alone, so every retry derives the same ones."""

from __future__ import annotations

import hashlib
import re

from billing.errors import InvalidCustomerIdError, shown
from billing.periods import Period
from billing.redact import SECRET_RE

# Safe in SQL, in a Temporal workflow ID, in a URL path and in the Web UI's query language.
_CUSTOMER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
KEY_LENGTH = 32


def validate_customer_id(customer_id: object) -> str:
    if not isinstance(customer_id, str) or _CUSTOMER_ID_RE.fullmatch(customer_id) is None:
        raise InvalidCustomerIdError(
            f"customer id {shown(customer_id, 70)} must be 1-64 characters of letters, digits,"
            " '_', '.' or '-', starting with a letter or digit"
        )
    if SECRET_RE.search(customer_id):
        # Not shown: it may be a key pasted by mistake. The vault refuses any request that
        # carries one, so none of this customer's charges could pass.
        raise InvalidCustomerIdError(
            "a customer id must not contain what looks like a Stripe or vault key"
            " (sk_live_..., rk_test_..., vk_...)"
        )
    return customer_id


def idempotency_key(namespace: str, customer_id: str, period: Period) -> str:
    """sha256 of `namespace:customer:period`, first 32 hex characters.

    Never a UUID, timestamp, attempt number, run id or host: a retry must send the same key.
    """
    digest = hashlib.sha256(f"{namespace}:{customer_id}:{period}".encode()).hexdigest()
    return digest[:KEY_LENGTH]


def period_workflow_id(period: Period) -> str:
    return f"billing-period-{period}"


# Its pattern, shown to people with a placeholder for the period.
CUSTOMER_WORKFLOW_ID = "billing-{period}-{customer_id}"


def customer_workflow_id(period: Period, customer_id: str) -> str:
    return CUSTOMER_WORKFLOW_ID.format(period=period, customer_id=customer_id)


def reconcile_workflow_id(period: Period) -> str:
    return f"billing-reconcile-{period}"

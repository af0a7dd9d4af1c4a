"""One customer as the ledger holds it: what it is billed now, and what each period did.

An operator asked "was this customer charged for December, and under which charge?" reads it
here, without SQL or the Web UI's search.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import asyncpg

from billing import ledger
from billing.errors import UnknownCustomerError
from billing.keys import customer_workflow_id, validate_customer_id
from billing.models import LedgerStatus, Record
from billing.periods import Period, parse_period

# A customer billed monthly for years has a row a month: a person reads the latest.
DEFAULT_PERIODS_SHOWN = 12
MAX_PERIODS_SHOWN = 1000


class CustomerAccount(Record):
    """The customer's row: what a run opened now would charge it."""

    customer_id: str
    active: bool
    stripe_customer_id: str
    payment_method: str | None
    amount_cents: int
    currency: str
    created_at: datetime
    updated_at: datetime


class BilledPeriod(Record):
    """The customer's ledger row of one period: fixed when claimed, whatever changed since."""

    period: str
    workflow_id: str
    status: LedgerStatus
    amount_cents: int
    currency: str
    stripe_customer_id: str
    payment_method: str | None
    charge_id: str | None
    payment_intent_id: str | None
    failure_code: str | None
    decline_code: str | None
    failure_message: str | None
    # Why it was skipped or cancelled, and by whom.
    reason: str | None
    decided_by: str | None
    # A skip asked for while the claim was open: it ends skipped unless its charge was sent.
    skip_reason: str | None
    skip_by: str | None
    attempts: int
    claimed_at: datetime
    completed_at: datetime | None


class PeriodWithoutRow(Record):
    """A period asked about in which the customer has no ledger row, and where its run is."""

    period: str
    # None: no run of the period has started.
    run_state: Literal["running", "completed"] | None


class CustomerHistory(Record):
    account: CustomerAccount
    periods: list[BilledPeriod]
    # Rows older than those listed (see --limit).
    older: int
    # Only when one period was asked about and the customer has no row in it.
    without_row: PeriodWithoutRow | None = None


_ROW_COLUMNS = """
    billing_period AS period, status, amount_cents, currency, stripe_customer_id,
    payment_method, charge_id, payment_intent_id, failure_code, decline_code, failure_message,
    reason, decided_by, skip_reason, skip_by, attempts, claimed_at, completed_at
"""


async def customer_history(
    conn: asyncpg.Connection,
    customer_id: str,
    *,
    period: Period | None = None,
    limit: int = DEFAULT_PERIODS_SHOWN,
) -> CustomerHistory:
    """The customer and its latest `limit` periods, newest first (or the one `period`)."""
    validate_customer_id(customer_id)
    account = await conn.fetchrow(
        "SELECT customer_id, active, stripe_customer_id, payment_method, amount_cents, currency,"
        " created_at, updated_at FROM customers WHERE customer_id = $1",
        customer_id,
    )
    if account is None:
        raise UnknownCustomerError(
            f"no customer {customer_id!r} in the ledger: `customers import` adds customers"
        )
    wanted = None if period is None else str(period)
    which = "customer_id = $1 AND ($2::text IS NULL OR billing_period = $2)"
    # The count beside the rows, in one statement: read apart, a row written between the two
    # would misstate how many are older.
    rows = await conn.fetch(
        f"SELECT {_ROW_COLUMNS}, count(*) OVER () AS matching FROM billing_runs WHERE {which}"
        " ORDER BY billing_period DESC LIMIT $3",
        customer_id,
        wanted,
        limit,
    )
    without_row = None
    if wanted is not None and not rows:
        record = await ledger.period_record(conn, wanted)
        without_row = PeriodWithoutRow(
            period=wanted, run_state=None if record is None else record.state
        )
    return CustomerHistory(
        account=CustomerAccount(**dict(account)),
        periods=[
            BilledPeriod(
                workflow_id=customer_workflow_id(parse_period(row["period"]), customer_id),
                **{name: value for name, value in row.items() if name != "matching"},
            )
            for row in rows
        ],
        older=rows[0]["matching"] - len(rows) if rows else 0,
        without_row=without_row,
    )

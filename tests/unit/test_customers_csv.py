"""CSV import: every row is validated first; one bad row rejects the file with its line."""

from __future__ import annotations

import pytest

from billing.customers import parse_customers_csv
from billing.errors import CustomerImportError

HEADER = "customer_id,stripe_customer_id,payment_method,amount_cents,currency\n"


def test_valid_file() -> None:
    rows = parse_customers_csv(
        (HEADER + "c-1,cus_A1,pm_123,1500,usd\nc-2,cus_B2,,99,eur\n").splitlines(True)
    )
    assert [(r.customer_id, r.payment_method, r.amount_cents) for r in rows] == [
        ("c-1", "pm_123", 1500),
        ("c-2", None, 99),
    ]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("c-1,cus_A,pm_1,1500,usd\nc-2,cus_B,pm_2,0,usd\n", "line 3: amount must be positive"),
        ("c-1,cus_A,pm_1,15.00,usd\n", "line 2: amount must be a whole number"),
        ("c-1,cus_A,pm_1,1500,USD\n", "line 2: currency"),
        ("c-1,cus_A,pm_1,1500,xyz\n", "line 2: currency"),
        ("x'; DROP TABLE customers;--,cus_A,pm_1,1500,usd\n", "line 2: customer_id"),
        ("c-1,acct_A,pm_1,1500,usd\n", "line 2: stripe_customer_id"),
        ("c-1,cus_A,card_1,1500,usd\n", "line 2: payment_method"),
        ("c-1,cus_A,pm_1,1500,usd\nc-1,cus_B,pm_2,10,usd\n", "line 3: customer 'c-1' already"),
        ("c-1,cus_A,pm_1,1500,usd,extra\n", "line 2: more fields"),
        (",cus_A,pm_1,1500,usd\n", "line 2: customer_id is empty"),
        ("c-1,cus_A,pm_1,100000000,usd\n", "line 2: amount 100000000 exceeds"),
        ("", "no customer rows"),
    ],
)
def test_bad_row_rejects_the_file_with_its_line(body: str, message: str) -> None:
    with pytest.raises(CustomerImportError, match=message):
        parse_customers_csv((HEADER + body).splitlines(True), source="in.csv")


def test_missing_columns_are_named() -> None:
    with pytest.raises(CustomerImportError, match="missing amount_cents, currency"):
        parse_customers_csv(["customer_id,stripe_customer_id,payment_method\n", "a,cus_A,\n"])

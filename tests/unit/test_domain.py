"""Domain rules: periods, keys, amounts, currencies, customer ids."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from billing.errors import (
    InvalidAmountError,
    InvalidCurrencyError,
    InvalidCustomerIdError,
    InvalidPeriodError,
)
from billing.keys import (
    customer_workflow_id,
    idempotency_key,
    period_workflow_id,
    validate_customer_id,
)
from billing.money import (
    MAX_AMOUNT_CENTS,
    parse_amount,
    spend_cap,
    validate_amount,
    validate_currency,
)
from billing.periods import Period, parse_period, period_for, period_range


@pytest.mark.parametrize("text", ["2026-12", "2000-01", "2999-12"])
def test_valid_periods_round_trip(text: str) -> None:
    assert str(parse_period(text)) == text


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("2026-13", "not 01-12"),
        ("2026-00", "not 01-12"),
        ("2026-1", "YYYY-MM"),
        ("26-12", "YYYY-MM"),
        ("2026/12", "YYYY-MM"),
        (" 2026-12", "YYYY-MM"),
        ("2026-12\n", "YYYY-MM"),
        ("1999-12", "outside"),
        ("2026-12'; DROP TABLE customers;--", "YYYY-MM"),
        ("", "YYYY-MM"),
        ("٢٠٢٦-١٢", "YYYY-MM"),
    ],
)
def test_invalid_periods_say_what_was_expected(text: str, reason: str) -> None:
    with pytest.raises(InvalidPeriodError, match=reason):
        parse_period(text)


@given(st.text(max_size=20))
def test_parse_period_accepts_only_canonical_text(text: str) -> None:
    try:
        period = parse_period(text)
    except InvalidPeriodError:
        return
    assert str(period) == text


@given(st.integers(2000, 2998), st.integers(1, 12))
def test_next_and_previous_are_inverse(year: int, month: int) -> None:
    period = Period(year, month)
    assert period.next().previous() == period
    assert period.ends_at == period.next().starts_at
    assert period.starts_at < period.ends_at


def test_period_for_arrears_and_advance() -> None:
    moment = datetime(2027, 1, 1, 2, 0, tzinfo=UTC)
    assert str(period_for(moment)) == "2026-12"
    assert str(period_for(moment, "advance")) == "2027-01"
    # The nominal time is read in its own zone: 1 Jan 01:00 in UTC+2 is still 31 Dec in UTC.
    tokyo = datetime(2027, 1, 1, 1, 0, tzinfo=timezone(timedelta(hours=9)))
    assert str(period_for(tokyo, "advance")) == "2027-01"
    with pytest.raises(InvalidPeriodError, match="time zone"):
        period_for(datetime(2027, 1, 1))


def test_period_range() -> None:
    assert [str(p) for p in period_range(Period(2026, 11), Period(2027, 2))] == [
        "2026-11",
        "2026-12",
        "2027-01",
        "2027-02",
    ]
    with pytest.raises(InvalidPeriodError, match="before"):
        period_range(Period(2027, 2), Period(2026, 11))


def test_key_is_stable_and_documented() -> None:
    period = Period(2026, 12)
    key = idempotency_key("billing", "cust-1", period)
    assert key == idempotency_key("billing", "cust-1", period)
    # sha256("billing:cust-1:2026-12")[:32], independent of anything but the intent.
    import hashlib

    assert key == hashlib.sha256(b"billing:cust-1:2026-12").hexdigest()[:32]
    assert len(key) == 32


@given(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True),
    st.integers(2000, 2999),
    st.integers(1, 12),
)
def test_keys_differ_when_the_intent_differs(a: str, b: str, year: int, month: int) -> None:
    period = Period(year, month)
    assert (idempotency_key("ns", a, period) == idempotency_key("ns", b, period)) == (a == b)
    assert idempotency_key("ns", a, period) != idempotency_key("other", a, period)
    assert idempotency_key("ns", a, period) != idempotency_key("ns", a, period.next())


def test_workflow_ids() -> None:
    period = Period(2026, 12)
    assert period_workflow_id(period) == "billing-period-2026-12"
    assert customer_workflow_id(period, "cust-1") == "billing-2026-12-cust-1"


@pytest.mark.parametrize(
    "bad",
    ["", "-leading", "a" * 65, "a b", "x'; DROP TABLE customers;--", "../etc", "a/b", "é", "a\n"],
)
def test_hostile_customer_ids_are_refused(bad: str) -> None:
    with pytest.raises(InvalidCustomerIdError, match="1-64 characters"):
        validate_customer_id(bad)


@pytest.mark.parametrize("good", [1, 999, MAX_AMOUNT_CENTS])
def test_valid_amounts(good: int) -> None:
    assert validate_amount(good) == good


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (0, "positive"),
        (-5, "positive"),
        (MAX_AMOUNT_CENTS + 1, "maximum"),
        (True, "whole"),
        (12.5, "whole"),
        ("100", "whole"),
    ],
)
def test_invalid_amounts(bad: object, reason: str) -> None:
    with pytest.raises(InvalidAmountError, match=reason):
        validate_amount(bad)


@pytest.mark.parametrize("bad", ["12.50", "-1", "1e3", "", " ", "١٢"])
def test_parse_amount_wants_plain_cents(bad: str) -> None:
    with pytest.raises(InvalidAmountError):
        parse_amount(bad)


@pytest.mark.parametrize("good", ["usd", "eur", "jpy"])
def test_valid_currencies(good: str) -> None:
    assert validate_currency(good) == good


@pytest.mark.parametrize("bad", ["USD", "us", "usdd", "xyz", "", "ü$d", 840])
def test_invalid_currencies(bad: object) -> None:
    with pytest.raises(InvalidCurrencyError):
        validate_currency(bad)


@pytest.mark.parametrize(
    ("total", "multiplier", "cap"), [(99510, 1.10, 109461), (1, 1.10, 2), (100, 1.0, 100)]
)
def test_spend_cap_rounds_up_to_a_cent_without_float_error(
    total: int, multiplier: float, cap: int
) -> None:
    assert spend_cap(total, multiplier) == cap


def test_spend_cap_refuses_a_cap_below_the_total() -> None:
    with pytest.raises(InvalidAmountError, match="below"):
        spend_cap(100, 0.9)


@pytest.mark.parametrize(
    "text",
    ["token=key_sk_test_abc123", "\\nsk_test_abc123", "x vk_AbC-123_z y", "rk_live_Q1w2"],
)
def test_redact_finds_keys_glued_to_other_text(text: str) -> None:
    from billing.redact import redact

    assert "[redacted key]" in redact(text)
    assert "abc123" not in redact(text) and "AbC-123" not in redact(text)

"""Domain rules: periods, keys, amounts, currencies, customer ids."""

from __future__ import annotations

import itertools
import re
import zoneinfo
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.period import ScheduledPeriodRequest, scheduled_period
from billing.errors import (
    InvalidAmountError,
    InvalidCurrencyError,
    InvalidCustomerIdError,
    InvalidInputError,
    InvalidPeriodError,
)
from billing.keys import (
    customer_workflow_id,
    idempotency_key,
    period_workflow_id,
    validate_customer_id,
)
from billing.models import OperatorRequest, SkipRequest
from billing.money import (
    MAX_AMOUNT_CENTS,
    describe_amount,
    parse_amount,
    spend_cap,
    validate_amount,
    validate_amount_in,
    validate_currency,
)
from billing.periods import (
    LATE_MONTHS,
    Billing,
    Period,
    check_far_flags,
    check_run_by_hand,
    check_skip_by_hand,
    is_late,
    parse_period,
    period_for,
    period_range,
    run_command,
)
from billing.schedules import (
    LAUNCHER,
    MonthlySchedule,
    first_firing,
    run_by_hand,
    validate_time_zone,
)
from billing.stripe_currencies import (
    MINIMUM_CHARGE,
    STRIPE_CURRENCIES,
    THREE_DECIMAL,
    WHOLE_UNITS_ONLY,
    ZERO_DECIMAL,
    decimal_places,
)
from workflows.scheduled_billing import ScheduledBillingWorkflow


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
        ("3000-01", "outside"),
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


def test_the_last_period_accepted_ends_in_the_year_after() -> None:
    # `run 2999-12 --ahead` is accepted: its key's expiry is counted from this end.
    assert Period(2999, 12).ends_at == datetime(3000, 1, 1, tzinfo=UTC)


def test_period_for_arrears_and_advance() -> None:
    moment = datetime(2027, 1, 1, 2, 0, tzinfo=UTC)
    assert str(period_for(moment)) == "2026-12"
    assert str(period_for(moment, "advance")) == "2027-01"
    # The nominal time is read in its own zone: 1 Jan 01:00 in UTC+9 is still 31 Dec in UTC.
    tokyo = datetime(2027, 1, 1, 1, 0, tzinfo=timezone(timedelta(hours=9)))
    assert str(period_for(tokyo, "advance")) == "2027-01"
    with pytest.raises(InvalidPeriodError, match="time zone"):
        period_for(datetime(2027, 1, 1))


def test_the_run_command_suggested_carries_the_flag_the_run_would_ask_for() -> None:
    now = datetime(2026, 12, 1, 0, 30, tzinfo=UTC)
    assert run_command(Period(2027, 1), now) == "python starter.py run 2027-01"
    assert run_command(Period(2027, 2), now) == "python starter.py run 2027-02 --ahead"
    assert run_command(Period(2026, 9), now) == "python starter.py run 2026-09"
    assert run_command(Period(2026, 8), now) == "python starter.py run 2026-08 --late"
    for period, flags in ((Period(2027, 2), {"ahead": True}), (Period(2026, 8), {"late": True})):
        check_run_by_hand(period, now, **flags)


def test_a_flag_for_a_far_month_is_refused_for_a_month_that_is_not() -> None:
    """`run 2026-10 --ahead` is 2027-10 mistyped, most likely: refused, not run."""
    now = datetime(2026, 12, 1, 0, 30, tzinfo=UTC)
    check_far_flags(Period(2027, 2), now, ahead=True)
    check_far_flags(Period(2026, 8), now, late=True)
    check_far_flags(Period(2026, 12), now)
    with pytest.raises(
        InvalidPeriodError,
        match=r"--ahead is for a period later than next month \(2027-01\), and 2026-10 is not",
    ):
        check_far_flags(Period(2026, 10), now, ahead=True)
    for period in (Period(2027, 1), Period(2026, 9), Period(2027, 2)):
        with pytest.raises(InvalidPeriodError, match=f"--late is for .*, and {period} is not"):
            check_far_flags(period, now, late=True)


def test_a_run_by_hand_refuses_a_period_far_ahead_or_long_past_unless_told() -> None:
    now = datetime(2026, 12, 1, 0, 30, tzinfo=UTC)
    for text in ("2026-09", "2026-11", "2026-12", "2027-01"):
        check_run_by_hand(parse_period(text), now)
    with pytest.raises(InvalidPeriodError, match=r"2027-02 is later than next month.*--ahead"):
        check_run_by_hand(Period(2027, 2), now, late=True)
    check_run_by_hand(Period(2027, 2), now, ahead=True)
    # A typo of a decade: every active customer would pay for a month before they joined.
    with pytest.raises(
        InvalidPeriodError,
        match=rf"2016-12 is more than {LATE_MONTHS} months before the current month \(2026-12\)"
        ".*--late",
    ):
        check_run_by_hand(Period(2016, 12), now, ahead=True)
    with pytest.raises(InvalidPeriodError, match="2026-08 is more than"):
        check_run_by_hand(Period(2026, 8), now)
    check_run_by_hand(Period(2016, 12), now, late=True)
    assert is_late(Period(2026, 8), now) and not is_late(Period(2026, 9), now)


def test_period_range() -> None:
    assert [str(p) for p in period_range(Period(2026, 11), Period(2027, 2))] == [
        "2026-11",
        "2026-12",
        "2027-01",
        "2027-02",
    ]
    with pytest.raises(InvalidPeriodError, match="before"):
        period_range(Period(2027, 2), Period(2026, 11))


@pytest.mark.parametrize(
    ("namespace", "customer_id", "period", "intent"),
    [
        ("billing", "cust-1", Period(2026, 12), b"billing:cust-1:2026-12"),
        # As given: ACME-1 and acme-1 may be two customers (billing.customers), each with its
        # own key; a month zero-padded as it is typed.
        ("billing", "ACME-1", Period(2027, 1), b"billing:ACME-1:2027-01"),
        ("Billing-EU", "acme-1", Period(2027, 1), b"Billing-EU:acme-1:2027-01"),
    ],
)
def test_key_is_stable_and_documented(
    namespace: str, customer_id: str, period: Period, intent: bytes
) -> None:
    key = idempotency_key(namespace, customer_id, period)
    assert key == idempotency_key(namespace, customer_id, period)
    # sha256("{namespace}:{customer_id}:{period}")[:32], independent of anything but the intent.
    import hashlib

    assert key == hashlib.sha256(intent).hexdigest()[:32]
    assert len(key) == 32


@given(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True),
    # Not 2999: December's next period would be past MAX_YEAR.
    st.integers(2000, 2998),
    st.integers(1, 12),
)
def test_keys_differ_when_the_intent_differs(a: str, b: str, year: int, month: int) -> None:
    period = Period(year, month)
    assert (idempotency_key("ns", a, period) == idempotency_key("ns", b, period)) == (a == b)
    assert idempotency_key("ns", a, period) != idempotency_key("other", a, period)
    assert idempotency_key("ns", a, period) != idempotency_key("ns", a, period.next())


@pytest.mark.parametrize(
    ("period", "customer_id", "period_id", "child_id"),
    [
        (Period(2026, 12), "cust-1", "billing-period-2026-12", "billing-2026-12-cust-1"),
        # The month zero-padded, as typed and as the runs already started hold it; the id's
        # case kept, as ACME-1 and acme-1 may be two customers, each with its own child.
        (Period(2027, 1), "ACME-1", "billing-period-2027-01", "billing-2027-01-ACME-1"),
    ],
)
def test_workflow_ids(period: Period, customer_id: str, period_id: str, child_id: str) -> None:
    assert period_workflow_id(period) == period_id
    assert customer_workflow_id(period, customer_id) == child_id


@pytest.mark.parametrize(
    "bad",
    ["", "-leading", "a" * 65, "a b", "x'; DROP TABLE customers;--", "../etc", "a/b", "é", "a\n"],
)
def test_hostile_customer_ids_are_refused(bad: str) -> None:
    with pytest.raises(InvalidCustomerIdError, match="1-64 characters"):
        validate_customer_id(bad)


@pytest.mark.parametrize(
    # Anywhere in the id: a key past its first characters is still sent with every charge.
    "looks_like_a_key",
    ["vk_1", "Novk_enterprise_customer1", "sk_test_42", "c" * 40 + "-vk_1"],
)
def test_a_customer_id_shaped_like_a_key_is_refused_unshown(looks_like_a_key: str) -> None:
    with pytest.raises(InvalidCustomerIdError, match="looks like a Stripe or vault key") as refused:
        validate_customer_id(looks_like_a_key)
    assert looks_like_a_key not in str(refused.value)


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


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("12.50", "whole number"),
        ("-1500", "must be positive, got '-1500'"),
        ("-1.5", "whole number"),
        ("1e3", "whole number"),
        ("", "whole number"),
        (" ", "whole number"),
        ("١٢", "whole number"),
        # A sign before digits that are not all ASCII is not a negative amount.
        ("-\u06612", "whole number"),
    ],
)
def test_parse_amount_wants_plain_cents(bad: str, reason: str) -> None:
    with pytest.raises(InvalidAmountError, match=reason):
        parse_amount(bad)


@pytest.mark.parametrize("good", ["usd", "eur", "jpy", "bgn", "kwd"])
def test_valid_currencies(good: str) -> None:
    assert validate_currency(good) == good


# ISO codes Stripe does not charge in: metals, funds, the test code, and some money too.
@pytest.mark.parametrize(
    "bad",
    ["USD", "us", "usdd", "xyz", "", "ü$d", 840, "xau", "xxx", "xts", "usn", "bov", "ghs", "irr"],
)
def test_invalid_currencies(bad: object) -> None:
    with pytest.raises(InvalidCurrencyError):
        validate_currency(bad)


def test_a_code_in_letters_that_are_not_ascii_is_not_told_to_be_written_in_lowercase() -> None:
    # The Kelvin sign lowercases to an ASCII "k": "\u212aes" is not "kes" in capitals.
    with pytest.raises(InvalidCurrencyError, match="three-letter ISO code, got"):
        validate_currency("\u212aes")


def test_a_three_decimal_currency_is_charged_to_the_hundredth() -> None:
    assert validate_amount_in(1230, "kwd") == 1230
    assert validate_amount_in(1235, "usd") == 1235
    with pytest.raises(InvalidAmountError, match="1235 kwd must end in 0"):
        validate_amount_in(1235, "kwd")


@pytest.mark.parametrize(
    ("amount", "currency", "minimum"), [(49, "usd", 50), (29, "gbp", 30), (1, "jpy", 50)]
)
def test_an_amount_below_stripes_minimum_charge_is_refused(
    amount: int, currency: str, minimum: int
) -> None:
    # Stripe refuses it (amount_too_small) and the customer would fail for the period.
    assert validate_amount_in(minimum, currency) == minimum
    shown = describe_amount(currency, minimum)
    with pytest.raises(InvalidAmountError, match=f"minimum charge of {shown} "):
        validate_amount_in(amount, currency)
    # Stripe publishes no minimum for every currency: those are not checked here.
    assert validate_amount_in(1, "kes") == 1


def test_icelandic_krona_is_charged_in_whole_units() -> None:
    assert validate_amount_in(500, "isk") == 500
    with pytest.raises(InvalidAmountError, match="550 isk must end in 00"):
        validate_amount_in(550, "isk")


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
    [
        "token=key_sk_test_abc123XYZ0123456789",
        "\\nsk_test_abc123XYZ0123456789",
        "/v1/payment_intents/Xsk_" + "live_abc123XYZ0123456789",  # split: no key in the file
        "pi_1Xvk_abc123_XYZ-0123456789",
        "x vk_abc123 y",
        "rk_live_abc123",
        "=sk_live_abc123",
        # Glued, a restricted key too, and one of the shortest length a key has.
        "token=key_rk_" + "live_abc123XYZ0123456789",  # split, as above
        "key_sk_test_abc123" + "a" * 10,
        "pi_1Xvk_abc123" + "a" * 10,
        # Stripe's masked form, as its 403 quotes a key: the last characters are the key's.
        "The provided key 'rk_live_" + "*" * 20 + "abc123' does not have the permissions",
        "Invalid API Key provided: sk_test_" + "*" * 20 + "abc123",
    ],
)
def test_redact_finds_keys_glued_to_other_text(text: str) -> None:
    from billing.redact import redact

    assert "[redacted key]" in redact(text)
    assert "abc123" not in redact(text)


def test_redact_takes_a_whole_key_with_underscores() -> None:
    from billing.redact import redact

    assert redact("key sk_test_local_emulator, vk_a_b-c") == "key [redacted key], [redacted key]"


@pytest.mark.parametrize(
    "glued",
    ["token=key_", "pi_1X", "/v1/charges/X"],
)
@pytest.mark.parametrize(
    "key",
    [
        "sk_" + "live_abc123XYZ0123456789tail",  # split: no key in the file
        "rk_" + "test_abc123XYZ0123456789tail",
        "vk_abc123_XYZ-0123456789tail",
    ],
)
def test_a_glued_key_is_redacted_to_its_last_character(glued: str, key: str) -> None:
    """Past its first 16 characters a key is still the key: no tail of it is left."""
    from billing.redact import redact

    assert redact(f"{glued}{key} done") == f"{glued}[redacted key] done"


def test_a_cut_text_is_redacted_first_and_marked() -> None:
    from billing.redact import shown_cut

    key = "sk_test_abc123XYZ0123456789"
    # Cut first, a key glued to other text would be too short to be known as one.
    assert shown_cut(f"code:X{key}\nmore", 10, " (cut)") == "code:X[red (cut)"
    assert shown_cut("short\ttext", 10) == "short text"


def test_redact_leaves_words_that_hold_a_prefix() -> None:
    from billing.redact import redact

    text = (
        "task_queue=billing expand[]=outcome.risk_level is_sk_enabled network_live_status"
        " metadata[work_test_run]=1 bookmark_rk_x (sk_test_...)"
    )
    assert redact(text) == text


# -- properties over any input: a valid value or the domain's own error, never anything else --

# What a Temporal workflow ID, a URL path segment, a SQL literal and the Web UI's query
# language all take without quoting.
_INERT = re.compile(r"[A-Za-z0-9_.-]+")
_any_object = st.one_of(
    st.none(), st.integers(), st.floats(), st.binary(), st.lists(st.text(max_size=3))
)


@given(st.one_of(st.text(max_size=80), st.from_regex(r"[A-Za-z0-9][\w.\-' /%]{0,70}")))
def test_a_customer_id_is_inert_everywhere_or_refused(text: str) -> None:
    try:
        customer_id = validate_customer_id(text)
    except InvalidCustomerIdError:
        return
    assert 1 <= len(customer_id) <= 64 and _INERT.fullmatch(customer_id)
    assert quote(customer_id, safe="") == customer_id
    workflow_id = customer_workflow_id(Period(2026, 12), customer_id)
    assert _INERT.fullmatch(workflow_id)


@given(_any_object)
def test_a_customer_id_that_is_not_text_is_refused(value: object) -> None:
    with pytest.raises(InvalidCustomerIdError):
        validate_customer_id(value)


@given(st.text(), st.text(), st.integers(2000, 2999), st.integers(1, 12))
def test_the_key_is_32_hex_digits_whatever_the_input(
    namespace: str, customer_id: str, year: int, month: int
) -> None:
    assert re.fullmatch(
        r"[0-9a-f]{32}", idempotency_key(namespace, customer_id, Period(year, month))
    )


@given(st.integers(-(10**6), 10**6), st.integers(-100, 100))
def test_a_period_is_in_range_or_refused(year: int, month: int) -> None:
    try:
        period = Period(year, month)
    except InvalidPeriodError:
        assert not (2000 <= year <= 2999 and 1 <= month <= 12)
        return
    assert parse_period(str(period)) == period


@pytest.mark.parametrize(
    "check", [parse_period, validate_customer_id, parse_amount, validate_currency]
)
def test_a_long_bad_value_is_not_echoed_in_full(check: Callable[[str], object]) -> None:
    with pytest.raises(InvalidInputError) as refused:
        check("'; DROP TABLE customers;--" * 400)
    assert len(str(refused.value)) < 250


@given(st.integers(2000, 2999), st.integers(1, 12), st.integers(0, 60))
def test_a_period_range_is_every_month_in_order(year: int, month: int, months: int) -> None:
    first = Period(year, month)
    last = first
    for _ in range(months):
        if last == Period(2999, 12):
            break
        last = last.next()
    periods = period_range(first, last)
    assert periods[0] == first and periods[-1] == last
    assert all(a.next() == b for a, b in itertools.pairwise(periods))


@given(
    st.datetimes(min_value=datetime(2000, 2, 2), max_value=datetime(2999, 12, 30)),
    st.integers(-14 * 60, 14 * 60),
)
def test_arrears_bill_the_month_before_advance(moment: datetime, offset_minutes: int) -> None:
    aware = moment.replace(tzinfo=timezone(timedelta(minutes=offset_minutes)))
    advance = period_for(aware, "advance")
    assert (advance.year, advance.month) == (aware.year, aware.month)
    assert period_for(aware, "arrears") == advance.previous()


@given(st.integers())
def test_an_amount_is_accepted_exactly_in_stripes_range(amount: int) -> None:
    try:
        assert validate_amount(amount) == amount
    except InvalidAmountError:
        assert not 1 <= amount <= MAX_AMOUNT_CENTS
    else:
        assert 1 <= amount <= MAX_AMOUNT_CENTS


@given(_any_object.filter(lambda value: not isinstance(value, int)))
def test_an_amount_that_is_not_an_integer_is_refused(value: object) -> None:
    with pytest.raises(InvalidAmountError):
        validate_amount(value)


def test_an_escaped_input_is_cut_as_shown() -> None:
    # Forty astral characters are 400 once escaped: the cut counts what the message shows.
    with pytest.raises(InvalidAmountError) as refused:
        parse_amount("\U0001019d" * 40)
    assert len(str(refused.value)) < 100


@given(st.one_of(st.text(), st.from_regex(r"\s*[0-9]{1,60}\s*", fullmatch=True)))
def test_parse_amount_gives_cents_or_says_why(text: str) -> None:
    try:
        amount = parse_amount(text)
    except InvalidAmountError as refused:
        assert len(str(refused)) < 150
        return
    assert 1 <= amount <= MAX_AMOUNT_CENTS
    assert amount == int(text.strip())


def test_parse_amount_refuses_more_digits_than_int_converts() -> None:
    with pytest.raises(InvalidAmountError, match="5000 digits exceeds"):
        parse_amount("9" * 5000)
    assert parse_amount("0" * 5000 + "100") == 100
    # Up to 40 digits the amount is shown; past them, only how many digits it has.
    with pytest.raises(InvalidAmountError, match=f"amount {'9' * 40} exceeds"):
        parse_amount("9" * 40)
    with pytest.raises(InvalidAmountError, match="amount of 41 digits exceeds"):
        parse_amount("9" * 41)


@given(st.integers(1, MAX_AMOUNT_CENTS), st.integers(0, 5))
def test_parse_amount_reads_what_validate_amount_accepts(amount: int, zeros: int) -> None:
    assert parse_amount(f" {'0' * zeros}{amount}\n") == amount


@given(st.one_of(st.text(max_size=5), _any_object))
def test_a_currency_is_a_lowercase_iso_code_or_refused(value: object) -> None:
    try:
        currency = validate_currency(value)
    except InvalidCurrencyError:
        return
    assert currency in STRIPE_CURRENCIES


@given(st.sampled_from(sorted(STRIPE_CURRENCIES)))
def test_every_stripe_currency_is_accepted_in_lowercase_only(code: str) -> None:
    assert validate_currency(code) == code
    with pytest.raises(InvalidCurrencyError, match="in lowercase"):
        validate_currency(code.upper())


@given(
    st.integers(0, 10**12),
    st.decimals(min_value=1, max_value=10, places=2, allow_nan=False, allow_infinity=False),
)
def test_the_cap_is_the_smallest_whole_cent_at_or_above_total_times_multiplier(
    total: int, multiplier: Decimal
) -> None:
    cap = spend_cap(total, float(multiplier))
    exact = Decimal(total) * multiplier
    assert exact <= cap < exact + 1
    assert spend_cap(total + 1, float(multiplier)) >= cap


def test_a_key_given_as_a_period_or_an_amount_is_not_echoed() -> None:
    key = "sk_live_" + "51HqLyjWDarjtT1zdp7dcXYZ"
    for parse, refusal in ((parse_period, InvalidPeriodError), (parse_amount, InvalidAmountError)):
        with pytest.raises(refusal) as refused:
            parse(key)
        assert "51HqLy" not in str(refused.value) and "[redacted key]" in str(refused.value)


def test_an_operators_reason_and_name_keep_no_key() -> None:
    key = "rk_test_" + "Zx9Zx9Zx9Zx9Zx9Zx9Zx9"
    request = SkipRequest(customer_id="c-1", reason=f"pasted {key} by mistake", operator=key)
    assert (request.customer_id, request.reason, request.operator) == (
        "c-1",
        "pasted [redacted key] by mistake",
        "[redacted key]",
    )


def test_an_operators_reason_and_name_are_one_line_each() -> None:
    """Logged and shown by `status`, they cannot forge another line; written in any script."""
    request = OperatorRequest(
        reason="price\n2026-12-04 06:00:00,000 INFO forged\tline\u200b, café", operator="al\nINFO x"
    )
    assert request.reason == "price 2026-12-04 06:00:00,000 INFO forged line , café"
    assert request.operator == "al INFO x"
    assert OperatorRequest.model_validate_json(request.model_dump_json()) == request
    assert OperatorRequest(reason="Prüfung der Beträge", operator="李").operator == "李"
    # One for one: a text within the limit before the rule (a run's state) still is.
    assert len(OperatorRequest(reason="x" * 499 + "\n", operator="alice").reason) == 500


def test_an_operators_reason_and_name_are_taken_from_one_character_to_their_limits() -> None:
    for operator in ("a", "a" * 100):
        assert OperatorRequest(reason="x", operator=operator).operator == operator
    for reason, operator in (("", "alice"), ("x", ""), ("x", "a" * 101)):
        with pytest.raises(ValidationError):
            OperatorRequest(reason=reason, operator=operator)


def test_a_redacted_reason_still_fits_its_limit() -> None:
    # A short key-shaped token grows when redacted: the limit counts the redacted text, so
    # the request the period rebuilds from it still validates.
    with pytest.raises(ValidationError, match="at most 500 characters"):
        OperatorRequest(reason="x" * 495 + " vk_1", operator="alice")
    request = OperatorRequest(reason="x" * 480 + " vk_1", operator="alice")
    assert OperatorRequest.model_validate_json(request.model_dump_json()) == request


@pytest.mark.parametrize(
    "name",
    [
        "localtime",
        "posixrules",
        "Factory",
        "Mars/Olympus",
        "posix/Europe/Berlin",
        "right/UTC",
        "America",
        "America/Argentina",
    ],
)
def test_a_schedule_zone_must_name_a_place(name: str) -> None:
    # "localtime" is each host's own zone: the CLI's, the server's and the worker's may differ.
    # posix/ and right/ are copies of the tree that only some systems hold.
    with pytest.raises(InvalidInputError, match=f"time zone '{name}' is not an IANA name"):
        validate_time_zone(name)


@pytest.mark.parametrize(
    "name", ["UTC", "Europe/Berlin", "America/Argentina/Buenos_Aires", "US/Pacific"]
)
def test_a_schedule_zone_naming_a_place_is_taken(name: str) -> None:
    assert validate_time_zone(name) == name


def test_a_key_given_as_a_zone_is_not_echoed() -> None:
    key = "sk_live_" + "a1" * 12
    with pytest.raises(InvalidInputError) as refused:
        validate_time_zone(key)
    assert key not in str(refused.value) and "[redacted key]" in str(refused.value)


def test_a_key_given_as_a_schedule_id_is_refused_and_not_echoed() -> None:
    key = "sk_live_" + "a1" * 12
    with pytest.raises(ValidationError) as refused:
        MonthlySchedule(schedule_id=key)
    # What the CLI prints of it (cli.main): the field and the message.
    [error] = refused.value.errors()
    assert error["loc"] == ("schedule_id",) and key not in error["msg"]
    assert "looks like a Stripe or vault key" in error["msg"]


def test_a_worker_reads_old_aliases_without_the_systems_zones() -> None:
    # Slim images ship a system database without aliases such as US/Pacific; the worker
    # falls back on the tzdata package, which holds them.
    zoneinfo.reset_tzpath(to=[])
    try:
        pacific = zoneinfo.ZoneInfo.no_cache("US/Pacific")
    finally:
        zoneinfo.reset_tzpath()
    assert pacific.utcoffset(datetime(2026, 7, 1)) == timedelta(hours=-7)


@pytest.mark.parametrize("zone", ["Mars/Olympus", "America"])
async def test_a_firing_whose_zone_the_worker_lacks_fails_for_good(zone: str) -> None:
    request = ScheduledPeriodRequest(
        nominal_time=datetime(2026, 12, 1, 2, tzinfo=UTC), time_zone=zone, billing="arrears"
    )
    with pytest.raises(ApplicationError, match=f"'{zone}' is not in this worker's") as raised:
        await ActivityEnvironment().run(scheduled_period, request)
    assert raised.value.non_retryable and raised.value.type == "UnknownTimeZone"


@pytest.mark.parametrize(("billing", "period"), [("advance", "2027-01"), ("arrears", "2026-12")])
async def test_a_firing_bills_the_month_it_is_in_the_schedules_zone(
    billing: Billing, period: str
) -> None:
    """A schedule firing at 02:00 on the 1st in Auckland fires on the 31st in UTC: read in
    UTC, the firing would bill the month before its own (billed already by the last one)."""
    request = ScheduledPeriodRequest(
        nominal_time=datetime(2026, 12, 31, 13, tzinfo=UTC),
        time_zone="Pacific/Auckland",
        billing=billing,
    )
    assert await ActivityEnvironment().run(scheduled_period, request) == period


@pytest.mark.parametrize(
    ("now", "day", "zone", "fires"),
    [
        ("2026-12-03T11:00:00+00:00", 1, "UTC", "2027-01-01T02:00:00+00:00"),
        ("2026-12-03T11:00:00+00:00", 5, "UTC", "2026-12-05T02:00:00+00:00"),
        # The 1st at 02:00 comes once the day has begun there: in Berlin, an hour later.
        ("2026-12-31T23:30:00+00:00", 1, "Europe/Berlin", "2027-01-01T02:00:00+01:00"),
        ("2027-01-01T01:30:00+00:00", 1, "Europe/Berlin", "2027-02-01T02:00:00+01:00"),
        # At its very time, a schedule fires next month: Temporal fires at no time past.
        ("2026-12-01T02:00:00+00:00", 1, "UTC", "2027-01-01T02:00:00+00:00"),
    ],
)
def test_a_new_schedule_first_fires_at_its_next_time_in_its_zone(
    now: str, day: int, zone: str, fires: str
) -> None:
    config = MonthlySchedule(day_of_month=day, hour=2, time_zone=zone)
    assert first_firing(config, datetime.fromisoformat(now)).isoformat() == fires


def test_only_a_reconciliation_follows_a_billing_schedule() -> None:
    with pytest.raises(ValidationError, match="a billing schedule follows no other"):
        MonthlySchedule(billing_schedule_id="billing-monthly")
    with pytest.raises(ValidationError, match="a billing schedule follows no other"):
        MonthlySchedule(months_time_zone="Europe/Berlin")
    with pytest.raises(ValidationError, match="Mars/Olympus"):
        MonthlySchedule(action="reconcile", months_time_zone="Mars/Olympus")
    MonthlySchedule(action="reconcile", billing_schedule_id="billing-monthly")


def test_schedules_start_the_launcher_by_its_registered_name() -> None:
    # Named, not imported, in billing.schedules: a renamed workflow would start nothing.
    assert ScheduledBillingWorkflow.__temporal_workflow_definition.name == LAUNCHER  # type: ignore[attr-defined]


def test_run_by_hand_asks_for_late_where_run_does_and_shortens_a_long_gap() -> None:
    now = datetime(2026, 12, 4, tzinfo=UTC)
    assert run_by_hand([Period(2026, 8), Period(2026, 9)], now) == (
        "python starter.py run 2026-08 --late; python starter.py run 2026-09"
    )
    years = period_range(Period(2024, 1), Period(2026, 10))
    listed = run_by_hand(years, now).split("; ")
    assert listed[0] == "python starter.py run 2024-01 --late"
    assert listed[3] == "... (34 months in all)"
    assert listed[-1] == "python starter.py run 2026-10"
    assert len(listed) == 6


def test_stripes_largest_amount_passes_and_one_more_does_not() -> None:
    assert validate_amount(99_999_999) == 99_999_999
    with pytest.raises(InvalidAmountError, match="exceeds Stripe's maximum"):
        validate_amount(100_000_000)


@pytest.mark.parametrize(
    ("customer_id", "valid"),
    [("a" * 64, True), ("a" * 65, False), ("_c1", False), ("c:1", False), ("c.1-x_2", True)],
)
def test_a_customer_id_is_up_to_64_of_the_characters_a_workflow_id_takes(
    customer_id: str, valid: bool
) -> None:
    if valid:
        assert validate_customer_id(customer_id) == customer_id
    else:
        with pytest.raises(InvalidCustomerIdError):
            validate_customer_id(customer_id)


def test_a_skip_for_a_far_month_with_no_run_needs_the_flag_for_its_direction() -> None:
    """A skip waits in the ledger for a run of its month: one for a mistyped month stops no
    charge in the month meant."""
    now = datetime(2026, 12, 15, tzinfo=UTC)
    check_skip_by_hand(Period(2026, 11), now)
    check_skip_by_hand(Period(2026, 1), now, late=True)
    check_skip_by_hand(Period(2027, 6), now, ahead=True)
    for period, wrong in ((Period(2026, 1), "ahead"), (Period(2027, 6), "late")):
        with pytest.raises(InvalidPeriodError, match=f"{period} .*, and has no run"):
            check_skip_by_hand(period, now, **{wrong: True})
        with pytest.raises(InvalidPeriodError, match="pass --"):
            check_skip_by_hand(period, now)


@pytest.mark.parametrize(
    ("currency", "places", "minimum"),
    [
        # As Stripe publishes them ("Supported currencies": zero-decimal, three-decimal,
        # minimum charge amounts), a few of each kind: a table edited by mistake shows here,
        # where the emulator, reading the same tables, would not.
        ("usd", 2, 50),
        ("chf", 2, 50),
        ("huf", 2, 17500),
        ("mxn", 2, 1000),
        ("jpy", 0, 50),
        ("xpf", 0, None),
        ("ugx", 0, None),
        ("bhd", 3, None),
        ("kwd", 3, None),
    ],
)
def test_currency_tables_hold_stripes_published_figures(
    currency: str, places: int, minimum: int | None
) -> None:
    assert currency in STRIPE_CURRENCIES
    assert decimal_places(currency) == places
    assert MINIMUM_CHARGE.get(currency) == minimum


def test_currency_tables_are_stripes_whole_lists() -> None:
    """Every entry, not a sample: one dropped or edited passes an amount Stripe refuses
    (amount_too_small, a three-decimal amount not ending in 0) at import and fails the
    customer at charge time, refuses one it takes, or shows an amount 10 or 100 times off."""
    zero = ["bif", "clp", "djf", "gnf", "jpy", "kmf", "krw", "mga", "pyg", "rwf", "ugx", "vnd"]
    minimum = {
        "usd": 50, "aed": 200, "aud": 50, "bgn": 100, "brl": 50, "cad": 50, "chf": 50,
        "czk": 1500, "dkk": 250, "eur": 50, "gbp": 30, "hkd": 400, "huf": 17500, "inr": 50,
        "jpy": 50, "mxn": 1000, "myr": 200, "nok": 300, "nzd": 50, "pln": 200, "ron": 200,
        "sek": 300, "sgd": 50, "thb": 1000,
    }  # fmt: skip
    tables = (ZERO_DECIMAL, THREE_DECIMAL, WHOLE_UNITS_ONLY, MINIMUM_CHARGE)
    assert tables == (
        frozenset({*zero, "vuv", "xaf", "xof", "xpf"}),
        frozenset({"bhd", "jod", "kwd", "omr", "tnd"}),
        frozenset({"isk"}),
        minimum,
    )
    assert (len(STRIPE_CURRENCIES), "zmw" in STRIPE_CURRENCIES) == (139, True)
    assert ZERO_DECIMAL | THREE_DECIMAL | set(minimum) <= STRIPE_CURRENCIES

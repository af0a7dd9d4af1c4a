"""Amounts and currencies as Stripe accepts them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from decimal import Decimal

from billing.errors import InvalidAmountError, InvalidCurrencyError, shown
from billing.stripe_currencies import (
    MINIMUM_CHARGE,
    STRIPE_CURRENCIES,
    THREE_DECIMAL,
    WHOLE_UNITS_ONLY,
    decimal_places,
)

# Stripe's ceiling for `amount`: eight digits in the smallest currency unit.
MAX_AMOUNT_CENTS = 99_999_999


def validate_amount(amount: object) -> int:
    """A positive integer of smallest currency units, at most Stripe's ceiling."""
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise InvalidAmountError(f"amount must be a whole number of cents, got {amount!r}")
    if amount <= 0:
        raise InvalidAmountError(f"amount must be positive, got {amount}")
    if amount > MAX_AMOUNT_CENTS:
        raise InvalidAmountError(f"amount {amount} exceeds Stripe's maximum of {MAX_AMOUNT_CENTS}")
    return amount


def parse_amount(text: str) -> int:
    """Parse an amount in cents written as digits (no decimals, signs or separators)."""
    stripped = text.strip()
    if stripped.startswith("-") and stripped[1:].isascii() and stripped[1:].isdigit():
        raise InvalidAmountError(f"amount must be positive, got {shown(text)}")
    if not stripped.isascii() or not stripped.isdigit():
        raise InvalidAmountError(f"amount must be a whole number of cents, got {shown(text)}")
    significant = stripped.lstrip("0")
    # Past 4,300 digits int() raises its own, unhelpful ValueError; and 40 are shown at most.
    if len(significant) > 40:
        raise InvalidAmountError(
            f"amount of {len(significant)} digits exceeds Stripe's maximum of {MAX_AMOUNT_CENTS}"
        )
    return validate_amount(int(significant or "0"))


def validate_currency(currency: object) -> str:
    """A currency Stripe charges in, in its lowercase form."""
    if not isinstance(currency, str) or len(currency) != 3 or not currency.isascii():
        raise InvalidCurrencyError(
            f"currency must be a three-letter ISO code, got {shown(currency)}"
        )
    if currency not in STRIPE_CURRENCIES:
        lower = " (in lowercase)" if currency.lower() in STRIPE_CURRENCIES else ""
        raise InvalidCurrencyError(
            f"currency {currency!r} is not one Stripe charges in{lower}: a lowercase ISO 4217"
            " code such as 'usd' or 'eur'"
        )
    return currency


def validate_amount_in(amount: int, currency: str) -> int:
    """`amount` as Stripe charges it in `currency`: at least its minimum charge, three-decimal
    ones to the hundredth, and those it takes in whole units only to the unit."""
    minimum = MINIMUM_CHARGE.get(currency)
    if minimum is not None and amount < minimum:
        raise InvalidAmountError(
            f"amount {amount} {currency} ({describe_amount(currency, amount)}) is below"
            f" Stripe's minimum charge of {describe_amount(currency, minimum)} (amounts are in"
            " the currency's smallest unit: is it in cents?)"
        )
    if currency in THREE_DECIMAL and amount % 10:
        raise InvalidAmountError(
            f"amount {amount} {currency} must end in 0: Stripe charges {currency} in"
            " thousandths rounded to the hundredth"
        )
    if currency in WHOLE_UNITS_ONLY and amount % 100:
        raise InvalidAmountError(
            f"amount {amount} {currency} must end in 00: Stripe charges {currency} in"
            f" hundredths but only whole units (100 is 1 {currency})"
        )
    return amount


def spend_cap(expected_total_cents: int, multiplier: float) -> int:
    """The period key's cap: the expected total with headroom, rounded up to a whole cent."""
    if multiplier < 1:
        raise InvalidAmountError(f"cap multiplier {multiplier} would cap below the expected total")
    # In decimal: 99510 * 1.10 in binary floating point is 109461.00000000001.
    return math.ceil(Decimal(expected_total_cents) * Decimal(str(multiplier)))


def spend_caps(totals_by_currency: Mapping[str, int], multiplier: float) -> dict[str, int]:
    """A period's keys' caps, one per currency: a run issues them, a preview shows them."""
    return {c: spend_cap(total, multiplier) for c, total in sorted(totals_by_currency.items())}


def describe_amount(currency: str, amount: int) -> str:
    """One amount for a person to read, in the currency's unit as Stripe's API counts it:
    1999 usd is "usd 19.99", 1700 jpy "jpy 1,700", 1230 kwd "kwd 1.230"."""
    places = decimal_places(currency)
    whole, part = divmod(abs(amount), 10**places)
    digits = f"{whole:,}" + (f".{part:0{places}d}" if places else "")
    return f"{currency} {'-' if amount < 0 else ''}{digits}"


def describe_amounts(by_currency: Mapping[str, int]) -> str:
    """Money per currency for a person to read, never added across currencies."""
    if not by_currency:
        return "nothing"
    return ", ".join(describe_amount(c, amount) for c, amount in sorted(by_currency.items()))

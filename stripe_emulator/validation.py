"""Reading request parameters with Stripe's validation rules and error codes."""

from __future__ import annotations

import re
from typing import Any, TypeVar

from billing.stripe_currencies import MINIMUM_CHARGE, STRIPE_CURRENCIES

from .errors import invalid, missing_param
from .forms import Params

T = TypeVar("T")

MAX_AMOUNT = 99_999_999
_INTEGER = re.compile(r"-?[0-9]{1,18}")

# Stripe's settlement currencies (the list its "Invalid currency" error prints).
CURRENCIES = STRIPE_CURRENCIES

METADATA_MAX_KEYS = 50
METADATA_KEY_MAX = 40
METADATA_VALUE_MAX = 500

# Accepted on every endpoint; applied to the response by the pipeline.
COMMON = frozenset({"expand"})
LIST = COMMON | {"limit", "starting_after", "ending_before"}


def check_known(params: Params, allowed: frozenset[str]) -> None:
    for name in params:
        if name not in allowed:
            raise invalid(
                f"Received unknown parameter: {name}", param=name, code="parameter_unknown"
            )


def require(value: T | None, name: str) -> T:
    if value is None:
        raise missing_param(name)
    return value


def string(params: Params, name: str) -> str | None:
    """A string parameter; an empty string means "not set", as on Stripe's optional fields."""
    value = params.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise invalid(f"Invalid string: {value!r}", param=name)
    return value


def integer(params: Params, name: str, *, minimum: int) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not _INTEGER.fullmatch(value):
        raise invalid(f"Invalid integer: {value}", param=name, code="parameter_invalid_integer")
    number = int(value)
    if number < minimum:
        raise invalid(
            f"This value must be greater than or equal to {minimum}.",
            param=name,
            code="parameter_invalid_integer",
        )
    return number


def amount(params: Params) -> int | None:
    value = integer(params, "amount", minimum=1)
    if value is not None and value > MAX_AMOUNT:
        raise invalid(
            f"Amount must be no more than {MAX_AMOUNT} in the currency's smallest unit.",
            param="amount",
            code="amount_too_large",
        )
    return value


def at_least_minimum(value: int, money: str) -> None:
    """Stripe refuses a charge below its minimum for the currency."""
    minimum = MINIMUM_CHARGE.get(money)
    if minimum is not None and value < minimum:
        raise invalid(
            f"Amount must be at least {minimum} {money} in the currency's smallest unit.",
            param="amount",
            code="amount_too_small",
        )


def currency(params: Params) -> str:
    value = require(string(params, "currency"), "currency")
    if value not in CURRENCIES:
        # Stripe answers this one without an error code.
        raise invalid(
            f"Invalid currency: {value}. Stripe currently supports these currencies: "
            + ", ".join(sorted(CURRENCIES)),
            param="currency",
        )
    return value


def boolean(params: Params, name: str) -> bool:
    value = params.get(name)
    if value is None:
        return False
    if value not in ("true", "false"):
        raise invalid(f"Invalid boolean: {value}", param=name)
    return bool(value == "true")


def limit(params: Params) -> int:
    value = integer(params, "limit", minimum=1)
    if value is None:
        return 10
    if value > 100:
        raise invalid(
            "This value must be less than or equal to 100.",
            param="limit",
            code="parameter_invalid_integer",
        )
    return value


def metadata(params: Params, current: dict[str, str] | None = None) -> dict[str, str]:
    """``current`` updated by the ``metadata`` param: keys merge, ``""`` unsets a key or all."""
    merged = dict(current or {})
    value: Any = params.get("metadata")
    if value is None:
        return merged
    if value == "":
        return {}
    if not isinstance(value, dict):
        raise invalid("Invalid hash", param="metadata")
    for key, item in value.items():
        if not isinstance(item, str):
            raise invalid(f"Invalid value for metadata[{key}]: a string", param=f"metadata[{key}]")
        if len(key) > METADATA_KEY_MAX or len(item) > METADATA_VALUE_MAX:
            raise invalid(
                f"Metadata keys can be up to {METADATA_KEY_MAX} characters and values up to "
                f"{METADATA_VALUE_MAX} characters long.",
                param=f"metadata[{key}]",
            )
        if item == "":
            merged.pop(key, None)
        else:
            merged[key] = item
    if len(merged) > METADATA_MAX_KEYS:
        raise invalid(f"Metadata can have up to {METADATA_MAX_KEYS} keys.", param="metadata")
    return merged


def hash_param(params: Params, name: str, allowed: frozenset[str]) -> Params:
    """A nested hash such as ``invoice_settings[...]``, checked for unknown keys."""
    value = params.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("Invalid hash", param=name)
    for key in value:
        if key not in allowed:
            raise invalid(
                f"Received unknown parameter: {name}[{key}]",
                param=f"{name}[{key}]",
                code="parameter_unknown",
            )
    return value

"""Stripe's error shape: ``{"error": {"type", "code", "message", "param", ...}}`` + HTTP status."""

from __future__ import annotations

from typing import Any

JSON = dict[str, Any]  # a JSON object, as sent and received

INVALID_REQUEST = "invalid_request_error"


class StripeError(Exception):
    """An API error answered to the client in Stripe's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = INVALID_REQUEST,
        code: str | None = None,
        param: str | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error: JSON = {"type": error_type, "message": message}
        if code is not None:
            self.error["code"] = code
            self.error["doc_url"] = f"https://stripe.com/docs/error-codes/{code.replace('_', '-')}"
        if param is not None:
            self.error["param"] = param
        self.error.update(extra)
        self.headers: dict[str, str] = {}

    def body(self) -> JSON:
        return {"error": self.error}


def invalid(message: str, *, param: str | None = None, code: str | None = None) -> StripeError:
    return StripeError(400, message, param=param, code=code)


def missing_param(param: str) -> StripeError:
    return invalid(f"Missing required param: {param}.", param=param, code="parameter_missing")


def no_such(kind: str, object_id: str, *, param: str, status: int = 400) -> StripeError:
    """Unknown id: 404 when it is the URL's resource, 400 when it is a parameter of the request."""
    return StripeError(
        status, f"No such {kind}: '{object_id}'", param=param, code="resource_missing"
    )


def api_error(message: str) -> StripeError:
    return StripeError(500, message, error_type="api_error")

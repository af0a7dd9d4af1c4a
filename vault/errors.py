"""Refusals and admin errors, answered in Stripe's error shape."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from vault.models import Decision, ErrorDetail, ErrorResponse, FieldProblem

INVALID_REQUEST = "invalid_request_error"


class VaultError(Exception):
    """An error answered to the caller: a status, a machine-readable code and a sentence."""

    def __init__(
        self,
        status: int,
        code: str | None,
        message: str,
        *,
        error_type: str = INVALID_REQUEST,
        param: str | None = None,
        fields: list[FieldProblem] | None = None,
        should_retry: bool = False,
        fenced_below: int | None = None,
        close_connection: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.fields = fields
        self.should_retry = should_retry
        self.fenced_below = fenced_below
        self.close_connection = close_connection

    def response(self, headers: Mapping[str, str] | None = None) -> web.Response:
        body = ErrorResponse(
            error=ErrorDetail(
                type=self.error_type,
                code=self.code,
                message=self.message,
                param=self.param,
                fields=self.fields,
                fenced_below=self.fenced_below,
            )
        )
        # The Stripe SDK (with retries on) honours this: a refusal does not change on retry.
        all_headers = {"Stripe-Should-Retry": "true" if self.should_retry else "false"}
        all_headers.update(headers or {})
        response = web.Response(
            status=self.status,
            body=body.model_dump_json(exclude_none=True),
            content_type="application/json",
            headers=all_headers,
        )
        if self.close_connection:
            response.force_close()
        return response


class Refusal(VaultError):
    """A request the vault answers itself; `decision` is what the audit row records (None:
    keep the decision already made, e.g. "forwarded" when the upstream did not answer)."""

    def __init__(
        self, decision: Decision | None, status: int, code: str, message: str, **kwargs: Any
    ) -> None:
        super().__init__(status, code, message, **kwargs)
        self.decision = decision


def invalid_input(error: ValidationError, what: str) -> VaultError:
    """422 naming each bad field and why; input values are left out of the message."""
    problems = [
        FieldProblem(
            field=".".join(str(part) for part in problem["loc"]) or what,
            message=problem["msg"],
        )
        for problem in error.errors(include_input=False, include_url=False)
    ]
    if any(problem["type"] == "json_invalid" for problem in error.errors(include_url=False)):
        return VaultError(400, "body_invalid", f"the {what} is not valid JSON", fields=problems)
    summary = "; ".join(f"{p.field}: {p.message}" for p in problems)
    return VaultError(
        422,
        "parameter_invalid",
        f"invalid {what}: {summary}",
        param=problems[0].field if problems else None,
        fields=problems,
    )

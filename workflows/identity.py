"""What a billing workflow checks of itself before its first command."""

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from billing.data_converter import (
        INVALID_WORKFLOW_INPUT,
        ExtraWorkflowInputError,
        MissingWorkflowInputError,
    )
    from billing.errors import InvalidInputError, shown
    from billing.models import WorkflowInput

WRONG_WORKFLOW_ID = "WrongWorkflowId"

T = TypeVar("T")
InputT = TypeVar("InputT", bound=WorkflowInput)
MethodT = TypeVar("MethodT", bound=Callable[..., Any])


def one_input(model: type[WorkflowInput]) -> Callable[[MethodT], MethodT]:
    """For the method a workflow's input reaches first (its run, or its `@workflow.init`
    constructor): called with more inputs than that one, it fails the workflow saying so
    (ExtraWorkflowInputError). The SDK reads the signature through the wrapper, so the
    input is still decoded to `model`; a `*inputs` of the method's own would drop every
    type hint."""

    def check(inputs: tuple[object, ...]) -> None:
        if len(inputs) > 1:
            raise ExtraWorkflowInputError(model, len(inputs))

    def wrap(method: MethodT) -> MethodT:
        if inspect.iscoroutinefunction(method):

            @functools.wraps(method)
            async def run(self: object, *inputs: object) -> object:
                check(inputs)
                return await method(self, *inputs)

            return cast(MethodT, run)

        @functools.wraps(method)
        def init(self: object, *inputs: object) -> None:
            check(inputs)
            method(self, *inputs)

        return cast(MethodT, init)

    return wrap


def given(request: InputT | None, model: type[InputT]) -> InputT:
    """The workflow's input, or a failure of the workflow saying it has none. A workflow's
    input defaults to None in its signature only so that a start without one reaches this,
    rather than failing every workflow task for as long as the workflow holds its ID."""
    if request is None:
        raise MissingWorkflowInputError(workflow.info().workflow_type, model)
    return request


def checked(check: Callable[[str], T], text: str) -> T:
    """`check(text)` (a period parsed, an id validated), or a failure of the workflow, not of
    its task, that says what was wrong."""
    try:
        return check(text)
    except InvalidInputError as exc:
        raise ApplicationError(str(exc), type=INVALID_WORKFLOW_INPUT, non_retryable=True) from None


def require_id(expected: str, what: str, started_by: str) -> None:
    """Fail unless this run's workflow ID is `expected`: one run of a period, and one charge
    of a customer in it, at a time rest on deterministic IDs, which a run started by hand under
    another (the Web UI's start form, `temporal workflow start` without an ID) would bypass.
    Called before any command, so no recorded history differs."""
    actual = workflow.info().workflow_id
    if actual != expected:
        raise ApplicationError(
            f"{what} must have the workflow ID {expected}, not {shown(actual, 80)}: {started_by}",
            type=WRONG_WORKFLOW_ID,
            non_retryable=True,
        )

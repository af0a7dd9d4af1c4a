"""The data converter of every client, worker and replayer: pydantic's, except that a
workflow input its model refuses fails the workflow, not its task.

The SDK turns a payload that cannot be decoded into a failed workflow task, retried for as
long as the workflow lives: right for a result a new deploy will read, wrong for a workflow
started by hand (Temporal's CLI or Web UI) with a field its model forbids, which would hold
its ID (a period's, a customer's) doing nothing. A FailureError from decoding fails the
workflow instead, so that is what a refused `WorkflowInput` raises.

Its failure converter redacts anything shaped like a key from every failure's message,
stack trace and details (I5): Temporal keeps them in the run's history, for as long as the
namespace keeps the run, and shows them in the Web UI, and an exception no code of ours
wrote (a library's, quoting what it was given) could carry one.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import ValidationError
from temporalio.api.common.v1 import Payload
from temporalio.api.failure.v1 import Failure
from temporalio.contrib.pydantic import PydanticPayloadConverter
from temporalio.converter import DataConverter, DefaultFailureConverter, PayloadConverter
from temporalio.exceptions import ApplicationError

from billing.models import WorkflowInput
from billing.redact import redact, shown_cut

INVALID_WORKFLOW_INPUT = "InvalidWorkflowInput"
# Problems named in the failure; the rest are counted.
PROBLEMS_SHOWN = 5
# Characters of a location's part shown (four times that of a problem's message).
PART_SHOWN = 40


class InvalidWorkflowInputError(ApplicationError):
    """A workflow's input refused: it fails the workflow, not its task, saying why."""

    def __init__(self, why: str) -> None:
        super().__init__(
            f"{why}; nothing was done", type=INVALID_WORKFLOW_INPUT, non_retryable=True
        )


class RefusedWorkflowInputError(InvalidWorkflowInputError):
    """A workflow input its model refuses: in a worker it fails the workflow; a client
    reading one (a schedule's arguments) gets it in place of pydantic's ValidationError."""

    def __init__(self, model: type[WorkflowInput], exc: ValidationError) -> None:
        super().__init__(f"the workflow's input is not a valid {model.__name__}: {problems(exc)}")


class MissingWorkflowInputError(InvalidWorkflowInputError):
    """A workflow started with no input at all (`temporal workflow start` without `--input`,
    the Web UI's start form left empty): the SDK then calls it with no argument, and the
    converter never sees one, so the workflow raises this itself."""

    def __init__(self, workflow_type: str, model: type[WorkflowInput]) -> None:
        super().__init__(
            f"the workflow's input is missing: {workflow_type} takes one {model.__name__}"
        )


class ExtraWorkflowInputError(InvalidWorkflowInputError):
    """More inputs than the workflow takes (a second `--input` to `temporal workflow
    start`): the SDK then decodes none of them to its model and calls the workflow with them
    all, whose TypeError would fail every workflow task for as long as the workflow lived,
    holding its ID; so the workflow raises this itself (workflows.identity.one_input)."""

    def __init__(self, model: type[WorkflowInput], given: int) -> None:
        super().__init__(
            f"the workflow takes one input, a {model.__name__}, and {given} were given"
        )


class BillingPayloadConverter(PydanticPayloadConverter):
    def from_payloads(
        self, payloads: Sequence[Payload], type_hints: list[type] | None = None
    ) -> list[Any]:
        try:
            return super().from_payloads(payloads, type_hints)
        except ValidationError as exc:
            refused = next(
                (
                    t
                    for hint in type_hints or ()
                    for t in _optional_of(hint)
                    if isinstance(t, type) and issubclass(t, WorkflowInput)
                ),
                None,
            )
            if refused is None:
                raise
            raise RefusedWorkflowInputError(refused, exc) from None


def _optional_of(hint: Any) -> tuple[Any, ...]:
    """The types a hint admits where it is `X | None` (a workflow's input is optional in its
    signature: MissingWorkflowInputError), else the hint itself."""
    if get_origin(hint) in (Union, UnionType) and type(None) in get_args(hint):
        return get_args(hint)
    return (hint,)


def problems(exc: ValidationError) -> str:
    """Where and what, without the values given (a value may be anything, a secret too). A
    location is the caller's own text where it names a field the model forbids or a dict's
    key, so each part is redacted and cut, as is the whole."""
    errors = exc.errors(include_url=False, include_input=False)
    shown = [
        f"{'.'.join(shown_cut(str(part), PART_SHOWN) for part in e['loc']) or 'the input'}:"
        f" {shown_cut(e['msg'], PART_SHOWN * 4)}"
        for e in errors[:PROBLEMS_SHOWN]
    ]
    if len(errors) > PROBLEMS_SHOWN:
        shown.append(f"and {len(errors) - PROBLEMS_SHOWN} more")
    return shown_cut("; ".join(shown), PART_SHOWN * 25)


class RedactingFailureConverter(DefaultFailureConverter):
    def to_failure(
        self, exception: BaseException, payload_converter: PayloadConverter, failure: Failure
    ) -> None:
        # The SDK converts each cause through this method too.
        super().to_failure(exception, payload_converter, failure)
        failure.message = redact(failure.message)
        failure.stack_trace = redact(failure.stack_trace)
        for payload in _details(failure):
            # JSON text: a key is a run of [A-Za-z0-9_-] inside a string, and its stand-in
            # keeps the string, and the document, valid.
            if payload.metadata.get("encoding") == b"json/plain":
                payload.data = redact(payload.data.decode()).encode()


def _details(failure: Failure) -> Sequence[Payload]:
    """The payloads an error carries along with its message (ApplicationError's details,
    a cancel's)."""
    if failure.HasField("application_failure_info"):
        return failure.application_failure_info.details.payloads
    if failure.HasField("canceled_failure_info"):
        return failure.canceled_failure_info.details.payloads
    return []


DATA_CONVERTER = DataConverter(
    payload_converter_class=BillingPayloadConverter,
    failure_converter_class=RedactingFailureConverter,
)

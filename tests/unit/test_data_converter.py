"""What a refused workflow input's failure says: it lands in the run's history (the Web UI,
`temporal workflow show`, the starter's error), so it shows nothing the input carried, and
stays short whatever the input. A field the model forbids, or a dict's key, is named by the
caller's own text, which pydantic's `include_input=False` does not hide."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import pytest
from pydantic import ValidationError
from temporalio.api.failure.v1 import Failure
from temporalio.exceptions import ApplicationError

from billing.data_converter import DATA_CONVERTER, RefusedWorkflowInputError
from billing.models import (
    BillingPeriodInput,
    Claim,
    CustomerChargeInput,
    CustomerOutcome,
    RunOptions,
    WorkflowInput,
)
from tests.unit.claims import CLAIM

KEY = "sk_live_" + "A1b2C3d4E5f6G7h8I9j0K1l2"


def _refusal(model: type[WorkflowInput], payload: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as refused:
        model.model_validate(payload)
    return RefusedWorkflowInputError(model, refused.value).message


@pytest.mark.parametrize(
    ("model", "payload"),
    [
        pytest.param(
            CustomerChargeInput,
            {"period": "2026-12", "customer_id": "cust-1", KEY: "stripe_key"},
            id="a-forbidden-fields-name",
        ),
        pytest.param(
            BillingPeriodInput,
            {
                "period": "2026-12",
                "state": {"period": "2026-12", "counts": {"charged_by_currency": {KEY: "x"}}},
            },
            id="a-dict-key",
        ),
    ],
)
def test_a_key_given_as_a_name_is_not_shown(
    model: type[WorkflowInput], payload: dict[str, Any]
) -> None:
    message = _refusal(model, payload)
    assert KEY not in message and "[redacted key]" in message, message


def test_the_message_is_bounded_whatever_the_names() -> None:
    payload = {"period": "2026-12", **{f"f{n}_" + "x" * 20_000: 1 for n in range(5)}}
    message = _refusal(BillingPeriodInput, payload)
    assert len(message) < 1_200, len(message)
    assert message.startswith("the workflow's input is not a valid BillingPeriodInput: f0_xxx")


def test_a_failure_and_its_causes_keep_no_key() -> None:
    """What Temporal keeps of an exception no code of ours wrote: its message and stack
    trace, and each cause's, in the run's history (I5)."""
    try:
        try:
            raise ConnectionError(f"upstream refused {KEY}")
        except ConnectionError as cause:
            raise RuntimeError(f"charge failed with {KEY}") from cause
    except RuntimeError as error:
        failure = Failure()
        DATA_CONVERTER.failure_converter.to_failure(
            error, DATA_CONVERTER.payload_converter, failure
        )
    assert failure.message == "charge failed with [redacted key]"
    assert failure.cause.message == "upstream refused [redacted key]"
    assert KEY not in str(failure) and failure.stack_trace


def test_an_errors_details_keep_no_key() -> None:
    """Details go to the run's history beside the message: one producer that forgot to
    redact what it put there (a Stripe error's text, say) would keep a key there."""
    error = ApplicationError(
        "declined", {"message": f"upstream refused {KEY}"}, [KEY], type="CardDeclined"
    )
    failure = Failure()
    DATA_CONVERTER.failure_converter.to_failure(error, DATA_CONVERTER.payload_converter, failure)
    assert KEY not in str(failure)
    details = DATA_CONVERTER.payload_converter.from_payloads(
        failure.application_failure_info.details.payloads
    )
    assert details == [{"message": "upstream refused [redacted key]"}, ["[redacted key]"]]


# A value that is no key, so that only leaving it out keeps it from the run's history.
CARD = "4242424242424242"


def _decoded(value: dict[str, Any], hint: Any) -> Any:
    converter = DATA_CONVERTER.payload_converter
    return converter.from_payloads(converter.to_payloads([value]), [hint])[0]


@pytest.mark.parametrize(
    "hint",
    [CustomerChargeInput, CustomerChargeInput | None, Optional[CustomerChargeInput]],  # noqa: UP045
    ids=["the-model", "x-or-none", "optional"],
)
def test_a_workflow_input_its_model_refuses_is_a_failure_showing_no_value(hint: Any) -> None:
    """A failure fails the workflow (its ID freed at once); pydantic's error, kept as its
    cause, would quote each value given in the run's history."""
    with pytest.raises(RefusedWorkflowInputError) as refused:
        _decoded({"period": "2026-12", "customer_id": int(CARD)}, hint)
    assert "customer_id: Input should be a valid string" in refused.value.message
    failure = Failure()
    DATA_CONVERTER.failure_converter.to_failure(
        refused.value, DATA_CONVERTER.payload_converter, failure
    )
    assert CARD not in str(failure), failure


def test_a_claims_age_by_the_ledgers_clock_stays_out_of_a_workflows_payloads() -> None:
    """A workflow passing a claim on (to the charge, to its next run) passes no age that
    grows stale in its history: the charge reads the claim's age from the ledger again."""
    aged = CLAIM.model_copy(update={"claimed_ago": timedelta(hours=30)})
    converter = DATA_CONVERTER.payload_converter
    assert converter.from_payloads(converter.to_payloads([aged]), [Claim]) == [CLAIM]


@pytest.mark.parametrize(
    "hint", [CustomerOutcome, CustomerOutcome | None], ids=["the-model", "x-or-none"]
)
def test_any_other_value_its_model_refuses_stays_pydantics_error(hint: Any) -> None:
    """An activity's or a child's result an older worker cannot read fails the workflow
    task, retried until a worker that reads it takes it: failing the workflow would end a
    period's run half done."""
    with pytest.raises(ValidationError):
        _decoded({"customer_id": "cust-1", "outcome": "refunded"}, hint)


@pytest.mark.parametrize(
    ("option", "least", "most"),
    [
        # Within Temporal's own limits: 2,000 pending children a run, 51,200 events a history.
        ("max_in_flight", 1, 1500),
        ("max_starting", 1, 1500),
        ("page_size", 1, 5000),
        ("history_event_limit", 200, 40000),
        ("child_history_event_limit", 10, 40000),
        ("hand_over_after_seconds", 0, 600),
    ],
)
def test_a_runs_options_are_taken_up_to_their_limits_and_refused_past_them(
    option: str, least: int, most: int
) -> None:
    for value in (least, most):
        assert getattr(RunOptions.model_validate({option: value}), option) == value
    for value in (least - 1, most + 1):
        with pytest.raises(ValidationError, match=option):
            RunOptions.model_validate({option: value})

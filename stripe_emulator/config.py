"""Run-time configuration of the emulator: fault probabilities, latency, rate limit, seed."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


def _probability(description: str) -> Any:
    return Field(default=0.0, ge=0.0, le=1.0, description=description)


class EmulatorConfig(BaseModel):
    """Also the JSON body of ``POST /_emulator/faults`` (partial updates allowed)."""

    # Unknown fields are refused so a misspelled fault name fails loudly instead of doing nothing.
    model_config = ConfigDict(extra="forbid", frozen=True)

    drop_after_commit: float = _probability(
        "probability that a money-moving request is committed, then the connection is closed"
    )
    error_before_commit: float = _probability(
        "probability of a 500 before executing (not saved: a retry executes afresh)"
    )
    error_saved_before_commit: float = _probability(
        "probability of a 500 saved for the key before executing: nothing is charged, and a"
        " retry with the key replays the 500 until the key is forgotten"
    )
    error_after_commit: float = _probability(
        "probability of a 500 after committing (saved and replayed for the key)"
    )
    rate_limited: float = _probability(
        "probability of a 429 before executing, as Stripe answers past its rate limit, whatever"
        " the rate (nothing saved: a retry executes afresh)"
    )
    latency_ms: int = Field(
        default=0, ge=0, le=600_000, description="delay added to every /v1 request"
    )
    rate_limit_rps: float | None = Field(
        default=None, gt=0, description="requests per second per API key (default: unlimited)"
    )
    endpoint_rate_limit_rps: float | None = Field(
        default=None,
        gt=0,
        description="requests per second per API key and endpoint, each method and path"
        " (POST /v1/payment_intents, GET /v1/charges/{id}) its own, as Stripe counts them"
        " (Stripe's default is 25; here, default: unlimited)",
    )
    seed: int | None = Field(default=None, description="seed of the fault draws")
    idempotency_ttl_seconds: float = Field(
        default=86_400,
        gt=0,
        description="how long a saved idempotent result is replayed (a change applies to every"
        " result saved already)",
    )

    def updated(self, changes: dict[str, Any]) -> EmulatorConfig:
        """A validated copy with ``changes`` applied; fields not in ``changes`` keep their value."""
        return EmulatorConfig.model_validate({**self.model_dump(), **changes})

"""Bodies of the admin API, shared by the server (validation, OpenAPI) and the client."""

from __future__ import annotations

import secrets
from datetime import UTC, date, datetime, timedelta
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    RootModel,
    SecretStr,
    SerializationInfo,
    StringConstraints,
    ValidationInfo,
    WithJsonSchema,
    field_serializer,
    field_validator,
)

from billing.money import validate_currency
from billing.stripe_currencies import STRIPE_CURRENCIES
from vault.endpoints import ENTRY_PATTERN, beyond_worker_endpoints, malformed_entries

KEY_ID_PATTERN = r"^vkey_[0-9a-f]{16}$"
SECRET_PREFIX = "vk_"  # noqa: S105 (a prefix, not a secret)
IDEMPOTENCY_KEY_PATTERN = r"^[A-Za-z0-9_.:-]{1,255}$"
# How a spend_cap_exceeded names a key's daily cap (keys issued by hand may have one), which
# the run's advice reads: it frees itself at midnight UTC, where a renewal would not help.
DAILY_CAP = "daily cap (UTC day)"
# Validation context: the server's ceiling on caps (VAULT_MAX_CAP_CENTS).
MAX_CAP_CONTEXT = "max_cap_cents"
# Serialisation context under which IssuedKey's secret is written out instead of masked.
REVEAL_SECRET_CONTEXT = "reveal_secret"  # noqa: S105

KeyId = Annotated[str, StringConstraints(pattern=KEY_ID_PATTERN)]
# Years 2000-2999, as billing.periods allows: a schema pattern, so the OpenAPI document says so.
Period = Annotated[str, StringConstraints(pattern=r"^2[0-9]{3}-(0[1-9]|1[0-2])$")]
CURRENCY_PATTERN = r"^[a-z]{3}$"
# One Stripe charges in: a key in another could never be spent, and its cap would hold room
# in the worker token's budget for nothing. The OpenAPI document lists them.
Currency = Annotated[
    str,
    StringConstraints(pattern=CURRENCY_PATTERN),
    AfterValidator(validate_currency),
    WithJsonSchema({"type": "string", "enum": sorted(STRIPE_CURRENCIES)}),
]
Label = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9 _.:/@-]{0,99}$")]
Endpoint = Annotated[str, StringConstraints(pattern=ENTRY_PATTERN)]
IdempotencyKey = Annotated[str, StringConstraints(pattern=IDEMPOTENCY_KEY_PATTERN)]


def _integral_number(value: object) -> object:
    # JSON Schema counts 100.0 as an integer; "100", 100.5 and true stay refused (strict).
    return int(value) if isinstance(value, float) and value.is_integer() else value


Cents = Annotated[int, Field(gt=0), BeforeValidator(_integral_number)]
Attempt = Annotated[int, Field(ge=1), BeforeValidator(_integral_number)]
Seconds = Annotated[int, Field(ge=1, le=30 * 86400), BeforeValidator(_integral_number)]
# As the proxy takes it in its Vault-Fencing-Token header.
FencingToken = Annotated[int, Field(ge=1, le=999_999_999), BeforeValidator(_integral_number)]
ReservationState = Literal["pending", "unknown", "committed", "released"]
Decision = Literal[
    "forwarded",
    "replayed",
    "refused_auth",
    "refused_endpoint",
    "refused_request",
    "refused_cap",
    "refused_daily_cap",
    "refused_in_flight",
]
# What the admin API did to a key, recorded in the key's audit with the token that did it.
AdminAction = Literal["issued", "revoked", "resolved", "fenced"]
Role = Literal["admin", "worker"]


class Body(BaseModel):
    """A request body: unknown fields and coercions (a cap given as "100") are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Query(BaseModel):
    """Query parameters: strings converted to their types, unknown names refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class View(BaseModel):
    """A response body; fields the client does not know yet are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)


def new_key_id() -> str:
    """A fresh vault key id: 64 random bits, so ids callers choose do not meet."""
    return "vkey_" + secrets.token_hex(8)


def past_ceiling(cents: int, ceiling: int) -> str | None:
    """Why a cap or daily cap cannot be issued under VAULT_MAX_CAP_CENTS; None if it can."""
    if cents > ceiling:
        return f"{cents} exceeds this vault's ceiling VAULT_MAX_CAP_CENTS={ceiling}"
    return None


def never_issuable(
    *,
    cap_cents: int,
    daily_cap_cents: int | None,
    allowed_endpoints: list[str],
    issued_by: str,
    max_cap_cents: int,
) -> str | None:
    """Why the admin API could never have issued a key like this; None if it could.

    The same checks as an issue's (IssueKeyRequest, budget.admit), for the proxy to apply to
    every key row it is shown: whoever can write vault_keys can write any row."""
    for name, cents in (("cap_cents", cap_cents), ("daily_cap_cents", daily_cap_cents)):
        past = None if cents is None else past_ceiling(cents, max_cap_cents)
        if past is not None:
            return f"its {name} {past}"
    malformed = malformed_entries(allowed_endpoints)
    if malformed:
        return f"it allows {len(malformed)} endpoint(s) no key may allow"
    if issued_by not in ("admin", "worker"):
        return "it names neither token as its issuer"
    if issued_by == "worker" and beyond_worker_endpoints(allowed_endpoints):
        return "it was issued with the worker token but allows endpoints beyond WORKER_ENDPOINTS"
    return None


class IssueKeyRequest(Body):
    key_id: KeyId | None = Field(
        default=None,
        description="the new key's id, chosen by the caller (new_key_id) so that one who loses"
        " the answer still knows which key to revoke; drawn by the vault when absent. An id"
        " already taken is refused (409): the secret is shown once, to the request that"
        " issued the key.",
    )
    vendor: Literal["stripe"] = "stripe"
    label: Label
    period: Period
    cap_cents: Cents
    currency: Currency
    daily_cap_cents: Cents | None = Field(
        default=None, description="at most cap_cents; counted per UTC day"
    )
    allowed_endpoints: list[Endpoint] = Field(
        min_length=1,
        max_length=50,
        description="'METHOD /v1/path' entries; '*' matches one path segment. GET anything,"
        " POST only the metered 'POST /v1/payment_intents' and 'POST /v1/charges', and"
        " 'POST /v1/payment_intents/*/cancel' (an unconfirmed intent of a charge in doubt of the"
        " key's period).",
    )
    expires_at: AwareDatetime

    @field_validator("cap_cents", "daily_cap_cents")
    @classmethod
    def _within_ceiling(cls, cap: int | None, info: ValidationInfo) -> int | None:
        ceiling = (info.context or {}).get(MAX_CAP_CONTEXT)
        past = None if cap is None or ceiling is None else past_ceiling(cap, ceiling)
        if past is not None:
            raise ValueError(past)
        return cap

    @field_validator("daily_cap_cents")
    @classmethod
    def _within_cap(cls, daily: int | None, info: ValidationInfo) -> int | None:
        cap = info.data.get("cap_cents")
        if daily is not None and cap is not None and daily > cap:
            raise ValueError(f"must not exceed cap_cents ({cap}): a larger daily cap never applies")
        return daily

    @field_validator("expires_at")
    @classmethod
    def _in_future(cls, expires_at: datetime) -> datetime:
        if expires_at <= datetime.now(UTC):
            raise ValueError("must be in the future")
        return expires_at

    @field_validator("allowed_endpoints")
    @classmethod
    def _unique(cls, entries: list[str]) -> list[str]:
        return list(dict.fromkeys(entries))


class KeyInfo(View):
    id: KeyId
    vendor: Literal["stripe"]
    label: str
    period: str
    currency: str
    cap_cents: int
    daily_cap_cents: int | None
    reserved_cents: int = Field(description="pending and unknown reservations")
    spent_cents: int = Field(description="committed reservations")
    remaining_cents: int = Field(description="cap_cents - reserved_cents - spent_cents")
    daily_used_cents: int | None = Field(description="reserved + spent today (UTC), if capped")
    allowed_endpoints: list[str]
    expires_at: datetime
    expired: bool
    revoked: bool
    revoked_at: datetime | None
    # Defaulted, so a newer client reads the keys of a vault from before it was recorded.
    revoked_by: Role | None = Field(
        default=None,
        description="the token that revoked the key (admin, if both did); a worker key the"
        " admin revoked counts its whole cap against the worker budget for the window",
    )
    created_at: datetime
    # Defaulted, so a newer client reads the keys of a vault from before the worker token.
    issued_by: Literal["admin", "worker"] = Field(
        default="admin",
        description="the token that issued it; worker keys count against the worker budget",
    )


class IssuedKey(KeyInfo):
    """The key as issued: the only response that ever carries its secret."""

    secret: Annotated[
        SecretStr,
        WithJsonSchema(
            {"type": "string", "pattern": r"^vk_[A-Za-z0-9_-]{43}$", "description": "shown once"}
        ),
    ]

    @field_serializer("secret", when_used="json")
    def _reveal_only_to_issuer(self, secret: SecretStr, info: SerializationInfo) -> str:
        # Masked by default, so a model logged or recorded by accident does not leak the key.
        if (info.context or {}).get(REVEAL_SECRET_CONTEXT):
            return secret.get_secret_value()
        return str(secret)


class KeyList(View):
    keys: list[KeyInfo] = Field(description="newest first")
    next_before: KeyId | None = Field(
        default=None, description="more keys match: pass as `before` for the next page"
    )


class FindKeysQuery(Query):
    period: Period | None = None
    label: Label | None = None
    limit: int = Field(default=1000, ge=1, le=1000)
    before: KeyId | None = Field(default=None, description="a page's `next_before`")


class AuditEntry(View):
    id: int
    at: datetime
    vault_key_id: str | None
    method: str
    path: str
    idempotency_key: str | None
    amount_cents: int | None
    currency: str | None
    customer: str | None
    upstream_status: int | None = Field(description="null: refused, or the upstream never answered")
    decision: Decision | AdminAction
    refusal_code: str | None
    reservation_state: ReservationState | None
    latency_ms: float
    actor: Role | None = Field(
        default=None,
        description="the token an admin call was made with; null for a call through the key",
    )


class AuditPage(View):
    entries: list[AuditEntry] = Field(
        description="newest first: requests through the key, and what the admin API did to it"
    )
    next_before: int | None = Field(description="pass as `before` for the next page")


class AuditQuery(Query):
    limit: int = Field(default=100, ge=1, le=500)
    before: int | None = Field(default=None, ge=1, le=2**62)


class ReservationInfo(View):
    idempotency_key: str
    endpoint: str
    state: ReservationState
    amount_cents: int
    committed_cents: int | None
    currency: str
    customer: str | None
    day: date
    attempt: int
    upstream_status: int | None
    created_at: datetime
    updated_at: datetime
    # Defaulted, so a newer client reads a vault from before it.
    counted_under: KeyId | None = Field(
        default=None,
        description="committed, but this vault key had committed the same request first:"
        " the charge's spend is counted there",
    )


class ReservationList(View):
    reservations: list[ReservationInfo]
    # Defaulted, so a newer client reads a vault from before pages.
    next_after: int | None = Field(
        default=None, description="pass as `after` for the next page; none after the last"
    )


class ReservationsQuery(Query):
    state: ReservationState | None = None
    limit: int = Field(default=100, ge=1, le=1000)
    after: int | None = Field(
        default=None, ge=0, le=2**62, description="a page's `next_after`: the page after it"
    )


class _Resolution(Body):
    # Without it a retry that took the reservation over between the lookup and this call,
    # and whose charge Stripe took, would be settled by the older attempt's finding.
    attempt: Attempt | None = Field(
        default=None,
        description="the reservation's attempt the outcome was found for; refused (409) if a"
        " retry has taken the reservation over since",
    )


class ResolveSucceeded(_Resolution):
    outcome: Literal["succeeded"]
    amount_cents: Cents | None = Field(
        default=None, description="amount Stripe charged, if less than the reserved amount"
    )


class ResolveFailed(_Resolution):
    outcome: Literal["failed"]
    # By the vault's own clock: a caller's clock ahead would release a request Stripe may
    # still commit.
    min_idle_seconds: Seconds | None = Field(
        default=None,
        description="release only if the reservation has not changed for this long past the"
        " vault's longest wait on Stripe (its upstream timeout plus 10 s), by the vault's"
        " clock; refused (409) otherwise",
    )


class ResolveRequest(
    RootModel[Annotated[ResolveSucceeded | ResolveFailed, Field(discriminator="outcome")]]
):
    """What reconciliation found on Stripe for a reservation left in the unknown state."""

    model_config = ConfigDict(frozen=True)

    @property
    def amount_cents(self) -> int | None:
        return self.root.amount_cents if isinstance(self.root, ResolveSucceeded) else None

    @property
    def min_idle(self) -> timedelta | None:
        seconds = self.root.min_idle_seconds if isinstance(self.root, ResolveFailed) else None
        return None if seconds is None else timedelta(seconds=seconds)


class FenceRequest(Body):
    """Refuse, from now on, every request of the idempotency key through the key whose
    fencing token is below `below`, or that carries none: its earlier attempts, one of which
    may be held up on its way."""

    below: FencingToken


class Fence(View):
    idempotency_key: str
    fenced_below: int = Field(description="the fence standing: it is only ever raised")


class Status(View):
    status: str


class FieldProblem(View):
    field: str
    message: str


class ErrorDetail(View):
    """Stripe's error shape, so the Stripe SDK and the admin client read refusals alike."""

    type: str
    code: str | None = None
    message: str
    param: str | None = None
    fields: list[FieldProblem] | None = None
    # A spend_cap_exceeded of a request with a Vault-Fencing-Token, or an attempt_superseded:
    # the fence standing, below which no request with that Idempotency-Key is sent through
    # this key again.
    fenced_below: int | None = None


class ErrorResponse(View):
    error: ErrorDetail

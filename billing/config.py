"""Settings from environment variables, with defaults that match the local stack."""

from __future__ import annotations

import re
from typing import Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from billing.db_roles import DatabaseRoles
from billing.errors import BillingError, MigrationError, validation_reason
from billing.models import ChargeApi
from billing.redact import one_line
from billing.sealing import SETTING, SecretBox

S = TypeVar("S", bound=BaseSettings)
T = TypeVar("T", bound=str | SecretStr)

# The oldest a claim may be before it is looked up on Stripe first (billing_lookup_after_seconds).
LOOKUP_AFTER_MAX_SECONDS = 23 * 3600
# The local emulator's address (the devstack's and the tests'), Stripe's stand-in here.
DEFAULT_STRIPE_API_BASE = "http://127.0.0.1:12111"
# A scheme, a host (with its port), and any path. No user or password before the host, and
# no query or fragment: the vault and Stripe take their tokens in headers, the workers log
# these URLs, and the CLI prints the Web UI's with every run's link.
_HTTP_URL = re.compile(r"https?://[^\s/@?#]+(/[^\s?#]*)?")
# A host (a name, an IPv4 or a bracketed IPv6 address) and its port: nothing else, such as a
# user and password, or an API key pasted into the wrong variable, which errors then echo.
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?):[0-9]{1,5}")
# Temporal's namespace names: letters, digits, '.', '-' and '_'.
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def http_url(value: str) -> str:
    if not _HTTP_URL.fullmatch(value) or not _names_a_host(value):
        raise ValueError(
            "must be an http:// or https:// URL with a host (and a port from 1 to 65535, if"
            " any) and no user, password, query or fragment, such as http://host:8080"
        )
    return value


def _names_a_host(url: str) -> bool:
    """Whether the URL has a host, and a port a connection can be made to if it gives one:
    `http://:8080` or port 99999 would fail only at the first call."""
    parts = urlsplit(url)
    try:
        port = parts.port  # ValueError past 65535
    except ValueError:
        return False
    return bool(parts.hostname) and port != 0


def stripe_api_base(value: str) -> str:
    """Stripe's base URL as its client takes it: the SDK adds `/v1/...` to it, so a base
    written as Stripe's reference writes the API's (`https://api.stripe.com/v1`) sends every
    request to `/v1/v1/...`, which Stripe answers 404."""
    base = http_url(value).rstrip("/")
    if base.lower().endswith("/v1"):  # a hand-typed /V1 fails the same way
        raise ValueError(
            "ends in /v1, which the client adds itself: give the base without it, such as"
            " https://api.stripe.com"
        )
    return base


def stripe_secret_key(value: SecretStr) -> SecretStr:
    """A Stripe secret or restricted key: a publishable key, or one read with a line break
    (a secret made with `echo`), is refused on every request, or fails it before sending."""
    if not value.get_secret_value().startswith(("sk_", "rk_")):
        raise ValueError("must be a Stripe secret or restricted key (sk_... or rk_...)")
    refuse_untrimmed(value)
    return value


def words(value: T) -> T:
    """A value set by hand: not blank, with no spaces or line break around it."""
    text = value.get_secret_value() if isinstance(value, SecretStr) else value
    if not text.strip():
        raise ValueError("is set but blank: give it a value, or unset it")
    refuse_untrimmed(value)
    return value


def namespace_name(value: str) -> str:
    if not _NAMESPACE.fullmatch(value):
        raise ValueError("must be a namespace's name: letters, digits, '.', '-' and '_'")
    return value


def host_port(value: str) -> str:
    if not _HOST_PORT.fullmatch(value) or not 1 <= int(value.rsplit(":", 1)[1]) <= 65535:
        raise ValueError(
            "must be host:port, such as 127.0.0.1:7233, with a port from 1 to 65535 and no"
            " scheme, user or password (a Temporal Cloud API key goes in TEMPORAL_API_KEY)"
        )
    return value


def refuse_untrimmed(value: SecretStr | str | None) -> None:
    """A setting read with spaces or a line break around it (an env file written by hand, a
    secret made with `echo`) is refused at start, by name: sent in a header, it fails every
    request later with a message that names no setting."""
    text = value.get_secret_value() if isinstance(value, SecretStr) else value
    if text is not None and text != text.strip():
        raise ValueError("has spaces or a line break around it: remove them")


class SettingsError(BillingError):
    """The environment holds a missing or bad setting."""


def load_settings(cls: type[S]) -> S:
    """`cls` from the environment. A bad value is reported by its variable's name and why,
    never by its value: pydantic's own message would show the input, secrets included."""
    try:
        return cls()
    except ValidationError as error:
        prefix = cls.model_config.get("env_prefix") or ""
        lines = []
        for problem in error.errors(include_input=False, include_url=False):
            name = prefix + "_".join(str(part) for part in problem["loc"]).upper()
            reason = (
                "is required but not set"
                if problem["type"] == "missing"
                else validation_reason(problem["msg"])
            )
            lines.append(f"{name}: {reason}" if problem["loc"] else reason)
        raise SettingsError("invalid settings:\n  " + "\n  ".join(lines)) from None


class TemporalSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="TEMPORAL_", extra="ignore", hide_input_in_errors=True
    )

    address: str = "127.0.0.1:7233"
    namespace: str = "default"
    task_queue: str = "billing"
    ui_url: str = "http://127.0.0.1:8233"

    @field_validator("ui_url")
    @classmethod
    def _ui_url(cls, value: str) -> str:
        # The CLI prints it with every run's link.
        return http_url(value)

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return host_port(value)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        return namespace_name(value)

    @field_validator("task_queue")
    @classmethod
    def _task_queue(cls, value: str) -> str:
        # "billing\n" is another queue, which no worker or starter of the others polls.
        return words(value)


class DatabaseSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore", hide_input_in_errors=True)

    database_url: str = Field(
        default="postgresql://postgres@127.0.0.1:5433/billing",
        description="PostgreSQL holding the billing ledger",
    )

    @field_validator("database_url")
    @classmethod
    def _database_named(cls, value: str) -> str:
        # Blank, asyncpg would try PGHOST, local sockets and localhost as this OS user, and
        # migrate whichever PostgreSQL answered.
        if not value.strip():
            raise ValueError("is set but blank: name the billing ledger's PostgreSQL")
        return value


class OperatorSettings(BaseSettings):
    """Who the CLI records as steering a run, when `--operator` names no one."""

    model_config = SettingsConfigDict(extra="ignore", hide_input_in_errors=True)

    billing_operator: str | None = Field(
        default=None, description="the name recorded with a pause, cancel, skip or mark"
    )

    @field_validator("billing_operator")
    @classmethod
    def _named(cls, value: str | None) -> str | None:
        if value is not None and not one_line(value).strip():
            # As compose passes it on when the shell has none: the login there is the
            # image's, no person's.
            raise ValueError(
                "is set but empty: set it to your name (docker compose run -e"
                " BILLING_OPERATOR=...), or pass --operator"
            )
        return value


class DatabaseRolesSettings(BaseSettings):
    """The roles `starter.py migrate` grants to after migrating (billing/db_roles.py): the
    workers' and CLI's (the ledger's), and the vault's. Both or neither; unset, nothing is
    granted, as before roles (every process then shares the owner's role)."""

    model_config = SettingsConfigDict(extra="ignore", hide_input_in_errors=True)

    billing_db_ledger_role: str | None = Field(
        default=None, description="role of DATABASE_URL for workers and the CLI"
    )
    billing_db_vault_role: str | None = Field(
        default=None, description="role of the vault's VAULT_DATABASE_URL"
    )

    @model_validator(mode="after")
    def _both_or_neither(self) -> DatabaseRolesSettings:
        if (self.billing_db_ledger_role is None) != (self.billing_db_vault_role is None):
            raise ValueError(
                "set both BILLING_DB_LEDGER_ROLE and BILLING_DB_VAULT_ROLE, or neither: granting"
                " one role alone would leave the other without its tables"
            )
        try:
            self.roles()
        except MigrationError as exc:
            raise ValueError(str(exc)) from None
        return self

    def roles(self) -> DatabaseRoles | None:
        if self.billing_db_ledger_role is None or self.billing_db_vault_role is None:
            return None
        return DatabaseRoles(ledger=self.billing_db_ledger_role, vault=self.billing_db_vault_role)


class CapSettings(BaseSettings):
    """How far a period's vault key may go past its expected total: all `preview` needs, so
    that it asks for none of the workers' secrets."""

    model_config = SettingsConfigDict(extra="ignore", hide_input_in_errors=True)

    # The period's vault key is capped at the expected total times this.
    billing_cap_multiplier: float = Field(default=1.10, ge=1.0, le=10.0, allow_inf_nan=False)


class BillingSettings(CapSettings):
    """What the worker needs to charge: where Stripe is and how keys are derived."""

    stripe_api_base: str = DEFAULT_STRIPE_API_BASE
    stripe_api_key: SecretStr = SecretStr("sk_test_local_emulator")
    billing_charge_api: ChargeApi = "payment_intents"
    billing_key_namespace: str = Field(default="billing", min_length=1)
    # Under a second, every charge would time out and be retried for ever.
    billing_stripe_timeout_seconds: float = Field(default=30.0, ge=1, allow_inf_nan=False)
    # Claims older than this are looked up on Stripe before a new request: Stripe keeps
    # idempotency keys for 24 hours, so a later replay would execute as a new charge. At most
    # 23 hours, an hour for clocks that disagree (the vault refuses replays from then on too).
    billing_lookup_after_seconds: float = Field(
        default=LOOKUP_AFTER_MAX_SECONDS, gt=0, allow_inf_nan=False
    )
    # With a vault, workers charge through it with per-period keys and never hold the Stripe
    # secret (STRIPE_API_KEY is then unused); the worker token lets them issue those keys
    # within the vault's worker budget. The admin token still works in its place, for
    # deployments from before the worker token, but a worker taken over could then mint keys
    # without limit.
    billing_vault_url: str | None = None
    billing_vault_worker_token: SecretStr | None = None
    billing_vault_admin_token: SecretStr | None = None
    billing_vault_key_grace_days: int = Field(default=7, ge=1, le=90)
    # Fernet keys, newest first, that seal those keys' secrets in the ledger database
    # (billing/sealing.py): whoever reads the database cannot charge with them.
    billing_key_encryption_keys: SecretStr | None = None
    # Stripe requests per second for all workers together, so the cluster stays under
    # Stripe's rate (25/s per endpoint by default, which every charge shares): charges take
    # slots in the ledger database (billing/rate_limit.py). Unset means no limit; under one
    # request a minute is a typo.
    billing_stripe_rps: float | None = Field(default=None, ge=1 / 60, allow_inf_nan=False)

    @field_validator("billing_lookup_after_seconds")
    @classmethod
    def _looked_up_within_stripes_window(cls, value: float) -> float:
        if value > LOOKUP_AFTER_MAX_SECONDS:
            raise ValueError(
                f"at most {LOOKUP_AFTER_MAX_SECONDS} (23 hours): Stripe forgets an idempotency"
                " key after 24 hours, so a claim retried later without a lookup first could be"
                " charged a second time"
            )
        return value

    @field_validator("billing_key_namespace")
    @classmethod
    def _key_namespace(cls, value: str) -> str:
        # Part of every idempotency key: "billing " would key a period's charges afresh.
        return words(value)

    @field_validator("billing_key_encryption_keys")
    @classmethod
    def _encryption_keys_valid(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            SecretBox(value)
        return value

    @field_validator("billing_vault_url", "billing_vault_worker_token", "billing_vault_admin_token")
    @classmethod
    def _not_blank(cls, value: str | SecretStr | None) -> str | SecretStr | None:
        # A blank value (`NAME=` in an env file) would read as unset: the worker would charge
        # Stripe directly, with no spend cap, and say nothing.
        return None if value is None else words(value)

    @field_validator("billing_vault_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return None if value is None else http_url(value)

    @field_validator("stripe_api_base")
    @classmethod
    def _stripe_api_base(cls, value: str) -> str:
        return stripe_api_base(value)

    @field_validator("stripe_api_key")
    @classmethod
    def _stripe_api_key(cls, value: SecretStr) -> SecretStr:
        refuse_untrimmed(value)
        return value

    @model_validator(mode="after")
    def _vault_needs_its_secrets(self) -> BillingSettings:
        if self.billing_vault_url:
            if self.billing_vault_worker_token is None and self.billing_vault_admin_token is None:
                raise ValueError(
                    "BILLING_VAULT_URL is set: BILLING_VAULT_WORKER_TOKEN is needed too"
                )
            if self.billing_key_encryption_keys is None:
                raise ValueError(f"BILLING_VAULT_URL is set: {SETTING} is needed too")
        elif self.vault_token() is not None:
            raise ValueError(
                "a vault token is set but BILLING_VAULT_URL is not: set it too, or a worker"
                " would charge Stripe directly, with no spend cap"
            )
        else:
            # The workers charge with it. Behind a vault they leave it unused, and it may be
            # blank or a placeholder there, as a deployment withholding the real key sets it.
            try:
                stripe_secret_key(self.stripe_api_key)
            except ValueError as exc:
                raise ValueError(f"STRIPE_API_KEY {exc}") from None
        # The default base is the local emulator's: a key of one's own went there over plain
        # http, each charge retried for ever. Behind a vault the tools that seed customers
        # still send it; a placeholder there is not a key.
        if {"stripe_api_key", "stripe_api_base"} & self.model_fields_set == {
            "stripe_api_key"
        } and self.stripe_api_key.get_secret_value().startswith(("sk_", "rk_")):
            raise ValueError(
                "STRIPE_API_KEY is set but STRIPE_API_BASE is not, which defaults to the"
                f" local emulator ({DEFAULT_STRIPE_API_BASE}): set STRIPE_API_BASE to"
                " Stripe's (https://api.stripe.com) or the emulator's URL"
            )
        # Unused by a worker behind the vault, but the tools that seed customers send it.
        if self.stripe_api_key.get_secret_value().startswith(
            ("sk_live_", "rk_live_")
        ) and not self.stripe_api_base.startswith("https://"):
            raise ValueError(
                "STRIPE_API_BASE must be an https:// URL for a live Stripe key, which would"
                " otherwise travel in clear text"
            )
        return self

    def vault_token(self) -> SecretStr | None:
        """What workers call the vault with: the worker token, else the admin token."""
        return self.billing_vault_worker_token or self.billing_vault_admin_token

    def vault_token_setting(self) -> str:
        """The variable vault_token() comes from, for a message about a token refused."""
        if self.billing_vault_worker_token is not None:
            return "BILLING_VAULT_WORKER_TOKEN"
        return "BILLING_VAULT_ADMIN_TOKEN"

    def secret_box(self) -> SecretBox:
        """What seals the period keys' secrets; only a worker with a vault needs one."""
        if self.billing_key_encryption_keys is None:
            raise SettingsError(f"{SETTING} is not set: it seals the period keys' secrets")
        return SecretBox(self.billing_key_encryption_keys)


class ObservabilitySettings(BaseSettings):
    """How a process reports: its log lines, and where its metrics are scraped (unset: off)."""

    model_config = SettingsConfigDict(extra="ignore", hide_input_in_errors=True)

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_any_case(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    log_format: Literal["text", "json"] = "text"
    metrics_host: str = "127.0.0.1"
    billing_metrics_port: int | None = Field(default=None, ge=1, le=65535)
    temporal_metrics_port: int | None = Field(default=None, ge=1, le=65535)

    @field_validator("metrics_host")
    @classmethod
    def _metrics_host(cls, value: str) -> str:
        # Blank, the metrics would be served on every interface: 0.0.0.0 says so.
        return words(value)

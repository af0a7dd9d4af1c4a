"""The vault's configuration, from `VAULT_*` environment variables."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from billing.config import refuse_untrimmed, stripe_api_base, stripe_secret_key
from billing.money import validate_currency
from vault.budget import WorkerPolicy


class VaultSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="VAULT_", extra="ignore", frozen=True, hide_input_in_errors=True
    )

    database_url: str = Field(
        default="postgresql://postgres@127.0.0.1:5433/billing",
        description="PostgreSQL holding the vault tables (migrations/002_vault.sql)",
    )
    # No defaults for the secrets: a vault started without them must not start at all.
    admin_token: SecretStr = Field(description="bearer token of the admin API")
    # Workers hold this one instead: it issues keys only within the budget below, and cannot
    # revoke other keys than its own or read the audit log (vault/budget.py).
    worker_token: SecretStr | None = Field(
        default=None, description="bearer token for workers; needs VAULT_WORKER_BUDGET_CENTS"
    )
    # No default, like the ceiling below: how much a taken-over worker could spend is a policy.
    worker_budget_cents: int | None = Field(
        default=None,
        gt=0,
        le=2**62,
        description="per currency: caps of live worker keys plus what dead ones took, over"
        " the window",
    )
    worker_budget_days: int = Field(
        default=45,
        ge=1,
        le=366,
        description="the budget's rolling window; no worker key lives longer",
    )
    # Required with the token: the budget is per currency, so each one allowed adds to it.
    worker_currencies: Annotated[frozenset[str], NoDecode] = Field(
        default=frozenset(), description="comma-separated currencies worker keys may be in"
    )
    # No user or password before the host (billing.config.stripe_api_base): the secret goes
    # in a header, and an error may name the URL. No default: a default address (the local
    # emulator's) would take the real secret to whatever listens there.
    upstream_stripe_base: str = Field(
        description="Stripe's API base URL (https://api.stripe.com, or the local emulator's),"
        " with no password"
    )
    upstream_stripe_secret: SecretStr = Field(description="the real Stripe secret key")
    # No default: the ceiling on any key's cap is a policy each deployment chooses.
    # At most 2**62, so sums of caps and amounts stay within Postgres' bigint.
    max_cap_cents: int = Field(gt=0, le=2**62, description="no key may be issued with a larger cap")
    upstream_timeout_seconds: float = Field(default=30.0, gt=0, le=600)
    upstream_max_connections: int = Field(default=200, ge=1)
    # Small on purpose: connections are held only for single statements, never across the
    # upstream call, and more backends queueing for one key row cost more than they add.
    database_pool_size: int = Field(default=10, ge=2, le=200)
    # aiohttp's server reads a request for as long as its client sends: without these, a
    # client trickling its headers or its body holds a connection open for good (slowloris).
    header_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="how long a connection may take to send a request's headers, counted from"
        " its opening or its last answer (so also how long it may stay idle); longer than the"
        " clients' own idle timeout (15 s in aiohttp's client), so that they close first",
    )
    # Requests with no known vault key are counted per peer and window, not audited each
    # (vault/unauthenticated.py).
    unauthenticated_window_seconds: int = Field(
        default=60,
        ge=1,
        le=3600,
        description="how often the counts of requests with no known vault key are written,"
        " one row per peer",
    )
    body_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="how long a request's body may take to arrive once the vault reads it"
        " (its headers and key checked); 408 past it, with nothing reserved",
    )

    @field_validator("admin_token", "worker_token")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        # Its own message: pydantic's would state the token's length.
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("must be at least 16 characters")
        refuse_untrimmed(value)
        return value

    @field_validator("upstream_stripe_secret")
    @classmethod
    def _stripe_secret_shape(cls, value: SecretStr) -> SecretStr:
        return stripe_secret_key(value)

    @field_validator("upstream_stripe_base")
    @classmethod
    def _stripe_base(cls, value: str) -> str:
        return stripe_api_base(value)

    @field_validator("database_url")
    @classmethod
    def _database_named(cls, value: str) -> str:
        # Blank, asyncpg would try PGHOST, local sockets and localhost as this OS user.
        if not value.strip():
            raise ValueError("is set but blank: name the vault's PostgreSQL")
        return value

    @model_validator(mode="after")
    def _live_key_over_tls(self) -> VaultSettings:
        secret = self.upstream_stripe_secret.get_secret_value()
        if secret.startswith(("sk_live_", "rk_live_")) and not self.upstream_stripe_base.startswith(
            "https://"
        ):
            raise ValueError(
                "VAULT_UPSTREAM_STRIPE_BASE must be an https:// URL for a live Stripe key,"
                " which would otherwise travel in clear text"
            )
        return self

    @field_validator("worker_currencies", mode="before")
    @classmethod
    def _currency_list(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        currencies = frozenset(c.strip() for c in value.split(",") if c.strip())
        for currency in sorted(currencies):
            validate_currency(currency)
        return currencies

    @model_validator(mode="after")
    def _worker_token_needs_a_policy(self) -> VaultSettings:
        if self.worker_token is None:
            return self
        for name, value in (
            ("VAULT_WORKER_BUDGET_CENTS", self.worker_budget_cents),
            ("VAULT_WORKER_CURRENCIES", self.worker_currencies),
        ):
            if not value:
                raise ValueError(f"VAULT_WORKER_TOKEN is set: {name} is needed too")
        if self.worker_token.get_secret_value() == self.admin_token.get_secret_value():
            raise ValueError("VAULT_WORKER_TOKEN must differ from VAULT_ADMIN_TOKEN")
        return self

    def worker_policy(self) -> WorkerPolicy | None:
        """What the worker token may issue; None without one."""
        if self.worker_token is None or self.worker_budget_cents is None:
            return None
        return WorkerPolicy(
            budget_cents=self.worker_budget_cents,
            window=timedelta(days=self.worker_budget_days),
            currencies=self.worker_currencies,
        )

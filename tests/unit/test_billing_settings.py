"""The worker's settings from the environment: URLs it would log are refused with a password."""

from __future__ import annotations

import pytest
from pydantic import SecretStr, ValidationError

from billing.config import BillingSettings, TemporalSettings


@pytest.mark.parametrize("setting", ["stripe_api_base", "billing_vault_url"])
def test_a_url_with_a_password_is_refused_without_echoing_it(setting: str) -> None:
    with pytest.raises(ValidationError) as refused:
        BillingSettings(**{setting: "https://ops:hunter2@vault.internal"})  # type: ignore[arg-type]
    assert "no user or password" in str(refused.value)
    assert "hunter2" not in str(refused.value)


def test_the_web_uis_url_is_refused_with_a_password_as_the_cli_prints_it() -> None:
    with pytest.raises(ValidationError) as refused:
        TemporalSettings(ui_url="https://ops:hunter2@temporal-ui.internal")
    assert "ui_url\n  Value error, must be an http:// or https:// URL" in str(refused.value)
    assert "hunter2" not in str(refused.value)


def test_a_token_read_with_its_newline_is_refused_naming_it() -> None:
    """Sent in a header, it would fail the worker's first call to the vault with a message
    naming no setting."""
    with pytest.raises(ValidationError) as refused:
        BillingSettings(
            billing_vault_url="http://vault:8180",
            billing_vault_worker_token=SecretStr("worker-token-from-a-file\n"),
        )
    assert "billing_vault_worker_token\n  Value error, has spaces or a line break" in str(
        refused.value
    )


def test_an_at_sign_after_the_host_is_no_password() -> None:
    settings = BillingSettings(stripe_api_base="https://stripe.internal/v1@edge")
    assert settings.stripe_api_base == "https://stripe.internal/v1@edge"

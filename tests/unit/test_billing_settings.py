"""The worker's settings from the environment: URLs it would log are refused with a password."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from billing.config import BillingSettings


@pytest.mark.parametrize("setting", ["stripe_api_base", "billing_vault_url"])
def test_a_url_with_a_password_is_refused_without_echoing_it(setting: str) -> None:
    with pytest.raises(ValidationError) as refused:
        BillingSettings(**{setting: "https://ops:hunter2@vault.internal"})  # type: ignore[arg-type]
    assert "no user or password" in str(refused.value)
    assert "hunter2" not in str(refused.value)


def test_an_at_sign_after_the_host_is_no_password() -> None:
    settings = BillingSettings(stripe_api_base="https://stripe.internal/v1@edge")
    assert settings.stripe_api_base == "https://stripe.internal/v1@edge"

"""The worker's settings from the environment: URLs it would log are refused with a password."""

from __future__ import annotations

import pytest
from pydantic import SecretStr, ValidationError

from billing.config import BillingSettings, SettingsError, TemporalSettings, load_settings
from billing.sealing import new_key


@pytest.mark.parametrize("setting", ["stripe_api_base", "billing_vault_url"])
def test_a_url_with_a_password_is_refused_without_echoing_it(setting: str) -> None:
    with pytest.raises(ValidationError) as refused:
        BillingSettings(**{setting: "https://ops:hunter2@vault.internal"})  # type: ignore[arg-type]
    assert "no user, password, query or fragment" in str(refused.value)
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


@pytest.mark.parametrize(
    "base",
    ["https://api.stripe.com/v1", "https://proxy.internal/stripe/v1/", "https://api.stripe.com/V1"],
)
def test_a_stripe_base_with_the_clients_v1_in_it_is_refused(base: str) -> None:
    """As Stripe's reference writes the API's base: the client adds /v1 itself, so every
    charge went to /v1/v1/..., which Stripe answers 404 (helper-188)."""
    with pytest.raises(ValidationError, match="ends in /v1, which the client adds itself"):
        BillingSettings(stripe_api_base=base)


def test_a_stripe_base_keeps_its_path_without_a_trailing_slash() -> None:
    # A proxy's prefix is the client's to build on; "/" then "/v1/..." would be "//v1/...".
    settings = BillingSettings(stripe_api_base="https://proxy.internal/stripe/")
    assert settings.stripe_api_base == "https://proxy.internal/stripe"


@pytest.mark.parametrize(
    ("key", "message"),
    [
        # Made with `echo`; pasted with a space: refused with a vault too.
        ("sk_test_abc\n", "stripe_api_key\n  Value error, has spaces or a line break"),
        (" sk_test_abc", "stripe_api_key\n  Value error, has spaces or a line break"),
        # Blank; the publishable key, not the secret.
        ("", "STRIPE_API_KEY must be a Stripe secret or restricted key"),
        ("pk_" + "live_abcdefabcdefabcdef", "STRIPE_API_KEY must be a Stripe secret"),
    ],
)
def test_a_stripe_key_not_shaped_as_a_secret_key_is_refused_unechoed(
    key: str, message: str
) -> None:
    """Taken as it was, every charge of a worker without a vault failed before it was sent
    (a header with a line break) or was refused, with no word of STRIPE_API_KEY."""
    with pytest.raises(ValidationError, match=message) as refused:
        BillingSettings(stripe_api_key=SecretStr(key))
    assert "abcdef" not in str(refused.value)


def test_a_stripe_key_of_ones_own_needs_its_base_set_too() -> None:
    """The base defaults to the local emulator's address: a worker given a key and no base
    sent it there over plain http, and retried every charge for ever."""
    key = SecretStr("sk_test_" + "Q7" * 12)
    with pytest.raises(ValidationError, match="STRIPE_API_KEY is set but STRIPE_API_BASE is not"):
        BillingSettings(stripe_api_key=key)
    # Behind a vault too: the tools that seed customers send it (a placeholder is no key).
    vault = {
        "billing_vault_url": "http://vault.internal:8180",
        "billing_vault_worker_token": SecretStr("worker-token"),
        "billing_key_encryption_keys": SecretStr(new_key()),
    }
    with pytest.raises(ValidationError, match="STRIPE_API_KEY is set but STRIPE_API_BASE is not"):
        BillingSettings(stripe_api_key=key, **vault)  # type: ignore[arg-type]
    assert BillingSettings(stripe_api_key=key, stripe_api_base="https://api.stripe.com")
    # Neither set is the local stack's pair, the emulator's own key at its address.
    assert BillingSettings().stripe_api_base == "http://127.0.0.1:12111"


@pytest.mark.parametrize("placeholder", ["", "unused"])
def test_a_stripe_key_workers_leave_unused_behind_a_vault_may_be_withheld(
    placeholder: str,
) -> None:
    settings = BillingSettings(
        stripe_api_key=SecretStr(placeholder),
        billing_vault_url="http://vault.internal:8180",
        billing_vault_worker_token=SecretStr("worker-token"),
        billing_key_encryption_keys=SecretStr(new_key()),
    )
    assert settings.stripe_api_key.get_secret_value() == placeholder


def test_an_at_sign_after_the_host_is_no_password() -> None:
    settings = BillingSettings(stripe_api_base="https://stripe.internal/v1@edge")
    assert settings.stripe_api_base == "https://stripe.internal/v1@edge"


# Shaped like no Stripe or vault key, as a vault token or a Temporal Cloud API key (a JWT) is:
# billing.redact does not know it, so only not echoing it keeps it out (helper-163).
TOKEN = "Zx9qRtWorkerToken0123456789abcdef"  # noqa: S105
JWT = "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJvcHMifQ.c2lnbmF0dXJlLW9mLXRoZS1rZXk"


@pytest.mark.parametrize("setting", ["stripe_api_base", "billing_vault_url"])
def test_a_url_with_a_token_in_its_query_is_refused_without_echoing_it(setting: str) -> None:
    """The workers log these URLs at start (helper-163 F1)."""
    valid = {
        "billing_vault_url": "http://vault.internal:8180",
        "billing_vault_worker_token": SecretStr("worker-token"),
        "billing_key_encryption_keys": SecretStr(new_key()),
    }
    with pytest.raises(ValidationError) as refused:
        BillingSettings(**{**valid, setting: f"https://vault.internal/?access_token={TOKEN}"})  # type: ignore[arg-type]
    assert setting in str(refused.value)
    assert TOKEN not in str(refused.value)


@pytest.mark.parametrize("tail", [f"/?token={TOKEN}", f"/#{TOKEN}"])
def test_the_web_uis_url_with_a_token_after_it_is_refused(tail: str) -> None:
    """The CLI prints it, with "/namespaces/..." after it, in every run's link."""
    with pytest.raises(ValidationError) as refused:
        TemporalSettings(ui_url="https://temporal-ui.internal" + tail)
    assert TOKEN not in str(refused.value)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("address", f"ops:{TOKEN}@127.0.0.1:7233"),
        ("address", JWT),
        # A host and port with a key after it: refused whole, not taken for its start.
        ("address", f"127.0.0.1:7233/?api_key={TOKEN}"),
        ("namespace", f"ns {TOKEN}"),
    ],
)
def test_a_temporal_address_or_namespace_not_shaped_as_one_is_refused_unechoed(
    setting: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A password before the host, or an API key pasted into the wrong variable, was echoed
    whole by every error naming the address (helper-163 F2)."""
    monkeypatch.setenv(f"TEMPORAL_{setting.upper()}", value)
    with pytest.raises(SettingsError) as refused:
        load_settings(TemporalSettings)
    assert f"TEMPORAL_{setting.upper()}: must be" in str(refused.value)
    assert TOKEN not in str(refused.value) and JWT[:24] not in str(refused.value)


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "127.0.0.1:0", "[::1]:65536"])
def test_a_temporal_address_with_no_port_to_connect_to_is_refused(address: str) -> None:
    """Taken, it failed only at the first connection, as if the server were down."""
    with pytest.raises(ValidationError, match="with a port from 1 to 65535"):
        TemporalSettings(address=address)


@pytest.mark.parametrize(
    "url", ["http://:8180", "http://vault:99999", "http://vault:0", "https://[::1]:65536/"]
)
@pytest.mark.parametrize("setting", ["stripe_api_base", "billing_vault_url"])
def test_a_url_with_no_host_or_port_to_connect_to_is_refused(setting: str, url: str) -> None:
    with pytest.raises(ValidationError, match="URL with a host \\(and a port from 1 to 65535"):
        BillingSettings(**{setting: url})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1:7233", "temporal:7233", "ns.acct.tmprl.cloud:7233", "[::1]:7233", "h:65535"],
)
def test_a_temporal_address_as_host_and_port_is_taken(address: str) -> None:
    assert TemporalSettings(address=address).address == address


def test_a_settings_error_reads_without_pydantics_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BILLING_VAULT_URL", "http://vault:8080")
    monkeypatch.setenv("BILLING_VAULT_WORKER_TOKEN", "abc")
    monkeypatch.delenv("BILLING_KEY_ENCRYPTION_KEYS", raising=False)
    with pytest.raises(SettingsError) as refused:
        load_settings(BillingSettings)
    assert "Value error, " not in str(refused.value)


@pytest.mark.parametrize(
    ("tokens", "used"),
    [
        ({"billing_vault_worker_token"}, "BILLING_VAULT_WORKER_TOKEN"),
        ({"billing_vault_admin_token"}, "BILLING_VAULT_ADMIN_TOKEN"),
        # Both, as a deployment moving to the worker token leaves them: the admin token
        # would let a worker taken over mint keys past the vault's worker budget.
        ({"billing_vault_worker_token", "billing_vault_admin_token"}, "BILLING_VAULT_WORKER_TOKEN"),
    ],
)
def test_workers_call_the_vault_with_the_worker_token_whenever_it_is_set(
    tokens: set[str], used: str
) -> None:
    settings = BillingSettings(
        billing_vault_url="http://vault.internal:8180",
        billing_key_encryption_keys=SecretStr(new_key()),
        **{name: SecretStr(name.upper()) for name in tokens},  # type: ignore[arg-type]
    )
    token = settings.vault_token()
    assert token is not None and token.get_secret_value() == used
    assert settings.vault_token_setting() == used

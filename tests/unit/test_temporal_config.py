"""Where and how the project connects to Temporal: settings, Temporal's own TEMPORAL_*
variables and profile file, and errors that say what to fix without quoting a secret."""

from __future__ import annotations

from pathlib import Path

import pytest

from billing.config import TemporalSettings
from billing.errors import ConfigurationError
from billing.reporting import ui_link
from billing.temporal_client import connect_config, unreachable_because

API_KEY = "tmprl-api-key-do-not-print"
PROFILES = f"""
[profile.cloud]
address = "billing.a1b2c.tmprl.cloud:7233"
namespace = "billing.a1b2c"
api_key = "{API_KEY}"
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No TEMPORAL_* variable of the machine's, and no profile file from its home."""
    for name in ("ADDRESS", "NAMESPACE", "API_KEY", "PROFILE", "CONFIG_FILE", "TLS"):
        monkeypatch.delenv(f"TEMPORAL_{name}", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))


def test_nothing_set_is_the_local_dev_server() -> None:
    assert connect_config(TemporalSettings()) == {
        "target_host": "127.0.0.1:7233",
        "namespace": "default",
    }


def test_a_runs_web_ui_link_is_in_the_namespace_it_runs_in() -> None:
    temporal = TemporalSettings(namespace="billing.a1b2c", ui_url="https://cloud.temporal.io")
    assert ui_link(temporal, "billing-period-2026-12") == (
        "https://cloud.temporal.io/namespaces/billing.a1b2c/workflows/billing-period-2026-12"
    )


def test_a_profile_in_the_home_directory_is_read_only_when_asked_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    home_profiles = tmp_path / "temporalio" / "temporal.toml"
    home_profiles.parent.mkdir()
    home_profiles.write_text(PROFILES.replace("profile.cloud", "profile.default"))
    assert "api_key" not in connect_config(TemporalSettings())
    monkeypatch.setenv("TEMPORAL_PROFILE", "default")
    assert connect_config(TemporalSettings()).get("api_key") == API_KEY


def test_an_api_key_turns_tls_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEMPORAL_API_KEY", API_KEY)
    config = connect_config(TemporalSettings(address="billing.a1b2c.tmprl.cloud:7233"))
    assert (config.get("api_key"), config.get("tls")) == (API_KEY, True)


def test_a_profile_names_the_cloud_namespace_unless_the_environment_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    profiles = tmp_path / "temporal.toml"
    profiles.write_text(PROFILES)
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(profiles))
    monkeypatch.setenv("TEMPORAL_PROFILE", "cloud")
    config = connect_config(TemporalSettings())
    assert (config["target_host"], config["namespace"], config.get("api_key")) == (
        "billing.a1b2c.tmprl.cloud:7233",
        "billing.a1b2c",
        API_KEY,
    )
    monkeypatch.setenv("TEMPORAL_ADDRESS", "10.0.0.5:7233")
    config = connect_config(TemporalSettings())
    assert (config["target_host"], config["namespace"]) == ("10.0.0.5:7233", "billing.a1b2c")


def test_a_missing_certificate_file_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEMPORAL_TLS_CLIENT_CERT_PATH", "/etc/billing/missing-client.pem")
    monkeypatch.setenv("TEMPORAL_TLS_CLIENT_KEY_PATH", "/etc/billing/missing-client.key")
    with pytest.raises(ConfigurationError, match="missing-client") as caught:
        connect_config(TemporalSettings())
    assert "TEMPORAL_TLS" in str(caught.value)


def test_an_unknown_profile_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    profiles = tmp_path / "temporal.toml"
    profiles.write_text(PROFILES)
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(profiles))
    monkeypatch.setenv("TEMPORAL_PROFILE", "prod")
    with pytest.raises(ConfigurationError, match="'prod' not found"):
        connect_config(TemporalSettings())


def test_a_broken_profile_file_is_refused_without_quoting_its_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    profiles = tmp_path / "temporal.toml"
    profiles.write_text(f'[profile.default]\napi_key = "{API_KEY}\n')
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(profiles))
    with pytest.raises(ConfigurationError, match="TEMPORAL_CONFIG_FILE") as caught:
        connect_config(TemporalSettings())
    assert API_KEY not in str(caught.value)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("address", f"https://billing:{API_KEY}@billing.a1b2c.tmprl.cloud:7233"),
        ("namespace", "billing a1b2c"),
    ],
)
def test_a_profiles_bad_address_or_namespace_is_refused_by_name_unquoted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, setting: str, value: str
) -> None:
    """Checked as the settings' are: unchecked, the SDK's own error quoted the address,
    a password in it too."""
    profiles = tmp_path / "temporal.toml"
    profiles.write_text(f'[profile.default]\n{setting} = "{value}"\n')
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(profiles))
    with pytest.raises(ConfigurationError, match=f"^the Temporal {setting} must be ") as caught:
        connect_config(TemporalSettings())
    assert value not in str(caught.value) and API_KEY not in str(caught.value)


@pytest.mark.parametrize(
    ("core_error", "because"),
    [
        (
            "Failed client connect: Server connection error: tonic::transport::Error(Transport,"
            ' ConnectError(ConnectError("tcp connect error", 127.0.0.1:1, Os { code: 111, kind:'
            ' ConnectionRefused, message: "Connection refused" })))',
            "Connection refused",
        ),
        (
            "Failed client connect: Server connection error: tonic::transport::Error(Transport,"
            ' ConnectError(ConnectError("dns error", Custom { kind: Uncategorized, error:'
            ' "failed to lookup address information: Name or service not known" })))',
            "failed to lookup address information: Name or service not known",
        ),
        pytest.param(
            "Failed client connect: Server connection error: tonic::transport::Error(Transport,"
            ' Custom { kind: Other, error: "tls handshake eof" }, Os { code: 104, kind:'
            ' ConnectionReset, message: "Connection reset by peer" })',
            "Connection reset by peer",
            id="the-innermost-of-two-causes",
        ),
        (
            "Failed client connect: Server connection error: tonic::transport::Error(Transport)",
            "Failed client connect: Server connection error",
        ),
    ],
)
def test_temporal_unreachable_is_told_by_its_root_cause(core_error: str, because: str) -> None:
    """Not the SDK core's debug dump of its causes (helper-169 F9)."""
    assert unreachable_because(RuntimeError(core_error)) == because

"""BILLING_DB_LEDGER_ROLE and BILLING_DB_VAULT_ROLE: both or neither, two plain role names."""

from __future__ import annotations

import pytest

from billing.config import DatabaseRolesSettings, SettingsError, load_settings
from billing.db_roles import DatabaseRoles, owner_of, table_privileges


def test_neither_set_grants_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BILLING_DB_LEDGER_ROLE", raising=False)
    monkeypatch.delenv("BILLING_DB_VAULT_ROLE", raising=False)
    assert load_settings(DatabaseRolesSettings).roles() is None


def test_both_set_name_the_two_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BILLING_DB_LEDGER_ROLE", "billing_ledger")
    monkeypatch.setenv("BILLING_DB_VAULT_ROLE", "billing_vault")
    roles = load_settings(DatabaseRolesSettings).roles()
    assert roles == DatabaseRoles(ledger="billing_ledger", vault="billing_vault")


@pytest.mark.parametrize(
    ("ledger", "vault", "said"),
    [
        ("billing_ledger", None, "or neither"),
        ("billing", "billing", "BILLING_DB_VAULT_ROLE must differ"),
        (
            'x"; DROP TABLE customers; --',
            "billing_vault",
            "BILLING_DB_LEDGER_ROLE: must be",
        ),
        ("billing_ledger", "Vault", "BILLING_DB_VAULT_ROLE: must be"),
    ],
)
def test_one_alone_the_same_twice_or_an_odd_name_is_refused(
    monkeypatch: pytest.MonkeyPatch, ledger: str, vault: str | None, said: str
) -> None:
    monkeypatch.setenv("BILLING_DB_LEDGER_ROLE", ledger)
    if vault is None:
        monkeypatch.delenv("BILLING_DB_VAULT_ROLE", raising=False)
    else:
        monkeypatch.setenv("BILLING_DB_VAULT_ROLE", vault)
    with pytest.raises(SettingsError) as refused:
        load_settings(DatabaseRolesSettings)
    assert said in str(refused.value)
    assert "DROP TABLE" not in str(refused.value)


@pytest.mark.parametrize(
    ("table", "ledger", "vault"),
    [
        ("vault_keys", "", "SELECT, INSERT, UPDATE, DELETE"),
        ("vault_audit", "", "SELECT, INSERT"),
        ("vault_added_later", "", "SELECT, INSERT, UPDATE, DELETE"),
        ("billing_runs", "SELECT, INSERT, UPDATE, DELETE", ""),
        ("period_vault_keys", "SELECT, INSERT, UPDATE, DELETE", ""),
        ("schema_migrations", "SELECT", "SELECT"),
    ],
)
def test_a_table_belongs_to_the_vault_by_its_name_prefix(
    table: str, ledger: str, vault: str
) -> None:
    assert table_privileges(owner_of(table), table) == (ledger, vault)

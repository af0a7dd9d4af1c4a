"""docker-compose.yml and the Dockerfile, checked without a Docker engine: the Compose
Specification's JSON schema, and every command, variable, file and dependency they name."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
from check_jsonschema.builtin_schemas import get_builtin_schema
from pydantic_settings import BaseSettings

from billing import liveness, search_attributes
from billing.config import (
    BillingSettings,
    DatabaseRolesSettings,
    DatabaseSettings,
    ObservabilitySettings,
    OperatorSettings,
    TemporalSettings,
)
from billing.redact import redact
from cli import commands
from tests.deploy.compose import COMPOSE_FILE, ROOT, is_project_service, load
from vault.app import shutdown_seconds
from vault.settings import VaultSettings

DOCKERFILE = ROOT / "Dockerfile"
BILLING_SETTINGS: tuple[type[BaseSettings], ...] = (
    TemporalSettings,
    DatabaseSettings,
    DatabaseRolesSettings,
    BillingSettings,
    ObservabilitySettings,
    OperatorSettings,
)
SECRET_NAME = re.compile(r"PASSWORD|PWD|SECRET|TOKEN|API_KEY|ENCRYPTION_KEY")
COMMAND_FLAG = re.compile(r"^--[a-z][a-z-]*$")

COMPOSE, INTERPOLATION = load()
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
PROJECT_SERVICES = {name: s for name, s in SERVICES.items() if is_project_service(s)}


def env_names(settings: type[BaseSettings]) -> dict[str, bool]:
    """The environment variables a settings class reads, each with whether it is required."""
    prefix = settings.model_config.get("env_prefix", "")
    names = {}
    for name, field in settings.model_fields.items():
        alias = field.validation_alias or field.alias
        names[(alias if isinstance(alias, str) else prefix + name).upper()] = field.is_required()
    return names


def vault_settings() -> type[BaseSettings]:
    if not (ROOT / "vault").is_dir():
        pytest.skip("the vault package (vault/) is not in this tree yet")
    from vault.settings import VaultSettings

    return VaultSettings


def settings_read_by(argv: list[str]) -> tuple[type[BaseSettings], ...]:
    if argv[1:3] == ["-m", "vault"]:
        return (vault_settings(),)
    if argv[1:3] == ["-m", "stripe_emulator"]:
        return ()  # configured by its flags only
    return BILLING_SETTINGS


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "use the mapping form of `environment`"
    return {k: str(v) for k, v in env.items()}


def test_compose_file_follows_the_compose_specification() -> None:
    schema = get_builtin_schema("vendor.compose-spec")
    jsonschema.Draft202012Validator(schema).validate(COMPOSE)
    assert "version" not in COMPOSE, "the Compose Specification has no `version:`"


def test_the_stack_has_every_part() -> None:
    expected = {"postgres", "temporal", "temporal-ui", "temporal-setup", "migrate", "vault"}
    assert expected <= set(SERVICES)
    workers = [s for s in PROJECT_SERVICES.values() if s["command"] == ["python", "worker.py"]]
    assert sum(w.get("deploy", {}).get("replicas", 1) for w in workers) >= 2
    emulator = SERVICES["stripe-emulator"]
    assert emulator["profiles"] == ["emulator"], "the emulator is never part of a default stack"


@pytest.mark.parametrize("name", sorted(PROJECT_SERVICES))
def test_project_command_exists(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = PROJECT_SERVICES[name]["command"]
    assert isinstance(argv, list) and argv[0] == "python", "exec form: python gets SIGTERM"
    if argv[1] == "-m":
        module, flags = argv[2], [a for a in argv[3:] if a.startswith("--")]
        if module == "vault":
            vault_settings()
        assert (ROOT / module / "__main__.py").is_file(), f"no package {module} with __main__"
        usage = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for flag in flags:
            assert COMMAND_FLAG.match(flag) and flag in usage, f"{module} has no {flag}"
        return
    script, args = argv[1], argv[2:]
    assert (ROOT / script).is_file(), f"{script} is not in the project"
    if script == "starter.py":
        try:
            commands.parser().parse_args(args)
        except SystemExit as exit_:
            assert exit_.code == 0, f"starter.py rejects {args}: {capsys.readouterr().err}"
    else:
        assert script == "worker.py" and not args


@pytest.mark.parametrize("name", sorted(PROJECT_SERVICES))
def test_project_environment_is_read_by_the_settings(name: str) -> None:
    service = PROJECT_SERVICES[name]
    readers = settings_read_by(service["command"])
    known: dict[str, bool] = {}
    for settings in readers:
        known |= env_names(settings)
    env = environment(service)
    unknown = sorted(set(env) - set(known))
    assert not unknown, f"{name} sets variables no settings class reads: {unknown}"
    missing = sorted(n for n, required in known.items() if required and n not in env)
    assert not missing, f"{name} lacks required settings: {missing}"


def test_the_cli_derives_keys_and_caps_as_the_workers_do() -> None:
    shared = (
        "TEMPORAL_NAMESPACE",
        "TEMPORAL_TASK_QUEUE",
        "DATABASE_URL",
        "BILLING_KEY_NAMESPACE",
        "BILLING_CAP_MULTIPLIER",
    )
    cli, worker = environment(SERVICES["cli"]), environment(SERVICES["worker"])
    assert {n: cli.get(n) for n in shared} == {n: worker[n] for n in shared}


def test_secrets_come_from_the_environment_never_the_file() -> None:
    text = COMPOSE_FILE.read_text()
    assert redact(text) == text, "something shaped like a Stripe or vault key is in the file"
    raw = load({})[0]  # interpolated with nothing set: a secret has no default to fall back to
    for name, service in raw["services"].items():
        for key, value in environment(service).items():
            if SECRET_NAME.search(key):
                assert re.fullmatch(r"<[A-Z_]+>", value), f"{name}.{key} is not `${{VAR:?...}}`"


def test_required_variables_are_the_secrets_and_the_cap() -> None:
    assert INTERPOLATION.required == {
        "POSTGRES_PASSWORD",
        "VAULT_ADMIN_TOKEN",
        "STRIPE_SECRET_KEY",
        "VAULT_MAX_CAP_CENTS",
        "VAULT_WORKER_TOKEN",
        "VAULT_WORKER_BUDGET_CENTS",
        "VAULT_WORKER_CURRENCIES",
        "BILLING_KEY_ENCRYPTION_KEYS",
        "LEDGER_DB_PASSWORD",
        "VAULT_DB_PASSWORD",
    }


def test_workers_charge_through_the_vault_and_hold_neither_stripe_secret_nor_admin_token() -> None:
    vault = SERVICES["vault"]
    port = vault["command"][vault["command"].index("--port") + 1]
    workers = [s for s in PROJECT_SERVICES.values() if s["command"] == ["python", "worker.py"]]
    for worker in workers:
        env = environment(worker)
        assert env["BILLING_VAULT_URL"] == f"http://vault:{port}"
        assert env["BILLING_VAULT_WORKER_TOKEN"] == environment(vault)["VAULT_WORKER_TOKEN"]
        assert not any("<VAULT_ADMIN_TOKEN>" in value for value in env.values())
        assert env["BILLING_KEY_ENCRYPTION_KEYS"] == "<BILLING_KEY_ENCRYPTION_KEYS>"
        assert "STRIPE_API_KEY" not in env
        assert not any("<STRIPE_SECRET_KEY>" in value for value in env.values())


def test_the_vault_is_given_time_to_finish_its_requests_before_it_is_killed() -> None:
    """Killed before, a charge that may have gone through would leave no audit row."""
    grace = SERVICES["vault"]["stop_grace_period"]
    assert grace.endswith("s")
    assert float(grace[:-1]) > shutdown_seconds(VaultSettings.model_construct())


def _database_user(url: str) -> tuple[str | None, str | None]:
    """A DSN's user and password (still `<NAME>` for an unset `${NAME:?...}`)."""
    parts = urlsplit(url)
    return parts.username, parts.password


def test_workers_the_cli_and_the_vault_each_have_a_database_role_of_their_own() -> None:
    """F1: a worker taken over must not reach the vault's tables, so its DSN names neither the
    vault's role nor the schema's owner (POSTGRES_USER, a superuser in the image)."""
    owner = environment(SERVICES["postgres"])["POSTGRES_USER"]
    workers = [s for s in PROJECT_SERVICES.values() if s["command"] == ["python", "worker.py"]]
    ledger_users = {
        _database_user(environment(s)["DATABASE_URL"]) for s in [*workers, SERVICES["cli"]]
    }
    assert len(ledger_users) == 1, "workers and the CLI share one ledger role"
    (ledger, ledger_password), *_ = ledger_users
    vault, vault_password = _database_user(environment(SERVICES["vault"])["VAULT_DATABASE_URL"])
    assert ledger is not None and vault is not None
    assert len({ledger, vault, owner}) == 3
    assert (ledger_password, vault_password) == ("<LEDGER_DB_PASSWORD>", "<VAULT_DB_PASSWORD>")
    # The owner migrates, and grants each role its own tables.
    migrate = environment(SERVICES["migrate"])
    assert _database_user(migrate["DATABASE_URL"]) == (owner, "<POSTGRES_PASSWORD>")
    assert (migrate["BILLING_DB_LEDGER_ROLE"], migrate["BILLING_DB_VAULT_ROLE"]) == (ledger, vault)
    # No project service but migrate holds the owner's password.
    for name, service in PROJECT_SERVICES.items():
        if name != "migrate":
            assert not any("<POSTGRES_PASSWORD>" in v for v in environment(service).values())


def test_postgres_creates_both_roles_with_their_passwords_on_first_start() -> None:
    postgres = SERVICES["postgres"]
    mounts = {c["source"]: c["target"] for c in postgres["configs"]}
    assert mounts["postgres-roles"].startswith("/docker-entrypoint-initdb.d/")
    assert mounts["postgres-roles"].endswith(".sql")
    env = environment(postgres)
    script = COMPOSE["configs"]["postgres-roles"]["content"]
    roles = re.findall(r"^CREATE ROLE (\w+) LOGIN PASSWORD :'(\w+)';$", script, re.MULTILINE)
    read = dict(re.findall(r"^\\getenv (\w+) (\w+)$", script, re.MULTILINE))
    migrate = environment(SERVICES["migrate"])
    by_role = {role: read[variable] for role, variable in roles}
    assert by_role == {
        migrate["BILLING_DB_LEDGER_ROLE"]: "LEDGER_DB_PASSWORD",
        migrate["BILLING_DB_VAULT_ROLE"]: "VAULT_DB_PASSWORD",
    }
    assert all(env[variable] == f"<{variable}>" for variable in by_role.values())


def test_every_compose_variable_is_documented() -> None:
    deployment = (ROOT / "docs" / "deployment.md").read_text()
    undocumented = sorted(v for v in INTERPOLATION.used if f"`{v}`" not in deployment)
    assert not undocumented, f"docs/deployment.md does not explain {undocumented}"


def test_every_setting_is_in_the_configuration_reference() -> None:
    reference = (ROOT / "docs" / "deployment.md").read_text()
    settings = [*BILLING_SETTINGS, vault_settings()]
    names = {name for s in settings for name in env_names(s)}
    undocumented = sorted(n for n in names if f"| `{n}` |" not in reference)
    assert not undocumented, f"docs/deployment.md's configuration tables lack {undocumented}"


def test_dependencies_exist_and_their_conditions_can_be_met() -> None:
    for name, service in SERVICES.items():
        for target, spec in service.get("depends_on", {}).items():
            assert target in SERVICES, f"{name} depends on undefined service {target}"
            dependency = SERVICES[target]
            assert "profiles" not in dependency, f"{name} needs {target}, which is optional"
            condition = spec["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in dependency, f"{target} has no healthcheck"
            else:
                assert condition == "service_completed_successfully"
                assert dependency.get("restart") == "no", f"{target} is not a one-shot"


def test_health_checks_ask_what_the_service_serves() -> None:
    for name, service in PROJECT_SERVICES.items():
        if "healthcheck" not in service:
            continue
        probe = " ".join(service["healthcheck"]["test"])
        found = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/.-]*)", probe)
        assert found, f"{name}'s health check asks no local URL: {probe}"
        port, path = found.groups()
        argv, env = service["command"], environment(service)
        if port == env.get("BILLING_METRICS_PORT"):
            assert path in ("/metrics", liveness.HEALTH_PATH)
            continue
        if port in {v for k, v in env.items() if k.endswith("_METRICS_PORT")}:
            assert path == "/metrics"
            continue
        assert argv[argv.index("--port") + 1] == port, f"{name} does not listen on {port}"
        package = ROOT / argv[2]
        sources = "".join(p.read_text() for p in package.rglob("*.py"))
        assert f'"{path}"' in sources, f"{argv[2]} serves no {path}"


def test_temporal_setup_registers_the_workflows_search_attributes() -> None:
    script = SERVICES["temporal-setup"]["command"][0]
    assert "temporal operator search-attribute create" in script
    registered = set(re.findall(r"^register (\w+) (\w+)$", script, re.MULTILINE))
    assert registered == {(key.name, "Keyword") for key in search_attributes.ALL}


def test_third_party_images_are_pinned() -> None:
    for name, service in SERVICES.items():
        if is_project_service(service):
            assert "build" in service
            continue
        image, _, tag = service["image"].partition(":")
        assert re.fullmatch(r"\d+(\.\d+)*", tag), f"{name}: pin {image} to a version"
    temporal_tags = {
        s["image"].partition(":")[2]
        for s in SERVICES.values()
        if s["image"].startswith(("temporalio/server:", "temporalio/admin-tools:"))
    }
    assert len(temporal_tags) == 1, "server and admin-tools (schema) must be one version"


def dockerfile_instructions() -> list[tuple[str, list[str]]]:
    lines = DOCKERFILE.read_text().replace("\\\n", " ").splitlines()
    return [
        (line.split()[0].upper(), line.split()[1:])
        for line in lines
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_dockerfile_copies_what_exists_and_what_the_commands_need() -> None:
    instructions = dockerfile_instructions()
    copied: set[str] = set()
    for sources in (args[:-1] for op, args in instructions if op == "COPY"):
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such file in the project"
            copied.add(source.rstrip("/"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    packages = [p.rstrip("*") for p in setuptools["packages"]["find"]["include"]]
    needed = {f"{m}.py" for m in setuptools["py-modules"]} | {"migrations", "pyproject.toml"}
    needed |= {p for p in packages if (ROOT / p).is_dir()}
    assert needed <= copied, f"the image lacks {sorted(needed - copied)}"


def test_dockerfile_runs_as_a_user_without_dev_extras() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", ["python:3.11-slim"])
    users = [args[0] for op, args in instructions if op == "USER"]
    assert users and users[-1] not in {"root", "0"}
    installs = [" ".join(args) for op, args in instructions if op == "RUN" and "pip" in args]
    assert installs and not any("[dev]" in run for run in installs)


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".devstack", ".env"} <= set(ignored)

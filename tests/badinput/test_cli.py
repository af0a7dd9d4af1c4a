"""The command lines given bad arguments: exit status 2 and one message saying what was wrong.

Bad arguments are refused before anything is contacted: the first group runs every command
with Temporal, PostgreSQL and Stripe unreachable, so a message about the input (rather than
"cannot reach ...") proves nothing was started or charged. The second group runs against the
real dev server and database, where the input is well formed but names something that is not
there, and checks the ledger and the namespace are left as they were.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
from temporalio.client import Client, WorkflowFailureError, WorkflowQueryFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

import worker
from billing import ledger, operations, seeding
from billing.config import BillingSettings, SettingsError
from billing.db import where
from billing.errors import BillingError, InvalidInputError, NoWorkerError
from billing.keys import idempotency_key
from billing.models import OperatorRequest, SkipRequest
from billing.periods import Period, period_for
from billing.runs import start_period
from cli import arguments, commands
from cli.main import main
from devstack import demo
from devstack.postgres import LocalPostgres
from devstack.stack import StackConfig
from stripe_emulator import EmulatorConfig
from stripe_emulator import serve as serve_emulator
from tests import forked_cli
from tests.conftest import free_port
from vault.__main__ import main as vault_main

ROOT = Path(__file__).resolve().parents[2]
HEADER = "customer_id,stripe_customer_id,payment_method,amount_cents,currency\n"
HOSTILE_ID = "x'; DROP TABLE customers;--"


@dataclass(frozen=True)
class Exit:
    code: int
    stdout: str
    stderr: str


async def run_cli(*argv: str, env: Mapping[str, str]) -> Exit:
    if argv[0] == "starter.py":
        return Exit(
            *await forked_cli.run(ROOT / argv[0], argv[1:], {**os.environ, **env}, 60, ROOT)
        )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return Exit(process.returncode, stdout.decode(), stderr.decode())


def _csv(body: str) -> str:
    return HEADER + body


# argv after `python`, and what the message must say; one or two cases per command, as each
# costs a Python start-up. `{bad_csv}` is a file whose third line is bad.
CASES: dict[str, tuple[list[str], str]] = {
    "run month 13": (["starter.py", "run", "2026-13"], "month 13 is not 01-12"),
    "run sql period": (["starter.py", "run", "2026-12' OR '1'='1"], "not in the form YYYY-MM"),
    "run years ahead": (["starter.py", "run", "2099-01"], "2099-01 is later than next month"),
    "run years back": (["starter.py", "run", "2016-12"], "2016-12 is more than 3 months before"),
    "status year": (["starter.py", "status", "1999-12"], "year 1999 is outside 2000-2999"),
    "preview month 0": (["starter.py", "preview", "2026-00"], "month 0 is not 01-12"),
    "watch nan": (["starter.py", "watch", "2026-12", "--interval", "nan"], "from 0.2 to 3600"),
    "pause empty reason": (
        ["starter.py", "pause", "2026-12", "--reason", ""],
        "--reason: expected words saying why, got a blank reason",
    ),
    "skip blank reason": (
        ["starter.py", "skip", "2026-12", "c-1", "--reason", "   "],
        "--reason: expected words saying why, got a blank reason",
    ),
    "cancel empty operator": (
        ["starter.py", "cancel", "2026-12", "--reason", "r", "--operator", ""],
        "--operator: expected the name of whoever acts, got a blank one",
    ),
    # Both were kept, as a blank in the audit trail (helper-188).
    "handled blank operator": (
        [
            "starter.py",
            "handled",
            "2026-12",
            "duplicate",
            "ch_3Nx",
            "--reason",
            "r",
            "--operator",
            " ",
        ],
        "--operator: expected the name of whoever acts, got a blank one",
    ),
    "pause zero-width reason": (
        ["starter.py", "pause", "2026-12", "--reason", "\u200b", "--operator", "alice"],
        "--reason: expected words saying why, got a blank reason",
    ),
    "schedule pause blank operator": (
        ["starter.py", "schedule", "pause", "--note", "n", "--operator", "\u200b"],
        "--operator: expected the name of whoever acts, got a blank one",
    ),
    "resume long operator": (
        ["starter.py", "resume", "2026-12", "--reason", "ok", "--operator", "o" * 101],
        "operator: String should have at most 100 characters",
    ),
    "skip sql id": (["starter.py", "skip", "2026-12", HOSTILE_ID, "--reason", "r"], "1-64"),
    "skip url id": (
        ["starter.py", "skip", "2026-12", "../c%2F1?x=1", "--reason", "r"],
        "error: the customer id: customer id '../c%2F1?x=1' must be 1-64",
    ),
    "deactivate sql id": (["starter.py", "customers", "deactivate", "c-1", HOSTILE_ID], "1-64"),
    "handled not a charge": (
        ["starter.py", "handled", "2026-12", "duplicate", "pi_3Nx", "--reason", "refunded"],
        "expected a Stripe charge id as a report names it (ch_... or py_...), got 'pi_3Nx'",
    ),
    "handled no such kind": (
        ["starter.py", "handled", "2026-12", "triple", "ch_3Nx", "--reason", "r"],
        "invalid choice: 'triple'",
    ),
    "handled blank reason": (
        ["starter.py", "handled", "2026-12", "duplicate", "ch_3Nx", "--reason", " "],
        "got a blank reason",
    ),
    "handled no charge": (
        ["starter.py", "handled", "2026-12", "duplicate", "--reason", "refunded"],
        "give its kind, its charge id and --reason",
    ),
    "handled no reason": (
        ["starter.py", "handled", "2026-12", "duplicate", "ch_3Nx"],
        "give its kind, its charge id and --reason",
    ),
    "handled list undo": (
        ["starter.py", "handled", "2026-12", "--undo"],
        "without them, handled only lists the marks",
    ),
    "handled list reason": (
        ["starter.py", "handled", "2026-12", "--reason", "refunded"],
        "--reason, --undo and --force go with a finding's kind and charge id",
    ),
    "handled list force": (
        ["starter.py", "handled", "2026-12", "--force"],
        "--reason, --undo and --force go with a finding's kind and charge id",
    ),
    # Every command that names a period checks it as `run` does, before anything is contacted.
    "pause month 13": (["starter.py", "pause", "2026-13", "--reason", "r"], "month 13 is not"),
    "renew-keys month 13": (
        ["starter.py", "renew-keys", "2026-13", "--reason", "r"],
        "month 13 is not 01-12",
    ),
    "renew-keys blank reason": (
        ["starter.py", "renew-keys", "2026-12", "--reason", " "],
        "--reason: expected words saying why, got a blank reason",
    ),
    "failures month 13": (["starter.py", "failures", "2026-13"], "month 13 is not 01-12"),
    "reconcile month 13": (["starter.py", "reconcile", "2026-13"], "month 13 is not 01-12"),
    "handled month 13": (["starter.py", "handled", "2026-13"], "month 13 is not 01-12"),
    "backfill without a start": (
        ["starter.py", "schedule", "backfill", "--end", "2026-09"],
        "the following arguments are required: --start",
    ),
    "no command": (["starter.py"], "the following arguments are required: command"),
    "schedule no command": (
        ["starter.py", "schedule"],
        "the following arguments are required: schedule_command",
    ),
    "deactivate no one": (
        ["starter.py", "customers", "deactivate"],
        "the following arguments are required: customer_id",
    ),
    "schedule day 29": (
        ["starter.py", "schedule", "create", "--day", "29"],
        "error: --day: must be 28 or less: day 29 is missing from some months",
    ),
    "schedule hour": (
        ["starter.py", "schedule", "create", "--hour", "25"],
        "error: --hour: Input should be less than or equal to 23",
    ),
    "schedule minute": (
        ["starter.py", "schedule", "create", "--minute", "60"],
        "error: --minute: Input should be less than or equal to 59",
    ),
    "pause long reason": (
        ["starter.py", "pause", "2026-12", "--reason", "x" * 600],
        "error: --reason: String should have at most 500 characters (got 600)",
    ),
    "schedule follows without reconciling": (
        ["starter.py", "schedule", "create", "--billing-schedule", "billing-monthly"],
        "--billing-schedule says what a reconciliation follows: it goes with --reconcile",
    ),
    "schedule billed by hand without reconciling": (
        ["starter.py", "schedule", "create", "--billed-by-hand"],
        "--billed-by-hand says what a reconciliation follows: it goes with --reconcile",
    ),
    "schedule reconciles on a day": (
        ["starter.py", "schedule", "create", "--reconcile", "--day", "5", "--leave-unbilled"],
        "--day and --leave-unbilled go with a billing schedule, not --reconcile",
    ),
    "schedule blank zone": (
        ["starter.py", "schedule", "create", "--time-zone", ""],
        "time zone '' is not an IANA name",
    ),
    "schedule blank id": (
        ["starter.py", "schedule", "describe", "--id", ""],
        "schedule id '' must be 1-975 characters",
    ),
    "schedule zone": (
        ["starter.py", "schedule", "create", "--time-zone", "Mars/Olympus"],
        # The reason alone: only a string too long is told its length.
        "error: --time-zone: time zone 'Mars/Olympus' is not an IANA name such as 'UTC' or"
        " 'Europe/Berlin'\n",
    ),
    "schedule catchup huge": (
        ["starter.py", "schedule", "create", "--catchup-hours", "1e300"],
        "--catchup-hours: expected a number above 0 and at most 8784",
    ),
    "schedule catchup tiny": (
        ["starter.py", "schedule", "create", "--catchup-hours", "0.001"],
        "--catchup-hours: must be at least 10 seconds (0.0028 hours), Temporal's least",
    ),
    "run ahead and late": (
        ["starter.py", "run", "2026-11", "--ahead", "--late"],
        "argument --late: not allowed with argument --ahead",
    ),
    "skip ahead and late": (
        ["starter.py", "skip", "2026-11", "cust-1", "--reason", "x", "--late", "--ahead"],
        "argument --ahead: not allowed with argument --late",
    ),
    "backfill reversed": (
        ["starter.py", "schedule", "backfill", "--start", "2026-11", "--end", "2026-09"],
        "ends (2026-09) before it starts (2026-11)",
    ),
    "import bad row": (
        ["starter.py", "customers", "import", "{bad_csv}"],
        "line 3: amount must be positive",
    ),
    "show bad id": (
        ["starter.py", "customers", "show", "acme 1"],
        "customer id 'acme 1' must be 1-64 characters",
    ),
    "show too many": (
        ["starter.py", "customers", "show", "acme-1", "--limit", "1001"],
        "--limit: at most 1,000 periods, got 1,001",
    ),
    "seed zero": (["starter.py", "customers", "seed-demo", "--count", "0"], "positive whole"),
    "seed huge": (
        ["starter.py", "customers", "seed-demo", "--count", "99999999999"],
        "at most 1,000,000 demo customers, got 99,999,999,999",
    ),
    "demo superscript": (["starter.py", "demo", "--customers", "²"], "positive whole"),
    # As `run`: refused before the local stack starts (helper-169 F4).
    "demo late": (
        ["starter.py", "demo", "--period", "2019-01"],
        "2019-01 is more than 3 months before the current month",
    ),
    "demo ahead": (
        ["starter.py", "demo", "--period", "2099-01"],
        "2099-01 is later than next month",
    ),
    # A flag for a far month, given for a month that is not: a mistyped year (helper-177 F3).
    "run ahead of a past month": (
        ["starter.py", "run", "2020-01", "--ahead"],
        "--ahead is for a period later than next month",
    ),
    "run late of a recent month": (
        ["starter.py", "run", str(period_for(datetime.now(UTC), "advance").previous()), "--late"],
        "--late is for a period more than 3 months before the current month",
    ),
    "backfill late of a recent month": (
        [
            *("starter.py", "schedule", "backfill", "--late"),
            *("--start", str(period_for(datetime.now(UTC), "advance").previous())),
            *("--end", str(period_for(datetime.now(UTC), "advance").previous())),
        ],
        "--late is for a period more than 3 months before the current month",
    ),
    "demo ahead without a period": (
        ["starter.py", "demo", "--ahead"],
        "--ahead lets --period name a month far from this one: without --period",
    ),
    "vault port": (["-m", "vault", "--port", "70000"], "not a TCP port"),
}


def unreachable(port: int) -> dict[str, str]:
    """Every service's address, at a port nothing listens on."""
    return {
        "TEMPORAL_ADDRESS": f"127.0.0.1:{port}",
        "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{port}/billing",
        "STRIPE_API_BASE": f"http://127.0.0.1:{port}",
        # The vault starts only when its settings are complete, and they are not bad here.
        "VAULT_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{port}/billing",
        "VAULT_ADMIN_TOKEN": "adm_test_token_4f9c2e7a1b",
        "VAULT_UPSTREAM_STRIPE_SECRET": "sk_test_cli_unused",
        "VAULT_MAX_CAP_CENTS": "100",
    }


# The programs the cases name, called in this process: a Python start-up for each case was
# most of this file's time. test_a_malformed_database_url_is_named_... runs each for real.
PROGRAMS: dict[tuple[str, ...], Callable[[list[str]], int]] = {
    ("starter.py",): main,
    ("-m", "vault"): vault_main,
}


def call(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Exit:
    """`python *argv`, in this process: its exit status and what it printed."""
    for prefix, program in PROGRAMS.items():
        if tuple(argv[: len(prefix)]) == prefix:
            try:
                code = program(argv[len(prefix) :])
            except SystemExit as exited:  # argparse's own refusals
                code = exited.code if isinstance(exited.code, int) else 1
            printed = capsys.readouterr()
            return Exit(code, printed.out, printed.err)
    raise AssertionError(f"no program for {argv}")


def test_a_watch_interval_below_its_floor_is_refused() -> None:
    parse = arguments.number(3600, least=0.2)
    assert parse("0.2") == 0.2
    # Not parsed: a default below the floor would query Temporal in a busy loop too.
    assert commands.parser().parse_args(["watch", "2026-12"]).interval >= 0.2
    with pytest.raises(argparse.ArgumentTypeError, match=r"from 0\.2 to 3600, got '1e-9'"):
        parse("1e-9")


@pytest.mark.parametrize("lost_with", [TimeoutError, ConnectionResetError])
def test_a_connection_lost_midway_is_one_line_not_a_traceback(
    lost_with: type[Exception], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # asyncpg's command_timeout, or the database restarting during a command.
    async def lost(args: argparse.Namespace) -> int:
        raise lost_with()

    monkeypatch.setattr(commands, "cmd_preview", lost)
    assert main(["preview", "2026-12"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {lost_with.__name__} while talking to the database")
    assert "may or may not have taken effect" in err and err.count("\n") == 1


@pytest.mark.parametrize("case", list(CASES))
def test_bad_arguments_are_refused_before_anything_is_contacted(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bad_csv = tmp_path / "customers.csv"
    bad_csv.write_text(_csv("c-1,cus_A,pm_1,1500,usd\nc-2,cus_B,pm_2,0,usd\n"))
    for name, value in unreachable(free_port()).items():
        monkeypatch.setenv(name, value)
    argv, expected = CASES[case]
    result = call([a.format(bad_csv=bad_csv) for a in argv], capsys)
    assert result.code == 2, result
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert "cannot reach" not in result.stderr and "could not start" not in result.stderr
    assert result.stdout == ""


LIVE_KEY = "sk_live_" + "Q7" * 12


@pytest.mark.parametrize(
    "argv",
    [
        ["schedule", "create", "--billing", LIVE_KEY],
        ["schedule", "create", "--hour", LIVE_KEY],
        ["schedule", "create", "--catchup-hours", LIVE_KEY],
        ["watch", "2026-12", "--interval", LIVE_KEY],
        ["schedule", LIVE_KEY],
        ["status", "2026-12", LIVE_KEY],
    ],
    ids=["choice", "int", "positive", "number", "sub-command", "unexpected"],
)
def test_a_key_pasted_into_the_wrong_place_is_not_echoed(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse's own errors quote the value given (helper-152 F4): redacted, as the
    project's own checks show bad input."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert LIVE_KEY not in err and "[redacted key]" in err, err


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"BILLING_VAULT_URL": "http://127.0.0.1:1"}, "BILLING_VAULT_WORKER_TOKEN is needed too"),
        # Blank in an env file: read as unset, the worker charged around the vault, uncapped.
        (
            {"BILLING_VAULT_URL": "http://127.0.0.1:1", "BILLING_VAULT_WORKER_TOKEN": ""},
            "BILLING_VAULT_WORKER_TOKEN: is set but blank",
        ),
        ({"BILLING_VAULT_WORKER_TOKEN": "a-worker-token-0123"}, "BILLING_VAULT_URL is not"),
        ({"BILLING_CAP_MULTIPLIER": "0.5"}, "BILLING_CAP_MULTIPLIER: Input should be greater"),
        # Not "less than or equal to 10", which sent the operator to the wrong fix.
        ({"BILLING_CAP_MULTIPLIER": "nan"}, "BILLING_CAP_MULTIPLIER: Input should be a finite"),
        # The vault's cap is the backstop for a charge sent twice: ten times the total is no cap.
        ({"BILLING_CAP_MULTIPLIER": "11"}, "BILLING_CAP_MULTIPLIER: Input should be less than"),
        # Past Stripe's key window a retry without a lookup first would charge again.
        ({"BILLING_LOOKUP_AFTER_SECONDS": "86400"}, "could be charged a second time"),
        ({"BILLING_LOOKUP_AFTER_SECONDS": "inf"}, "should be a finite number"),
        ({"BILLING_STRIPE_TIMEOUT_SECONDS": "inf"}, "should be a finite number"),
        # A rate so low its first slot overflowed the rate limiter's arithmetic.
        ({"BILLING_STRIPE_RPS": "1e-300"}, "BILLING_STRIPE_RPS: Input should be greater than"),
        ({"LOG_LEVEL": "LOUD"}, "LOG_LEVEL: Input should be"),
        # No scheme: every call failed as unreachable, and runs waited at their opening.
        ({"BILLING_VAULT_URL": "vault:8080"}, "BILLING_VAULT_URL: must be an http"),
        # A live key, secret or restricted, in clear text over the network.
        (
            {"STRIPE_API_KEY": "sk_live_" + "Q7" * 12, "STRIPE_API_BASE": "http://api.stripe.com"},
            "STRIPE_API_BASE must be an https:// URL for a live Stripe key",
        ),
        (
            {"STRIPE_API_KEY": "rk_live_" + "Q7" * 12, "STRIPE_API_BASE": "http://api.stripe.com"},
            "STRIPE_API_BASE must be an https:// URL for a live Stripe key",
        ),
        # Keys expiring as they are issued: every charge of a run refused, the run paused.
        (
            {"BILLING_VAULT_KEY_GRACE_DAYS": "0"},
            "BILLING_VAULT_KEY_GRACE_DAYS: Input should be greater than or equal to 1",
        ),
        # Blank, asyncpg tried local defaults and the worker migrated whatever answered.
        ({"DATABASE_URL": " "}, "DATABASE_URL: is set but blank"),
        # Another queue, which no starter polled; every charge timing out, retried for ever.
        ({"TEMPORAL_TASK_QUEUE": "billing\n"}, "TEMPORAL_TASK_QUEUE: has spaces"),
        (
            {"BILLING_STRIPE_TIMEOUT_SECONDS": "1e-9"},
            "BILLING_STRIPE_TIMEOUT_SECONDS: Input should",
        ),
        ({"BILLING_KEY_NAMESPACE": " "}, "BILLING_KEY_NAMESPACE: is set but blank"),
        ({"METRICS_HOST": ""}, "METRICS_HOST: is set but blank"),
        # As Stripe's reference writes it: every charge went to /v1/v1/... and failed for good.
        ({"STRIPE_API_BASE": "https://api.stripe.com/v1"}, "STRIPE_API_BASE: ends in /v1"),
        # A secret made with `echo`: every charge failed before it was sent, retried for ever.
        ({"STRIPE_API_KEY": "sk_test_" + "Q7" * 12 + "\n"}, "STRIPE_API_KEY: has spaces"),
        # A key of one's own and no base: sent to the local emulator's address, retried for ever.
        ({}, "STRIPE_API_KEY is set but STRIPE_API_BASE is not"),
    ],
)
async def test_a_worker_with_a_bad_setting_names_it_and_shows_no_value(
    env: dict[str, str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Refused before the worker contacts anything. In this process: worker.py prints the
    error and exits 2 (test_a_malformed_database_url_is_named_... runs it for real)."""
    secret = "sk_test_" + "Q7" * 12  # the whole environment is the input pydantic would show
    for name, value in {"STRIPE_API_KEY": secret, **env}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(BillingError) as refused:
        await worker.main()
    message = str(refused.value)
    assert expected in message
    assert "input_value" not in message
    printed = capsys.readouterr()
    assert "Q7Q7" not in message + printed.out + printed.err


@pytest.mark.parametrize(
    ("argv", "variable"),
    [
        (["starter.py", "preview", "2026-12"], "DATABASE_URL"),
        (["worker.py"], "DATABASE_URL"),
        (["-m", "vault"], "VAULT_DATABASE_URL"),
    ],
)
async def test_a_malformed_database_url_is_named_and_its_password_not_shown(
    argv: list[str], variable: str
) -> None:
    # Unescaped '/' and '#' in the password: the URL parser's own message quotes a piece.
    url = "postgresql://billing:Pa55w/0rd#S3cret@127.0.0.1:5432/billing"
    env = {
        variable: url,
        "VAULT_ADMIN_TOKEN": "adm_test_token_4f9c2e7a1b",
        "VAULT_UPSTREAM_STRIPE_BASE": "https://api.stripe.com",
        "VAULT_UPSTREAM_STRIPE_SECRET": "sk_test_cli_unused",
        "VAULT_MAX_CAP_CENTS": "100",
    }
    result = await run_cli(*argv, env=env)
    assert (result.code, result.stdout) == (2, ""), result
    assert f"{variable} is not a valid PostgreSQL URL" in result.stderr
    assert "percent-encode" in result.stderr
    assert "Pa55w" not in result.stderr and "S3cret" not in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "url",
    [
        # A Unix socket, its password a parameter.
        "postgresql:///billing?host=/nonexistent/socket-dir&password=Pa55wS3cret",
        # Hosts to fail over between.
        "postgresql://billing:Pa55wS3cret@127.0.0.1:1,127.0.0.1:2/billing",
    ],
)
async def test_urls_asyncpg_takes_are_not_refused_as_malformed(url: str) -> None:
    result = await run_cli("starter.py", "preview", "2026-12", env={"DATABASE_URL": url})
    assert result.code == 2, result
    assert "cannot reach PostgreSQL" in result.stderr
    assert "not a valid PostgreSQL URL" not in result.stderr
    assert "Pa55w" not in result.stderr


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:secret@db:5432/billing?password=x", "db:5432/billing"),
        ("postgresql://u:secret@h1:1,h2:2/billing", "h1:1,h2:2/billing"),
        ("postgresql://u:p@ss@h1:1,h2:2/billing", "the host the URL names"),
        ("postgresql:///billing?host=/run/pg&password=x", "/billing"),
        # An '@' outside the user part: none of the URL is shown.
        ("postgresql://u:pa?ss@db:5432/billing", "the host the URL names"),
        ("postgresql://u:pa/ss@db/billing", "the host the URL names"),
        ("postgresql:///billing?user=ops@corp&password=S3cret", "the host the URL names"),
        ("postgresql://db/billing?application_name=a@b&password=S3c@ret", "the host the URL names"),
        ("postgresql://ops@corp:2024/Winter!@127.0.0.1:1/billing", "the host the URL names"),
        ("postgresql://ops@127.0.0.1:2024#Winter@db/billing", "the host the URL names"),
        ("postgresql://u:S3[cret@[::1]/billing", "the host the URL names"),
        ("postgresql://db/billing;password=S3cret", "db/billing"),
    ],
)
def test_a_database_url_is_shown_without_user_password_or_parameters(url: str, shown: str) -> None:
    assert where(url) == shown


async def test_an_import_repricing_customers_a_running_period_has_not_billed_is_refused(
    db: asyncpg.Pool, database_url: str, tmp_path: Path
) -> None:
    await db.execute(
        "INSERT INTO customers (customer_id, stripe_customer_id, payment_method, amount_cents,"
        " currency, active) VALUES ('c-1', 'cus_A', 'pm_1', 100, 'usd', true),"
        " ('c-2', 'cus_B', 'pm_2', 100, 'usd', true), ('c-3', 'cus_C', 'pm_3', 100, 'usd', false),"
        " ('c-6', 'cus_F', 'pm_6', 100, 'usd', false)"
    )
    async with db.acquire() as conn:
        # c-4 a cancelled run never started: the open run claims it at its price of then.
        await conn.execute(
            "INSERT INTO customers (customer_id, stripe_customer_id, payment_method,"
            " amount_cents, currency) VALUES ('c-4', 'cus_D', 'pm_4', 100, 'usd')"
        )
        key = idempotency_key("billing", "c-4", Period(2026, 12))
        await ledger.cancel_customers(conn, "2026-12", {"c-4": key}, "r", "alice")
        plan = await ledger.plan_period(conn, "2026-12")
        await ledger.start_period(conn, plan, "billing-period-2026-12")
    path = tmp_path / "customers.csv"
    # c-3, inactive now, is made active by the import: in a new currency, it would pause the run.
    path.write_text(
        _csv(
            "c-1,cus_A,pm_1,100,usd\nc-2,cus_B,pm_2,250,usd\nc-3,cus_C,pm_3,100,eur\n"
            "c-4,cus_D,pm_4,300,usd\nc-5,cus_E,pm_5,100,eur\nc-6,cus_F,pm_6,100,usd\n"
        )
    )
    argv = ["starter.py", "customers", "import", str(path), "--reactivate"]
    env = {"DATABASE_URL": database_url}
    refused = await run_cli(*argv, env=env)
    assert (refused.code, refused.stdout) == (2, ""), refused
    assert "adds or changes the price of 5 customers the open run of 2026-12" in refused.stderr
    assert "c-4 (usd 1.00 -> usd 3.00)" in refused.stderr
    # Made active again, or new: either may join the run's list at a price it never counted.
    assert "c-3 (inactive, usd 1.00 -> eur 1.00)" in refused.stderr
    assert "c-5 (new -> eur 1.00)" in refused.stderr
    assert "c-6 (inactive, usd 1.00 -> usd 1.00)" in refused.stderr
    assert (
        "c-2 (usd 1.00 -> usd 2.50)" in refused.stderr and "nothing was imported" in refused.stderr
    )
    assert await db.fetchval("SELECT amount_cents FROM customers WHERE customer_id = 'c-2'") == 100
    forced = await run_cli(*argv, "--while-running", env=env)
    assert forced.code == 0, forced
    assert await db.fetchval("SELECT amount_cents FROM customers WHERE customer_id = 'c-2'") == 250
    # Imported all the same, the changes are on record in the output.
    assert "note: the open run of 2026-12 may bill these as now imported:" in forced.stdout
    assert "c-4 (usd 1.00 -> usd 3.00)" in forced.stdout


async def test_an_import_makes_a_deactivated_customer_active_only_when_asked(
    db: asyncpg.Pool, database_url: str, tmp_path: Path
) -> None:
    """c-2 left and was deactivated; a file exported before that (or a master file imported
    whole) made it active again without a word, and the next run billed it (helper-188)."""
    await db.execute(
        "INSERT INTO customers (customer_id, stripe_customer_id, payment_method, amount_cents,"
        " currency, active) VALUES ('c-1', 'cus_A', 'pm_1', 100, 'usd', true),"
        " ('c-2', 'cus_B', 'pm_2', 100, 'usd', false), ('c-3', 'cus_C', 'pm_3', 100, 'usd', false)"
    )
    path = tmp_path / "master.csv"
    path.write_text(
        _csv("c-1,cus_A,pm_1,200,usd\nc-2,cus_B,pm_2,100,usd\nc-4,cus_D,pm_4,100,usd\n")
    )
    argv = ["starter.py", "customers", "import", str(path)]
    env = {"DATABASE_URL": database_url}
    refused = await run_cli(*argv, env=env)
    assert (refused.code, refused.stdout) == (2, ""), refused
    assert (
        "1 inactive customer id would be made active again and billed from the next run on: c-2."
        " If they are back, import with --reactivate"
    ) in refused.stderr
    assert "nothing was imported" in refused.stderr
    written = "SELECT customer_id, amount_cents, active FROM customers ORDER BY customer_id"
    assert [tuple(r) for r in await db.fetch(written)] == [
        ("c-1", 100, True),
        ("c-2", 100, False),
        ("c-3", 100, False),
    ]
    asked = await run_cli(*argv, "--reactivate", env=env)
    assert (asked.code, asked.stdout.strip()) == (
        0,
        f"imported 3 customers from {path} into the ledger at {where(database_url)}",
    ), asked
    assert [tuple(r) for r in await db.fetch(written)] == [
        ("c-1", 200, True),
        ("c-2", 100, True),
        ("c-3", 100, False),
        ("c-4", 100, True),
    ]


async def test_seeding_with_stripe_unreachable_is_one_line_and_writes_nothing(
    db: asyncpg.Pool, database_url: str
) -> None:
    """It printed the Stripe SDK's traceback and exited 1, the code of a reconciliation's
    findings (helper-187)."""
    closed = free_port()
    result = await run_cli(
        "starter.py",
        "customers",
        "seed-demo",
        "--count",
        "3",
        env={"DATABASE_URL": database_url, "STRIPE_API_BASE": f"http://127.0.0.1:{closed}"},
    )
    assert (result.code, result.stdout) == (2, ""), result
    assert result.stderr.startswith(
        f"error: cannot reach Stripe at http://127.0.0.1:{closed} (STRIPE_API_BASE); nothing was"
        " written to the ledger"
    )
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
    assert await db.fetchval("SELECT count(*) FROM customers") == 0


async def test_seeding_again_reuses_the_stripe_customers_and_counts_the_ledgers_others(
    db: asyncpg.Pool, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeding run again (interrupted, or `demo` after `customers seed-demo`) gets Stripe's
    replay of each customer, a batch at a time; and as a run bills every active customer,
    those the demo did not create are counted apart."""
    await db.execute(
        "INSERT INTO customers (customer_id, stripe_customer_id, payment_method, amount_cents,"
        " currency, active) VALUES ('c-1', 'cus_A', 'pm_1', 100, 'usd', true),"
        " ('c-2', 'cus_B', 'pm_2', 100, 'usd', false)"
    )
    monkeypatch.setattr(seeding, "_BATCH", 2)  # three customers in two batches
    monkeypatch.setenv("DATABASE_URL", database_url)
    demo_rows = (
        "SELECT customer_id, stripe_customer_id, amount_cents FROM customers"
        " WHERE customer_id LIKE 'demo-%' ORDER BY customer_id"
    )
    async with serve_emulator(EmulatorConfig()) as emulator:
        monkeypatch.setenv("STRIPE_API_BASE", emulator.url)
        first = await seeding.seed_demo(3)
        rows = await db.fetch(demo_rows)
        again = await seeding.seed_demo(3)
        assert await db.fetch(demo_rows) == rows
    assert first == again == seeding.DemoSeed(written=3, active=4, not_demo=1)
    assert [(r["customer_id"], r["amount_cents"]) for r in rows] == [
        (f"demo-{i:06d}", seeding.demo_amount(i)) for i in (1, 2, 3)
    ]
    assert len({r["stripe_customer_id"] for r in rows}) == 3


async def test_an_import_warns_of_a_stripe_customer_charged_under_two_ids(
    db: asyncpg.Pool, database_url: str, tmp_path: Path
) -> None:
    # acme_1 is not acme-1 spelt another way (that is refused): it may be a second account
    # of the same Stripe customer, or the same one imported twice. Imported, and said so.
    # b-0, inactive, is charged under no id: cus_B is not named.
    await db.execute(
        "INSERT INTO customers (customer_id, stripe_customer_id, payment_method, amount_cents,"
        " currency, active) VALUES ('b-0', 'cus_B', 'pm_2', 100, 'usd', false)"
    )
    path = tmp_path / "customers.csv"
    path.write_text(
        _csv("acme-1,cus_A,pm_1,100,usd\nacme_1,cus_A,pm_1,100,usd\nb-1,cus_B,pm_2,100,usd\n")
    )
    result = await run_cli(
        "starter.py", "customers", "import", str(path), env={"DATABASE_URL": database_url}
    )
    assert (result.code, result.stdout.strip()) == (
        0,
        f"imported 3 customers from {path} into the ledger at {where(database_url)}",
    )
    assert (
        "warning: 1 Stripe customer charged under more than one active customer id, once"
        " per id every period: cus_A (acme-1, acme_1)"
    ) in result.stderr
    assert "customers deactivate ID" in result.stderr


@pytest.mark.parametrize("argv", [["preview", "2026-12"], ["customers", "import", "IN.csv"]])
async def test_a_database_never_migrated_is_named_with_what_to_do(
    postgres: LocalPostgres, tmp_path: Path, argv: list[str]
) -> None:
    path = tmp_path / "customers.csv"
    path.write_text(_csv("c-1,cus_A,pm_1,100,usd\n"))
    conn = await asyncpg.connect(postgres.dsn())
    try:
        await conn.execute(f"CREATE DATABASE never_migrated_{argv[0]}")
    finally:
        await conn.close()
    command = [str(path) if a == "IN.csv" else a for a in argv]
    result = await run_cli(
        "starter.py", *command, env={"DATABASE_URL": postgres.dsn(f"never_migrated_{argv[0]}")}
    )
    assert (result.code, result.stdout) == (2, ""), result
    assert "python starter.py migrate" in result.stderr
    assert "Traceback" not in result.stderr


async def test_a_database_or_address_refused_is_one_line_not_a_traceback(
    db: asyncpg.Pool, database_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "customers.csv"
    path.write_text(_csv("c-1,cus_A,pm_1,100,usd\n"))
    cases = [
        # A read-only database (a replica's URL, say): PostgreSQL refuses the write.
        (
            ["customers", "import", str(path)],
            {"DATABASE_URL": database_url + "?default_transaction_read_only=on"},
            "PostgreSQL refused: cannot execute INSERT in a read-only transaction",
        ),
        (
            ["preview", "2026-12"],
            {"DATABASE_URL": "postgresql://postgres@127.0.0.1:99999/billing"},
            "DATABASE_URL: connect(): port must be 0-65535",
        ),
        (
            ["status", "2026-12"],
            # Shaped as host:port, but no IPv6 address: the SDK's refusal.
            {"TEMPORAL_ADDRESS": "[1::2::3]:7233"},
            "the Temporal address '[1::2::3]:7233' (TEMPORAL_ADDRESS, or the profile's address):"
            " invalid target URL",
        ),
    ]
    for argv, env, expected in cases:
        result = await run_cli("starter.py", *argv, env=env)
        assert (result.code, result.stdout) == (2, ""), result
        assert expected in result.stderr
        assert "Traceback" not in result.stderr
    assert await db.fetchval("SELECT count(*) FROM customers") == 0


async def test_a_bad_import_leaves_the_customers_as_they_were(
    db: asyncpg.Pool, database_url: str, tmp_path: Path
) -> None:
    await db.execute(
        "INSERT INTO customers (customer_id, stripe_customer_id, payment_method, amount_cents,"
        " currency) VALUES ('c-1', 'cus_A', 'pm_1', 100, 'usd')"
    )
    before = [dict(r) for r in await db.fetch("SELECT * FROM customers")]
    path = tmp_path / "customers.csv"
    # Rows 2 and 3 are good (one updates c-1); the last is bad, so none may be written.
    path.write_text(
        _csv(f"c-1,cus_A,pm_1,999,usd\nc-2,cus_B,pm_2,500,usd\n{HOSTILE_ID},cus_C,,5,usd\n")
    )
    result = await run_cli(
        "starter.py", "customers", "import", str(path), env={"DATABASE_URL": database_url}
    )
    assert result.code == 2
    assert "line 4: customer_id: " in result.stderr and "1-64 characters" in result.stderr
    assert [dict(r) for r in await db.fetch("SELECT * FROM customers")] == before


async def test_unknown_names_on_the_real_stack_are_clear_errors_and_start_nothing(
    temporal_client: Client, db: asyncpg.Pool, database_url: str
) -> None:
    env = {
        "TEMPORAL_ADDRESS": temporal_client.service_client.config.target_host,
        "TEMPORAL_NAMESPACE": temporal_client.namespace,
        "DATABASE_URL": database_url,
    }
    for argv, expected in (
        (["skip", "2026-12", "nobody", "--reason", "r"], "customer 'nobody' is not in the ledger"),
        # A month far from now with no run: most likely mistyped, so the skip would stop nothing.
        (
            ["skip", "2062-12", "nobody", "--reason", "r"],
            "2062-12 is later than next month, and has no run",
        ),
        (["skip", "2025-01", "nobody", "--reason", "r"], "2025-01 is more than"),
        (
            ["skip", "2062-12", "nobody", "--reason", "r", "--ahead"],
            "customer 'nobody' is not in the ledger",
        ),
        (["pause", "2026-12", "--reason", "r"], "no run of 2026-12 is running to pause"),
        (
            ["renew-keys", "2026-12", "--reason", "r"],
            "no run of 2026-12 is running to renew the keys of",
        ),
        (["schedule", "trigger", "--id", "no-such-schedule"], "no schedule 'no-such-schedule'"),
    ):
        result = await run_cli("starter.py", *argv, env=env)
        assert (result.code, result.stdout) == (2, ""), result
        assert expected in result.stderr
        assert "Traceback" not in result.stderr
    assert [w async for w in temporal_client.list_workflows()] == []
    assert await db.fetchval("SELECT count(*) FROM billing_runs") == 0


async def test_a_namespace_that_does_not_exist_is_named_not_read_as_no_run(
    temporal_client: Client,
) -> None:
    # Every workflow of a missing namespace reads as never started: a status said a billed
    # period never ran, and a cancel that nothing was running.
    env = {
        "TEMPORAL_ADDRESS": temporal_client.service_client.config.target_host,
        "TEMPORAL_NAMESPACE": "prod-typo",
    }
    for argv in (["status", "2026-12"], ["cancel", "2026-12", "--reason", "r"]):
        result = await run_cli("starter.py", *argv, env=env)
        assert (result.code, result.stdout) == (2, ""), result
        assert "has no namespace 'prod-typo' (TEMPORAL_NAMESPACE" in result.stderr
        assert "Traceback" not in result.stderr


async def test_an_operator_request_no_worker_takes_up_is_an_error_not_a_hang(
    temporal_client: Client, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run open on a task queue no worker polls: pause, resume, cancel and skip waited for
    # ever, printing nothing.
    monkeypatch.setattr(operations, "ACCEPT_TIMEOUT", timedelta(seconds=1))
    period = Period(2026, 12)
    handle = await start_period(temporal_client, period, "nobody-polls-this")
    request = OperatorRequest(reason="wrong prices", operator="ops")
    for action in ("pause", "cancel"):
        with pytest.raises(NoWorkerError, match=f"no worker took up the {action} of 2026-12"):
            await operations.control(temporal_client, period, action, request)
    skip = SkipRequest(customer_id="c-1", reason="r", operator="ops")
    with pytest.raises(NoWorkerError, match="no worker took up the skip of c-1 in 2026-12"):
        await operations.skip(temporal_client, BillingSettings(), database_url, period, skip)
    # A cancel from outside (Ctrl-C) before the deadline is that, not "no worker".
    monkeypatch.setattr(operations, "ACCEPT_TIMEOUT", timedelta(seconds=30))
    waiting = asyncio.create_task(operations.control(temporal_client, period, "pause", request))
    await asyncio.sleep(0.5)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await handle.terminate("test over")


async def test_the_demo_finds_its_stack_whatever_namespace_the_shell_names(
    temporal_client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = StackConfig(root=tmp_path)
    address = temporal_client.service_client.config.target_host
    namespace = temporal_client.namespace
    config.env_file.write_text(
        f"export TEMPORAL_ADDRESS={address}\nexport TEMPORAL_NAMESPACE={namespace}\n"
    )
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "billing-staging")  # another server's
    assert await demo._stack_reachable(config)


def test_an_operator_without_a_login_name_is_asked_for_one(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_login() -> str:
        raise OSError("No username set in the environment")

    monkeypatch.setattr(getpass, "getuser", no_login)
    monkeypatch.delenv("BILLING_OPERATOR", raising=False)
    with pytest.raises(InvalidInputError, match="pass --operator or set BILLING_OPERATOR"):
        arguments.operator(argparse.Namespace(operator=None))


@pytest.mark.parametrize("broken", ["stdout", "database"])
def test_output_nobody_reads_is_no_database_error(
    broken: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pause ... | head`: the pause was done, and only its output found no reader; a pipe
    the database's connection broke still says it may or may not have taken effect."""
    read, write = os.pipe()
    if broken == "stdout":
        os.close(read)
    # Read by nobody; or, when the database's connection broke, by a reader still there.
    stdout = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", stdout)

    async def done_then_printed(_: argparse.Namespace) -> int:
        if broken == "database":
            raise BrokenPipeError(32, "Broken pipe")
        print("paused 2026-12\n" * 10_000)
        return 0

    monkeypatch.setattr(commands, "cmd_control", done_then_printed)
    code = main(["pause", "2026-12", "--reason", "audit"])
    err = capsys.readouterr().err
    stdout.close()
    if broken == "stdout":
        assert (code, err) == (141, "")
    else:
        os.close(read)
        assert code == 2 and "it may or may not have taken effect" in err


# As compose passes it on when the shell has none: the login there is the image's. A
# zero-width space reads as nobody in the audit trail too.
@pytest.mark.parametrize("nobody", [" ", "\u200b"])
def test_an_operator_set_to_nothing_is_refused_not_taken_from_the_login(
    nobody: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BILLING_OPERATOR", nobody)
    with pytest.raises(SettingsError, match="BILLING_OPERATOR: is set but empty"):
        arguments.operator(argparse.Namespace(operator=None))
    monkeypatch.setenv("BILLING_OPERATOR", "alice")
    assert arguments.operator(argparse.Namespace(operator=None)) == "alice"
    assert arguments.operator(argparse.Namespace(operator="bob")) == "bob"


@pytest.mark.parametrize("error", [asyncpg.UndefinedColumnError, asyncpg.UndefinedFunctionError])
def test_a_database_an_older_release_migrated_is_told_to_migrate(
    error: type[asyncpg.PostgresError],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def older_schema(_: argparse.Namespace) -> int:
        raise error(
            "column r.cancelled_before_start does not exist\n"
            'HINT:  Perhaps you meant to reference the column "r.cancelled".'
        )

    monkeypatch.setattr(commands, "cmd_preview", older_schema)
    assert main(["preview", "2026-12"]) == 2
    stderr = capsys.readouterr().err
    assert "cancelled_before_start does not exist" in stderr
    assert "HINT" not in stderr and stderr.count("\n") == 1, stderr
    assert "apply the migrations with 'python starter.py migrate'" in stderr


SEARCH_ATTRIBUTE_HINT = "the namespace lacks the project's search attributes"


@pytest.mark.parametrize(
    ("raised", "code", "said"),
    [
        (
            RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b""),
            2,
            "error: Temporal cannot be reached (UNAVAILABLE: connection refused): what runs"
            " there goes on",
        ),
        (
            RPCError(
                "BillingPeriod is not a valid search attribute", RPCStatusCode.INVALID_ARGUMENT, b""
            ),
            2,
            "error: Temporal answered INVALID_ARGUMENT: BillingPeriod is not a valid search"
            f" attribute: {SEARCH_ATTRIBUTE_HINT}; `python starter.py setup` registers them",
        ),
        # Only a refusal about search attributes is sent to `setup`.
        (
            RPCError("search attribute BillingPeriod", RPCStatusCode.PERMISSION_DENIED, b""),
            2,
            "error: Temporal answered PERMISSION_DENIED: search attribute BillingPeriod\n",
        ),
        (
            RPCError("workflow id too long", RPCStatusCode.INVALID_ARGUMENT, b""),
            2,
            "error: Temporal answered INVALID_ARGUMENT: workflow id too long\n",
        ),
        (
            WorkflowQueryFailedError("query handler broken"),
            2,
            "error: the run did not answer its status query: query handler broken (see its"
            " workflow task's failure in the Web UI)",
        ),
        (
            WorkflowFailureError(cause=ApplicationError("no open claim")),
            3,
            "error: the workflow failed: no open claim\n",
        ),
        (KeyboardInterrupt(), 130, ""),
    ],
    ids=[
        "temporal away",
        "no search attributes",
        "refused otherwise",
        "invalid otherwise",
        "query failed",
        "workflow failed",
        "interrupted",
    ],
)
def test_what_temporal_answers_is_one_line_and_its_exit_status(
    raised: BaseException,
    code: int,
    said: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exit 3 is a run that failed, as `run --wait` tells one; 1 is left to reconciliation's
    findings, 130 to Ctrl-C."""

    async def answered(_: argparse.Namespace) -> int:
        raise raised

    monkeypatch.setattr(commands, "cmd_preview", answered)
    assert main(["preview", "2026-12"]) == code
    printed = capsys.readouterr()
    assert printed.out == ""
    assert said in printed.err and printed.err.count("\n") == (1 if said else 0), printed.err
    if "INVALID_ARGUMENT" not in said:
        assert SEARCH_ATTRIBUTE_HINT not in printed.err


async def test_deactivating_customers_says_what_it_did_and_refuses_what_it_cannot(
    db: asyncpg.Pool, database_url: str
) -> None:
    await db.execute(
        "INSERT INTO customers (customer_id, stripe_customer_id, payment_method, amount_cents,"
        " currency, active) VALUES ('c-1', 'cus_A', 'pm_1', 100, 'usd', true),"
        " ('c-2', 'cus_B', 'pm_2', 100, 'usd', true), ('c-3', 'cus_C', 'pm_3', 100, 'usd', false)"
    )
    env = {"DATABASE_URL": database_url}

    async def active() -> list[str]:
        rows = await db.fetch("SELECT customer_id FROM customers WHERE active ORDER BY 1")
        return [row["customer_id"] for row in rows]

    deactivate = ["starter.py", "customers", "deactivate"]
    unknown = await run_cli(*deactivate, "c-1", "nobody", env=env)
    assert (unknown.code, unknown.stdout) == (2, ""), unknown
    assert "no customer 'nobody' in the ledger; nothing was deactivated" in unknown.stderr
    bad = await run_cli(*deactivate, "c-1", "no spaces", env=env)
    assert (bad.code, bad.stdout) == (2, ""), bad
    assert "customer id 'no spaces' must be 1-64 characters" in bad.stderr
    assert await active() == ["c-1", "c-2"]
    # A run open with c-1 and c-2 not yet claimed: its plan counted them.
    async with db.acquire() as conn:
        plan = await ledger.plan_period(conn, "2026-12")
        await ledger.start_period(conn, plan, "billing-period-2026-12")
    refused = await run_cli(*deactivate, "c-1", "c-3", env=env)
    assert (refused.code, refused.stdout) == (2, ""), refused
    assert "1 customer an open run has not claimed yet: c-1 (2026-12)" in refused.stderr
    assert "Nothing was deactivated" in refused.stderr
    assert await active() == ["c-1", "c-2"]
    forced = await run_cli(*deactivate, "c-1", "c-3", "--while-running", env=env)
    assert forced.code == 0, forced
    assert "deactivated 1 customer: c-1\nalready inactive: c-3\n" in forced.stdout
    assert "note: 1 customer an open run has not claimed yet: c-1 (2026-12)" in forced.stdout
    assert await active() == ["c-2"]
    # c-2's claim is open (the run ended, say terminated, without finishing it): a run
    # charges it whether or not c-2 is active, so it is named, with what stops it.
    async with db.acquire() as conn:
        await ledger.claim(
            conn,
            "c-2",
            "2026-12",
            idempotency_key("billing", "c-2", Period(2026, 12)),
            "run-1",
            charge_api="payment_intents",
        )
        await ledger.finish_period(conn, "2026-12", "{}")
    open_claim = await run_cli(*deactivate, "c-2", env=env)
    assert (open_claim.code, open_claim.stdout) == (2, ""), open_claim
    assert "1 claim open, which a run charges whether or not" in open_claim.stderr
    skip = "`starter.py skip PERIOD CUSTOMER --reason ...` stops one"
    assert f"c-2 (2026-12); {skip}" in open_claim.stderr
    assert await active() == ["c-2"]
    async with db.acquire() as conn:
        await conn.execute("UPDATE billing_runs SET skip_reason = 'gone' WHERE customer_id = 'c-2'")
    done = await run_cli(*deactivate, "c-2", env=env)
    assert (done.code, done.stdout) == (0, "deactivated 1 customer: c-2\n"), done
    assert await active() == []


async def test_a_deactivation_the_open_run_would_take_for_a_rename_is_refused_saying_so(
    db: asyncpg.Pool, database_url: str
) -> None:
    """c-1 and c-2, two accounts on cus_A; the open run charged c-1. Deactivated, c-1 makes
    the run take c-2 for it renamed and never bill it. The refusal is the only word of it: a
    command that exits 0 saying nothing reads as c-1 deactivated."""
    await db.execute(
        "INSERT INTO customers (customer_id, stripe_customer_id, payment_method, amount_cents,"
        " currency) VALUES ('c-1', 'cus_A', 'pm_1', 100, 'usd'), ('c-2', 'cus_A', 'pm_2', 100,"
        " 'usd')"
    )
    async with db.acquire() as conn:
        plan = await ledger.plan_period(conn, "2026-12")
        await ledger.start_period(conn, plan, "billing-period-2026-12")
    await db.execute(
        "INSERT INTO billing_runs (customer_id, billing_period, idempotency_key, amount_cents,"
        " currency, stripe_customer_id, status, charge_started_at, charge_id, completed_at)"
        " VALUES ('c-1', '2026-12', $1, 100, 'usd', 'cus_A', 'charged', now(), 'ch_1', now())",
        idempotency_key("billing", "c-1", Period(2026, 12)),
    )
    argv = ["starter.py", "customers", "deactivate", "c-1"]
    env = {"DATABASE_URL": database_url}
    held = "1 active customer sharing a Stripe customer an open run billed under these ids"
    refused = await run_cli(*argv, env=env)
    assert (refused.code, refused.stdout) == (2, ""), refused
    assert held in refused.stderr and "and not bill: c-2 in 2026-12 (as c-1)" in refused.stderr
    assert "Nothing was deactivated" in refused.stderr
    assert await db.fetchval("SELECT count(*) FROM customers WHERE active") == 2
    forced = await run_cli(*argv, "--while-running", env=env)
    assert forced.code == 0, forced
    assert forced.stdout.startswith("deactivated 1 customer: c-1\nnote: " + held)
    assert await db.fetchval("SELECT customer_id FROM customers WHERE active") == "c-2"

"""billing.logs: one JSON object a line with the event's fields, readable text otherwise, and
nothing shaped like a secret in either, whoever logged it."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from billing import logs

ROOT = Path(__file__).resolve().parents[2]
# The live one is built, not written out: no live-key pattern in the repository.
SECRETS = ("sk_test_4eC39HqLyjWDarjtT1zdp7dc", "vk_9f2b_c0ffee-123", "sk_" + "live_ABCdef123")


def capture(log_format: str) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.formatter(log_format))
    logger = logging.getLogger(f"tests.logs.{log_format}")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, stream


@pytest.fixture
def json_log() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    logger, stream = capture("json")
    yield logger, stream
    logger.handlers = []


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_an_event_is_one_json_object_with_its_fields(
    json_log: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = json_log
    logs.log_event(
        logger,
        "charge",
        period="2026-12",
        customer_id="cust-000042",
        workflow_id="billing-2026-12-cust-000042",
        key_prefix=logs.key_prefix("3f2a9c0d" + "e" * 24),
        outcome="charged",
        amount_cents=1999,
    )
    (line,) = lines(stream)
    assert list(line)[:4] == ["time", "level", "logger", "message"]
    assert datetime.fromisoformat(str(line["time"])).tzinfo is not None
    assert line["level"] == "INFO"
    assert line["logger"] == "tests.logs.json"
    assert line["message"] == line["event"] == "charge"
    assert line["key_prefix"] == "3f2a9c0d"
    assert (line["period"], line["customer_id"], line["amount_cents"]) == (
        "2026-12",
        "cust-000042",
        1999,
    )


def test_every_record_is_a_line_even_with_a_traceback(
    json_log: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = json_log
    logger.info("plain %s", "message")
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        logger.exception("failed")
    first, second = lines(stream)
    assert first["message"] == "plain message"
    assert "RuntimeError: boom" in str(second["exc_info"])


@pytest.mark.parametrize("secret", SECRETS)
def test_a_secret_is_redacted_wherever_it_is_logged(
    json_log: tuple[logging.Logger, io.StringIO], secret: str
) -> None:
    logger, stream = json_log
    logger.warning("key %s refused", secret)
    logs.log_event(logger, "refusal", detail=f"Bearer {secret}", nested={"why": [f"x\n{secret}"]})
    try:
        raise ValueError(f"the key {secret} is not valid")
    except ValueError:
        logger.exception("charge failed")
    text = stream.getvalue()
    assert secret not in text
    parsed = lines(stream)
    assert parsed[0]["message"] == "key [redacted key] refused"
    assert parsed[1]["detail"] == "Bearer [redacted key]"
    assert parsed[1]["nested"] == {"why": ["x\n[redacted key]"]}
    assert "[redacted key]" in str(parsed[2]["exc_info"])


def test_text_lines_are_readable_and_redacted() -> None:
    logger, stream = capture("text")
    logs.log_event(
        logger, "claim", customer_id="cust-1", token=SECRETS[0], extra={"k": f"\n{SECRETS[1]}"}
    )
    text = stream.getvalue()
    assert "INFO tests.logs.text: claim event=claim customer_id=cust-1" in text
    assert all(secret not in text for secret in SECRETS)
    assert text.count("\n") == 1


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_line_forwarded_from_the_sdk_core_shows_its_message_not_its_entry(
    log_format: str,
) -> None:
    """The SDK hands each core line over with its entry object as an extra field; the
    message already says what the entry holds, and the object's repr is noise."""
    logger, stream = capture(log_format)

    class BufferedLogEntry:
        pass

    logger.warning(
        "[sdk_core::retry] gRPC call retried 5 times", extra={"temporal_log": BufferedLogEntry()}
    )
    logger.handlers = []
    assert "retried 5 times" in stream.getvalue()
    assert "temporal_log" not in stream.getvalue() and "BufferedLogEntry" not in stream.getvalue()


def test_configure_writes_json_when_asked() -> None:
    program = (
        "import logging\n"
        "from billing import logs\n"
        "logs.configure()\n"
        "logs.log_event(logging.getLogger('billing.test'), 'record', period='2026-12',"
        f" note='{SECRETS[0]}')\n"
        "logging.getLogger('billing.test').debug('hidden at INFO')\n"
        # stripe-python's line for each request: the worker's log is about billing.
        "logging.getLogger('stripe').info('message=Request to Stripe api')\n"
    )
    env = {**os.environ, "LOG_FORMAT": "json", "LOG_LEVEL": "INFO"}
    done = subprocess.run(
        [sys.executable, "-c", program],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    (line,) = [json.loads(text) for text in done.stderr.splitlines()]
    assert (line["event"], line["period"], line["note"]) == ("record", "2026-12", "[redacted key]")


def test_configure_writes_text_by_default() -> None:
    program = (
        "import logging\n"
        "from billing import logs\n"
        "logs.configure()\n"
        "logging.getLogger('x').info('hi')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in {"LOG_FORMAT", "LOG_LEVEL"}}
    done = subprocess.run(
        [sys.executable, "-c", program],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stderr.rstrip().endswith("INFO x: hi")
    # The level asked for (the CLI's WARNING) over LOG_LEVEL.
    quiet = program.replace("configure()", "configure('WARNING')") + (
        "logging.getLogger('x').warning('shown')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", quiet],
        cwd=ROOT,
        env={**env, "LOG_LEVEL": "DEBUG"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stderr.rstrip().endswith("WARNING x: shown") and "hi" not in done.stderr

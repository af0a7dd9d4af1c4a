"""Logging shared by the worker, the CLI and the local stack: one line per record, text or JSON.

`LOG_FORMAT=json` writes one JSON object a line (time, level, logger, message and the event's
fields); anything shaped like a secret is redacted from every line, whatever logged it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter
from temporalio import workflow

from billing.config import ObservabilitySettings, load_settings
from billing.redact import redact

# LogRecord attributes that are not an event's fields (taskName is new in Python 3.12), and
# the SDK core's forwarded entry (`temporal_log`), an object whose fields its message holds.
_NOT_FIELDS = frozenset([*RESERVED_ATTRS, "taskName", "temporal_log"])
KEY_PREFIX_LENGTH = 8

_signal_log = logging.getLogger("billing.signals")


def _redacted(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact(str(k)): _redacted(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted(v) for v in value]
    return value


class RedactingJsonFormatter(JsonFormatter):
    def __init__(self) -> None:
        super().__init__(
            "{levelname}{name}{message}",
            style="{",
            rename_fields={"levelname": "level", "name": "logger"},
            timestamp="time",
            reserved_attrs=list(_NOT_FIELDS),
        )

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        time = log_data.pop("time")
        # Each value is redacted before it is escaped: `\n` + a key would hide it from the
        # pattern's word boundary once serialized.
        return {"time": time, **_redacted(log_data)}

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class RedactingTextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        # Values are redacted before repr() can escape a newline in front of a key.
        fields = " ".join(f"{k}={_redacted(v)}" for k, v in event_fields(record).items())
        return redact(f"{line} {fields}" if fields else line)


def event_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a record was logged with (`extra=`), beyond logging's own attributes."""
    return {k: v for k, v in record.__dict__.items() if k not in _NOT_FIELDS}


def formatter(log_format: str) -> logging.Formatter:
    return RedactingJsonFormatter() if log_format == "json" else RedactingTextFormatter()


def configure(level: str | None = None) -> None:
    settings = load_settings(ObservabilitySettings)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(settings.log_format))
    logging.basicConfig(level=level or settings.log_level, handlers=[handler])
    # stripe-python logs each request at INFO; keep the worker's log about billing.
    logging.getLogger("stripe").setLevel(logging.WARNING)


def log_event(
    logger: logging.Logger, event: str, *, level: int = logging.INFO, **fields: Any
) -> None:
    """One line for an event that matters: the event's name is the message and a field."""
    logger.log(level, event, extra={"event": event, **fields})


def key_prefix(idempotency_key: str) -> str:
    """Enough of a key to find its requests in Stripe's log, too little to be the key."""
    return idempotency_key[:KEY_PREFIX_LENGTH]


def log_signal(signal: str, **fields: Any) -> None:
    """Log a signal a workflow received, from its handler; not again when history replays.

    Workflow code imports this module under `workflow.unsafe.imports_passed_through()`.
    """
    if workflow.unsafe.is_replaying_history_events():
        return
    info = workflow.info()
    log_event(_signal_log, "signal", signal=signal, workflow_id=info.workflow_id, **fields)

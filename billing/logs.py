"""Logging set-up shared by the worker, the CLI and the local stack."""

import logging
import os


def configure(level: str | None = None) -> None:
    logging.basicConfig(
        level=level or os.environ.get("LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # stripe-python logs each request at INFO; keep the worker's log about billing.
    logging.getLogger("stripe").setLevel(logging.WARNING)

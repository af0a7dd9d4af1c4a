"""A Stripe-compatible local server with Stripe's idempotency semantics, test cards, rate limits
and fault injection, for the local stack, the test suite and benchmarks. Never for production.
"""

from .app import create_app
from .config import EmulatorConfig
from .server import RunningEmulator, serve

__all__ = ["EmulatorConfig", "RunningEmulator", "create_app", "serve"]

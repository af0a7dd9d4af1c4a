"""Errors a person can act on: each says what was wrong and what was expected."""

from billing.redact import redact


def shown(value: object, limit: int = 40) -> str:
    """`value` quoted for an error message, at most `limit` characters of it: a hostile input
    is never echoed whole, nor anything shaped like a key. The cut counts the quoted form, so
    escapes (10 characters for one astral character) cannot stretch it."""
    # Redacted before the cut, so that a cut key is still found whole.
    quoted = repr(redact(value) if isinstance(value, str) else value)
    if len(quoted) <= limit + 2:  # the value and its two quotes
        return quoted
    return f"{quoted[: limit + 1]}..."


class BillingError(Exception):
    """Base class for the project's own errors."""


class InvalidInputError(BillingError, ValueError):
    """Input that can never become valid by retrying (period, amount, currency, id)."""


class InvalidPeriodError(InvalidInputError):
    pass


class InvalidAmountError(InvalidInputError):
    pass


class InvalidCurrencyError(InvalidInputError):
    pass


class InvalidCustomerIdError(InvalidInputError):
    pass


class CustomerImportError(InvalidInputError):
    """A CSV import was rejected; nothing was imported."""


class PeriodNotOpenError(InvalidInputError):
    """A claim for a period no run has open: a customer is billed by its period's run only."""


class UnknownCustomerError(BillingError):
    pass


class HeldCustomerError(BillingError):
    """A customer a run holds: the period billed its Stripe customer under another id."""

    def __init__(self, message: str, held_as: str) -> None:
        super().__init__(message)
        self.held_as = held_as


class LedgerBusyError(BillingError):
    """A change to the customers waited too long for a run's opening or another change."""


class UnknownScheduleError(BillingError):
    pass


class ForeignScheduleError(UnknownScheduleError):
    """A schedule that exists, but starts something else than what was asked of it."""


class MigrationError(BillingError):
    pass


class LedgerConflictError(BillingError):
    """The ledger already holds a different result for a charge: never overwritten."""


class ClaimClosedError(LedgerConflictError):
    """A claim ended (e.g. cancelled by its run) before this attempt could charge it."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class RunEndedError(BillingError):
    """A period's run ended without a summary (failed, terminated, timed out)."""

    def __init__(self, message: str, *, period: str, workflow_id: str, state: str) -> None:
        super().__init__(message)
        self.period = period
        self.workflow_id = workflow_id
        self.state = state


class ConfigurationError(BillingError):
    """A setting (an environment variable, a file it names) is wrong; the message says which."""


class ServiceUnavailableError(BillingError):
    """Temporal or PostgreSQL could not be reached."""


class NoWorkerError(ServiceUnavailableError):
    """A run is open, but no worker answered for it."""


def validation_reason(message: str) -> str:
    """A pydantic error's message as said to a person: without its "Value error, " prefix."""
    return message.removeprefix("Value error, ")

"""Which Stripe endpoints a key may call, and which of them the vault meters against the cap."""

from __future__ import annotations

import re
from collections.abc import Iterable

# A metered request's number for its attempt, higher for each later attempt of the request: a
# cap refusal fences off the attempts below it (vault.reservations.reserve). Not forwarded.
FENCE_HEADER = "Vault-Fencing-Token"
# Requests the vault meters: it reads amount and currency from their body and reserves them.
METERED = frozenset({"POST /v1/payment_intents", "POST /v1/charges"})
# The one other write a key may allow, which moves no money: cancelling a PaymentIntent
# Stripe left unconfirmed after answering its create with an error. The vault forwards it only
# for such an intent, of a charge its period's keys sent and have no answer to (vault.cancels).
CANCEL = "POST /v1/payment_intents/*/cancel"
# The metadata entry in which the billing workers' charges name their Idempotency-Key, which
# ties an intent to the request that made it (Stripe does not say which key made an intent).
KEY_METADATA = "billing_key"
# The vault's answers to a metered request of which nothing reached Stripe, past its key's
# check: held up past its deadline to be sent, its key not checkable (the database away), or
# no connection to Stripe made. A worker's retry then passes the ledger's gate afresh, as
# after a 429.
HELD_UP = "vault_held_up"
DATABASE_UNAVAILABLE = "vault_database_unavailable"
UPSTREAM_UNREACHABLE = "vault_upstream_unreachable"
NOT_SENT_CODES = frozenset({HELD_UP, DATABASE_UNAVAILABLE, UPSTREAM_UNREACHABLE})
# The vault's refusals of a cancel (vault.cancels): an intent it does not tie to a charge in
# doubt of the key's period (none, or one answered or settled since), one whose charge is
# being sent again right now (retry), and its own secret refused reading the intent (no
# retry mends it).
NOT_IN_DOUBT = "payment_intent_not_this_keys"
CHARGE_IN_FLIGHT = "payment_intent_charge_in_flight"
UPSTREAM_REFUSED = "upstream_refused"
# All a key issued with the worker token may allow: the billing workers' charges and the
# lookups of them (billing/period_keys.py), so such a key cannot read the rest of the account.
WORKER_ENDPOINTS = (
    "POST /v1/payment_intents",
    "GET /v1/payment_intents",
    "GET /v1/payment_intents/*",
    CANCEL,
    "POST /v1/charges",
    "GET /v1/charges",
    "GET /v1/charges/*",
)

# An allowlist entry: a method and a path whose segments may be `*` (one segment). Keys may
# read anything listed but write only to metered endpoints and CANCEL: many other Stripe POSTs
# move money too (confirm, capture, invoices, subscriptions), and the cap cannot see their
# amounts.
ENTRY_PATTERN = (
    r"^(GET /v1(/([A-Za-z0-9_-]{1,100}|\*)){1,6}"
    r"|POST /v1/(payment_intents|charges)|POST /v1/payment_intents/\*/cancel)$"
)
_ENTRY_RE = re.compile(ENTRY_PATTERN)


def malformed_entries(entries: Iterable[str]) -> list[str]:
    """The allowlist entries no key may hold (ENTRY_PATTERN: issue and proxy alike)."""
    return [entry for entry in entries if _ENTRY_RE.fullmatch(entry) is None]


def beyond_worker_endpoints(entries: Iterable[str]) -> list[str]:
    """The entries a key issued with the worker token may not hold."""
    return [entry for entry in entries if entry not in WORKER_ENDPOINTS]


# A request path the proxy accepts: plain segments only, so no encoding tricks (`..`, `%2F`)
# can make the path the allowlist checked differ from the path the upstream serves.
PATH_RE = re.compile(r"/v1(/[A-Za-z0-9_-]{1,255}){1,8}")


def allows(entries: list[str], method: str, path: str) -> bool:
    """Whether any entry matches `method path`; `*` matches exactly one segment."""
    segments = path.split("/")
    for entry in entries:
        entry_method, _, entry_path = entry.partition(" ")
        if entry_method != method:
            continue
        wanted = entry_path.split("/")
        if len(wanted) == len(segments) and all(
            w in ("*", s) for w, s in zip(wanted, segments, strict=True)
        ):
            return True
    return False

"""What a period run must leave behind, checked from outside the orchestrator: Stripe's ledger
and request log (the emulator's), the billing ledger, and the vault's keys.

I1-I4 of DESIGN section 4 as a list of violations rather than assertions, so that the chaos
run reports every one of them, and the integration tests assert that there are none.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from billing import period_keys
from billing.customers import CustomerRow
from billing.models import PeriodSummary
from billing.reconciliation import MADE_STATUSES, ReconcileReport
from stripe_emulator.client import EmulatorClient
from vault.client import VaultAdmin
from vault.models import KeyInfo

Row = Mapping[str, Any]
MONEY_PATHS = ("/v1/payment_intents", "/v1/charges")


@dataclass(frozen=True)
class Expected:
    """Who is due in the period, and who must end without a charge."""

    period: str
    customers: Sequence[CustomerRow]
    declined: frozenset[str] = frozenset()
    cancelled: frozenset[str] = frozenset()

    @property
    def to_charge(self) -> int:
        return len(self.customers) - len(self.declined | self.cancelled)


@dataclass
class Findings:
    violations: list[str] = field(default_factory=list)
    # Customers with more than one successful charge; due customers with none.
    duplicates: int = 0
    lost: int = 0
    ledger_total_cents: int = 0
    stripe_total_cents: int = 0
    vault_spent_cents: int | None = None
    # Reservations whose outcome the vault has not learnt (a saved 500, a lost answer, a
    # settle cut off by a database restart): counted against the cap until reconciled.
    vault_unresolved: int | None = None

    def figures(self) -> dict[str, int | None]:
        return {
            "duplicates": self.duplicates,
            "lost": self.lost,
            "ledger_total_cents": self.ledger_total_cents,
            "stripe_total_cents": self.stripe_total_cents,
            "vault_spent_cents": self.vault_spent_cents,
            "vault_unresolved": self.vault_unresolved,
            "violations": len(self.violations),
        }


def check_billed_once(
    expected: Expected,
    charges: Sequence[Row],
    requests: Sequence[Row],
    rows: Sequence[Row],
) -> Findings:
    """I1-I3: from Stripe's charges and requests, and the period's ledger rows."""
    found = Findings()
    problem = found.violations.append
    due = {c.customer_id: c for c in expected.customers}
    # Charges made: succeeded, or pending as a bank debit is until its bank answers.
    made: dict[str, list[Row]] = defaultdict(list)
    for charge in charges:
        if charge["status"] in MADE_STATUSES and (
            charge["metadata"].get("billing_period") == expected.period
        ):
            made[str(charge["metadata"].get("customer_id"))].append(charge)
    found.stripe_total_cents = sum(int(c["amount"]) for cs in made.values() for c in cs)

    # I1: at most one charge made per customer; exactly one unless it must not be charged.
    for customer_id in sorted(set(made) - set(due)):
        problem(f"{customer_id}: charged in Stripe but not due in {expected.period}")
    for customer in expected.customers:
        got = made.get(customer.customer_id, [])
        unpaid = customer.customer_id in expected.declined | expected.cancelled
        if len(got) > 1:
            found.duplicates += 1
        elif not got and not unpaid:
            found.lost += 1
        if len(got) != (0 if unpaid else 1):
            problem(f"{customer.customer_id}: {len(got)} charges made in Stripe")
        for charge in got:
            sent = (charge["amount"], charge["currency"], charge["customer"])
            if sent != (customer.amount_cents, customer.currency, customer.stripe_customer_id):
                problem(f"{customer.customer_id}: charge {charge['id']} is {sent}")

    # Every money request with a key: its parameters, and Stripe's answers. One of the period
    # carries a key of its ledger: a retry under another key would charge again once the
    # first request executes.
    ledger_keys = {r["idempotency_key"] for r in rows}
    sent_with: dict[str, set[str]] = defaultdict(set)
    answered: dict[str, set[int | None]] = defaultdict(set)
    for request in requests:
        if request["method"] == "POST" and request["path"] in MONEY_PATHS:
            key = request["idempotency_key"]
            if not key:
                problem(f"a request to {request['path']} without an Idempotency-Key")
                continue
            metadata = (request["params"] or {}).get("metadata") or {}
            if metadata.get("billing_period") == expected.period and key not in ledger_keys:
                problem(
                    f"{metadata.get('customer_id')}: a request to {request['path']} with key"
                    f" {key[:8]}, which no ledger row of {expected.period} holds"
                )
            sent_with[key].add(json.dumps(request["params"], sort_keys=True))
            answered[key].add(request["status"])

    # I2: every due customer in one terminal state, agreeing with Stripe.
    by_customer = {r["customer_id"]: r for r in rows}
    for customer_id in sorted(set(due) ^ set(by_customer)):
        where = "in the ledger but not due" if customer_id in by_customer else "has no ledger row"
        problem(f"{customer_id}: {where}")
    for customer_id, row in sorted(by_customer.items()):
        status = row["status"]
        if customer_id in expected.declined:
            if status != "failed" or not row["failure_code"]:
                problem(f"{customer_id}: declined card, but the ledger says {status}")
        elif customer_id in expected.cancelled:
            # Stopped at the gate, or after Stripe answered its key only with errors, a 500
            # it saved among them (ledger.stop_behind_saved_error).
            answers = answered[row["idempotency_key"]]
            if status != "cancelled":
                problem(f"{customer_id}: cancelled before its charge, but the ledger says {status}")
            elif row["charge_started_at"] is not None and not all(map(_refused, answers)):
                problem(f"{customer_id}: cancelled after Stripe answered its key {answers}")
        elif status != "charged":
            problem(f"{customer_id}: left {status} in the ledger")
        elif [c["id"] for c in made.get(customer_id, [])][:1] != [row["charge_id"]]:
            problem(f"{customer_id}: the ledger records {row['charge_id']}, not Stripe's charge")
    found.ledger_total_cents = sum(r["amount_cents"] for r in rows if r["status"] == "charged")
    if found.ledger_total_cents != found.stripe_total_cents:
        problem(
            f"ledger total {found.ledger_total_cents} cents != the total Stripe charged"
            f" {found.stripe_total_cents} cents"
        )

    # I3: every request for one key carried the same parameters. A row cancelled at the gate
    # holds a key that never went to Stripe.
    for row in rows:
        key = row["idempotency_key"]
        if row["charge_started_at"] is None:
            continue
        if key not in sent_with:
            problem(f"{row['customer_id']}: charge started, but Stripe never saw key {key[:8]}")
        elif len(sent_with[key]) != 1:
            problem(f"{row['customer_id']}: key {key[:8]} sent with different parameters")
    return found


def _refused(status: int | None) -> bool:
    """Stripe answered with no charge: rate-limited, or a 5xx (a dropped answer is None).
    Whether a charge was made all the same is I1's check."""
    return status is not None and (status == 429 or status >= 500)


def check_vault(found: Findings, keys: Sequence[KeyInfo], unresolved: Sequence[Row]) -> None:
    """I4, once reconciliation has run: the period's keys never passed their caps, no
    reservation is left unresolved (`unresolved`: their idempotency key, amount and state),
    and the money the keys counted as spent is the ledger's."""
    problem = found.violations.append
    if not keys:
        problem("the vault holds no key for the period")
    for key in keys:
        if key.spent_cents + key.reserved_cents > key.cap_cents:
            problem(
                f"vault key {key.id}: spent {key.spent_cents} + reserved {key.reserved_cents}"
                f" cents pass its cap of {key.cap_cents}"
            )
    found.vault_spent_cents = sum(k.spent_cents for k in keys)
    found.vault_unresolved = len(unresolved)
    if unresolved:
        problem(f"{len(unresolved)} vault reservations still unresolved after reconciliation")
    reserved = sum(k.reserved_cents for k in keys)
    if reserved != sum(r["amount_cents"] for r in unresolved):
        problem(f"the keys hold {reserved} cents reserved, not what their reservations say")
    if found.vault_spent_cents != found.ledger_total_cents:
        problem(
            f"vault spent {found.vault_spent_cents} cents != ledger total"
            f" {found.ledger_total_cents} cents"
        )


def check_summary(found: Findings, expected: Expected, summary: PeriodSummary) -> None:
    """The run's own summary, which the operator reads, agrees with the ledger."""
    counts = (summary.due, summary.charged + summary.already_billed, summary.failed)
    wanted = (len(expected.customers), expected.to_charge, len(expected.declined))
    if counts != wanted:
        found.violations.append(
            f"the run's summary says (due, charged, failed) = {counts}, not {wanted}"
        )


def check_reconcile(found: Findings, report: ReconcileReport) -> None:
    """Reconciliation after the run finds nothing wrong: no duplicate, orphan or unrecorded
    charge on Stripe, no claim left open."""
    problem = found.violations.append
    for finding in report.findings:
        problem(
            f"reconciliation: {finding.kind} charge {finding.charge_id} of"
            f" {finding.amount_cents} {finding.currency}"
        )
    for claim in report.claims:
        problem(f"reconciliation: claim of {claim.customer_id} {claim.action}: {claim.detail}")
    for reservation in report.reservations:
        if reservation.state == "unknown":
            problem(
                f"reconciliation left the vault reservation of {reservation.customer_id}"
                f" unknown: {reservation.detail}"
            )


async def ledger_rows(pool: asyncpg.Pool, period: str) -> list[asyncpg.Record]:
    async with pool.acquire() as conn:
        rows: list[asyncpg.Record] = await conn.fetch(
            "SELECT * FROM billing_runs WHERE billing_period = $1 ORDER BY customer_id", period
        )
    return rows


async def unresolved_reservations(pool: asyncpg.Pool, keys: Sequence[KeyInfo]) -> list[Row]:
    # From the vault's table: its admin API lists unknown reservations, not pending ones
    # whose settle a database restart cut off.
    async with pool.acquire() as conn:
        rows: list[Row] = await conn.fetch(
            "SELECT idempotency_key, amount_cents, state FROM vault_reservations"
            " WHERE vault_key_id = ANY($1::text[]) AND state IN ('pending', 'unknown')",
            [k.id for k in keys],
        )
    return rows


async def collect(
    expected: Expected,
    emulator: EmulatorClient,
    pool: asyncpg.Pool,
    admin: VaultAdmin | None,
    summary: PeriodSummary | None = None,
    reconcile: ReconcileReport | None = None,
) -> Findings:
    """Every check above, on the evidence as it is now."""
    rows = await ledger_rows(pool, expected.period)
    found = check_billed_once(expected, await emulator.charges(), await emulator.requests(), rows)
    if admin is not None:
        keys = await admin.find_keys(period=expected.period, label=period_keys.LABEL)
        check_vault(found, keys, await unresolved_reservations(pool, keys))
    if summary is not None:
        check_summary(found, expected, summary)
    if reconcile is not None:
        check_reconcile(found, reconcile)
    return found

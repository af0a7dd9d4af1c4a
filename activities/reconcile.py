"""Reconciliation's I/O: open claims and whether a workflow still owns them, lookups on
Stripe (always by listing the customer's payments, never Stripe's lagging search), the
vault's reservations left unknown, and the period's charges on Stripe against the ledger."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from functools import partial
from typing import Any, Literal, TypeVar

import asyncpg
import stripe
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError

from activities.stripe_access import StripeAccess
from activities.stripe_failures import (
    KEY_REFUSED,
    REFUSED,
    lookup_key_refused,
    misdirected,
    reconciliation_failure,
    vault_key_unusable,
)
from activities.stripe_gateway import StripeGateway
from billing import ledger, logs, metrics, period_keys, run_states
from billing.config import BillingSettings
from billing.errors import LedgerConflictError, shown
from billing.keys import customer_workflow_id, period_workflow_id
from billing.models import ChargeFailure, ChargeResult, Claim
from billing.periods import parse_period
from billing.rate_limit import stripe_rate
from billing.reconciliation import (
    ChargesPage,
    ChargesPageRequest,
    ChildState,
    ClaimResolution,
    ClaimsToResolve,
    CustomerToCheck,
    ReconcileInput,
    ReconcileVerdict,
    ReservationResolution,
    StripeCharge,
    classify,
    for_listing,
    left_alone,
    left_unknown_because,
    recorded_failure,
    release_wait,
    reservations_to_report,
)
from billing.sealing import UnsealError
from billing.temporal_client import workflow_status
from vault.client import (
    VaultAdmin,
    VaultAdminError,
    VaultAuthError,
    VaultForbidden,
    VaultInvalidRequest,
)
from vault.models import ReservationInfo

# Open claims one run resolves; a period normally ends with none, and the next run (the
# schedule fires daily) takes any rest. Those left alone (a paused period's window of
# running charges) are read past, a page of this many at a time for as long as
# CLAIMS_SCAN_SECONDS, so that they take no fixed place ahead of a claim stranded behind
# them; the report lists this many of them, those for a person first.
MAX_CLAIMS = 1000
CLAIMS_SCAN_SECONDS = 20.0
# Reservations one report lists (a workflow result is bounded); the rest are counted in the
# worker's log.
MAX_SHOWN = 1000
# How long one run settles reservations, well inside the activity's start-to-close timeout
# (PAGE_TIMEOUT in workflows/reconcile.py); the next run takes the rest.
SETTLE_BUDGET_SECONDS = 240.0
# What the report says of a reservation the budget left.
NOT_EXAMINED = "not examined in the time given: the next reconciliation of the period does"
# Well inside the page activity's heartbeat timeout (workflows/reconcile.py).
HEARTBEAT_EVERY = 2.0
# Calls to Temporal or Stripe at once from one activity: well under Stripe's rate limit
# once the pages' calls add up, and a 429 is retried by Temporal anyway.
CONCURRENCY = 8
# A ledger row finished elsewhere with another result: reported, never overwritten.
LEDGER_CONFLICT = "LedgerConflict"
# No vault key stored for the claim's period and currency: nothing to look it up with.
NO_PERIOD_KEY = "NoPeriodKey"
# The period's key cannot be decrypted with BILLING_KEY_ENCRYPTION_KEYS.
KEY_UNREADABLE = "KeyUnreadable"
# How long reads of a period whose key was seen expired or revoked skip it for a lookup key.
RECHECK_UNUSABLE_SECONDS = 600.0

log = logging.getLogger("billing.reconcile")
T = TypeVar("T")


@asynccontextmanager
async def heartbeating(every: float = HEARTBEAT_EVERY) -> AsyncIterator[None]:
    """Heartbeat while a slow page of Stripe calls runs, so a worker that dies mid-page is
    noticed within the heartbeat timeout instead of the whole start-to-close timeout."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(every)
            activity.heartbeat()

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()


async def _bounded(calls: list[Callable[[], Awaitable[T]]]) -> list[T]:
    """Each call's result, CONCURRENCY at a time. The first failure is raised as it is and
    stops the rest: they would go on calling Stripe, taking turns of its rate, while the
    activity is tried again. Each call is made only at its turn, so none stopped is left
    unawaited."""
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with limit:
            return await call()

    tasks = [asyncio.ensure_future(one(call)) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def _workflow_state(client: Client, workflow_id: str) -> ChildState:
    status = await workflow_status(client.get_workflow_handle(workflow_id))
    if status is None:
        return "absent"
    return "running" if status == WorkflowExecutionStatus.RUNNING else "closed"


def _unknown(
    key_id: str,
    reservation: ReservationInfo,
    customer_id: str | None = None,
    detail: str | None = None,
) -> ReservationResolution:
    """The reservation, left unknown for `detail`."""
    return ReservationResolution(
        vault_key_id=key_id,
        key_prefix=logs.key_prefix(reservation.idempotency_key),
        customer_id=customer_id,
        state="unknown",
        currency=reservation.currency,
        detail=detail,
    )


def _log(event: str, period: str, key: str, **fields: Any) -> None:
    logs.log_event(
        log,
        event,
        period=period,
        workflow_id=activity.info().workflow_id,
        key_prefix=logs.key_prefix(key),
        **fields,
    )


class ReconcileActivities:
    def __init__(
        self,
        pool: asyncpg.Pool,
        access: StripeAccess,
        settings: BillingSettings,
        admin: VaultAdmin | None = None,
    ) -> None:
        self._pool = pool
        self._access = access
        self._admin = admin
        # (period, currency) whose key was seen expired or revoked, and when (monotonic):
        # read with a lookup key straight away for a while.
        self._unusable: dict[tuple[str, str], float] = {}
        # Lookups share the cluster's Stripe rate with the charges.
        self._stripe_rate = stripe_rate(pool, settings)

    def _paced(self, gateway: StripeGateway) -> StripeGateway:
        """`gateway`, each request it sends taking its turn of the cluster's Stripe rate."""
        if self._stripe_rate is None:
            return gateway
        return gateway.taking_turns(self._stripe_rate.wait_turn)

    async def _reading(
        self,
        period: str,
        currency: str,
        read: Callable[[StripeGateway], Awaitable[T]],
        *,
        recheck: bool = False,
    ) -> tuple[T, bool]:
        """`read` through the period's key, or through a lookup key once that has expired,
        was revoked or its row deleted (the daily reconciliation checks a period for weeks
        after its key's grace). Returns what `read` found, and whether the period's key
        served it, i.e. can still charge. After a refusal the period's key is skipped for a
        while, unless `recheck`: an operator may replace it."""
        slot = (period, currency)
        seen = self._unusable.get(slot)
        try:
            if recheck or seen is None or time.monotonic() - seen > RECHECK_UNUSABLE_SECONDS:
                # Twice at most: the key refused may be one this worker cached before
                # `renew-keys` or a rerun replaced it, and an operator then revoked.
                for _ in range(2):
                    try:
                        gateway = await self._access.gateway(period, currency)
                        result = await read(self._paced(gateway))
                    except period_keys.NoPeriodKeyError:
                        break
                    except stripe.StripeError as exc:
                        if not vault_key_unusable(exc):
                            raise
                        if not await self._access.replaced(period, currency, gateway.vault_key_id):
                            break
                    else:
                        self._unusable.pop(slot, None)
                        return result, True
                self._access.forget(period, currency)
                self._unusable[slot] = time.monotonic()
            gateway = await self._access.lookup_gateway(period, currency)
        except UnsealError as exc:
            # A setting to fix, not a customer to skip.
            raise ApplicationError(str(exc), type=KEY_UNREADABLE, non_retryable=True) from None
        try:
            return await read(self._paced(gateway)), False
        except stripe.StripeError as exc:
            if not vault_key_unusable(exc):
                raise
            # The lookup key itself refused: the next read issues another.
            self._access.forget_lookup(period, currency)
            raise lookup_key_refused(exc) from None

    async def _find(
        self, claim: Claim, *, recheck: bool = False
    ) -> tuple[ChargeResult | ChargeFailure | None, bool]:
        """The claim's charge on Stripe, looked up by the key in its metadata, and whether
        the period's key can still charge (see _reading)."""
        return await self._read_for(claim, lambda g: g.find(claim), recheck=recheck)

    async def _read_for(
        self, claim: Claim, read: Callable[[StripeGateway], Awaitable[T]], *, recheck: bool = False
    ) -> tuple[T, bool]:
        """_reading for one claim, its errors as the workflow acts on them."""
        try:
            return await self._reading(claim.period, claim.currency, read, recheck=recheck)
        except period_keys.NoPeriodKeyError as exc:
            raise ApplicationError(str(exc), type=NO_PERIOD_KEY, non_retryable=True) from None
        except stripe.StripeError as exc:
            raise reconciliation_failure(exc) from None

    @activity.defn(name="reconcile_record_verdict")
    async def record_verdict(self, verdict: ReconcileVerdict) -> None:
        """Keep what the reconciliation left to look at again, for the daily one to go back
        to (ledger.periods_to_recheck)."""
        async with self._pool.acquire() as conn:
            await ledger.record_reconciliation(
                conn, verdict.period, verdict.open_reason, verdict.began_at
            )

    @activity.defn(name="reconcile_open_claims")
    async def open_claims(self, request: ReconcileInput) -> ClaimsToResolve:
        """The period's open claims, oldest first, split into those no workflow owns (to
        resolve, MAX_CLAIMS at most) and those left alone, with the reason, read past."""
        period = parse_period(request.period)
        client = activity.client()
        # The ledger first: a run that closes before the describe is seen completed.
        async with self._pool.acquire() as conn:
            control = (await ledger.open_runs(conn, [request.period])).get(request.period)
        status = await workflow_status(client.get_workflow_handle(period_workflow_id(period)))
        period_running = status == WorkflowExecutionStatus.RUNNING
        unclaimed = 0
        if (
            control not in (None, "cancelled")
            and status != WorkflowExecutionStatus.CANCELED  # Temporal's Cancel: an operator's
            and run_states.ended_unclosed(status)
        ):
            async with self._pool.acquire() as conn:
                unclaimed = await ledger.unclaimed_due(conn, request.period)
        if unclaimed:
            metrics.count_run_ended_unclosed()
            logs.log_event(
                log,
                "run_ended_unclosed",
                level=logging.ERROR,
                period=request.period,
                unclaimed=unclaimed,
                status=status.name.lower() if status else "gone",
            )
        deadline = time.monotonic() + CLAIMS_SCAN_SECONDS
        resolve: list[Claim] = []
        left: list[ClaimResolution] = []
        after: Claim | None = None
        more = True
        while more and len(resolve) < MAX_CLAIMS and time.monotonic() < deadline:
            async with self._pool.acquire() as conn:
                found = await ledger.open_claims(conn, request.period, MAX_CLAIMS + 1, after)
            taken = found[:MAX_CLAIMS]
            more = len(found) > MAX_CLAIMS
            children = await _bounded(
                [
                    partial(
                        _workflow_state, client, customer_workflow_id(period, c.claim.customer_id)
                    )
                    for c in taken
                ]
            )
            for open_claim, child in zip(taken, children, strict=True):
                alone = left_alone(child, period_running, open_claim, datetime.now(UTC))
                if alone is not None:
                    left.append(alone)
                elif len(resolve) < MAX_CLAIMS:
                    resolve.append(open_claim.claim)
                else:
                    more = True  # this one and the rest wait for the next run
                    break
            if taken:
                after = taken[-1].claim
        if len(left) > MAX_CLAIMS:
            log.warning(
                "%s: %d open claims left alone, %d listed", request.period, len(left), MAX_CLAIMS
            )
        left.sort(key=lambda c: not c.needs_person)
        return ClaimsToResolve(
            resolve=resolve, left=left[:MAX_CLAIMS], more=more, unclaimed_by_ended_run=unclaimed
        )

    @activity.defn(name="reconcile_settle_claim")
    async def settle_claim(self, claim: Claim) -> ClaimResolution | None:
        """Record the claim's outcome if Stripe has its charge; None when Stripe has nothing
        with its key (the workflow then charges it again with that same key)."""
        # The period's key is tried first whatever was seen before: a "left" must be sure.
        found, can_charge = await self._find(claim, recheck=True)
        if found is None:
            if can_charge:
                return await self._charged_otherwise(claim)
            return ClaimResolution(
                customer_id=claim.customer_id,
                action="left",
                needs_person=True,
                detail="Stripe has no charge with its key, and its period's vault key has"
                " expired or was revoked: to charge it, delete the key's row in"
                " period_vault_keys and run the period again, which issues a new one",
            )
        key = claim.idempotency_key
        try:
            async with self._pool.acquire() as conn:
                if isinstance(found, ChargeResult):
                    if await ledger.record_charge(conn, key, found):
                        metrics.charge_recorded(
                            found.amount_cents, found.currency, claim.claimed_at
                        )
                    resolution = ClaimResolution(
                        customer_id=claim.customer_id,
                        action="recorded",
                        outcome="charged",
                        charge_id=found.charge_id,
                    )
                else:
                    await ledger.record_unbilled(conn, key, "failed", found)
                    resolution = recorded_failure(claim.customer_id, found)
        except LedgerConflictError as exc:
            raise ApplicationError(str(exc), type=LEDGER_CONFLICT, non_retryable=True) from None
        _log(
            "reconcile_claim",
            claim.period,
            claim.idempotency_key,
            customer_id=claim.customer_id,
            action=resolution.action,
            outcome=resolution.outcome,
            charge_id=resolution.charge_id,
        )
        return resolution

    async def _charged_otherwise(self, claim: Claim) -> ClaimResolution | None:
        """Before the claim is charged again: None unless Stripe already holds a charge of
        the period for its Stripe customer that its key's lookup did not find: for the
        customer, made under another key (an earlier BILLING_KEY_NAMESPACE, a script) or
        through the other API; or under an id of ours not active now (the customer renamed,
        which the rename hold guards in a run). One under another active id is that
        account's own (two may share a Stripe customer). A second charge would bill the
        customer twice; which charge stands is a person's call."""
        charges, _ = await self._read_for(
            claim, lambda g: g.period_charges(claim.stripe_customer_id, claim.period)
        )
        made = [c for c in charges if c.state == "made"]
        others = {c.customer_id for c in made} - {claim.customer_id}
        active: set[str] = set()
        if others:
            async with self._pool.acquire() as conn:
                active = await ledger.active_among(conn, others)
        held = [c for c in made if c.customer_id not in active]
        if not held:
            return None
        first = held[0]
        if first.customer_id != claim.customer_id:
            whose = (
                f"its Stripe customer under the id {shown(first.customer_id)}, not an active"
                " customer now (renamed?)"
            )
        else:
            keyed = "its own key" if first.billing_key == claim.idempotency_key else "another key"
            whose = f"this customer, made under {keyed} or through the other API"
        return ClaimResolution(
            customer_id=claim.customer_id,
            action="left",
            needs_person=True,
            charge_id=first.charge_id,
            detail=f"Stripe already holds charge {first.charge_id} of this period for {whose}:"
            " charging again would bill it twice. Record that charge for the claim, or refund it"
            " and run the period again, by hand",
        )

    @activity.defn(name="reconcile_reservations")
    async def settle_reservations(
        self, request: ReconcileInput
    ) -> list[ReservationResolution] | None:
        """Settle the period's vault reservations left unknown (the vault counts stale
        pending ones as unknown) with what Stripe has. None without a vault."""
        if self._admin is None:
            return None
        admin = self._admin
        deadline = time.monotonic() + SETTLE_BUDGET_SECONDS

        async def settle(key_id: str, found: ReservationInfo) -> ReservationResolution | None:
            if time.monotonic() > deadline:
                return None
            return await self._settle(admin, key_id, found)

        async with heartbeating():
            keys = await admin.find_keys(period=request.period, label=period_keys.LABEL)
            todo = [(k.id, r) for k in keys for r in await admin.unknown_reservations(k.id)]
            # In a new order each run, for as long as the budget lasts: a backlog that never
            # settles takes no fixed place ahead of the rest, and the run goes on to its claims.
            random.shuffle(todo)
            settled = await _bounded([partial(settle, key_id, found) for key_id, found in todo])
        # Those the budget left are reported unknown too: the period's verdict then keeps it to
        # look at again (ReconcileReport.open_reason), where it read as nothing left.
        resolutions = [
            _unknown(key_id, found, detail=NOT_EXAMINED) if resolution is None else resolution
            for (key_id, found), resolution in zip(todo, settled, strict=True)
        ]
        examined = sum(resolution is not None for resolution in settled)
        # Each settlement is logged; the report lists what a person must act on first.
        if examined < len(todo) or len(resolutions) > MAX_SHOWN:
            log.warning(
                "%s: %d vault reservations unknown, %d examined in the time given, %d reported",
                request.period,
                len(todo),
                examined,
                min(len(resolutions), MAX_SHOWN),
            )
        return reservations_to_report(resolutions, MAX_SHOWN)

    async def _settle(
        self, admin: VaultAdmin, key_id: str, reservation: ReservationInfo
    ) -> ReservationResolution:
        key = reservation.idempotency_key
        async with self._pool.acquire() as conn:
            claim = await ledger.claim_by_key(conn, key)
        unknown = _unknown(key_id, reservation, claim.customer_id if claim else None)
        if claim is None:
            # Nothing of ours to look it up by: settle it with the admin token, by hand.
            detail = "no ledger row has this key"
            return unknown.model_copy(update={"detail": detail, "needs_person": True})
        try:
            found, _ = await self._find(claim)
            outcome: Literal["succeeded", "failed"]
            if isinstance(found, ChargeResult):
                outcome, amount, wait = "succeeded", found.amount_cents, None
            else:
                if reason := left_unknown_because(found):
                    return unknown.model_copy(update={"detail": reason, "needs_person": True})
                outcome, amount = "failed", None
                wait = release_wait(found, reservation.upstream_status)
            info = await admin.resolve(
                key_id,
                key,
                outcome,
                amount,
                attempt=reservation.attempt,
                min_idle_seconds=None if wait is None else int(wait.total_seconds()),
            )
        except (ApplicationError, VaultAdminError) as exc:
            # One reservation's trouble leaves it unknown for the next run, and the rest of
            # reconciliation goes on: Stripe's rate or an intent waiting on a step, the vault
            # away, a retry that took it over (409). The message (ours, Stripe's or the
            # vault's) says which. What no later run changes is for a person: no key to read
            # with, a token or an amount the vault refuses.
            # (A key refused here is a lookup key, which the next read replaces; a URL Stripe
            # does not know is refused the same way, and stays so.)
            lasting = isinstance(exc, (VaultAuthError, VaultForbidden, VaultInvalidRequest)) or (
                isinstance(exc, ApplicationError)
                and exc.non_retryable
                and (exc.type != KEY_REFUSED or misdirected(exc))
            )
            return unknown.model_copy(update={"detail": exc.message, "needs_person": lasting})
        state = "committed" if info.state == "committed" else "released"
        _log("reconcile_reservation", claim.period, key, vault_key_id=key_id, state=state)
        elsewhere = f"counted under vault key {info.counted_under}" if info.counted_under else None
        return unknown.model_copy(
            update={"state": state, "amount_cents": info.committed_cents, "detail": elsewhere}
        )

    async def _counted_here(
        self,
        period: str,
        customers: list[CustomerToCheck],
        found: list[list[StripeCharge] | None],
    ) -> set[str]:
        """The page's charges it counts: those listed under the one customer of ours that
        counts their Stripe customer's (ledger.first_listers: one the period claimed, whose
        listing is never skipped, where there is one; if its listing fails, it is reported
        unchecked)."""
        async with self._pool.acquire() as conn:
            first = await ledger.first_listers(
                conn, period, {c.stripe_customer_id for c in customers}
            )
        return {
            charge.charge_id
            for customer, listing in zip(customers, found, strict=True)
            if first.get(customer.stripe_customer_id) == customer.customer_id
            for charge in listing or []
        }

    @activity.defn(name="reconcile_charges_page")
    async def compare_charges(self, request: ChargesPageRequest) -> ChargesPage:
        """One page of customers: their charges of the period on Stripe against the ledger."""
        async with self._pool.acquire() as conn:
            customers = await ledger.customers_page(
                conn, request.period, request.after, request.limit
            )

        async def listed(customer: CustomerToCheck) -> list[StripeCharge] | None:
            try:
                charges, _ = await self._reading(
                    request.period,
                    customer.currency,
                    lambda g: g.period_charges(customer.stripe_customer_id, request.period),
                )
            except period_keys.NoPeriodKeyError:
                # No key can read its currency: unchecked, unless the period never claimed
                # it (e.g. inactive, in a currency retired since), when nothing of ours can
                # have charged it and a daily "unchecked" would only cry wolf.
                return None if customer.in_ledger else []
            except stripe.StripeError as exc:
                failure = reconciliation_failure(exc)
                if failure.type != REFUSED:
                    # Retried (rate limit, outage), or a refused key, which no customer's
                    # listing would pass: the page fails, as before.
                    raise
                # Refused for this customer alone (e.g. its Stripe customer was deleted): the
                # rest of the page is still compared, and this one is reported unchecked.
                log.warning(
                    "could not list the charges of %s for %s: %s",
                    customer.customer_id,
                    request.period,
                    failure.message,
                )
                return None
            return charges

        try:
            async with heartbeating():
                found = await _bounded([partial(listed, c) for c in customers])
        except stripe.StripeError as exc:
            raise reconciliation_failure(exc) from None
        charges = [charge for listing in found if listing for charge in listing]
        async with self._pool.acquire() as conn:
            entries = await ledger.ledger_entries(
                conn, request.period, sorted({c.customer_id for c in charges})
            )
            classified = classify(charges, entries)
            handled: dict[tuple[str, str], str] = {}
            if classified:
                await ledger.record_reported(conn, request.period, classified)
                handled = await ledger.handled_among(conn, classified)
        unchecked = [c for c, listing in zip(customers, found, strict=True) if listing is None]
        findings = [f for f in classified if (f.charge_id, f.kind) not in handled]
        for f in classified:
            # Every one, where a person can find it: the report lists the first MAX_LISTED.
            handled_by = handled.get((f.charge_id, f.kind))
            logs.log_event(
                log,
                "reconcile_finding" if handled_by is None else "reconcile_finding_handled",
                level=logging.WARNING if handled_by is None else logging.INFO,
                period=request.period,
                workflow_id=activity.info().workflow_id,
                kind=f.kind,
                customer_id=f.customer_id,
                charge_id=f.charge_id,
                amount_cents=f.amount_cents,
                currency=f.currency,
                ledger_status=f.ledger_status,
                ledger_charge_id=f.ledger_charge_id,
                key_prefix=f.key_prefix,
                handled_by=handled_by,
            )
        # A charge listed under two customers of ours (sharing a Stripe customer) is counted
        # on one page alone (_counted_here), its findings past the report's room likewise.
        counted = await self._counted_here(request.period, customers, found)
        once = {c.charge_id: c for c in charges}
        in_full, unlisted_counts = for_listing(findings, request.listed_room, counted)
        return ChargesPage(
            findings=in_full,
            unlisted_counts=unlisted_counts,
            # Where its one counting listing counts it, like a finding past the room.
            handled=sum(charge_id in counted for charge_id, _ in handled),
            customers=len(customers),
            # Each charge once, though two of the page's customers listed it.
            charges=sum(c.state == "made" and c.charge_id in counted for c in once.values()),
            pending=sum(c.pending and c.charge_id in counted for c in once.values()),
            unchecked=[c.customer_id for c in unchecked],
            next_cursor=customers[-1].customer_id if len(customers) == request.limit else None,
        )

"""Period-level I/O: plan the run, page through due customers, read outcomes, operator
controls (pause, resume, cancel, skip), close."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import asyncpg
from pydantic import Field
from temporalio import activity
from temporalio.client import (
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
    WorkflowHandle,
)
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError

from activities.stripe_failures import KEY_REFUSED
from billing import ledger, logs, period_keys, run_states
from billing.config import BillingSettings
from billing.customer_start import CUSTOMER_CHARGE_WORKFLOW, customer_start
from billing.errors import LedgerBusyError, UnknownCustomerError
from billing.keys import customer_workflow_id, idempotency_key
from billing.models import (
    CHILD_HISTORY_EVENTS,
    CancelPage,
    ChildHistoryLimit,
    Control,
    Counts,
    CustomerOutcome,
    DueCustomer,
    DuePage,
    Listing,
    OperatorRequest,
    PeriodPlan,
    PeriodSummary,
    Record,
    RunIdentity,
    SkipRequest,
    SkipResult,
)
from billing.money import spend_caps
from billing.periods import Billing, parse_period, period_for
from billing.reconciliation import RECHECK_RUNS_WITHIN, RECHECKS_PER_FIRING, PeriodToRecheck
from billing.temporal_client import ENDED_UNCOMPLETED, described
from vault.client import (
    VaultAdmin,
    VaultAdminError,
    VaultAuthError,
    VaultForbidden,
    VaultInvalidRequest,
)

# A try of a run's opening, control or close that is not the current try of the period's
# latest run: it writes nothing (_check_current_try).
STALE_TRY = "StaleTry"
# How long a writer of the period's row, holding its lock, waits for Temporal's answer.
DESCRIBE_TIMEOUT = timedelta(seconds=10)


class PrepareRequest(Record):
    period: str
    workflow_id: str
    # RunIdentity.run_id; None from a run that began before runs were told apart
    # (migrations/031).
    run_id: str | None = None


class DuePageRequest(Record):
    period: str
    after: str | None
    limit: int
    # Only due customers the run's listing did not reach (PeriodActivities._due_page).
    unlisted: bool = False
    # The run starts a customer with no row again whatever its last child's end
    # (RESTART_COMPLETED_UNCLAIMED): one closed before the run opened is not reached.
    restarts_completed: bool = False
    # The listing of the run (LISTINGS_MARKED), which passes over the customers an earlier
    # listing of the run took; None from a run begun before, which tells them by rows and
    # children (`unlisted`).
    listing: Listing | None = None
    # The customers the run took from this listing's pages since its last request: marked
    # as taken before the page is read.
    taken: list[str] = Field(default_factory=list)


class MarkedCloseRequest(Record):
    summary: PeriodSummary
    # The run's latest listing, and the customers it took since its last page.
    listing: Listing
    taken: list[str] = Field(default_factory=list)


class OutcomesRequest(Record):
    period: str
    customer_ids: list[str]
    # Answer once this many have an outcome, or after wait_seconds with those found.
    enough: int
    wait_seconds: float
    # For a child started again in place of one that a cancel stopped (_closed_without_row).
    child_history_event_limit: ChildHistoryLimit = CHILD_HISTORY_EVENTS


class ControlRequest(Record):
    period: str
    control: Control
    request: OperatorRequest


class SkipCustomerRequest(Record):
    period: str
    request: SkipRequest


class CancelRequest(Record):
    period: str
    after: str | None
    limit: int
    request: OperatorRequest


log = logging.getLogger("billing.period")

# How often the ledger is read while outcomes are awaited.
OUTCOMES_POLL_SECONDS = 0.5
# A child that closed before its claim (its customer was gone) leaves no ledger row.
ENDED_WITHOUT_CLAIM = "ended_without_claim"
# ApplicationError type: the customer to skip is not in the ledger, or inactive.
UNKNOWN_CUSTOMER = "UnknownCustomer"
# How many due customers with no row the close reads at a time, looking for one never listed.
UNLISTED_PAGE = 500


class ScheduledPeriodRequest(Record):
    nominal_time: datetime
    time_zone: str
    billing: Billing


@activity.defn(name="scheduled_period")
async def scheduled_period(request: ScheduledPeriodRequest) -> str:
    """The period a schedule's firing bills, read in the schedule's own time zone."""
    try:
        zone = ZoneInfo(request.time_zone)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        # No retry brings the zone: fail this firing for all to see, and leave the schedule's
        # next one free to launch.
        raise ApplicationError(
            f"time zone {request.time_zone!r} is not in this worker's time-zone database;"
            " recreate the schedule with a zone such as 'Europe/Berlin', then backfill the"
            " missed firing",
            type="UnknownTimeZone",
            non_retryable=True,
        ) from exc
    local = request.nominal_time.astimezone(zone)
    return str(period_for(local, request.billing))


class PeriodActivities:
    def __init__(
        self, pool: asyncpg.Pool, settings: BillingSettings, admin: VaultAdmin | None = None
    ) -> None:
        self._pool = pool
        self._settings = settings
        self._admin = admin

    def _key(self, customer_id: str, period: str) -> str:
        return idempotency_key(
            self._settings.billing_key_namespace, customer_id, parse_period(period)
        )

    @activity.defn(name="prepare_period")
    async def prepare(self, request: PrepareRequest) -> PeriodPlan:
        admin = self._admin
        issued: list[period_keys.RenewedKey] = []

        async def before_recording(plan: PeriodPlan, unsent: dict[str, int]) -> None:
            if admin is not None:
                # Before the keys too, which a stale try would issue for nothing.
                await _check_current_try("opening", plan.period)
                issued.extend(await self._ensure_keys(conn, admin, plan, unsent))
            # Under the row's lock, which the write then holds (the vault may have been slow).
            await ledger.lock_period(conn, plan.period)
            await _check_current_try("opening", plan.period)

        async with self._pool.acquire() as conn:
            # The keys before the run is recorded, on the opening's connection (a second one
            # from the pool could wait behind other openings for ever): one refused leaves the
            # period's record as it was, and an import waits, so the plan they serve holds.
            try:
                plan = await ledger.open_period(
                    conn, request.period, request.workflow_id, before_recording, _opening(request)
                )
            except Exception:
                if admin is not None:
                    # Rolled back, perhaps after the vault issued keys (a stale try refused,
                    # another currency's key refused, Temporal away as it asked): stored by
                    # no run now, and no retry, opening or close of the month may come.
                    await self._revoke_unused(conn, request.period)
                raise
            held = await ledger.held_customers(conn, request.period)
        if admin is not None:
            await _revoke_replaced(admin, request.period, issued)
        for customer in held:
            logs.log_event(
                log,
                "held",
                level=logging.WARNING,
                period=request.period,
                customer_id=customer.customer_id,
                stripe_customer_id=customer.stripe_customer_id,
                held_as=customer.held_as,
            )
        return plan.model_copy(update={"held": len(held)})

    async def _ensure_keys(
        self,
        conn: asyncpg.Connection,
        admin: VaultAdmin,
        plan: PeriodPlan,
        unsent: dict[str, int],
        *,
        renewing: bool = False,
    ) -> list[period_keys.RenewedKey]:
        """The period's vault key per currency, capped at the expected total with headroom;
        returns those issued. A stored key kept with less room than the run has yet to send
        is replaced if the workers issued it or when `renewing`; one an operator issued fails
        a run's opening, and a revoked one is never replaced (period_keys.kept_key). Every
        stored key is checked before any is issued: a new key whose row a later refusal
        rolled back would count against the vault's worker budget until it expired."""
        period = parse_period(plan.period)
        caps = spend_caps(plan.totals_by_currency, self._settings.billing_cap_multiplier)
        to_issue: list[str] = []
        for currency in caps:
            with _needs_operator(plan.period, currency):
                kept = await period_keys.kept_key(
                    conn, admin, period, currency, unsent.get(currency, 0), renewing=renewing
                )
            if kept is None:
                to_issue.append(currency)
        # At every opening and renewal, not only before an issue: a key replaced by one
        # this run's first try stored, whose revoke failed, is revoked when it is tried again.
        try:
            await _revoke_unstored(conn, admin, plan.period)
        except VaultForbidden as exc:
            # A vault from before workers could revoke their own keys: they stay counted.
            log.warning("%s: could not revoke unused keys: %s", plan.period, exc.message)
        grace = timedelta(days=self._settings.billing_vault_key_grace_days)
        box = self._settings.secret_box()
        issued = []
        for currency in to_issue:
            replaced = await period_keys.stored_key_id(conn, plan.period, currency)
            with _needs_operator(plan.period, currency, replacing=replaced):
                key = await period_keys.issue_key(
                    conn, admin, box, period, currency, caps[currency], grace, known_in=self._pool
                )
            issued.append(period_keys.RenewedKey(**key.model_dump(), replaced=replaced))
        return issued

    @activity.defn(name="renew_period_keys")
    async def renew_keys(self, period: str) -> period_keys.KeyRenewal:
        """New vault keys for the period's paused run where its key has less room than the
        run's open claims and unclaimed customers may charge, or expires soon, capped for
        what it has left (at the prices of now, with the usual headroom): resumed, it bills
        the rest. Keys with room are kept, and a revoked key is refused, as at a run's
        opening; run again, it issues nothing. As the current try of the period's latest run
        only (_check_current_try), asked under the opening's lock: a try of a run terminated
        since, landing late, would replace and revoke the keys a rerun opened with."""
        admin = self._admin
        if admin is None:
            raise ApplicationError(
                "this worker charges Stripe without the vault: there is no key to renew",
                type=KEY_REFUSED,
                non_retryable=True,
            )
        async with self._pool.acquire() as conn, conn.transaction():
            # As a run's opening does: the plan the caps come from holds until they are stored.
            await ledger.lock_for_change(conn, "renewing the period's keys")
            await _check_current_try("key renewal", period)
            plan = await ledger.plan_period(conn, period)
            # Everything still open, not only what no attempt sent with the key: a claim sent
            # with it may hold nothing of its room (refused before Stripe on a retry), and one
            # too few would pause the run again at once. Claims in doubt are counted twice.
            open_totals = plan.totals_by_currency
            renewed = await self._ensure_keys(conn, admin, plan, open_totals, renewing=True)
        await _revoke_replaced(admin, period, renewed)
        for key in renewed:
            logs.log_event(
                log,
                "key_renewed",
                period=period,
                currency=key.currency,
                vault_key_id=key.vault_key_id,
                cap_cents=key.cap_cents,
                replaced=key.replaced,
            )
        return period_keys.KeyRenewal(period=period, keys=renewed)

    @activity.defn(name="period_completed")
    async def completed(self, period: str) -> bool:
        """Whether a launch leaves the period as it is (run_states.finished_runs): the ledger
        shows a run of it that completed, cancelled ones too, which it remembers past the
        namespace's retention, or one an operator cancelled that has not closed."""
        async with self._pool.acquire() as conn:
            return bool(await run_states.finished_runs(conn, [period]))

    @activity.defn(name="latest_billed_period")
    async def latest_billed(self, period: str) -> str | None:
        """The period a daily reconciliation checks when a schedule would bill `period` now:
        that one once its run has started, else the one before (billed on a day of the
        month still to come, or later in the day); None if neither has had a run."""
        candidates = [period, str(parse_period(period).previous())]
        async with self._pool.acquire() as conn:
            return await ledger.latest_run(conn, candidates)

    @activity.defn(name="periods_to_recheck")
    async def periods_to_recheck(self, period: str) -> list[PeriodToRecheck]:
        """The earlier periods a daily reconciliation of `period` also checks again: those
        whose last reconciliation left something, or with a run since (ledger)."""
        async with self._pool.acquire() as conn:
            return await ledger.periods_to_recheck(
                conn, period, RECHECK_RUNS_WITHIN, RECHECKS_PER_FIRING
            )

    @activity.defn(name="due_customers")
    async def due_customers(self, request: DuePageRequest) -> DuePage:
        async with self._pool.acquire() as conn:
            if request.listing is not None:
                return await ledger.listed_page(
                    conn,
                    request.period,
                    request.after,
                    request.limit,
                    request.listing,
                    request.taken,
                )
            return await self._due_page(
                conn,
                request.period,
                request.after,
                request.limit,
                unlisted=request.unlisted,
                restarts_completed=request.restarts_completed,
            )

    async def _due_page(
        self,
        conn: asyncpg.Connection,
        period: str,
        after: str | None,
        limit: int,
        *,
        unlisted: bool,
        restarts_completed: bool,
    ) -> DuePage:
        """A page of due customers after the cursor; if `unlisted`, only those the run's
        listing did not reach (_unreached: imported, or released from a hold, behind it). One
        whose child of this run ended before its claim has no row either, but the run counted
        it already. The cursor is the page's, so a page may be empty."""
        page = await ledger.due_page(conn, period, after, limit, without_row=unlisted)
        if not unlisted:
            return page
        return DuePage(
            customers=await self._unreached(conn, period, page.customers, restarts_completed),
            next_cursor=page.next_cursor,
        )

    async def _unreached(
        self,
        conn: asyncpg.Connection,
        period: str,
        customers: Sequence[DueCustomer],
        restarts_completed: bool,
    ) -> list[DueCustomer]:
        """Those of `customers` (due, with no row) that the period's open run has not reached:
        with no workflow for the period, one still running (an earlier run's: this run's have
        ended by its close, and each is on one page of a listing), or only one that ended
        before its claim (failed, terminated; completed too, if the run `restarts_completed`)
        before the run opened, which a listing starts again. One that ended since was this
        run's, or one it waited for and counted."""
        if not customers:
            return []
        opened = await ledger.run_opened_at(conn, period)
        children = await asyncio.gather(*(self._child_of(period, c.customer_id) for c in customers))
        return [
            c
            for c, child in zip(customers, children, strict=True)
            if child is None
            # Still running before its claim, an earlier run's (terminated): the listing's
            # start is refused, and the run awaits its outcome.
            or child.status == WorkflowExecutionStatus.RUNNING
            or (
                # Started again by a listing (RESTART_UNCLAIMED's reuse policy).
                (restarts_completed or child.status in ENDED_UNCOMPLETED)
                and opened is not None
                and child.close_time is not None
                and child.close_time < opened
            )
        ]

    @staticmethod
    def _child(period: str, customer_id: str) -> WorkflowHandle[Any, CustomerOutcome]:
        return activity.client().get_workflow_handle(
            customer_workflow_id(parse_period(period), customer_id), result_type=CustomerOutcome
        )

    async def _child_of(self, period: str, customer_id: str) -> WorkflowExecutionDescription | None:
        """The customer's workflow for the period, however it ended; None if it never ran (or
        is gone past the namespace's retention)."""
        return await described(self._child(period, customer_id))

    @activity.defn(name="await_outcomes")
    async def await_outcomes(self, request: OutcomesRequest) -> list[CustomerOutcome]:
        """Outcomes of customers whose child the run cannot await (an earlier run started
        it), read from the ledger once `enough` have one, or when the wait is over."""
        deadline = time.monotonic() + request.wait_seconds
        while True:
            async with self._pool.acquire() as conn:
                found = await ledger.outcomes(
                    conn, request.period, request.customer_ids, awaited=True
                )
            if len(found) >= request.enough or time.monotonic() >= deadline:
                break
            await asyncio.sleep(OUTCOMES_POLL_SECONDS)
        if len(found) < request.enough:
            found += await self._closed_without_row(request)
        return found

    async def _closed_without_row(self, request: OutcomesRequest) -> list[CustomerOutcome]:
        """Children that closed without ever writing a ledger row report through their own
        result; one that failed or was terminated before its claim charged nothing. One an
        earlier run started that found its row written by a cancel of that run (an ended
        run's, operations.cancel_ended_run), the period closed at its claim, is started again
        in its place while this run bills: the row is the next run's to claim, and this run
        is that run. Its outcome is then awaited as before, through the ledger. A cancel of
        this run landing after the check is the claim's to see: it leaves such a row to the
        next run (ledger.claim)."""
        period = request.period
        async with self._pool.acquire() as conn:
            missing = await ledger.without_rows(conn, period, request.customer_ids)
            billing_since = await ledger.run_opened_at(conn, period, billing=True)
        outcomes: list[CustomerOutcome] = []
        ended: list[str] = []
        for customer_id in missing:
            description = await self._child_of(period, customer_id)
            if description is None:
                # Gone past the retention while awaited: ended, as far as anyone can tell.
                ended.append(customer_id)
            elif description.status == WorkflowExecutionStatus.COMPLETED:
                outcome = await self._child(period, customer_id).result()
                if (
                    outcome.outcome == "cancelled"
                    and billing_since is not None
                    and description.start_time < billing_since
                ):
                    await self._start_again(request, customer_id)
                else:
                    outcomes.append(outcome)
            elif description.status != WorkflowExecutionStatus.RUNNING:
                ended.append(customer_id)
        if ended:
            # It may have claimed after the first read, then failed: a claim, not nothing.
            async with self._pool.acquire() as conn:
                ended = await ledger.without_rows(conn, period, ended)
        outcomes += [
            CustomerOutcome(customer_id=c, outcome="failed", failure_code=ENDED_WITHOUT_CLAIM)
            for c in ended
        ]
        return outcomes

    @staticmethod
    async def _start_again(request: OutcomesRequest, customer_id: str) -> None:
        """Start the customer's workflow for this run, as its child would be started."""
        info = activity.info()
        start = customer_start(
            request.period, customer_id, info.workflow_id, request.child_history_event_limit
        )
        log.info("%s: starting %s again for this run", request.period, start.workflow_id)
        with contextlib.suppress(WorkflowAlreadyStartedError):
            # Started by a try of this activity before, and running: awaited as it is.
            await activity.client().start_workflow(
                CUSTOMER_CHARGE_WORKFLOW,
                start.input,
                id=start.workflow_id,
                task_queue=info.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                static_summary=start.summary,
                search_attributes=start.search_attributes,
            )

    @activity.defn(name="set_control")
    async def set_control(self, request: ControlRequest) -> None:
        async with self._pool.acquire() as conn, conn.transaction():
            await ledger.lock_period(conn, request.period)
            await _check_current_try("control", request.period)
            await ledger.set_control(
                conn,
                request.period,
                request.control,
                request.request.reason,
                request.request.operator,
            )

    @activity.defn(name="skip_customer")
    async def skip_customer(self, request: SkipCustomerRequest) -> SkipResult:
        skip = request.request
        try:
            async with self._pool.acquire() as conn:
                return await ledger.request_skip(
                    conn,
                    skip.customer_id,
                    request.period,
                    self._key(skip.customer_id, request.period),
                    skip.reason,
                    skip.operator,
                )
        except UnknownCustomerError as exc:
            raise ApplicationError(str(exc), type=UNKNOWN_CUSTOMER, non_retryable=True) from exc

    @activity.defn(name="cancel_unstarted")
    async def cancel_unstarted(self, request: CancelRequest) -> CancelPage:
        """Cancel one page of customers after the cursor; count what each one ends as. As
        the current try of the period's latest run only (_check_current_try): a try of a run
        terminated since, landing late, would cancel the claims of a rerun's children, which
        no run reopens."""
        async with self._pool.acquire() as conn:
            async with conn.transaction():
                await ledger.lock_period(conn, request.period)
                await _check_current_try("cancel", request.period)
                page, open_ids = await ledger.cancel_unstarted_page(
                    conn,
                    request.period,
                    request.after,
                    request.limit,
                    self._settings.billing_key_namespace,
                    request.request.reason,
                    request.request.operator,
                )
            ended = await ledger.outcomes(
                conn, request.period, [c.customer_id for c in page.customers]
            )
        counts = Counts(due=len(page.customers))
        for outcome in ended:
            counts.add(outcome)
        finished = {outcome.customer_id for outcome in ended}
        return CancelPage(
            counts=counts,
            next_cursor=page.next_cursor,
            sent=[c for c in open_ids if c not in finished],
        )

    @activity.defn(name="close_period")
    async def close(self, summary: PeriodSummary) -> None:
        async with self._pool.acquire() as conn:
            async with conn.transaction():
                await ledger.lock_period(conn, summary.period)
                await _finish(conn, summary)
            await self._revoke_unused(conn, summary.period)

    @activity.defn(name="close_period_if_all_listed")
    async def close_if_all_listed(self, summary: PeriodSummary) -> bool:
        """Close the period as `close` does, unless a due customer is left that the run's
        listing did not reach (imported behind it): then False, and nothing is written.
        Checked and closed as one step to an import (ledger.lock_for_change), so that none
        lands in between. Looked for first without the lock, which Temporal's answers would
        hold up (a describe per customer with no row): under it, only those new since are."""
        return await self._close_if_reached(summary, restarts_completed=False)

    @activity.defn(name="close_period_if_all_reached")
    async def close_if_all_reached(self, summary: PeriodSummary) -> bool:
        """`close_if_all_listed` for a run that starts a customer with no row again whatever
        its last child's end (RESTART_COMPLETED_UNCLAIMED)."""
        return await self._close_if_reached(summary, restarts_completed=True)

    @activity.defn(name="close_period_if_all_marked")
    async def close_if_all_marked(self, request: MarkedCloseRequest) -> bool:
        """`close_if_all_listed` for a run whose listings mark the customers it took
        (LISTINGS_MARKED): a due customer is left if the run took it from no listing,
        whatever its row (given one meanwhile by a skip, or by an earlier run's child, it is
        in no count of the run yet) or workflow. One query, under the import's lock."""
        summary, listing = request.summary, request.listing
        period = summary.period
        async with self._pool.acquire() as conn:
            if await self._closed_before(conn, period):
                return True
            await ledger.mark_taken(conn, period, listing, request.taken)
            async with conn.transaction():
                await ledger.lock_for_change(conn, "the run's close")
                if await ledger.unlisted_due(conn, period, listing):
                    return False
                await ledger.lock_period(conn, period)
                await _finish(conn, summary)
            await self._revoke_unused(conn, period)
        return True

    async def _closed_before(self, conn: asyncpg.Connection, period: str) -> bool:
        """Whether an earlier try of this close wrote the summary, its answer lost (maybe
        before it had revoked the period's unused keys, which it does now). Only the current
        try of the latest run writes the row, whose opening left it running."""
        record = await ledger.period_record(conn, period)
        if record is None or record.state != "completed":
            return False
        await _check_current_try("close", period)
        await self._revoke_unused(conn, period)
        return True

    async def _close_if_reached(self, summary: PeriodSummary, *, restarts_completed: bool) -> bool:
        period = summary.period
        async with self._pool.acquire() as conn:
            if await self._closed_before(conn, period):
                return True
            reached = await self._reached_without_row(conn, period, frozenset(), restarts_completed)
            if reached is None:
                return False
            async with conn.transaction():
                await ledger.lock_for_change(conn, "the run's close")
                if (
                    await self._reached_without_row(conn, period, reached, restarts_completed)
                    is None
                ):
                    return False
                await ledger.lock_period(conn, period)
                await _finish(conn, summary)
            await self._revoke_unused(conn, period)
        return True

    async def _reached_without_row(
        self,
        conn: asyncpg.Connection,
        period: str,
        known: frozenset[str],
        restarts_completed: bool,
    ) -> frozenset[str] | None:
        """The due customers with no row, each of which has a workflow for the period (those
        in `known` are taken to have one); None if one has none: no listing reached it."""
        reached: set[str] = set()
        after: str | None = None
        while True:
            page = await ledger.due_page(conn, period, after, UNLISTED_PAGE, without_row=True)
            new = [c for c in page.customers if c.customer_id not in known]
            if await self._unreached(conn, period, new, restarts_completed):
                return None
            reached.update(c.customer_id for c in page.customers)
            if page.next_cursor is None:
                return frozenset(reached)
            after = page.next_cursor

    async def _revoke_unused(self, conn: asyncpg.Connection, period: str) -> None:
        """Revoke the period's keys no run stores, where no opening may come to: at the
        close (a key the vault issued only after the opening's retry had looked, a vault slow
        to answer) and after an opening that failed once the vault may have issued keys. Each
        would otherwise hold its cap against the worker budget until it expired. Under the
        opening's lock, as there; a failure only warns (the close does not wait on the
        vault)."""
        if self._admin is None:
            return
        try:
            async with conn.transaction():
                await ledger.lock_for_change(conn, "revoking the period's unused keys")
                await _revoke_unstored(conn, self._admin, period)
        except (VaultAdminError, LedgerBusyError) as exc:
            log.warning(
                "%s: unused keys not revoked (a later opening or close revokes them, else"
                " they expire): %s",
                period,
                exc,
            )


def _opening(request: PrepareRequest) -> RunIdentity | None:
    """The run opening the period, at this attempt's time by Temporal's clock: a child
    of an earlier run may end after the run started, while its opening was tried again."""
    if request.run_id is None:
        return None
    return RunIdentity(
        run_id=request.run_id, opened_at=activity.info().current_attempt_scheduled_time
    )


async def _not_current_try() -> str | None:
    """Why this activity is not the current try of the latest run of its workflow, or None
    if it is. A try that timed out (its worker frozen past the timeout), or one of a run that
    has ended (terminated, or reset: its activities finish on their workers all the same), is
    not: another run, or try, may have opened or closed the period since. None outside an
    activity (a benchmark's opening)."""
    if not activity.in_activity():
        return None
    info = activity.info()
    if info.workflow_id is None:
        return "no workflow started it"
    workflow = activity.client().get_workflow_handle(info.workflow_id)
    # Asked under the period's row lock, which every charge's gate shares: not for long.
    latest = await workflow.describe(rpc_timeout=DESCRIBE_TIMEOUT)
    if latest.run_id != info.workflow_run_id:
        return f"its run {info.workflow_run_id} is not the workflow's latest, {latest.run_id}"
    if latest.status != WorkflowExecutionStatus.RUNNING:
        ended = latest.status.name.lower() if latest.status is not None else "ended"
        return f"its run {info.workflow_run_id} has ended ({ended})"
    pending = [
        p.attempt
        for p in latest.raw_description.pending_activities
        if p.activity_id == info.activity_id
    ]
    if info.attempt in pending:
        return None
    if pending:
        return f"it is attempt {info.attempt}, and Temporal waits on attempt {pending[0]}"
    return f"Temporal no longer waits on activity {info.activity_id} of its run"


async def _check_current_try(what: str, period: str) -> None:
    """Write the period's row (its run's `what`) only as the current try of the latest run,
    asked under the row's lock (ledger.lock_period), which every writer of it holds to its
    write (its keys: under the opening's lock, which a run's opening holds to its record):
    no other write lands between the answer and this one. Refused, it fails the try,
    retryably: Temporal drops a stale try's answer, and one refused wrongly is tried again
    (its message says what did not match)."""
    why = await _not_current_try()
    if why is not None:
        raise ApplicationError(
            f"{period}: this try of the run's {what} writes nothing: it is not the current try"
            f" of the period's latest run ({why})",
            type=STALE_TRY,
        )


async def _finish(conn: asyncpg.Connection, summary: PeriodSummary) -> None:
    """Write the run's summary, as the current try of the latest run (_check_current_try)."""
    await _check_current_try("close", summary.period)
    await ledger.finish_period(conn, summary.period, summary.model_dump_json())


async def _revoke_unstored(conn: asyncpg.Connection, admin: VaultAdmin, period: str) -> None:
    """Revoke the period's keys no run stores (period_keys.revoke_unstored), saying so."""
    for key_id in await period_keys.revoke_unstored(conn, admin, parse_period(period)):
        logs.log_event(log, "unstored_key_revoked", period=period, vault_key_id=key_id)


async def _revoke_replaced(
    admin: VaultAdmin, period: str, issued: Sequence[period_keys.RenewedKey]
) -> None:
    """Revoke the keys the new ones replaced, once stored: a worker that cached one would
    otherwise charge through its room as well as the new key's cap (the kill switch sends it
    to the new key instead, activities/charging.py). Charges already sent settle as usual. A
    revoke the vault could not make raises, and the activity's retry revokes the key under
    the opening's lock (period_keys.revoke_unstored); one the worker token may not make (a
    key issued with the admin token) is only named."""
    for key in issued:
        if key.replaced is None:
            continue
        old = await admin.get_key(key.replaced)
        if old.revoked and old.revoked_by != "worker":
            # Revoked since the opening found it live: an operator's kill switch stays
            # pulled, on the new key too, and the run pauses at its first charge, saying so.
            await admin.revoke(key.vault_key_id)
            logs.log_event(
                log,
                "replacement_revoked",
                level=logging.WARNING,
                period=period,
                vault_key_id=key.vault_key_id,
                replaced=key.replaced,
            )
            continue
        try:
            await admin.revoke(key.replaced)
        except VaultForbidden as exc:
            logs.log_event(
                log,
                "replaced_key_not_revoked",
                level=logging.WARNING,
                period=period,
                vault_key_id=key.replaced,
                error=str(exc),
            )
            continue
        logs.log_event(log, "replaced_key_revoked", period=period, vault_key_id=key.replaced)


@contextlib.contextmanager
def _needs_operator(period: str, currency: str, replacing: str | None = None) -> Iterator[None]:
    """A key refused for a reason no retry changes fails the run, saying why; `replacing`,
    the stored key a new one would replace."""
    try:
        yield
    except (
        period_keys.KeyRevokedError,
        period_keys.KeyTooSmallError,
        VaultInvalidRequest,
        VaultAuthError,
        VaultForbidden,
    ) as exc:
        # Revoked (the kill switch), too small for the run, a cap over the vault's ceiling, a
        # wrong token, a worker budget spent: each needs an operator, not a retry.
        fix = ""
        if isinstance(exc, VaultAuthError):
            fix = (
                " (the workers' BILLING_VAULT_WORKER_TOKEN, or BILLING_VAULT_ADMIN_TOKEN without"
                " one, is not a token the vault holds)"
            )
        elif isinstance(exc, VaultForbidden) and replacing is not None:
            # Issued before the old key is revoked, so that a refusal leaves it working.
            fix = (
                f" (the key it would replace, {replacing}, counts its whole cap against the"
                " budget until then: raise VAULT_WORKER_BUDGET_CENTS, or revoke that key with"
                " the worker token, delete its row in period_vault_keys and run again)"
            )
        raise ApplicationError(
            f"no vault key for {period} ({currency}): {exc}{fix}",
            type=KEY_REFUSED,
            non_retryable=True,
        ) from None

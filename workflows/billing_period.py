"""One billing period: fan out a child per due customer, in a bounded window, and sum up.

Children are started in batches within one workflow task (a serial await per start caps the
rate at a few per second), each by a task of its own that nothing waits for (waiting for a
batch's starts let the window drain), and report by completing: the run awaits each child's
result. A report by signal would cost every customer three more history events and a workflow
task, and serialize on the parent: it halved the fan-out's throughput. A child another run
started cannot be awaited: the ledger says when it finishes. That is how a run that continues
as new hands over the children still in flight after a short wait for them, so that one slow
charge does not hold the period.

Operators pause, resume, cancel and skip through updates, which answer (and refuse, e.g. a
resume of a cancelled run); the ledger carries their word to charges already scheduled, and a
resume or cancel signals the children in flight, which wait at a paused gate.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import NoReturn

from temporalio import workflow
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    ChildWorkflowError,
    FailureError,
    WorkflowAlreadyStartedError,
)

with workflow.unsafe.imports_passed_through():
    from activities.period import (
        CancelRequest,
        ControlRequest,
        DuePageRequest,
        MarkedCloseRequest,
        OutcomesRequest,
        PeriodActivities,
        PrepareRequest,
        SkipCustomerRequest,
    )
    from billing import logs, money, search_attributes
    from billing.customer_start import customer_start
    from billing.keys import customer_workflow_id, period_workflow_id, validate_customer_id
    from billing.models import (
        AUTOMATIC,
        AWAITED_SHOWN,
        REASON_MAX_LENGTH,
        BillingPeriodInput,
        ChargeFailure,
        Control,
        ControlState,
        CustomerOutcome,
        DueCustomer,
        Listing,
        OperatorRequest,
        PeriodProgress,
        PeriodState,
        PeriodSummary,
        RunOptions,
        SkipRequest,
        SkipResult,
        finished_outcome,
    )
    from billing.period_keys import KeyRenewal
    from billing.periods import parse_period
    from billing.redact import shown_line
    from workflows.customer_charge import CustomerChargeWorkflow
    from workflows.identity import checked, given, one_input, require_id
    from workflows.signals import PERIOD_BLOCKED, PERIOD_CONTROL

ACTIVITY_TIMEOUT = timedelta(seconds=60)
RENEW_TIMEOUT = timedelta(minutes=5)
# How long one wait for outcomes of children started elsewhere lasts at most.
LEDGER_WAIT = timedelta(seconds=10)
# Runs recorded before this patch closed without waiting for updates still in flight.
ANSWER_UPDATES_BEFORE_CLOSE = "answer-updates-before-close"
# A cancel waits for charges another run's children sent (CancelPage.sent).
CANCEL_AWAITS_SENT = "cancel-awaits-sent"
# A refused key reported once every outcome is in pauses nothing.
NO_PAUSE_ONCE_FINISHED = "no-pause-once-finished"
# Waiting on children started elsewhere (the ledger polled every LEDGER_WAIT) continues as
# new when the history is long, as the fan-out does: such a child may take hours.
LONG_WAITS_CONTINUE = "long-waits-continue-as-new"
# The cancel is in the ledger before customers are marked cancelled: a child of an earlier
# run claiming such a row meanwhile would otherwise pass the gate while the ledger still said
# running, and charge a customer this run counts cancelled.
CANCEL_AFTER_CONTROL_WRITTEN = "cancel-after-control-written"
# A paused run continues as new when its history is long: children reporting a refused key,
# and operators' updates (a skip each), add to it for as long as the pause lasts.
PAUSES_CONTINUE = "pauses-continue-as-new"
# A customer with no ledger row gets a new child when the one before ended (terminated,
# failed) before its claim; it was counted failed (ended_without_claim), and its ID used to
# refuse every later run of the period until Temporal's retention dropped it.
RESTART_UNCLAIMED = "restart-unclaimed"
# ... and when the one before completed without a claim: it found the customer inactive
# (unknown_customer), who has been made active again since. No row means no claim, so
# nothing was charged under that ID; its ID used to refuse every later run of the period.
# The listing of the unlisted and the close then take such a child, closed before the run
# opened, for one this run has not reached (close_if_all_reached): a run from before would
# list it again for ever, its start refused.
RESTART_COMPLETED_UNCLAIMED = "restart-completed-unclaimed"
# A cancel accepted while keys are renewed woke the children before the new keys existed:
# refused again, they waited on their timers (up to 5 minutes), and the advice to renew
# stayed. The renewal now wakes them, as for a run cancelled before it.
WAKE_AFTER_RENEWAL = "wake-after-renewal"
# A rerun lists page after page of customers already finished, each page a marker holding it
# whole, within one workflow task, whose history length is read only at the next: it went on
# to the end of the list in one run (a million billed customers passed Temporal's 50 MB and
# the run was terminated). The cancel's paging, an activity a page, did the same. Both now
# continue as new: the listing after LISTED_PER_RUN customers, or a page for every two
# events of the limit; the cancel as the fan-out does.
LISTING_CONTINUES = "listing-continues-as-new"
LISTED_PER_RUN = 20_000
# Temporal's own cancel (the Web UI's button, `temporal workflow cancel`) is an operator's
# cancel. It used to end the run CANCELED with nothing in the ledger: the customers not yet
# charged were never marked, and the schedule's next launch billed them after all.
TEMPORAL_CANCEL_IS_A_CANCEL = "temporal-cancel-is-a-cancel"
# Under the SDK's job order for runs without its logic flag 2, a workflow task's signals and
# updates run a pass of the workflow before its other jobs, Temporal's cancel among them: a
# paused run that signals took past its history limit handed over in that pass, and the cancel,
# which does not cross continue-as-new, was lost (a later resume billed customers it was to
# stop). And children reporting while `run` wrote a cancel after the hand-over were counted in
# this run and awaited again by the next. A run that hands over now waits for a later
# workflow task first (a short timer at most), and hands over what is still in flight then.
SETTLE_BEFORE_HAND_OVER = "settle-before-hand-over"
HAND_OVER_SETTLE = timedelta(milliseconds=1)
# An operator's update refused meanwhile, which billing.operations tries again on the next
# run: taken, each would add to a history already past its limit, for as long as they came.
HANDING_OVER = "HandingOver"
TEMPORAL_CANCEL = OperatorRequest(
    reason="cancelled in Temporal (the Web UI's Cancel, or its API): customers not yet charged"
    " end cancelled",
    operator="temporal",
)
# A key refusal reported while the run's plan is made came from a child of an earlier run
# (this one has started none), refused the key the opening is renewing or replacing: the
# pause it made only waited for an operator. The child tries again once its wait is over,
# with the new key, and reports again if that is refused too.
BLOCKED_AFTER_OPENING = "blocked-after-opening"
# A batch listed while an operator paused or cancelled the run (the listing's local activity
# outlasted a workflow task, as on a slow database) was started all the same, beside the
# control's write: its children could pass the ledger's gate before that write landed, and
# charge customers the cancel meant to stop. Such a batch is now put back, not started.
BATCH_PUT_BACK_AT_CONTROL = "batch-put-back-at-control"
# The listing walks customers in id order: one imported (or released from a hold) behind it
# was never billed by the run, and nothing said so after. Its close, taken as one step to an
# import, now writes nothing while such a customer (due, with no row and no child) is left,
# and the run lists those and bills them. An operator's word given meanwhile (pause, cancel,
# skip, Temporal's cancel) is taken and applies if the run goes back to billing.
LISTS_THE_UNLISTED = "lists-the-unlisted"
# The listing of the unlisted and the close took a due customer for reached if it had a row,
# or a workflow this run had reached: one given a row meanwhile (an operator's skip, a claim by
# a child an earlier run left running) was in the ledger but in no count of the run's summary.
# The ledger now marks the customers a run takes from its listings' pages (migrations/032),
# sent with the next page's request or the close's; the listing of the unlisted and the close
# (close_if_all_marked) take those it took from no listing, whatever their row or workflow
# (one whose workflow is gone past the namespace's retention is not listed again). Decided by
# the chain's first run: a run of before marked nothing.
LISTINGS_MARKED = "listings-marked"


# Room left when a reason is cut, for what redacting the cut text again may add.
_CUT_MARGIN = 40


# Outside the sandbox for speed; the tests run it inside (see workflows/__init__.py).
@workflow.defn(name="BillingPeriodWorkflow", sandboxed=False)
class BillingPeriodWorkflow:
    @workflow.init
    @one_input(BillingPeriodInput)
    def __init__(self, request: BillingPeriodInput | None = None) -> None:
        request = given(request, BillingPeriodInput)
        self._options: RunOptions = request.options
        self._state = request.state or PeriodState(period=request.period)
        # Every customer whose outcome the run waits for; those started elsewhere also sit in
        # `_elsewhere`, the rest are awaited in `_children`.
        self._in_flight: set[str] = set(self._state.started_elsewhere)
        self._elsewhere: set[str] = set(self._state.started_elsewhere)
        self._children: set[asyncio.Task[None]] = set()
        # Children whose start the server has not yet answered.
        self._starting = 0
        self._ledger_watch: asyncio.Task[None] | None = None
        self._buffer: list[DueCustomer] = []
        self._finished = False
        # The ledger has the run closed (the close activity, after it finished): `backfill`
        # and `trigger` read that, so until then a query does not say the run is over.
        self._closed = False
        # Control writes reach the ledger one at a time, each writing the latest word, so a
        # pause written late cannot overwrite a cancel.
        self._control_writes = asyncio.Lock()
        # Key renewals under way (renew_keys).
        self._renewing = 0
        # Listed by this run (LISTING_CONTINUES).
        self._listed_pages = 0
        self._listed_customers = 0
        # Decided with the run's other patches; an update may be validated before that.
        self._lists_the_unlisted = False
        self._settles_before_hand_over = False
        self._restarts_completed = False
        # The hand-over has waited for a later workflow task (_settled).
        self._hand_over_settled = False
        self._billing: asyncio.Task[PeriodSummary] | None = None
        # The close's activity is under way (LISTS_THE_UNLISTED): a word waits for its verdict.
        self._verdict_pending = False

    @workflow.run
    async def run(self, request: BillingPeriodInput | None = None) -> PeriodSummary:
        # Decided once, before any command: runs recorded before it waited on regardless.
        self._long_waits_continue = workflow.patched(LONG_WAITS_CONTINUE)
        self._pauses_continue = workflow.patched(PAUSES_CONTINUE)
        self._listing_bounded = workflow.patched(LISTING_CONTINUES)
        self._temporal_cancel_is_a_cancel = workflow.patched(TEMPORAL_CANCEL_IS_A_CANCEL)
        self._lists_the_unlisted = workflow.patched(LISTS_THE_UNLISTED)
        self._settles_before_hand_over = workflow.patched(SETTLE_BEFORE_HAND_OVER)
        if self._state.restarts_completed is None:
            # Decided for the whole chain: a customer counted failed by a run of before would
            # otherwise be billed, and counted again, by its next.
            first = self._state.runs == 1
            self._state.restarts_completed = first and workflow.patched(RESTART_COMPLETED_UNCLAIMED)
        self._restarts_completed = self._state.restarts_completed
        if self._state.runs == 1 and workflow.patched(LISTINGS_MARKED):
            self._state.listing = 0
        parsed = checked(parse_period, self._state.period)
        period = str(parsed)
        require_id(
            period_workflow_id(parsed),
            f"a run of {period}",
            f"start it with `python starter.py run {period}`",
        )
        if not self._temporal_cancel_is_a_cancel:
            return await self._bill(period)
        # Temporal cancels the task running `run`: billing goes on in a task of its own,
        # which the cancel reaches as an operator's would, through the run's control.
        billing = self._billing = asyncio.create_task(self._bill(period))
        while True:
            try:
                if self._settles_before_hand_over:
                    await self._settled()
                return await asyncio.shield(billing)
            except asyncio.CancelledError:
                if billing.done() and not self._handed_over():
                    # Finished in the same turn: its summary, or what ended it.
                    return billing.result()
                if (
                    self._control.control != "cancelled"
                    and not self._closed
                    and (not self._finished or self._lists_the_unlisted)
                ):
                    # Handed over already, the next run carries the cancel (and its state
                    # is sent once `run` ends).
                    await self._set_control("cancelled", TEMPORAL_CANCEL)

    async def _settled(self) -> None:
        """Once billing has ended: if it handed over, in a later workflow task, so that a
        cancel that came in the same one reaches `run` first, with every update answered and
        only what is still in flight handed over."""
        assert self._billing is not None
        await workflow.wait([self._billing])
        if not self._handed_over():
            return
        if not self._hand_over_settled:
            self._hand_over_settled = True
            decided_in = workflow.info().get_current_history_length()
            # Until a later workflow task, by which this one's jobs are all applied: a busy
            # run gets one from a child's report at once, an idle one when the timer fires
            # (about a second on the dev server: a timer alone cost throughput).
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: workflow.info().get_current_history_length() > decided_in,
                    timeout=HAND_OVER_SETTLE,
                    timeout_summary="hand over once the workflow task's jobs are all in",
                )
        # An update taken meanwhile gets its answer. Each ends on its activity's result: in a
        # pass after all of a task's jobs, a cancel among them. Not `_wait`, which takes a
        # cancel for the wait's end: here it is Temporal's, which `run` must write.
        await workflow.wait_condition(workflow.all_handlers_finished)
        # Sent as `run` ends: children that reported since billing handed over are counted.
        self._state.started_elsewhere = sorted(self._in_flight)

    def _refuse_while_handing_over(self) -> None:
        if self._handed_over():
            raise ApplicationError(
                f"the run of {self._state.period} is handing over to its next run"
                " (continue-as-new): try again in a moment",
                type=HANDING_OVER,
            )

    def _handed_over(self) -> bool:
        """Billing has ended by continuing as new (SETTLE_BEFORE_HAND_OVER)."""
        billing = self._billing
        return (
            self._settles_before_hand_over
            and billing is not None
            and billing.done()
            and isinstance(billing.exception(), workflow.ContinueAsNewError)
        )

    async def _bill(self, period: str) -> PeriodSummary:
        """Plan the period, fan out its customers, and close it with its summary."""
        state = self._state
        if state.plan is None:
            state.plan = await workflow.execute_activity_method(
                PeriodActivities.prepare,
                PrepareRequest(
                    period=period,
                    workflow_id=workflow.info().workflow_id,
                    run_id=workflow.info().first_execution_run_id,
                ),
                start_to_close_timeout=ACTIVITY_TIMEOUT,
                summary=f"plan {period}: count due customers and the expected total",
            )
            if self._control.control != "running":
                # An operator spoke while the plan was made, which reset the ledger's word.
                await self._write_control()
        self._publish_status()
        self._await_elsewhere(())
        while True:
            await self._fan_out(period)
            self._finished = True
            if workflow.patched(ANSWER_UPDATES_BEFORE_CLOSE):
                # An update accepted before (a skip, a pause) gets its answer, not "workflow
                # completed before the update completed".
                await self._wait(workflow.all_handlers_finished)
            control = self._control
            cancelled = control.control == "cancelled"
            summary = PeriodSummary(
                period=period,
                workflow_id=workflow.info().workflow_id,
                run_id=workflow.info().first_execution_run_id,
                cancel_reason=control.reason if cancelled else None,
                cancelled_by=control.operator if cancelled else None,
                held=state.plan.held,
                **state.counts.model_dump(),
            )
            if self._lists_the_unlisted and control.control == "paused":
                # Paused while the close waited for updates: hand over, close on resume.
                self._finished = False
                continue
            self._verdict_pending = self._lists_the_unlisted
            closed = await self._close(summary)
            self._verdict_pending = False
            if closed:
                break
            workflow.logger.info("due customers the listing did not reach: listing them")
            # An operator's word given while the run closed applies now (_set_control).
            self._finished = False
            self._list_the_unlisted()
        self._closed = True
        if self._lists_the_unlisted:
            # Words given as the run closed get their answer.
            await self._wait(workflow.all_handlers_finished)
        self._publish_status()
        return summary

    async def _fan_out(self, period: str) -> None:
        """Start a child per customer listed, until every outcome is in (or the run is
        cancelled and its cancel has marked the rest)."""
        state = self._state
        while True:
            await self._wait(
                lambda: (
                    self._control.control != "paused"
                    or (self._pauses_continue and self._should_continue_as_new())
                )
            )
            if self._control.control == "paused":
                # Children waiting at the gate finish only once it is resumed: hand them all
                # over now, once each has started (or nothing would report it) and every
                # operator's update (a skip, a resume) has its answer.
                await self._wait(lambda: self._starting == 0 and workflow.all_handlers_finished())
                self._hand_over(period)
            if self._control.control == "cancelled":
                await self._cancel_the_rest()
                # It stopped waiting for them, or paging: the history is long.
                if self._in_flight or not state.listing_done:
                    await self._continue_as_new(period)
                break
            await self._fill_window()
            if self._exhausted() and not self._in_flight:
                break
            await self._wait_for_room()
            if self._should_continue_as_new():
                await self._continue_as_new(period)

    async def _close(self, summary: PeriodSummary) -> bool:
        """Write the run's summary to the ledger; False, nothing written, while a due
        customer is left that no listing of a run still billing has reached."""
        if self._lists_the_unlisted and self._control.control != "cancelled":
            listing = self._listing()
            if listing is not None:
                taken = list(self._state.unmarked)
                closed = await workflow.execute_activity_method(
                    PeriodActivities.close_if_all_marked,
                    MarkedCloseRequest(summary=summary, listing=listing, taken=taken),
                    start_to_close_timeout=ACTIVITY_TIMEOUT,
                    summary=f"close {summary.period}, once every due customer is listed",
                )
                self._marked(taken)
                return closed
            return await workflow.execute_activity_method(
                (
                    PeriodActivities.close_if_all_reached
                    if self._restarts_completed
                    else PeriodActivities.close_if_all_listed
                ),
                summary,
                start_to_close_timeout=ACTIVITY_TIMEOUT,
                summary=f"close {summary.period}, once every due customer is listed",
            )
        await workflow.execute_activity_method(
            PeriodActivities.close,
            summary,
            start_to_close_timeout=ACTIVITY_TIMEOUT,
            summary=f"close {summary.period}",
        )
        return True

    def _listing(self) -> Listing | None:
        """The run's listing under way, under which the ledger marks the customers the run
        takes from its pages (LISTINGS_MARKED); None for a run whose first run began before."""
        if self._state.listing is None:
            return None
        return Listing(run_id=workflow.info().first_execution_run_id, number=self._state.listing)

    def _unmarked(self, taken: list[DueCustomer], sent: int) -> int:
        """Leave `taken[sent:]` for the ledger to mark (LISTINGS_MARKED); returns how many of
        `taken` are left so."""
        if self._state.listing is not None:
            self._state.unmarked += [c.customer_id for c in taken[sent:]]
        return len(taken)

    def _marked(self, taken: list[str]) -> None:
        """The ledger has marked `taken`, the first of the customers left unmarked."""
        del self._state.unmarked[: len(taken)]

    def _list_the_unlisted(self) -> None:
        """List, from the start, only the due customers the listing has not reached."""
        state = self._state
        state.unlisted = True
        state.cursor = None
        state.listing_done = False
        if state.listing is not None:
            state.listing += 1

    # -- operator controls -------------------------------------------------------------

    @workflow.update
    async def pause(self, request: OperatorRequest) -> PeriodProgress:
        return self._answer("pause", await self._set_control("paused", request))

    @pause.validator
    def _validate_pause(self, request: OperatorRequest) -> None:
        self._refuse_if_over("pause")
        if self._control.control == "paused":
            # A second pause would replace the reason, and with it the advice `status` gives
            # for a run that paused itself (renew-keys, not resume).
            raise ApplicationError(
                f"the run is paused already, by {self._control.operator}: {self._control.reason}"
                f" (`python starter.py status {self._state.period}` says what to do)"
            )

    @workflow.update
    async def resume(self, request: OperatorRequest) -> PeriodProgress:
        return self._answer("resume", await self._set_control("running", request))

    @resume.validator
    def _validate_resume(self, request: OperatorRequest) -> None:
        self._refuse_if_over("resume")
        if self._control.control == "running":
            raise ApplicationError("the run is running, not paused: there is nothing to resume")
        if self._renewing:
            # Resumed now, its children would take the old keys, and pause it again.
            raise ApplicationError("the run's keys are being renewed: resume it once that is done")

    @workflow.update
    async def cancel(self, request: OperatorRequest) -> PeriodProgress:
        return self._answer("cancel", await self._set_control("cancelled", request))

    @cancel.validator
    def _validate_cancel(self, request: OperatorRequest) -> None:
        if self._control.control == "cancelled" and not self._finished:
            raise ApplicationError(
                f"the run is already cancelled, by {self._control.operator}, and is finishing"
                " the charges it had sent"
            )
        self._refuse_if_over("cancel")

    @workflow.update
    async def renew_keys(self, request: OperatorRequest) -> KeyRenewal:
        logs.log_signal(
            "renew_keys",
            period=self._state.period,
            operator=request.operator,
            reason=request.reason,
        )
        # Runs recorded before WAKE_AFTER_RENEWAL decided here, before the activity.
        cancelled = self._control.control == "cancelled"
        self._renewing += 1
        try:
            renewal = await workflow.execute_activity_method(
                PeriodActivities.renew_keys,
                self._state.period,
                start_to_close_timeout=ACTIVITY_TIMEOUT,
                # The operator waits, and a resume is refused meanwhile: a vault or ledger
                # away this long is an answer to give them.
                schedule_to_close_timeout=RENEW_TIMEOUT,
                summary=f"renew the vault keys: {request.reason}",
            )
        finally:
            self._renewing -= 1
        if cancelled or (
            self._control.control == "cancelled" and workflow.patched(WAKE_AFTER_RENEWAL)
        ):
            # Its children still in flight sent their charge before the cancel: retried
            # with the new key, they end, and so does the run.
            self._state.refused_after_cancel = None
            await self._wake_children()
        return renewal

    @renew_keys.validator
    def _validate_renew_keys(self, request: OperatorRequest) -> None:
        self._refuse_while_handing_over()
        if self._finished:
            raise ApplicationError("cannot renew the keys of a run that has finished")
        if self._control.control == "running":
            raise ApplicationError(
                "renew the keys of a paused run only (it pauses itself when its key is refused"
                " or its cap is reached), or of a cancelled one still finishing the charges it"
                " had sent: pause it first"
            )
        if self._control.control == "cancelled" and not self._in_flight:
            raise ApplicationError("the cancelled run has no charge left to finish")

    @workflow.update
    async def skip(self, request: SkipRequest) -> SkipResult:
        logs.log_signal(
            "skip",
            period=self._state.period,
            customer_id=request.customer_id,
            operator=request.operator,
            reason=request.reason,
        )
        return await workflow.execute_activity_method(
            PeriodActivities.skip_customer,
            SkipCustomerRequest(period=self._state.period, request=request),
            start_to_close_timeout=ACTIVITY_TIMEOUT,
            summary=f"skip {request.customer_id}: {request.reason}",
        )

    @skip.validator
    def _validate_skip(self, request: SkipRequest) -> None:
        self._refuse_if_over(
            "skip a customer of", "skip it again: the skip is kept for the next run"
        )
        validate_customer_id(request.customer_id)

    def _refuse_if_over(self, action: str, then: str | None = None) -> None:
        """Refuse `action` on a run cancelled or finished. `then` is what to do once it has
        ended: for a cancelled run by default, start a new run; a finished one has nothing
        left to pause or resume, so it is said only when given. A closing run that may yet
        list customers its listing did not reach (LISTS_THE_UNLISTED) takes the word, which
        applies if it does (_set_control); a closed one that still answers words given as it
        closed takes none."""
        self._refuse_while_handing_over()
        if self._closed and self._lists_the_unlisted:
            over = "a run that has ended"
        elif self._control.control == "cancelled":
            # Still finishing the charges it sent: a new run is refused until it ends.
            over = f"a run cancelled by {self._control.operator}"
            then = then or "start a new run"
        elif self._finished and not self._lists_the_unlisted:
            over = "a run that is closing"
        else:
            return
        advice = (
            f": once it has ended (`python starter.py status {self._state.period}`), {then}"
            if then
            else ""
        )
        raise ApplicationError(f"cannot {action} {over}{advice}")

    def _answer(self, action: str, progress: PeriodProgress | None) -> PeriodProgress:
        """An update's answer; a word given as the run closed that did not apply says why."""
        if progress is not None:
            return progress
        if self._closed:
            raise ApplicationError(
                f"the run of {self._state.period} completed as the {action} arrived: every due"
                f" customer has its outcome, so the {action} changed nothing"
            )
        raise ApplicationError(
            f"the run of {self._state.period} was cancelled by {self._control.operator} as the"
            f" {action} arrived, so the {action} changed nothing"
        )

    async def _set_control(
        self, control: Control, request: OperatorRequest
    ) -> PeriodProgress | None:
        """Apply the word; None if it was given as the run closed, and then the run closed
        or was cancelled."""
        if self._closed and self._lists_the_unlisted:
            return None
        if self._verdict_pending:
            # Given as the run closes: it applies if the close finds customers the listing
            # did not reach, and the run goes back to bill them; else the run has ended.
            await self._wait(lambda: not self._verdict_pending)
            if self._closed or self._control.control == "cancelled":
                return None
        logs.log_signal(
            control, period=self._state.period, operator=request.operator, reason=request.reason
        )
        was_paused = self._control.control == "paused"
        self._state.control = ControlState(
            control=control, reason=request.reason, operator=request.operator
        )
        self._publish_status()
        await self._write_control()
        # Only a paused period has children waiting for its word; a signal to a child that
        # is not waiting would only fail its workflow task and run it again.
        if was_paused and control != "paused":
            await self._wake_children()
        return self.progress()

    async def _write_control(self) -> None:
        """Tell the ledger, which charges already scheduled read. One write at a time, each
        the latest word, so a pause written late cannot overwrite a cancel."""
        async with self._control_writes:
            latest = self._state.control
            await workflow.execute_activity_method(
                PeriodActivities.set_control,
                ControlRequest(
                    period=self._state.period,
                    control=latest.control,
                    request=OperatorRequest(
                        reason=latest.reason or "no reason given",
                        operator=latest.operator or AUTOMATIC,
                    ),
                ),
                start_to_close_timeout=ACTIVITY_TIMEOUT,
                summary=f"{latest.control} by {latest.operator}: {latest.reason}",
            )

    async def _wake_children(self) -> None:
        """Children wait for the period's word while it is paused, rather than poll the
        ledger: after a resume or cancel is in the ledger, each child in flight is told."""
        period = parse_period(self._state.period)
        await asyncio.gather(
            *(self._wake(customer_workflow_id(period, c)) for c in sorted(self._in_flight))
        )

    @staticmethod
    async def _wake(workflow_id: str) -> None:
        try:
            await workflow.get_external_workflow_handle(workflow_id).signal(PERIOD_CONTROL)
        except FailureError:
            pass  # finished meanwhile: nothing to wake

    @property
    def _control(self) -> ControlState:
        return self._state.control

    # -- progress ----------------------------------------------------------------------

    @workflow.signal(name=PERIOD_BLOCKED)
    async def period_blocked(self, failure: ChargeFailure) -> None:
        """The period's key was refused (cap reached, revoked): stop charging and say why."""
        if self._finished and workflow.patched(NO_PAUSE_ONCE_FINISHED):
            # Every outcome is in: a pause now would only be left in the ledger after the run.
            return
        if self._state.plan is None and workflow.patched(BLOCKED_AFTER_OPENING):
            return
        if self._control.control == "running":
            # Cut to what a reason holds: a longer message (a vault's or Stripe's, or anyone's
            # who can signal the run) would fail this workflow task on every attempt.
            reason = shown_line(f"{failure.code}: {failure.message}")
            if len(reason) > REASON_MAX_LENGTH:
                reason = reason[: REASON_MAX_LENGTH - _CUT_MARGIN] + " (cut)"
            await self._set_control("paused", OperatorRequest(reason=reason, operator=AUTOMATIC))
        elif self._control.control == "cancelled":
            # A charge sent before the cancel cannot be retried: the run waits for it.
            self._state.refused_after_cancel = failure.code
            self._describe()

    @workflow.query
    def progress(self) -> PeriodProgress:
        counts = self._state.counts
        control = self._control
        return PeriodProgress(
            period=self._state.period,
            workflow_id=workflow.info().workflow_id,
            state=self._state_word(),
            in_flight=len(self._in_flight),
            expected_due=self._state.plan.due if self._state.plan else None,
            held=self._state.plan.held if self._state.plan else 0,
            reason=control.reason,
            operator=control.operator,
            refused_after_cancel=self._state.refused_after_cancel,
            awaited_in_ledger=sorted(self._elsewhere)[:AWAITED_SHOWN],
            **counts.model_dump(),
        )

    def _state_word(self) -> str:
        control = self._control.control
        if control == "cancelled":
            return "cancelled" if self._closed else "cancelling"
        if self._closed:
            return "completed"
        if self._finished and control != "paused":
            # Every outcome is in; the ledger is yet to have the run closed. A pause taken
            # as the close waits for updates sends the run back to wait (_bill).
            return "closing"
        return control

    def _publish_status(self) -> None:
        """Search attributes and details the Web UI shows for this run."""
        workflow.upsert_search_attributes(
            [
                search_attributes.BILLING_PERIOD.value_set(self._state.period),
                search_attributes.BILLING_STATUS.value_set(self._state_word()),
            ]
        )
        self._describe()

    def _describe(self) -> None:
        counts = self._state.counts
        control = self._control
        expected = self._state.plan.due if self._state.plan else "?"
        words = {
            "running": "Running",
            "paused": f"PAUSED by {control.operator}: {control.reason}",
            "cancelling": f"CANCELLED by {control.operator}: {control.reason}; finishing"
            " charges already sent"
            + (
                f", one held up by its refused vault key ({self._state.refused_after_cancel}):"
                " renew-keys lets it finish"
                if self._state.refused_after_cancel
                else ""
            ),
            "cancelled": f"CANCELLED by {control.operator}: {control.reason}",
            "closing": "Closing: every outcome is in, the summary is being written",
            "completed": "Finished",
        }
        workflow.set_current_details(
            f"{words[self._state_word()]}. {counts.due} of {expected} due customers reached,"
            f" {len(self._in_flight)} in flight; {counts.charged} charged,"
            f" {counts.already_billed} already billed, {counts.failed} failed,"
            f" {counts.skipped} skipped, {counts.cancelled} cancelled;"
            f" charged {money.describe_amounts(counts.charged_by_currency)}"
        )

    # -- fan-out -----------------------------------------------------------------------

    def _settle(self, outcome: CustomerOutcome) -> None:
        # A customer is counted once, however many times the ledger is asked about it.
        if outcome.customer_id in self._in_flight:
            self._in_flight.discard(outcome.customer_id)
            self._elsewhere.discard(outcome.customer_id)
            self._state.counts.add(outcome)

    def _exhausted(self) -> bool:
        return self._state.listing_done and not self._buffer

    async def _next_batch(self, room: int) -> list[DueCustomer]:
        """Up to `room` customers to start; customers finished in the ledger are counted.
        Nothing if the run's control changed while a page was listed: the customers taken are
        put back, uncounted, for the pause's hand-over or the cancel's paging to list again."""
        state = self._state
        cursor = state.cursor
        taken: list[DueCustomer] = []
        # Those of `taken` already left to mark (_unmarked).
        sent = 0
        finished: list[CustomerOutcome] = []
        batch: list[DueCustomer] = []
        while len(batch) < room:
            if not self._buffer:
                if state.listing_done or self._listing_full():
                    break
                # This call's customers too, though a control's change may put them back:
                # the listing then takes them again, and over many pages of customers
                # finished already (a rerun), the unmarked would grow past a page.
                sent = self._unmarked(taken, sent)
                marking = list(state.unmarked)
                # Local: one short query, which the window waits for; through the task
                # queue it took a second under load while the window drained.
                page = await workflow.execute_local_activity_method(
                    PeriodActivities.due_customers,
                    DuePageRequest(
                        period=state.period,
                        after=state.cursor,
                        limit=self._options.page_size,
                        unlisted=state.unlisted,
                        restarts_completed=self._restarts_completed,
                        listing=self._listing(),
                        taken=marking,
                    ),
                    start_to_close_timeout=ACTIVITY_TIMEOUT,
                    summary=(
                        "list due customers the listing did not reach"
                        if state.unlisted
                        else "list due customers"
                    ),
                )
                self._marked(marking)
                self._buffer = page.customers
                state.listing_done = page.next_cursor is None
                self._listed_pages += 1
                self._listed_customers += len(page.customers)
                if not self._buffer:
                    # A page of the unlisted may be empty before the end (each customer on it
                    # had a child): the next one starts after it.
                    state.cursor = page.next_cursor or state.cursor
                    break
            customer = self._buffer.pop(0)
            taken.append(customer)
            state.cursor = customer.customer_id
            if customer.status is not None and customer.status != "claimed":
                finished.append(
                    CustomerOutcome(
                        customer_id=customer.customer_id,
                        outcome=finished_outcome(customer.status),
                    )
                )
            else:
                batch.append(customer)
        if self._control.control != "running" and workflow.patched(BATCH_PUT_BACK_AT_CONTROL):
            # Listed in order from the cursor, pages fetched meanwhile included.
            self._buffer = taken + self._buffer
            state.cursor = cursor
            return []
        state.counts.due += len(taken)
        self._unmarked(taken, sent)
        for outcome in finished:
            state.counts.add(outcome)
        return batch

    async def _fill_window(self) -> None:
        room = min(
            self._options.max_in_flight - len(self._in_flight),
            self._options.max_starting - self._starting,
        )
        if room <= 0:
            return
        batch = await self._next_batch(room)
        if not batch:
            return
        self._in_flight.update(c.customer_id for c in batch)
        # Each child is started and awaited by a task of its own: the loop does not wait
        # for a batch's starts, which the server acknowledges one by one, so the window is
        # refilled as soon as there is room.
        for customer in batch:
            task = asyncio.create_task(self._run_child(customer))
            self._children.add(task)
            task.add_done_callback(self._children.discard)
        self._describe()

    async def _start_child(
        self, customer: DueCustomer
    ) -> workflow.ChildWorkflowHandle[CustomerChargeWorkflow, CustomerOutcome] | None:
        """Start the customer's child; None when a child with its ID runs, or has run."""
        period = self._state.period
        customer_id = customer.customer_id
        # A closed child leaves its claim to reconciliation, which may charge it again under
        # the same ID: not started again. One that closed before claiming charged nothing.
        reuse = WorkflowIDReusePolicy.REJECT_DUPLICATE
        if customer.status is None and workflow.patched(RESTART_UNCLAIMED):
            reuse = (
                WorkflowIDReusePolicy.ALLOW_DUPLICATE
                if self._restarts_completed
                else WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY
            )
        start = customer_start(
            period,
            customer_id,
            workflow.info().workflow_id,
            self._options.child_history_event_limit,
        )
        try:
            return await workflow.start_child_workflow(
                CustomerChargeWorkflow.run,
                start.input,
                id=start.workflow_id,
                id_reuse_policy=reuse,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                static_summary=start.summary,
                search_attributes=start.search_attributes,
            )
        except WorkflowAlreadyStartedError:
            return None

    async def _run_child(self, customer: DueCustomer) -> None:
        customer_id = customer.customer_id
        self._starting += 1
        try:
            handle = await self._start_child(customer)
        finally:
            self._starting -= 1
        if handle is None:
            self._await_elsewhere([customer_id])
            return
        try:
            self._settle(await handle)
        except ChildWorkflowError:
            # Terminated or failed by hand: whatever it finished is in the ledger, and
            # reconciliation settles a claim it left open.
            workflow.logger.warning("child of %s ended without an outcome", customer_id)
            self._await_elsewhere([customer_id])

    def _await_elsewhere(self, customer_ids: Iterable[str]) -> None:
        """Learn the outcomes of these customers, whose child this run cannot await, from
        the ledger."""
        self._elsewhere.update(customer_ids)
        if self._elsewhere and (self._ledger_watch is None or self._ledger_watch.done()):
            self._ledger_watch = asyncio.create_task(self._watch_ledger())

    async def _watch_ledger(self) -> None:
        while self._elsewhere:
            # A paused period's children wait too: nothing to learn, no history to add.
            await self._wait(lambda: self._control.control != "paused")
            waiting = sorted(self._elsewhere)
            try:
                outcomes = await workflow.execute_activity_method(
                    PeriodActivities.await_outcomes,
                    OutcomesRequest(
                        period=self._state.period,
                        customer_ids=waiting,
                        # A window's refill: the run needs no more to start more children.
                        enough=min(len(waiting), self._refill()),
                        wait_seconds=LEDGER_WAIT.total_seconds(),
                        child_history_event_limit=self._options.child_history_event_limit,
                    ),
                    start_to_close_timeout=ACTIVITY_TIMEOUT,
                    summary=f"wait for outcomes of {len(waiting)} children started elsewhere",
                )
            except ActivityError as err:
                # Retried without limit, so only a bug ends here; nobody else would ask
                # again, and the run would wait for these customers forever.
                workflow.logger.error("waiting for outcomes failed, trying again: %s", err)
                await workflow.sleep(LEDGER_WAIT)
                continue
            for outcome in outcomes:
                self._settle(outcome)

    def _refill(self) -> int:
        # Refill when a tenth of the window is free: batches stay large, starts stay cheap
        # (up to `max_starting` of them at once).
        return max(1, self._options.max_in_flight // 10)

    async def _wait_for_room(self) -> None:
        """Until a refill fits and a start may be sent, the control changes, or the history
        is long enough to continue as new."""
        low_water = self._options.max_in_flight - self._refill()
        target = 0 if self._exhausted() else low_water
        await self._wait(
            lambda: (
                (len(self._in_flight) <= target and self._starting < self._options.max_starting)
                or self._control.control != "running"
                or self._long_wait_ends()
            )
        )

    def _long_wait_ends(self) -> bool:
        return self._long_waits_continue and self._should_continue_as_new()

    async def _cancel_the_rest(self) -> None:
        """Mark every customer not yet started cancelled, then let in-flight children end:
        those past the ledger's gate finish their charge, the rest record a cancel."""
        state = self._state
        if workflow.patched(CANCEL_AFTER_CONTROL_WRITTEN):
            async with self._control_writes:
                pass  # the cancel's own write, scheduled in the same task, has landed
        # Listed but not started: the cancel pages list them again from the cursor. Those of
        # a listing of the unlisted are left as they are, with no row: not reached by the run.
        state.listing_done = (state.listing_done and not self._buffer) or state.unlisted
        self._buffer = []
        while not state.listing_done:
            if self._listing_bounded and self._should_continue_as_new():
                break  # the next run pages on from the cursor, still cancelled
            page = await workflow.execute_activity_method(
                PeriodActivities.cancel_unstarted,
                CancelRequest(
                    period=state.period,
                    after=state.cursor,
                    limit=self._options.page_size,
                    request=OperatorRequest(
                        reason=self._control.reason or "cancelled",
                        operator=self._control.operator or "unknown",
                    ),
                ),
                start_to_close_timeout=ACTIVITY_TIMEOUT,
                summary="mark customers not started cancelled",
            )
            state.counts.merge(page.counts)
            # Patched: a worker of before may have run this page's task, and not waited.
            if page.sent and workflow.patched(CANCEL_AWAITS_SENT):
                # Counted due already: their outcome is added when the ledger has it.
                self._in_flight.update(page.sent)
                self._await_elsewhere(page.sent)
            state.cursor = page.next_cursor or state.cursor
            state.listing_done = page.next_cursor is None
        self._describe()
        await self._wait(lambda: not self._in_flight or self._long_wait_ends())

    async def _continue_as_new(self, period: str) -> None:
        """Hand the customers in flight to a new run; returns only when, once the children
        were let finish, none is left to hand over (the loop then finishes the period)."""
        await self._let_children_finish()
        if self._exhausted() and not self._in_flight:
            return
        self._hand_over(period)

    def _hand_over(self, period: str) -> NoReturn:
        """Continue as new, handing the customers in flight to the next run."""
        state = self._state
        # Listed but not started: the next run lists them again from the cursor.
        state.listing_done = self._exhausted()
        state.started_elsewhere = sorted(self._in_flight)
        state.runs += 1
        workflow.continue_as_new(
            BillingPeriodInput(period=period, options=self._options, state=state)
        )

    async def _let_children_finish(self) -> None:
        """Before continuing as new: a child reporting meanwhile makes the server refuse the
        continue-as-new, and the worker replay the whole run. Those still running after
        `hand_over_after_seconds` (none can finish while the period is paused) go to the
        next run, through the ledger; each must have started, or nothing would report it."""
        wait = self._options.hand_over_after_seconds
        if wait > 0 and self._control.control != "paused":
            with contextlib.suppress(TimeoutError):
                await self._wait(
                    lambda: not self._children and workflow.all_handlers_finished(),
                    timeout=timedelta(seconds=wait),
                    timeout_summary="let the children in flight finish before continuing",
                )
        await self._wait(lambda: self._starting == 0 and workflow.all_handlers_finished())

    async def _wait(
        self,
        condition: Callable[[], bool],
        *,
        timeout: timedelta | None = None,
        timeout_summary: str | None = None,
    ) -> None:
        """`workflow.wait_condition`, which Temporal's cancel does not end while the run
        handles that cancel itself (TEMPORAL_CANCEL_IS_A_CANCEL): under the SDK's coming
        activation rule (its logic flag 2) a wait that ends in the turn a cancel arrives
        raises CancelledError in whichever task waits, the billing task's and the ledger
        watch's included. Nothing else cancels those tasks, so such an error means the wait
        is over: the condition holds, or else the timeout has passed."""
        while True:
            try:
                await workflow.wait_condition(
                    condition, timeout=timeout, timeout_summary=timeout_summary
                )
                return
            except asyncio.CancelledError:
                if not self._temporal_cancel_is_a_cancel:
                    raise
                if condition():
                    return
                if timeout is not None:
                    raise TimeoutError from None

    def _should_continue_as_new(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self._options.history_event_limit
            or self._listing_full()
        )

    def _listing_full(self) -> bool:
        return self._listing_bounded and (
            self._listed_customers >= LISTED_PER_RUN
            or self._listed_pages * 2 >= self._options.history_event_limit
        )

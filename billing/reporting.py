"""How a period's counts read to a person, and where to look in the Web UI."""

from __future__ import annotations

from datetime import UTC, datetime

from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ActivityError, ChildWorkflowError, FailureError

from billing.config import TemporalSettings
from billing.customer_history import BilledPeriod, CustomerHistory, PeriodWithoutRow
from billing.failures import PeriodFailures
from billing.keys import CUSTOMER_WORKFLOW_ID
from billing.models import (
    AUTOMATIC,
    RENEWABLE_PAUSES,
    SPEND_CAP_EXCEEDED_CODE,
    VAULT_KEY_REVOKED_CODE,
    PeriodCounts,
    PeriodProgress,
    PeriodStatus,
    PeriodSummary,
    PeriodTotals,
    Preview,
    ShortKey,
)
from billing.money import describe_amount, describe_amounts
from billing.period_keys import KeyRenewal
from billing.periods import parse_period, run_command
from billing.reconciliation import HandledMarks, HandledResult, ReconcileReport
from billing.redact import shown_line
from billing.wording import counted, listed
from vault.models import DAILY_CAP


def describe(summary: PeriodCounts) -> str:
    due = f"due {summary.due}"
    if isinstance(summary, PeriodProgress) and summary.expected_due not in (None, summary.due):
        # A run lists its customers a page at a time: `due` is what it has listed so far.
        due += f" listed so far, of {summary.expected_due} expected"
    lines = [
        f"period {summary.period} ({summary.workflow_id})",
        f"  {due}: charged {summary.charged}, already billed"
        f" {summary.already_billed}, failed {summary.failed}, skipped {summary.skipped},"
        f" cancelled {summary.cancelled}",
        f"  charged {describe_amounts(summary.charged_by_currency)}",
    ]
    if summary.failed:
        lines.append(
            f"  failed customers by Stripe's code: python starter.py failures {summary.period}"
        )
    if summary.held:
        lines.append(
            f"  held {summary.held}: not due, their Stripe customer billed (or being billed)"
            f" this period under another id (renamed?); python starter.py preview"
            f" {summary.period} lists them"
        )
    if isinstance(summary, PeriodProgress):
        flight = (
            f"{summary.in_flight} started, held at the gate until the resume but for charges"
            " sent before the pause, which finish"
            if summary.state == "paused"
            else f"in flight {summary.in_flight}"
        )
        lines.insert(1, f"  state {summary.state}, {flight}")
        if summary.state == "not_started":
            # Not an empty run that succeeded: a mistyped month reads so too.
            period = parse_period(summary.period)
            lines.insert(
                2,
                f"  no run of {period} has started: `{run_command(period, datetime.now(UTC))}`"
                f" starts one (`python starter.py preview {period}` shows what it would charge)",
            )
        if summary.state in ("paused", "cancelling", "cancelled"):
            lines.insert(2, f"  {summary.state} by {summary.operator}: {summary.reason}")
        step = next_step(summary)
        if step is not None:
            lines.insert(3, f"  {step}")
        if summary.awaited_in_ledger and summary.state in ("running", "cancelling"):
            lines.append(
                f"  awaited in the ledger: {listed(summary.awaited_in_ledger)} (started by an"
                " earlier run, or ended without an outcome: `customers show ID` says where"
                f" each stands, and `reconcile {summary.period}` settles a claim nothing runs)"
            )
    elif isinstance(summary, PeriodSummary) and summary.cancelled_by is not None:
        lines.insert(1, f"  cancelled by {summary.cancelled_by}: {summary.cancel_reason}")
    if isinstance(summary, PeriodStatus) and summary.ledger is not None:
        run_open = summary.state in ("running", "paused", "closing", "cancelling")
        lines.append(f"  {describe_totals(summary.period, summary.ledger, run_open=run_open)}")
    return "\n".join(lines)


def describe_totals(period: str, totals: PeriodTotals, *, run_open: bool) -> str:
    """The ledger's totals of a period, every run's together, on one line; claims open
    with no run open are for reconciliation, which leaves those a workflow still owns or a
    pause holds, and says so."""
    settle = (
        f" (no run is open: python starter.py reconcile {period} settles those whose workflow"
        " has ended, and names any it must leave)"
        if totals.claimed and not run_open
        else ""
    )
    return (
        f"the period in the ledger, every run: charged {totals.charged}"
        f" ({describe_amounts(totals.charged_by_currency)}), failed {totals.failed}, skipped"
        f" {totals.skipped}, cancelled {totals.cancelled}, claims open {totals.claimed}{settle}"
    )


def next_step(progress: PeriodProgress) -> str | None:
    """What an operator does to go on with a paused run, or with a cancelled one held up by
    a refused key; None when the run needs nobody."""
    period = progress.period
    if progress.state == "cancelling" and progress.refused_after_cancel:
        code = progress.refused_after_cancel
        held = f"a charge sent before the cancel waits for the vault to take its key ({code})"
        renewal = _renewal(period, code)
        if renewal is None:
            return f"{held}: the run ends once that is mended"
        return f"{held}: to let it finish, {renewal}"
    if progress.state != "paused":
        return None
    resume = f"python starter.py resume {period} --reason ..."
    if progress.operator != AUTOMATIC:
        return f"to go on: {resume}"
    if _waits_for_a_day(progress.reason):
        return (
            f"to go on (or cancel the run): the key's {DAILY_CAP} frees a day's room at 00:00"
            f" UTC, then {resume}; the run pauses again each day its room is spent, and a"
            " charge larger than the daily cap never passes it (issue the key again)"
        )
    renewal = _renewal(period, progress.reason)
    if renewal is None:
        return f"to go on: mend what the reason says, then {resume}"
    return f"to bill the rest (or cancel the run): {renewal}, then {resume}"


def resumed_unrenewed(period: str, reason: str) -> str | None:
    """What to say of a resume of a run paused itself for `reason` whose keys nothing renewed
    since: None when new keys would not mend it, or a day's room will (the daily cap)."""
    renewal = _renewal(period, reason)
    if renewal is None or _waits_for_a_day(reason):
        return None
    return (
        f"the run had paused itself ({reason}) and no key of the period was issued since: its"
        f" charges are likely refused again, which pauses it again. To bill the rest:"
        f" {renewal}, then resume"
    )


def _waits_for_a_day(reason: str | None) -> bool:
    """Whether a run's vault refusal is its key's daily cap: room comes back at midnight UTC,
    not with new keys."""
    return _code(reason) == SPEND_CAP_EXCEEDED_CODE and DAILY_CAP in (reason or "")


def _code(reason: str | None) -> str:
    """The code a run's refusal reason starts with ("code: message")."""
    return (reason or "").split(":", 1)[0]


def _renewal(period: str, reason: str | None) -> str | None:
    """How new keys mend a run's vault refusal, by the code its reason starts with; None
    when they do not."""
    code = _code(reason)
    renew = f"python starter.py renew-keys {period} --reason ..."
    if code in RENEWABLE_PAUSES:
        return f"{renew} (it says if no key needs it)"
    if code == VAULT_KEY_REVOKED_CODE:
        # The kill switch stays pulled until the key's row is deleted (renew-keys says so).
        return (
            "once what the key was revoked for is dealt with, delete its row in"
            f" period_vault_keys, then {renew}"
        )
    return None


def _short_key(key: ShortKey) -> str:
    left, cap, charged, owed = (
        describe_amount(key.currency, c)
        for c in (
            key.cap_cents - key.charged_cents,
            key.cap_cents,
            key.charged_cents,
            key.unsent_cents,
        )
    )
    return (
        f"  warning: the period's {key.currency} key {key.vault_key_id}, not issued by this"
        f" ledger's workers, has at most {left} left of its cap of {cap} ({charged} charged"
        f" through it), less than the {owed} a run has yet to charge: a new run would be"
        " refused by it, and an open one pause at its cap, charging no more, unless it"
        " expires within a day (a run replaces such a key). Revoke it with the token that"
        " issued it and delete its row in period_vault_keys first (the refusal says how)"
    )


def ui_link(temporal: TemporalSettings, workflow_id: str) -> str:
    return f"{temporal.ui_url}/namespaces/{temporal.namespace}/workflows/{workflow_id}"


def describe_preview(preview: Preview, shown: int = 20) -> str:
    lines = [
        f"preview of {preview.period}: nothing is charged",
        f"  would charge {counted(len(preview.to_charge), 'customer')}"
        f" {describe_amounts(preview.totals_by_currency)};"
        f" new keys would be capped at {describe_amounts(preview.caps_by_currency)}, at"
        f" BILLING_CAP_MULTIPLIER={preview.cap_multiplier:g} as set here (the workers' own"
        " decides)"
        if preview.to_charge
        else "  would charge nobody",
    ]
    if preview.issued_caps_by_currency:
        lines.append(
            f"  the period's keys issued so far are capped at"
            f" {describe_amounts(preview.issued_caps_by_currency)}: a run keeps a key while it"
            " has room for what the run charges, and replaces one the workers issued that has"
            " not (one issued with the admin token refuses the run)"
        )
    lines += [_short_key(k) for k in preview.short_keys]
    lines += [
        f"    {x.customer_id}: {describe_amount(x.currency, x.amount_cents)}"
        for x in preview.to_charge[:shown]
    ]
    if len(preview.to_charge) > shown:
        lines.append(f"    ... and {len(preview.to_charge) - shown} more (--json lists all)")
    for warning in preview.warnings:
        label = "held" if warning.kind == "held" else "warning"
        lines.append(f"  {label}: {warning.message}: {listed(warning.entries, shown)}")
    lines.append(f"  already billed: {len(preview.already_billed)}")
    lines.append(
        f"  not billable this period (failed, skipped, cancelled or held):"
        f" {len(preview.not_billable)}"
    )
    return "\n".join(lines)


def describe_renewal(renewal: KeyRenewal) -> str:
    """New keys as an operator reads them, and what to do next."""
    if not renewal.keys:
        return (
            f"every vault key of {renewal.period} has room for what its run has yet to charge,"
            " and time left: none was renewed. Resume the run if its keys were renewed before"
            " (a cancelled run finishes once its charges take them), or see why it waits:"
            f" python starter.py status {renewal.period}"
        )
    lines = [f"new vault keys for {renewal.period}:"]
    for key in renewal.keys:
        cap = describe_amount(key.currency, key.cap_cents)
        replaced = (
            f", in place of {key.replaced} (revoked: workers still holding it take the new one;"
            " one issued with the admin token is for that token to revoke)"
            if key.replaced
            else ""
        )
        lines.append(f"  {key.vault_key_id}, capped at {cap}{replaced}")
    lines.append(
        f"resume the run to bill the rest: python starter.py resume {renewal.period} --reason"
        " ... (a cancelled run instead finishes the charges it had sent, and ends)"
    )
    return "\n".join(lines)


def describe_reconciliation(report: ReconcileReport) -> str:
    """The report as an operator reads it."""
    claims = report.claims
    lines = [
        f"reconciliation of {report.period} ({report.workflow_id})",
        f"  open claims: {len(claims)}"
        + "".join(
            f", {action} {n}"
            for action in ("recorded", "redriven", "left")
            if (n := sum(c.action == action for c in claims))
        )
        + (" (more remain: run it again)" if report.more_claims else ""),
    ]
    if report.unclaimed_by_ended_run:
        again = run_command(parse_period(report.period), datetime.now(UTC))
        lines.insert(
            1,
            f"  WARNING: {counted(report.unclaimed_by_ended_run, 'due customer')} of the period"
            " no run claimed, and its last run ended before its close (terminated, failed or"
            " timed out, or gone from Temporal): no run bills them and they have no claim to"
            f" settle here. Run it again to bill them ({again}; it bills customers added since"
            f" too), or, if it was stopped on purpose, `python starter.py cancel"
            f" {report.period} --reason ...` records that and leaves them unbilled",
        )
    lines += [
        f"    {c.customer_id}: {c.action}"
        + (f" {c.outcome}" if c.outcome else "")
        + (f" {c.charge_id}" if c.charge_id else "")
        + (f" ({c.detail})" if c.detail else "")
        for c in claims
    ]
    if report.vault_checked:
        lines.append(
            f"  vault reservations left unknown: {len(report.reservations)} examined"
            " (a backlog is taken in turns; the worker's log counts any rest)"
        )
        lines += [
            f"    {r.vault_key_id} key {r.key_prefix}...: {r.state}"
            + (
                f" {describe_amount(r.currency, r.amount_cents)}"
                if r.amount_cents and r.currency
                else ""
            )
            + (f" ({r.detail})" if r.detail else "")
            for r in report.reservations
        ]
    counts = report.finding_counts
    lines.append(
        f"  Stripe: {counted(report.charges_checked, 'charge')} of"
        f" {counted(report.customers_checked, 'customer')}"
        " checked"
        + (
            f" ({report.pending_charges} of them bank debits still pending: one the bank"
            " returns is reported then, as failed later)"
            if report.pending_charges
            else ""
        )
        + f"; {counted(counts.get('duplicate', 0), 'duplicate')},"
        f" {counted(counts.get('orphan', 0), 'orphan')},"
        f" {counts.get('unrecorded', 0)} unrecorded, {counts.get('failed_later', 0)} failed later"
        + _listed_of(len(report.findings), sum(counts.values()), "reconcile_finding")
        + (f"; {report.handled_count} handled by a person" if report.handled_count else "")
    )
    lines += [
        # The metadata of a charge made outside the orchestrator (an orphan) is anyone's text.
        f"    {f.kind.upper()} {shown_line(f.charge_id)}"
        f" {describe_amount(shown_line(f.currency), f.amount_cents)} for"
        f" {shown_line(f.customer_id)}"
        + (f" (ledger: {f.ledger_status}" if f.ledger_status else " (no ledger row")
        + (f", charge {f.ledger_charge_id})" if f.ledger_charge_id else ")")
        for f in report.findings
    ]
    if report.unchecked_customers:
        lines.append(
            f"  not checked (no vault key of the period for their currency, or Stripe refused"
            f" to list their charges: the worker's log says which):"
            f" {', '.join(report.unchecked_customers)}"
            + _listed_of(len(report.unchecked_customers), report.unchecked_count)
        )
    return "\n".join(lines)


def _listed_of(listed: int, total: int, logged_as: str | None = None) -> str:
    if total <= listed:
        return ""
    logged = f"; the worker's log has each ({logged_as})" if logged_as else ""
    return f" (the first {listed} of {total} listed here{logged})"


def failure_chain(error: BaseException) -> str:
    """A Temporal failure and its causes in a few words each, the root cause last, on one
    line and redacted."""
    parts: list[str] = []
    current: BaseException | None = error
    while current is not None:
        if isinstance(current, WorkflowFailureError):
            part = "the workflow failed"
        elif isinstance(current, ActivityError):
            part = f"its activity {current.activity_type} failed"
        elif isinstance(current, ChildWorkflowError):
            part = f"its child {current.workflow_type} failed"
        elif isinstance(current, FailureError):
            part = current.message
        else:
            part = str(current) or type(current).__name__
        # An error raised from another with the same words (`raise ... from exc`) adds none.
        if not parts or parts[-1] != part:
            parts.append(part)
        current = (
            current.cause if isinstance(current, WorkflowFailureError | FailureError) else None
        )
    # A terminate's reason is an operator's words, with whatever they pasted.
    return shown_line(": ".join(parts))


def describe_handled(result: HandledResult) -> str:
    finding = f"{result.kind.upper()} {result.charge_id}"
    marked = f"by {result.handled_by} ({result.reason}) for {result.period}"
    return {
        "recorded": f"{finding}: recorded as handled; later reconciliations count it rather"
        " than report it",
        "already": f"{finding} was recorded as handled before, {marked}: that record stands",
        "undone": f"{finding}: taken back (it was marked {marked}); it is reported again",
        "none": f"{finding} is not recorded as handled: nothing to take back",
    }[result.change]


def describe_handled_marks(listed: HandledMarks) -> str:
    standing = sum(mark.undone_at is None for mark in listed.marks)
    lines = [
        f"{standing} finding(s) marked handled under {listed.period}"
        + (f", {len(listed.marks) - standing} taken back" if standing < len(listed.marks) else "")
    ]
    for mark in listed.marks:
        line = (
            f"  {mark.kind.upper()} {mark.charge_id}: by {mark.handled_by}"
            f" {_utc(mark.handled_at)} ({mark.reason})"
        )
        if mark.undone_at is not None:
            line += f"; taken back by {mark.undone_by} {_utc(mark.undone_at)} ({mark.undo_reason})"
        lines.append(line)
    return "\n".join(lines)


def describe_customer(history: CustomerHistory) -> str:
    """A customer's account and its periods, newest first, as support reads them."""
    account = history.account
    lines = [
        f"customer {account.customer_id}: {'active' if account.active else 'inactive'},"
        f" {describe_amount(account.currency, account.amount_cents)} a period, Stripe customer"
        f" {account.stripe_customer_id}, payment method {account.payment_method or 'none named'}",
        "  each period's workflow: "
        + CUSTOMER_WORKFLOW_ID.format(period="PERIOD", customer_id=account.customer_id),
    ]
    lines += [f"  {row.period} {_billed(row)}" for row in history.periods]
    if history.without_row is not None:
        lines.append(f"  {_without_row(history.without_row)}")
    elif not history.periods:
        lines.append("  no period has claimed it yet")
    if history.older:
        lines.append(f"  {history.older} older period(s) not shown (--limit shows more)")
    return "\n".join(lines)


def _billed(row: BilledPeriod) -> str:
    """`{status} {amount} {when}` and what came of it."""
    head = f"{row.status} {describe_amount(row.currency, row.amount_cents)}"
    if row.completed_at is None:
        skip = f"; a skip is asked by {row.skip_by} ({row.skip_reason})" if row.skip_reason else ""
        return (
            f"{head} {_utc(row.claimed_at)}, not finished after {row.attempts} attempt(s){skip}:"
            f" its run's workflow ends it; if none runs, `reconcile {row.period}` settles it"
        )
    head += f" {_utc(row.completed_at)}"
    if row.status == "charged":
        intent = f" ({row.payment_intent_id})" if row.payment_intent_id else ""
        return f"{head} as {row.charge_id}{intent}"
    if row.status == "failed":
        decline = f" ({row.decline_code})" if row.decline_code else ""
        message = f": {shown_line(row.failure_message)}" if row.failure_message else ""
        return f"{head} after {row.attempts} attempt(s): {row.failure_code}{decline}{message}"
    return f"{head} by {row.decided_by} ({row.reason})"


def _without_row(period: PeriodWithoutRow) -> str:
    if period.run_state is None:
        return (
            f"{period.period} nothing: no run of it has started (`preview {period.period}` shows"
            " what a run would charge)"
        )
    if period.run_state == "running":
        return (
            f"{period.period} nothing yet: its run is open and has not claimed this customer"
            f" (`preview {period.period}` shows whether it is due)"
        )
    return (
        f"{period.period} nothing: its run completed without this customer, who was not active"
        " when the run listed its customers (or joined later), or was held as billed under"
        " another customer id with the same Stripe customer"
    )


def describe_failures(failures: PeriodFailures) -> str:
    """A period's failed customers by Stripe's code, and where the rest are found."""
    period = failures.period
    if failures.groups:
        lines = [
            f"{failures.failed} failed in the ledger for {period}, by Stripe's code"
            " (`customers show ID` tells one customer's story):"
        ]
    else:
        lines = [f"no customer failed in the ledger for {period}"]
    for group in failures.groups:
        decline = f" ({group.decline_code})" if group.decline_code else ""
        message = f' "{shown_line(group.message)}"' if group.message else ""
        if group.message and group.messages > 1:
            message = f" ({group.messages} messages; {group.customer_ids[0]}'s:{message})"
        named = listed(group.customer_ids, len(group.customer_ids))
        more = group.count - len(group.customer_ids)
        lines.append(
            f"  {group.failure_code}{decline} {group.count}{message}: {named}"
            + (f" and {more} more" if more else "")
        )
    lines.append(
        "a run also counts failed, with no row here, a customer gone before its claim"
        " (unknown_customer) and one whose workflow ended before it (ended_without_claim):"
        f' the Web UI lists every one with BillingPeriod="{period}" AND BillingStatus="failed"'
    )
    return "\n".join(lines)


def _utc(moment: datetime) -> str:
    return f"{moment.astimezone(UTC):%Y-%m-%d %H:%M} UTC"

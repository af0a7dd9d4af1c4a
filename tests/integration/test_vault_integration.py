"""Charging through the vault: per-period keys, the hard cap pausing a period, the kill
switch, and no secret in workflow history."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import aiohttp
import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ActivityError, ApplicationError

import billing.ledger.runs as ledger_runs
import worker
from activities.period import PeriodActivities, PrepareRequest, _needs_operator
from billing import ledger, operations, period_keys
from billing.customers import CustomerRow, upsert_customers
from billing.keys import customer_workflow_id, period_workflow_id
from billing.models import (
    AUTOMATIC,
    CustomerChargeInput,
    OperatorRequest,
    PeriodSummary,
    Preview,
    RunOptions,
    ShortKey,
    SkipRequest,
)
from billing.money import describe_amount, describe_amounts, spend_cap
from billing.period_keys import KeyRenewal
from billing.periods import period_for
from billing.preview import preview_period
from billing.reporting import describe
from billing.runs import period_status, start_period
from billing.seeding import create_demo_customers
from cli import commands, runs
from tests.integration.harness import (
    VAULT_ADMIN_TOKEN,
    VAULT_WORKER_BUDGET,
    VAULT_WORKER_TOKEN,
    Harness,
    accepted_update_inputs,
    at_least,
)
from tests.integration.invariants import assert_billed_once
from tests.integration.test_operations import replays
from tests.waiting import eventually
from vault.client import VaultAdmin, VaultUnavailable
from vault.models import IssuedKey, IssueKeyRequest, KeyInfo, new_key_id
from workflows.customer_charge import CustomerChargeWorkflow

# The current month: `run` refuses a period long past, so a fixed one would expire.
PERIOD = period_for(datetime.now(UTC), "advance")
ALICE = OperatorRequest(reason="cap checked", operator="alice")


async def period_key(harness: Harness) -> str:
    async with harness.pool.acquire() as conn:
        key_id: str = await conn.fetchval(
            "SELECT vault_key_id FROM period_vault_keys WHERE billing_period = $1", str(PERIOD)
        )
        return key_id


async def forwarded_count(harness: Harness) -> float:
    """vault_requests_total{decision="forwarded"} scraped from the vault's /metrics."""
    assert harness.vault is not None
    async with (
        aiohttp.ClientSession() as session,
        session.get(harness.vault.url + "/metrics") as response,
    ):
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vault_requests_total" and sample.labels == {"decision": "forwarded"}:
                return sample.value
    return 0.0


def _period_key(cap_cents: int, lives: timedelta = timedelta(days=2)) -> IssueKeyRequest:
    """A usd key for the period as a run's preparation asks for one."""
    return IssueKeyRequest(
        label=period_keys.LABEL,
        period=str(PERIOD),
        cap_cents=cap_cents,
        currency="usd",
        allowed_endpoints=period_keys.ALLOWED_ENDPOINTS,
        expires_at=datetime.now(UTC) + lives,
    )


async def _issue_as_an_opening(
    vaulted: Harness, db: asyncpg.Pool | asyncpg.Connection, admin: VaultAdmin
) -> period_keys.PeriodKey:
    """A usd key for the period issued as a run's opening issues it, listed in the ledger."""
    return await period_keys.issue_key(
        db,
        admin,
        vaulted.settings.secret_box(),
        PERIOD,
        "usd",
        100_000,
        timedelta(days=1),
        known_in=vaulted.pool,
    )


async def _stored_as_the_periods(vaulted: Harness, key: IssuedKey) -> None:
    """`key` stored as the period's usd key, as if a run's preparation had issued it."""
    await vaulted.pool.execute(
        "INSERT INTO period_vault_keys"
        " (billing_period, currency, vault_key_id, sealed_secret, cap_cents)"
        " VALUES ($1, 'usd', $2, $3, $4)",
        str(PERIOD),
        key.id,
        vaulted.settings.secret_box().seal(key.secret),
        key.cap_cents,
    )


async def test_a_period_charges_through_its_capped_key(vaulted: Harness) -> None:
    customers = await vaulted.seed(20)
    forwarded_before = await forwarded_count(vaulted)
    async with vaulted.running_worker():
        handle = await start_period(vaulted.client, PERIOD, vaulted.task_queue)
        summary = await handle.result()
    assert summary.charged == 20
    # The vault's own metrics moved with the run.
    assert await forwarded_count(vaulted) - forwarded_before >= 20
    await assert_billed_once(vaulted, str(PERIOD), customers)
    assert vaulted.vault is not None
    key = await vaulted.vault.admin.get_key(await period_key(vaulted))
    total = sum(c.amount_cents for c in customers)
    assert key.cap_cents == -(-total * 110 // 100)
    assert (key.spent_cents, key.reserved_cents, key.period) == (total, 0, str(PERIOD))
    assert key.issued_by == "worker"
    # Each claim names the key its attempt went through (see ledger.reopen_refused_charge).
    assert {tuple(r["sent_through"]) for r in await vaulted.ledger_rows(str(PERIOD))} == {(key.id,)}
    audit = await vaulted.vault.admin.audit(key.id, limit=500)
    assert sum(e.decision == "forwarded" and e.method == "POST" for e in audit) == 20
    # The worker held only the vault key: Stripe saw the vault's upstream secret on every call.
    upstream = vaulted.settings.stripe_api_key.get_secret_value()
    charges = [r for r in await vaulted.requests() if r["path"] == "/v1/payment_intents"]
    assert charges and all(r["api_key_suffix"] == upstream[-4:] for r in charges)
    # No secret in any workflow history of the run.
    box = vaulted.settings.secret_box()
    secrets = [
        VAULT_ADMIN_TOKEN,
        VAULT_WORKER_TOKEN,
        vaulted.settings.stripe_api_key.get_secret_value(),
        (
            await period_keys.read_key(vaulted.pool, box, str(PERIOD), "usd")
        ).secret.get_secret_value(),
    ]
    # The ledger keeps the period key's secret sealed only.
    async with vaulted.pool.acquire() as conn:
        stored = await conn.fetchrow("SELECT secret, sealed_secret FROM period_vault_keys")
    assert stored["secret"] is None and secrets[-1].encode() not in stored["sealed_secret"]
    async for execution in vaulted.client.list_workflows():
        history = await vaulted.client.get_workflow_handle(
            execution.id, run_id=execution.run_id
        ).fetch_history()
        text = json.dumps(history.to_json_dict())
        assert not any(secret in text for secret in secrets), execution.id
        assert "vk_" not in text


async def test_a_period_in_several_currencies_keeps_each_apart(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    currencies = ("usd", "eur", "jpy")
    customers = [
        row.model_copy(update={"currency": currencies[index % 3]})
        for index, row in enumerate(await create_demo_customers(vaulted.stripe, 9, prefix="cust"))
    ]
    await upsert_customers(vaulted.pool, customers)
    preview = await preview_period(
        vaulted.pool, str(PERIOD), vaulted.settings.billing_cap_multiplier
    )
    async with vaulted.running_worker():
        summary = await (await start_period(vaulted.client, PERIOD, vaulted.task_queue)).result()
    await assert_billed_once(vaulted, str(PERIOD), customers)
    expected = {c: sum(x.amount_cents for x in customers if x.currency == c) for c in currencies}
    assert (summary.charged, summary.charged_by_currency) == (9, expected)
    assert f"jpy {expected['jpy']:,}" in describe(summary)
    assert preview.totals_by_currency == expected
    # One capped key per currency, as the preview said, spent by its own currency only.
    assert vaulted.vault is not None
    async with vaulted.pool.acquire() as conn:
        keys = await conn.fetch(
            "SELECT currency, vault_key_id FROM period_vault_keys WHERE billing_period = $1",
            str(PERIOD),
        )
    spent, caps = {}, {}
    for row in keys:
        key = await vaulted.vault.admin.get_key(row["vault_key_id"])
        spent[key.currency], caps[key.currency] = key.spent_cents, key.cap_cents
    assert (spent, caps) == (expected, preview.caps_by_currency)
    # Once issued, the preview shows the keys' own caps: the workers' setting made them, not
    # the operator's. It asks for none of the workers' secrets.
    assert vaulted.vault is not None
    monkeypatch.setenv("BILLING_VAULT_URL", vaulted.vault.url)
    code, out, err = await vaulted.starter("preview", str(PERIOD))
    assert code == 0, err
    assert f"issued so far are capped at {describe_amounts(caps)}" in out
    assert "would be refused" not in err
    # A month `run` refuses without --ahead is previewed all the same, with a note saying so.
    later = PERIOD.next().next()
    code, out, err = await vaulted.starter("preview", str(later))
    assert code == 0 and f"preview of {later}: nothing is charged" in out, err
    assert f"note: `run {later}` would be refused: {later} is later than next month" in err
    assert "pass --ahead" in err


async def charging_one_at_a_time(vaulted: Harness) -> WorkflowHandle[Any, PeriodSummary]:
    """The period's run, one customer at a time, 200 ms each, once it has charged one; the
    worker must run."""
    await vaulted.set_faults(latency_ms=200)
    handle = await start_period(
        vaulted.client, PERIOD, vaulted.task_queue, RunOptions(max_in_flight=1)
    )
    await eventually(lambda: at_least(vaulted.succeeded(), 1))
    return handle


async def priced_past_the_cap(vaulted: Harness) -> None:
    """Prices raised tenfold mid-run (an import --while-running): the claims made from now on
    charge more than the key's cap, set from the plan, has room for, and the run pauses."""
    async with vaulted.pool.acquire() as conn:
        await conn.execute("UPDATE customers SET amount_cents = amount_cents * 10")
    await eventually(lambda: vaulted.in_state(PERIOD, "paused"), timeout=60)


async def test_cap_reached_pauses_the_period_until_an_operator_acts(vaulted: Harness) -> None:
    customers = await vaulted.seed(10)
    assert vaulted.vault is not None
    async with vaulted.running_worker():
        handle = await charging_one_at_a_time(vaulted)
        await priced_past_the_cap(vaulted)
        progress = await period_status(vaulted.client, PERIOD)
        assert progress.operator == "billing (automatic)"
        assert progress.reason is not None and "spend_cap_exceeded" in progress.reason
        key = await vaulted.vault.admin.get_key(await period_key(vaulted))
        assert key.spent_cents + key.reserved_cents <= key.cap_cents
        async with vaulted.pool.acquire() as conn:
            # The refused attempt sent its fencing token: the vault fenced off any attempt
            # before it, which the claim's reopening relies on.
            fences = await conn.fetch(
                "SELECT f.fenced_below, r.gate_passes FROM vault_fences f"
                " JOIN billing_runs r USING (idempotency_key)"
            )
        assert fences and all(f["fenced_below"] == f["gate_passes"] for f in fences)
        await operations.control(vaulted.client, PERIOD, "cancel", ALICE)
        summary = await handle.result()
    assert 1 <= summary.charged < 10
    assert summary.charged + summary.cancelled == 10
    succeeded = [c for c in await vaulted.charges() if c["status"] == "succeeded"]
    assert len(succeeded) == summary.charged
    assert sum(c["amount"] for c in succeeded) <= key.cap_cents
    assert key.cap_cents < sum(c.amount_cents for c in customers) * 2


async def test_a_run_paused_at_its_cap_bills_the_rest_once_its_keys_are_renewed(
    vaulted: Harness,
) -> None:
    """Cancelling and running again would leave unbilled every customer the cancel stopped at
    the gate (their workflow IDs are taken for the period): renewing the paused run's key
    and resuming it bills them all, each once."""
    customers = await vaulted.seed(10)
    assert vaulted.vault is not None
    async with vaulted.running_worker():
        handle = await charging_one_at_a_time(vaulted)
        with pytest.raises(operations.OperatorRefusedError, match="paused run only"):
            await operations.renew_keys(vaulted.client, PERIOD, ALICE)
        await priced_past_the_cap(vaulted)
        old = await period_key(vaulted)
        code, out, err = await vaulted.starter(
            "renew-keys", str(PERIOD), "--reason", "cap reached", "--operator", "bob", "--json"
        )
        assert code == 0, err
        [key] = KeyRenewal.model_validate_json(out).keys
        assert (key.replaced, key.vault_key_id) == (old, await period_key(vaulted))
        # Who renewed them and why, as the run's history keeps it.
        [asked] = await accepted_update_inputs(handle, "renew_keys", OperatorRequest)
        assert asked == OperatorRequest(reason="cap reached", operator="bob")
        assert (await vaulted.vault.worker.get_key(old)).revoked
        # The new key has room for all that is left: a second renewal issues nothing.
        assert (await operations.renew_keys(vaulted.client, PERIOD, ALICE)).keys == []
        await operations.control(vaulted.client, PERIOD, "resume", ALICE)
        summary = await handle.result()
        await replays(handle)
    assert (summary.charged, summary.cancelled, summary.failed) == (10, 0, 0)
    succeeded = [c for c in await vaulted.charges() if c["status"] == "succeeded"]
    assert sorted(c["customer"] for c in succeeded) == sorted(
        c.stripe_customer_id for c in customers
    )
    # The new key was capped for what was left, at the prices of then, with the headroom.
    # Capped for what was left: the first customer was charged at its old price before.
    left = 10 * sum(c.amount_cents for c in customers[1:])
    new = await vaulted.vault.admin.get_key(key.vault_key_id)
    assert new.cap_cents <= spend_cap(left, vaulted.settings.billing_cap_multiplier)


async def test_run_wait_says_when_the_run_pauses_itself(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run --wait` on a run that pauses itself at its key's cap says so, and what to do,
    rather than wait for an operator without a word."""
    await vaulted.seed(10)
    vaulted.use_cli_env(monkeypatch)
    monkeypatch.setattr(runs, "PAUSE_CHECK_SECONDS", 0.2)
    async with vaulted.running_worker():
        await charging_one_at_a_time(vaulted)
        args = commands.parser().parse_args(["run", str(PERIOD), "--wait"])
        waiting = asyncio.create_task(runs.cmd_run(args))
        await priced_past_the_cap(vaulted)
        warned = f"warning: the run of {PERIOD} is paused by {AUTOMATIC} (spend_cap_exceeded"
        seen = ""

        async def told() -> bool:
            nonlocal seen
            seen += capsys.readouterr().err
            return warned in seen

        await eventually(told)
        assert f"python starter.py renew-keys {PERIOD} --reason ..." in seen
        assert not waiting.done()
        await operations.renew_keys(vaulted.client, PERIOD, ALICE)
        await operations.control(vaulted.client, PERIOD, "resume", ALICE)
        assert await waiting == 0
    out, err = capsys.readouterr()
    assert (seen + err).count(warned) == 1
    assert "charged 10" in out


async def paused_with_a_charge_in_doubt(
    vaulted: Harness,
) -> tuple[CustomerRow, WorkflowHandle[Any, PeriodSummary]]:
    """One customer charged, each answer lost (every retry replays the charge and loses it
    again), until its key expired: the run paused, the charge in doubt. The worker must run."""
    [customer] = await vaulted.seed(1)
    await vaulted.set_faults(drop_after_commit=1.0)
    handle = await start_period(vaulted.client, PERIOD, vaulted.task_queue)
    await eventually(lambda: at_least(vaulted.succeeded(), 1))
    async with vaulted.pool.acquire() as conn:
        await conn.execute("UPDATE vault_keys SET expires_at = now()")
    await eventually(lambda: vaulted.in_state(PERIOD, "paused"), timeout=60)
    await vaulted.set_faults(drop_after_commit=0.0)
    return customer, handle


async def held_up_after_cancel(vaulted: Harness) -> bool:
    return (await period_status(vaulted.client, PERIOD)).refused_after_cancel is not None


async def assert_charged_once_woken_twice(
    vaulted: Harness, customer: CustomerRow, summary: PeriodSummary, key: period_keys.RenewedKey
) -> None:
    """The customer's child was woken by the cancel, then by the renewal rather than left to
    its timers, and charged once with the renewed key in place."""
    child = vaulted.client.get_workflow_handle(customer_workflow_id(PERIOD, customer.customer_id))
    woken = [
        e
        async for e in child.fetch_history_events()
        if e.HasField("workflow_execution_signaled_event_attributes")
    ]
    assert len(woken) == 2
    assert (summary.charged, summary.cancelled, summary.cancelled_by) == (1, 0, "alice")
    assert [c["customer"] for c in await vaulted.charges()] == [customer.stripe_customer_id]
    assert key.vault_key_id == await period_key(vaulted)


async def test_a_cancelled_run_held_up_by_a_refused_key_ends_once_its_keys_are_renewed(
    vaulted: Harness,
) -> None:
    """A charge sent before the cancel, in doubt, whose key then expired: its retry is
    refused, and it cannot be reopened (it reached Stripe), so the cancelled run waits for
    it. Status says so; renewing the keys lets it finish, charged once."""
    async with vaulted.running_worker():
        customer, handle = await paused_with_a_charge_in_doubt(vaulted)
        await operations.control(vaulted.client, PERIOD, "cancel", ALICE)
        await eventually(lambda: held_up_after_cancel(vaulted), timeout=60)
        progress = await period_status(vaulted.client, PERIOD)
        assert (progress.state, progress.in_flight) == ("cancelling", 1)
        assert progress.refused_after_cancel == "vault_key_expired"
        assert f"to let it finish, python starter.py renew-keys {PERIOD}" in describe(progress)
        [key] = (await operations.renew_keys(vaulted.client, PERIOD, ALICE)).keys
        summary = await asyncio.wait_for(handle.result(), timeout=60)
        await replays(handle)
    await assert_charged_once_woken_twice(vaulted, customer, summary, key)


async def renewal_waits(vaulted: Harness) -> bool:
    """Whether a renewal waits for the ledger's opening lock, which the test holds."""
    waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    return bool(await vaulted.pool.fetchval(waiting))


async def test_a_cancel_accepted_while_keys_are_renewed_is_woken_by_the_renewal(
    vaulted: Harness,
) -> None:
    """The cancel wakes the children before the new keys exist: the one in doubt is refused
    again and waits. The renewal, once its keys are stored, wakes it and drops the advice to
    renew, as for a run cancelled before it."""
    async with vaulted.running_worker():
        customer, handle = await paused_with_a_charge_in_doubt(vaulted)
        # The renewal waits for the ledger's opening lock, held here, while the cancel lands.
        async with vaulted.pool.acquire() as conn, conn.transaction():
            await conn.execute(ledger.OPENING_LOCK)
            renewing = asyncio.create_task(operations.renew_keys(vaulted.client, PERIOD, ALICE))
            await eventually(partial(renewal_waits, vaulted), timeout=15)
            await operations.control(vaulted.client, PERIOD, "cancel", ALICE)
            await eventually(lambda: held_up_after_cancel(vaulted), timeout=15)
        [key] = (await renewing).keys
        assert (await period_status(vaulted.client, PERIOD)).refused_after_cancel is None
        summary = await asyncio.wait_for(handle.result(), timeout=60)
        await replays(handle)
    await assert_charged_once_woken_twice(vaulted, customer, summary, key)


async def test_a_resume_while_the_keys_are_renewed_is_refused(vaulted: Harness) -> None:
    """Resumed before its new keys exist, the run's children would take the old key and
    pause it again: the resume waits for the renewal."""
    customers = await vaulted.seed(4)
    async with vaulted.running_worker():
        handle = await charging_one_at_a_time(vaulted)
        await operations.control(vaulted.client, PERIOD, "pause", ALICE)
        async with vaulted.pool.acquire() as conn, conn.transaction():
            await conn.execute(ledger.OPENING_LOCK)
            renewing = asyncio.create_task(operations.renew_keys(vaulted.client, PERIOD, ALICE))
            await eventually(partial(renewal_waits, vaulted), timeout=15)
            with pytest.raises(operations.OperatorRefusedError, match="keys are being renewed"):
                await operations.control(vaulted.client, PERIOD, "resume", ALICE)
        await renewing
        await operations.control(vaulted.client, PERIOD, "resume", ALICE)
        summary = await asyncio.wait_for(handle.result(), timeout=60)
    assert summary.charged == len(customers)


async def test_renewing_keys_leaves_the_kill_switch_pulled(vaulted: Harness) -> None:
    await vaulted.seed(10)
    assert vaulted.vault is not None
    async with vaulted.running_worker():
        handle = await charging_one_at_a_time(vaulted)
        await operations.control(vaulted.client, PERIOD, "pause", ALICE)
        revoked = await period_key(vaulted)
        await vaulted.vault.admin.revoke(revoked)
        with pytest.raises(operations.OperatorRefusedError, match="was revoked") as refused:
            await operations.renew_keys(vaulted.client, PERIOD, ALICE)
        assert "Delete its row in period_vault_keys" in str(refused.value)
        assert [k.id for k in await vaulted.vault.admin.find_keys(period=str(PERIOD))] == [revoked]
        assert await period_key(vaulted) == revoked
        await operations.control(vaulted.client, PERIOD, "cancel", ALICE)
        await handle.result()


async def _billed_then_more_imported(
    vaulted: Harness,
) -> tuple[list[CustomerRow], str, list[CustomerRow]]:
    """Three customers billed through a key of the workers', then three more imported: the
    customers billed, that key's id, the customers added."""
    first = await vaulted.seed(3)
    async with vaulted.running_worker():
        handle = await start_period(vaulted.client, PERIOD, vaulted.task_queue)
        assert (await handle.result()).charged == 3
    return first, await period_key(vaulted), await vaulted.seed(3, prefix="late")


async def test_a_rerun_expecting_more_than_its_key_has_left_replaces_it(
    vaulted: Harness,
) -> None:
    """Customers added after a period's run: its key, capped for the first run, has room for
    few of them, so a rerun keeping it would stop part-billed at the cap. The workers issued
    it, so the rerun's opening issues one for what is left and revokes it, as a renewal does
    (helper-169 F1: the operator had to find, revoke and delete the key by hand)."""
    assert vaulted.vault is not None
    first, old, added = await _billed_then_more_imported(vaulted)
    async with vaulted.running_worker():
        code, out, err = await vaulted.starter("run", str(PERIOD), "--wait")
        assert code == 0, err
        assert "charged 3, already billed 3" in out, out
    new = await vaulted.vault.admin.get_key(await period_key(vaulted))
    assert new.id != old
    assert new.cap_cents == spend_cap(
        sum(c.amount_cents for c in added), vaulted.settings.billing_cap_multiplier
    )
    revoked = await vaulted.vault.admin.get_key(old)
    assert revoked.revoked and revoked.revoked_by == "worker"
    await assert_billed_once(vaulted, str(PERIOD), [*first, *added])


@pytest.mark.parametrize("meanwhile", [False, True], ids=["live", "revoked-by-a-worker"])
async def test_a_reruns_opening_revokes_the_key_it_replaces_at_once_and_keeps_its_own(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch, meanwhile: bool
) -> None:
    """The key an opening replaces is revoked as the opening ends, not at the close: a
    worker that cached it would charge through its room as well as the new key's cap. One a
    worker revoked meanwhile (another opening's or a close's sweep of keys no run stores,
    once this opening stored the new one) is no operator's kill switch: the new key stays
    live, or the run would pause at its first charge for nothing."""
    assert vaulted.vault is not None
    vault = vaulted.vault
    _, old, _ = await _billed_then_more_imported(vaulted)
    if meanwhile:
        held_customers = ledger.held_customers

        async def swept_first(conn: asyncpg.Connection, period: str) -> Any:
            await vault.worker.revoke(old)
            return await held_customers(conn, period)

        monkeypatch.setattr(ledger, "held_customers", swept_first)
    opening = PeriodActivities(vaulted.pool, vaulted.settings, vault.worker)
    await opening.prepare(PrepareRequest(period=str(PERIOD), workflow_id="by-hand"))
    new = await vault.admin.get_key(await period_key(vaulted))
    replaced = await vault.admin.get_key(old)
    assert new.id != old and not new.revoked
    assert replaced.revoked and replaced.revoked_by == "worker"


async def test_a_replaced_key_the_vault_could_not_revoke_fails_the_opening_till_revoked(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A revoke of the replaced key that the vault could not make (down, restarting) fails
    the opening, whose retry revokes the key: taken for done, it would stay live, its room
    open to a worker that cached it, until the close."""
    assert vaulted.vault is not None
    worker = vaulted.vault.worker
    _, old, _ = await _billed_then_more_imported(vaulted)
    revoke = worker.revoke

    async def unavailable(key_id: str) -> Any:
        raise VaultUnavailable(503, None, f"the vault restarts, {key_id} left as it was")

    monkeypatch.setattr(worker, "revoke", unavailable)
    opening = PeriodActivities(vaulted.pool, vaulted.settings, worker)
    request = PrepareRequest(period=str(PERIOD), workflow_id="by-hand")
    with pytest.raises(VaultUnavailable):
        await opening.prepare(request)
    assert not (await vaulted.vault.admin.get_key(old)).revoked
    monkeypatch.setattr(worker, "revoke", revoke)
    await opening.prepare(request)
    replaced = await vaulted.vault.admin.get_key(old)
    assert replaced.revoked and replaced.revoked_by == "worker"
    assert await period_key(vaulted) != old


async def test_a_kill_switch_pulled_while_an_opening_replaces_the_key_stays_pulled(
    vaulted: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator revokes the period's key with the admin token while a rerun's opening,
    which found it live but too small, replaces it: the new key was stored and charged
    through, undoing the kill switch (helper-172 F1). It is revoked too, and the run pauses
    on vault_key_revoked before charging anyone."""
    assert vaulted.vault is not None
    vault = vaulted.vault
    await vaulted.seed(3)
    async with vaulted.running_worker():
        first = await start_period(vaulted.client, PERIOD, vaulted.task_queue)
        assert (await first.result()).charged == 3
        old = await period_key(vaulted)
        await vaulted.seed(3, prefix="late")
        issue = period_keys.issue_key

        async def revoked_meanwhile(*args: Any, **kwargs: Any) -> period_keys.PeriodKey:
            await vault.admin.revoke(old)
            return await issue(*args, **kwargs)

        monkeypatch.setattr(period_keys, "issue_key", revoked_meanwhile)
        handle = await start_period(vaulted.client, PERIOD, vaulted.task_queue)
        await eventually(lambda: vaulted.in_state(PERIOD, "paused"), timeout=30)
        progress = await period_status(vaulted.client, PERIOD)
        assert progress.reason is not None and "vault_key_revoked" in progress.reason
        await operations.control(vaulted.client, PERIOD, "cancel", ALICE)
        assert (await handle.result()).charged == 0
    new = await vault.admin.get_key(await period_key(vaulted))
    assert new.id != old and new.revoked and new.revoked_by == "worker"
    assert await vaulted.succeeded() == 3


async def test_a_replacement_past_the_worker_budget_names_the_key_it_would_replace(
    vaulted: Harness,
) -> None:
    """The opening issues the new key while the one it replaces still counts its whole cap
    against the worker budget (revoked after, so that a refusal leaves it working): a budget
    that fits only once that key is revoked refuses the replacement, and the message names
    the key in the way and the way out (helper-172 F2), which then bills the rest."""
    assert vaulted.vault is not None
    first, old, added = await _billed_then_more_imported(vaulted)
    async with vaulted.running_worker():
        new_cap = spend_cap(
            sum(c.amount_cents for c in added), vaulted.settings.billing_cap_multiplier
        )
        # Fill the budget (tests/integration/conftest.py) so that the new cap fits only once
        # the old key counts what it spent alone.
        left = VAULT_WORKER_BUDGET - sum(c.amount_cents for c in first) - new_cap
        while left > 0:
            filler = _period_key(min(left, 10**9)).model_copy(
                update={"label": "filler", "period": str(PERIOD.previous())}
            )
            await vaulted.vault.worker.issue_key(filler)
            left -= filler.cap_cents
        code, out, err = await vaulted.starter("run", str(PERIOD), "--wait")
        assert code == 3, (out, err)
        assert f"(the key it would replace, {old}, counts its whole cap against the" in err, err
        # As the message says.
        await vaulted.vault.worker.revoke(old)
        await vaulted.pool.execute("DELETE FROM period_vault_keys")
        code, out, err = await vaulted.starter("run", str(PERIOD), "--wait")
        assert code == 0 and "charged 3, already billed 3" in out, (out, err)
    await assert_billed_once(vaulted, str(PERIOD), [*first, *added])


async def test_a_key_too_small_issued_with_the_admin_token_refuses_the_rerun(
    vaulted: Harness,
) -> None:
    """An operator's key (issued with the admin token) stored as the period's, too small for
    a rerun: its cap is theirs to change, so the rerun stops before any charge, saying what
    to do (its revoke is the admin token's: deleting its row would leave it live, helper-171
    F2); done, the next rerun bills the rest."""
    assert vaulted.vault is not None
    first = await vaulted.seed(3)
    # Room for the first run and a dollar more, which the first run keeps.
    charged = sum(c.amount_cents for c in first)
    theirs = await vaulted.vault.admin.issue_key(_period_key(charged + 100, timedelta(days=3)))
    await _stored_as_the_periods(vaulted, theirs)
    async with vaulted.running_worker():
        assert (
            await (await start_period(vaulted.client, PERIOD, vaulted.task_queue)).result()
        ).charged == 3
        assert await period_key(vaulted) == theirs.id
        added = await vaulted.seed(3, prefix="late")
        # The preview says so first, from the ledger alone, though the cap is above what the
        # run has yet to charge (helper-169 F9, helper-174 F1).
        owed = sum(c.amount_cents for c in added)
        assert theirs.cap_cents >= owed
        code, out, err = await vaulted.starter("preview", str(PERIOD), "--json")
        assert code == 0, err
        short = ShortKey(
            currency="usd",
            vault_key_id=theirs.id,
            cap_cents=theirs.cap_cents,
            charged_cents=charged,
            unsent_cents=owed,
        )
        assert Preview.model_validate_json(out).short_keys == [short]
        code, out, err = await vaulted.starter("preview", str(PERIOD))
        assert (
            f"warning: the period's usd key {theirs.id}, not issued by this ledger's workers,"
            f" has at most usd 1.00 left of its cap of {describe_amount('usd', charged + 100)}"
            f" ({describe_amount('usd', charged)} charged through it), less than the"
            f" {describe_amount('usd', owed)} a run has yet to charge: a new run would be"
            " refused by it" in out
        ), out
        # Without --wait too, `run` waits for the opening, and says it was refused.
        code, out, err = await vaulted.starter("run", str(PERIOD))
        assert (code, out) == (3, ""), err
        assert "its activity prepare_period failed: no vault key for" in err
        assert f"its stored key {theirs.id}, which this ledger's workers did not issue" in err
        assert "(issued with the admin token), has usd 1.00 left" in err, err
        assert "nothing was charged. Reconcile the period if charges in doubt" in err
        assert "otherwise revoke it with the admin token (workers holding it would" in err
        assert f"DELETE FROM period_vault_keys WHERE billing_period = '{PERIOD}'" in err
        # `status` says how the rerun ended, and what the period's runs billed.
        code, out, err = await vaulted.starter("status", str(PERIOD))
        assert (code, out) == (3, ""), err
        assert "prepare_period failed" in err and "every run: charged 3 (usd " in err
        assert await vaulted.money_requests() == 3
        async with vaulted.pool.acquire() as conn:
            # The refused rerun left the period's record alone: a backfill still skips it.
            record = await ledger.period_record(conn, str(PERIOD))
        assert record is not None and record.state == "completed"
        # As the message says.
        await vaulted.vault.admin.revoke(theirs.id)
        await vaulted.pool.execute("DELETE FROM period_vault_keys")
        rerun = await start_period(vaulted.client, PERIOD, vaulted.task_queue)
        assert (await rerun.result()).charged == 3
    assert await period_key(vaulted) != theirs.id
    await assert_billed_once(vaulted, str(PERIOD), [*first, *added])


async def test_a_stored_key_refused_leaves_no_new_key_in_another_currency(
    vaulted: Harness,
) -> None:
    """Every stored key is checked before any is issued: a new key whose row the refusal
    rolled back would count against the worker budget until it expired."""
    assert vaulted.vault is not None
    usd, eur = await vaulted.seed(2)
    await upsert_customers(vaulted.pool, [eur.model_copy(update={"currency": "eur"})])
    small = await vaulted.vault.worker.issue_key(_period_key(usd.amount_cents - 1))
    await _stored_as_the_periods(vaulted, small)
    async with vaulted.running_worker():
        handle = await start_period(vaulted.client, PERIOD, vaulted.task_queue)
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    keys = await vaulted.vault.admin.find_keys(period=str(PERIOD))
    assert [k.id for k in keys] == [small.id]
    assert await vaulted.money_requests() == 0


async def test_an_opening_revokes_the_unused_keys_a_failed_one_left_unstored(
    vaulted: Harness,
) -> None:
    """An opening that failed after the vault issued a key (a later currency refused, its
    transaction rolled back) left a key no run stores, counting its whole cap against the
    worker budget until it expired. The next opening revokes it; a key this ledger did not
    issue (another deployment's on the same vault) stays."""
    assert vaulted.vault is not None
    customers = await vaulted.seed(2)
    async with vaulted.pool.acquire() as conn:
        opening = conn.transaction()
        await opening.start()
        left = await _issue_as_an_opening(vaulted, conn, vaulted.vault.worker)
        await opening.rollback()
    theirs = await vaulted.vault.worker.issue_key(_period_key(100_000))
    assert await period_keys.stored_key_id(vaulted.pool, str(PERIOD), "usd") is None
    async with vaulted.running_worker():
        summary = await (await start_period(vaulted.client, PERIOD, vaulted.task_queue)).result()
    assert summary.charged == 2
    stored = await period_keys.stored_key_id(vaulted.pool, str(PERIOD), "usd")
    assert stored is not None
    keys = {k.id: k for k in await vaulted.vault.admin.find_keys(period=str(PERIOD))}
    assert keys[left.vault_key_id].revoked and not keys[theirs.id].revoked
    assert stored not in (left.vault_key_id, theirs.id) and not keys[stored].revoked
    await assert_billed_once(vaulted, str(PERIOD), customers)


async def test_an_opening_revokes_every_key_failed_openings_left_not_only_one(
    vaulted: Harness,
) -> None:
    """Each opening that failed after the vault issued its key left one no run stores: the
    next opening revokes them all, not leaving some for the close, as each holds its whole
    cap against the worker budget meanwhile (a new key may need it)."""
    assert vaulted.vault is not None
    await vaulted.seed(1)
    left = []
    for _ in range(3):
        async with vaulted.pool.acquire() as conn:
            failed = conn.transaction()
            await failed.start()
            left.append(await _issue_as_an_opening(vaulted, conn, vaulted.vault.worker))
            await failed.rollback()
    opening = PeriodActivities(vaulted.pool, vaulted.settings, vaulted.vault.worker)
    await opening.prepare(PrepareRequest(period=str(PERIOD), workflow_id="by-hand"))
    keys = {k.id: k for k in await vaulted.vault.admin.find_keys(period=str(PERIOD))}
    assert [keys[key.vault_key_id].revoked for key in left] == [True] * 3
    assert not keys[await period_key(vaulted)].revoked


async def test_an_opening_revokes_a_key_whose_issue_answer_was_lost(vaulted: Harness) -> None:
    """The vault, slow to answer, issued a key after the worker had given up on the answer:
    nobody has its secret, and its whole cap counted against the worker budget until it
    expired. The worker lists the id it asks for first, so the next opening revokes it."""
    assert vaulted.vault is not None
    customers = await vaulted.seed(2)
    async with vaulted.pool.acquire() as holder, holder.transaction():
        # The vault's worker budget lock for usd (vault/budget.py), held past the timeout.
        await holder.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended('vault-worker-budget:usd', 0))"
        )
        async with VaultAdmin(vaulted.vault.url, VAULT_WORKER_TOKEN, timeout=1) as impatient:
            with pytest.raises(VaultUnavailable):
                await _issue_as_an_opening(vaulted, vaulted.pool, impatient)

    async def issued_anyway() -> bool:
        assert vaulted.vault is not None
        return len(await vaulted.vault.admin.find_keys(period=str(PERIOD))) == 1

    await eventually(issued_anyway, timeout=10)
    [lost] = await vaulted.vault.admin.find_keys(period=str(PERIOD))
    assert not lost.revoked
    assert await period_keys.stored_key_id(vaulted.pool, str(PERIOD), "usd") is None
    async with vaulted.running_worker():
        summary = await (await start_period(vaulted.client, PERIOD, vaulted.task_queue)).result()
    assert summary.charged == 2
    stored = await period_keys.stored_key_id(vaulted.pool, str(PERIOD), "usd")
    keys = {k.id: k for k in await vaulted.vault.admin.find_keys(period=str(PERIOD))}
    assert keys[lost.id].revoked and keys[lost.id].revoked_by == "worker"
    assert stored is not None and stored != lost.id and not keys[stored].revoked
    await assert_billed_once(vaulted, str(PERIOD), customers)


async def test_a_close_revokes_a_key_the_vault_issued_after_the_opening_looked(
    vaulted: Harness,
) -> None:
    """A key whose issue the vault committed only after the opening's retry had looked (a
    vault slow to answer) has no next opening to revoke it once the period completes: the
    close revokes it, and leaves the run's own key."""
    assert vaulted.vault is not None
    customers = await vaulted.seed(2)
    await vaulted.set_faults(latency_ms=1500)
    async with vaulted.running_worker():
        handle = await start_period(vaulted.client, PERIOD, vaulted.task_queue)
        await eventually(lambda: at_least(vaulted.money_requests(), 1))
        async with vaulted.pool.acquire() as conn:
            late_opening = conn.transaction()
            await late_opening.start()
            late = await _issue_as_an_opening(vaulted, conn, vaulted.vault.worker)
            await late_opening.rollback()
        assert (await handle.result()).charged == 2
    stored = await period_keys.stored_key_id(vaulted.pool, str(PERIOD), "usd")
    keys = {k.id: k for k in await vaulted.vault.admin.find_keys(period=str(PERIOD))}
    assert keys[late.vault_key_id].revoked and keys[late.vault_key_id].revoked_by == "worker"
    assert stored is not None and not keys[stored].revoked
    await assert_billed_once(vaulted, str(PERIOD), customers)


async def test_an_opening_issues_its_key_to_live_the_grace_past_the_later_of_period_and_now(
    vaulted: Harness,
) -> None:
    """The key outlives the period by the configured grace, so that retries, a pause and its
    resume still have it; a period already over (a backfill) gets that grace from now, or
    its key would expire as it is issued and refuse every charge."""
    assert vaulted.vault is not None
    await vaulted.seed(1)
    grace = timedelta(days=vaulted.settings.billing_vault_key_grace_days)
    opening = PeriodActivities(vaulted.pool, vaulted.settings, vaulted.vault.worker)
    past = PERIOD.previous().previous()
    for period, lives_past in ((PERIOD, PERIOD.ends_at), (past, datetime.now(UTC))):
        await opening.prepare(PrepareRequest(period=str(period), workflow_id="by-hand"))
        [key] = await vaulted.vault.admin.find_keys(period=str(period))
        assert abs(key.expires_at - (lives_past + grace)) < timedelta(minutes=1)


async def test_a_renewal_replaces_an_operators_key_too_small_for_what_is_left(
    vaulted: Harness,
) -> None:
    """An opening refuses an operator's key (issued with the admin token) too small for the
    run, as its cap is theirs to set; a renewal is an operator's word to replace it, capped
    for what the run has left. Refused too, the paused run could not go on."""
    assert vaulted.vault is not None
    customers = await vaulted.seed(3)
    theirs = await vaulted.vault.admin.issue_key(_period_key(100))
    await _stored_as_the_periods(vaulted, theirs)
    await vaulted.open_period_by_hand(PERIOD)
    renewing = PeriodActivities(vaulted.pool, vaulted.settings, vaulted.vault.worker)
    [renewed] = (await renewing.renew_keys(str(PERIOD))).keys
    assert renewed.replaced == theirs.id
    assert renewed.cap_cents == spend_cap(
        sum(c.amount_cents for c in customers), vaulted.settings.billing_cap_multiplier
    )
    assert await period_key(vaulted) == renewed.vault_key_id


@pytest.mark.parametrize("close", ["close", "close_if_all_listed", "close_if_all_reached"])
async def test_a_close_and_its_retry_once_written_revoke_the_keys_no_run_stores(
    vaulted: Harness, close: str
) -> None:
    """Each close a run may end with (the plain one of a cancelled run, those of a run from
    before LISTINGS_MARKED), and its retry once the period is completed (its answer lost),
    revokes the period's keys that no run stores (a vault slow to answer issued them after
    the opening looked), which would otherwise hold their caps against the worker budget
    until they expired."""
    assert vaulted.vault is not None
    await vaulted.open_period_by_hand(PERIOD)
    activities = PeriodActivities(vaulted.pool, vaulted.settings, vaulted.vault.worker)
    closing: Callable[[PeriodSummary], Awaitable[object]] = getattr(activities, close)
    summary = PeriodSummary.empty(str(PERIOD), "by-hand")

    async def left_unstored() -> str:
        assert vaulted.vault is not None
        async with vaulted.pool.acquire() as conn:
            opening = conn.transaction()
            await opening.start()
            key = await _issue_as_an_opening(vaulted, conn, vaulted.vault.worker)
            await opening.rollback()
        return key.vault_key_id

    async def revoked(key_id: str) -> bool:
        assert vaulted.vault is not None
        keys = {k.id: k for k in await vaulted.vault.admin.find_keys(period=str(PERIOD))}
        return keys[key_id].revoked and keys[key_id].revoked_by == "worker"

    before_the_close = await left_unstored()
    await closing(summary)
    assert await revoked(before_the_close)
    after_the_close = await left_unstored()
    await closing(summary)
    assert await revoked(after_the_close)


@pytest.mark.parametrize("cause", ["vault-down", "opening-lock-held"])
async def test_a_close_that_cannot_revoke_unused_keys_completes_the_period(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, cause: str
) -> None:
    """Revoking unused keys at the close is a courtesy: with the vault unreachable, or the
    opening's lock held past the wait (an import, or an opening waiting on the vault), the
    close gives up on the revoke, not on the period it has written, and the warning says a
    later opening or close revokes them."""
    await harness.open_period_by_hand(PERIOD)
    # A key listed as asked for, and stored by no run: the close asks the vault about it.
    await harness.pool.execute(
        "INSERT INTO issued_vault_keys (vault_key_id, billing_period, currency)"
        " VALUES ($1, $2, 'usd')",
        new_key_id(),
        str(PERIOD),
    )
    monkeypatch.setattr(ledger_runs, "CHANGE_WAIT_SECONDS", 0.5)
    async with (
        harness.pool.acquire() as importing,
        importing.transaction(),
        VaultAdmin("http://127.0.0.1:9", VAULT_WORKER_TOKEN, timeout=1) as unreachable,
    ):
        if cause == "opening-lock-held":
            await importing.execute(ledger_runs.OPENING_LOCK)
        closing = PeriodActivities(harness.pool, harness.settings, unreachable)
        await closing.close(PeriodSummary.empty(str(PERIOD), "by-hand"))
    async with harness.pool.acquire() as conn:
        record = await ledger.period_record(conn, str(PERIOD))
    assert record is not None and record.state == "completed"
    assert "unused keys not revoked (a later opening or close revokes them" in caplog.text
    held = "waited 0.5 s for a run being opened" in caplog.text
    assert held == (cause == "opening-lock-held")


async def test_a_stored_key_near_its_expiry_is_replaced_not_reused(vaulted: Harness) -> None:
    """A rerun late in the key's life would stop part-billed when the key expired, and a
    resume would only pause it again: its preparation issues a new key instead."""
    assert vaulted.vault is not None
    box = vaulted.settings.secret_box()
    grace = timedelta(days=7)

    async def ensure(unsent_cents: int = 4_000) -> period_keys.PeriodKey:
        """The key a run's preparation ends with: the stored one if kept, else a new one."""
        assert vaulted.vault is not None
        admin = vaulted.vault.worker
        kept = await period_keys.kept_key(vaulted.pool, admin, PERIOD, "usd", unsent_cents)
        return kept or await period_keys.issue_key(
            vaulted.pool, admin, box, PERIOD, "usd", 5_000, grace, known_in=vaulted.pool
        )

    first = await ensure()
    assert (await ensure(5_000)).vault_key_id == first.vault_key_id  # a week left: reused
    near = period_keys.REUSE_MIN_LIFE - timedelta(minutes=1)
    issued = await vaulted.vault.worker.issue_key(_period_key(5_000, near))
    async with vaulted.pool.acquire() as conn:
        await conn.execute(
            "UPDATE period_vault_keys SET vault_key_id = $1, sealed_secret = $2",
            issued.id,
            box.seal(issued.secret),
        )
    replaced = await ensure()
    assert replaced.vault_key_id not in (issued.id, first.vault_key_id)
    info = await vaulted.vault.worker.get_key(replaced.vault_key_id)
    assert info.expires_at - datetime.now(UTC) > grace - timedelta(minutes=1)


async def test_a_replaced_key_issued_with_the_admin_token_is_named_not_revoked(
    vaulted: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's key stored as the period's is for the admin token to revoke: replaced
    near its expiry, it is named in a warning, and the run bills through the new key."""
    assert vaulted.vault is not None
    await vaulted.seed(2)
    near = period_keys.REUSE_MIN_LIFE - timedelta(minutes=1)
    theirs = await vaulted.vault.admin.issue_key(_period_key(100_000, near))
    await _stored_as_the_periods(vaulted, theirs)
    async with vaulted.running_worker():
        summary = await (await start_period(vaulted.client, PERIOD, vaulted.task_queue)).result()
    assert summary.charged == 2
    assert await period_key(vaulted) != theirs.id
    assert not (await vaulted.vault.admin.get_key(theirs.id)).revoked
    [warned] = [r for r in caplog.records if getattr(r, "event", "") == "replaced_key_not_revoked"]
    assert warned.__dict__["vault_key_id"] == theirs.id
    assert "issued with the admin token" in warned.__dict__["error"]


@pytest.mark.parametrize(
    "how", ["revoked and deleted", "deleted", "near its expiry", "near its expiry, vault away"]
)
async def test_a_rerun_charges_with_the_key_its_preparation_gave_not_the_one_cached(
    vaulted: Harness, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that charged the first run holds its key; a rerun's preparation replaced it
    (after the revoke-and-delete the kill switch's message advises, a delete alone, or late
    in its life) and revoked it, on its retry if the vault was away. The rerun charges with
    the new key instead of pausing on the old one, or charging through the old one's room
    as well as the new one's cap."""
    assert vaulted.vault is not None
    if how.endswith("vault away"):
        revoke = VaultAdmin.revoke
        refused: list[str] = []

        async def away_once(admin: VaultAdmin, key_id: str) -> KeyInfo:
            if not refused:
                refused.append(key_id)
                raise VaultUnavailable(503, None, "the vault is restarting")
            return await revoke(admin, key_id)

        monkeypatch.setattr(VaultAdmin, "revoke", away_once)
    await vaulted.seed(3)
    async with vaulted.running_worker():  # one long-lived worker, as in production
        first = await start_period(vaulted.client, PERIOD, vaulted.task_queue)
        assert (await first.result()).charged == 3
        old = await period_key(vaulted)
        async with vaulted.pool.acquire() as conn:
            if how == "revoked and deleted":
                await vaulted.vault.admin.revoke(old)
            if how in ("revoked and deleted", "deleted"):
                await conn.execute("DELETE FROM period_vault_keys")
            else:
                # Room for the late customers too (e.g. first-run declines): only a revoke
                # keeps the worker from charging them through it.
                await conn.execute(
                    "UPDATE vault_keys SET expires_at = now() + interval '20 hours',"
                    " cap_cents = cap_cents * 10 WHERE id = $1",
                    old,
                )
        await vaulted.seed(2, prefix="late")
        rerun = await start_period(vaulted.client, PERIOD, vaulted.task_queue)
        summary = await rerun.result()
    assert await period_key(vaulted) != old
    assert (summary.charged, summary.already_billed) == (2, 3)
    # The refused attempt never reached Stripe, so it is not counted as one that may have,
    # nor is the key it was refused on.
    async with vaulted.pool.acquire() as conn:
        attempts = await conn.fetch(
            "SELECT attempts, sent_through FROM billing_runs WHERE customer_id LIKE 'late-%'"
        )
    new = await period_key(vaulted)
    assert [(r["attempts"], r["sent_through"]) for r in attempts] == [(1, [new])] * 2
    assert (await vaulted.vault.worker.get_key(old)).revoked
    if how.endswith("vault away"):
        assert refused == [old]


async def test_revoked_key_stops_charging(vaulted: Harness) -> None:
    await vaulted.seed(12)
    await vaulted.set_faults(latency_ms=100)
    assert vaulted.vault is not None
    async with vaulted.running_worker():
        handle = await start_period(
            vaulted.client, PERIOD, vaulted.task_queue, RunOptions(max_in_flight=2)
        )
        await eventually(lambda: at_least(vaulted.succeeded(), 2), timeout=30)
        await vaulted.vault.admin.revoke(await period_key(vaulted))

        await eventually(lambda: vaulted.in_state(PERIOD, "paused"), timeout=30)
        charged = len([c for c in await vaulted.charges() if c["status"] == "succeeded"])
        progress = await period_status(vaulted.client, PERIOD)
        assert progress.reason is not None and "vault_key_revoked" in progress.reason
        # The kill switch stays pulled until the key's row is deleted: status says so.
        assert "delete its row in period_vault_keys, then python starter.py renew-keys" in (
            describe(progress)
        )
        await operations.control(vaulted.client, PERIOD, "cancel", ALICE)
        summary = await handle.result()
    assert summary.charged == charged < 12
    assert len([c for c in await vaulted.charges() if c["status"] == "succeeded"]) == charged


async def test_a_resume_with_the_revoked_key_still_in_place_says_it_pauses_again(
    vaulted: Harness,
) -> None:
    """`resume` of a run that paused itself on its key exited 0 with nothing said, and the
    run took more claims and paused again (helper-187); with the keys renewed it says
    nothing more, and the run bills the rest, each customer once."""
    customers = await vaulted.seed(8)
    assert vaulted.vault is not None
    async with vaulted.running_worker():
        handle = await charging_one_at_a_time(vaulted)
        revoked = await period_key(vaulted)
        await vaulted.vault.admin.revoke(revoked)
        await eventually(lambda: vaulted.in_state(PERIOD, "paused"), timeout=30)
        code, _, err = await vaulted.starter("resume", str(PERIOD), "--reason", "try")
        assert code == 0, err
        assert (
            "warning: the run had paused itself (vault_key_revoked: the period's vault key was"
            " revoked, the kill switch"
        ) in err
        assert "delete its row in period_vault_keys, then python starter.py renew-keys" in err
        await eventually(lambda: vaulted.in_state(PERIOD, "paused"), timeout=30)
        async with vaulted.pool.acquire() as conn:
            await conn.execute("DELETE FROM period_vault_keys WHERE vault_key_id = $1", revoked)
        await operations.renew_keys(vaulted.client, PERIOD, ALICE)
        code, _, err = await vaulted.starter("resume", str(PERIOD), "--reason", "new key")
        assert (code, err) == (0, ""), err
        summary = await handle.result()
    assert (summary.charged, summary.failed) == (len(customers), 0)
    await assert_billed_once(vaulted, str(PERIOD), customers)


async def test_a_period_past_the_worker_budget_charges_nothing_and_says_why(
    vaulted: Harness,
) -> None:
    await vaulted.seed(3)
    assert vaulted.vault is not None
    # Another period's keys have taken the workers' whole budget for the window.
    for _ in range(10):
        await vaulted.vault.worker.issue_key(
            IssueKeyRequest(
                label="billing-period",
                period=str(PERIOD.previous()),
                cap_cents=10**9,
                currency="usd",
                allowed_endpoints=["POST /v1/payment_intents"],
                expires_at=datetime.now(UTC) + timedelta(days=1),
            )
        )
    async with vaulted.running_worker():
        handle = await start_period(vaulted.client, PERIOD, vaulted.task_queue)
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        # The operator's CLI says the same in a line, not a traceback, with its own exit code.
        code, out, err = await vaulted.starter("run", str(PERIOD), "--wait")
    assert (code, out) == (3, ""), err
    assert err.startswith(
        f"error: the run of {PERIOD} ended failed (its activity prepare_period failed: no"
        " vault key for"
    )
    assert "VAULT_WORKER_BUDGET_CENTS" in err and "Traceback" not in err
    assert isinstance(failed.value.cause, ActivityError)
    cause = failed.value.cause.cause
    assert isinstance(cause, ApplicationError) and cause.type == "KeyRefused"
    assert "VAULT_WORKER_BUDGET_CENTS" in cause.message and "revoke unused" in cause.message
    assert await vaulted.charges() == []


async def test_a_worker_says_at_start_when_the_vault_does_not_answer(
    vaulted: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong BILLING_VAULT_URL showed only as runs waiting at their opening, for ever; a
    wrong token as the next period's opening failing, with a 401 that named no setting."""
    assert vaulted.vault is not None
    setting = "BILLING_VAULT_WORKER_TOKEN"
    await worker._check_vault(vaulted.vault.worker, vaulted.vault.url, setting)
    assert "did not answer" not in caplog.text and "refused" not in caplog.text
    wrong = "http://127.0.0.1:9"  # discard: nothing listens
    async with VaultAdmin(wrong, "a-worker-token-0123") as admin:
        await worker._check_vault(admin, wrong, setting)
    assert f"the vault at {wrong} did not answer as ready" in caplog.text
    assert "check BILLING_VAULT_URL" in caplog.text
    async with VaultAdmin(vaulted.vault.url, "a-rotated-token-0123") as admin:
        await worker._check_vault(admin, vaulted.vault.url, setting)
    [refused] = [r for r in caplog.records if "refused" in r.getMessage()]
    assert refused.levelname == "ERROR"
    assert f"the vault at {vaulted.vault.url} refused {setting}" in refused.getMessage()
    assert "a-rotated-token" not in caplog.text
    # Started regardless, it fails the next period's opening, naming the setting there too.
    async with VaultAdmin(vaulted.vault.url, "a-rotated-token-0123") as admin:
        with pytest.raises(ApplicationError) as failed, _needs_operator(str(PERIOD), "usd"):
            await admin.find_keys(period=str(PERIOD))
    assert "admin_token_invalid" in failed.value.message
    assert "the workers' BILLING_VAULT_WORKER_TOKEN" in failed.value.message


async def test_a_lookup_key_the_vault_refuses_leaves_the_period_unreadable(
    vaulted: Harness,
) -> None:
    access = vaulted.vault_access()
    # Not a failure to retry: its customers are reported unchecked, with the vault's reason.
    with pytest.raises(period_keys.NoPeriodKeyError, match="not in VAULT_WORKER_CURRENCIES"):
        await access.lookup_gateway(str(PERIOD), "gbp")


async def test_a_customer_without_a_period_key_waits_at_the_gate(vaulted: Harness) -> None:
    customers = await vaulted.seed(4)
    late = customers[-1]
    await vaulted.set_faults(latency_ms=300)
    async with vaulted.running_worker():
        handle = await start_period(
            vaulted.client, PERIOD, vaulted.task_queue, RunOptions(max_in_flight=1, page_size=1)
        )

        async def planned() -> bool:
            async with vaulted.pool.acquire() as conn:
                return bool(await conn.fetchval("SELECT count(*) FROM period_vault_keys"))

        await eventually(planned, timeout=30)
        # Its currency changed after the plan issued the period's keys: none is in euros.
        async with vaulted.pool.acquire() as conn:
            await conn.execute(
                "UPDATE customers SET currency = 'eur' WHERE customer_id = $1", late.customer_id
            )
        await eventually(lambda: vaulted.in_state(PERIOD, "paused"), timeout=60)
        progress = await period_status(vaulted.client, PERIOD)
        assert progress.reason is not None and "no_period_key" in progress.reason
        # Nothing reached Stripe, so the claim is open again: the operator's skip reaches it.
        skip = SkipRequest(customer_id=late.customer_id, reason="no euro key", operator="alice")
        skipped = await operations.skip(
            vaulted.client, vaulted.settings, vaulted.database_url, PERIOD, skip
        )
        assert skipped.skipped, skipped.detail
        await operations.control(vaulted.client, PERIOD, "resume", ALICE)
        summary = await handle.result()
    assert (summary.charged, summary.skipped) == (3, 1)
    assert not [c for c in await vaulted.charges() if c["currency"] == "eur"]


async def test_a_child_refused_its_key_with_its_period_run_gone_waits_at_the_gate(
    vaulted: Harness,
) -> None:
    """A child refused its period key tells its period run, to pause it. With that run gone
    (terminated by hand) the signal fails, and the child still waits at the gate, where a
    cancel reaches it, rather than fail with its claim left open, or ask the vault again
    and again without waiting."""
    [customer] = await vaulted.seed(1)
    await vaulted.open_period_by_hand(PERIOD)
    async with vaulted.running_worker():
        handle = await vaulted.client.start_workflow(
            CustomerChargeWorkflow.run,
            CustomerChargeInput(
                period=str(PERIOD),
                customer_id=customer.customer_id,
                parent_workflow_id=period_workflow_id(PERIOD),
            ),
            id=customer_workflow_id(PERIOD, customer.customer_id),
            task_queue=vaulted.task_queue,
        )

        async def told_no_one() -> bool:
            failed = EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_FAILED
            return any(e.event_type == failed for e in (await handle.fetch_history()).events)

        await eventually(told_no_one)
        await handle.cancel()
        outcome = await asyncio.wait_for(handle.result(), 60)
    [row] = await vaulted.ledger_rows(str(PERIOD))
    assert (outcome.outcome, row["status"]) == ("skipped", "skipped")
    assert await vaulted.money_requests() == 0
    told = EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
    assert [e.event_type for e in (await handle.fetch_history()).events].count(told) == 1


@pytest.mark.parametrize(
    ("issued_by", "short_by", "then"),
    [
        ("worker", 0, "kept"),
        ("worker", 1, "replaced"),
        ("admin", 0, "kept"),
        ("admin", 1, "refused"),
    ],
)
async def test_a_stored_key_is_kept_only_while_its_room_less_charges_in_doubt_holds_what_is_left(
    vaulted: Harness, issued_by: str, short_by: int, then: str
) -> None:
    """A key's room is its cap less what it spent and what it holds for charges in doubt: a
    run keeping a key with less room than it has yet to send stops part-billed at the cap.
    A key of the workers' is then replaced; an operator's refuses the run, though the
    workers issued other keys (an earlier period's), as its cap is theirs to change."""
    assert vaulted.vault is not None
    box = vaulted.settings.secret_box()
    await period_keys.issue_key(
        vaulted.pool,
        vaulted.vault.worker,
        box,
        PERIOD.previous(),
        "usd",
        1_000,
        timedelta(days=1),
        known_in=vaulted.pool,
    )
    if issued_by == "worker":
        ours = await _issue_as_an_opening(vaulted, vaulted.pool, vaulted.vault.worker)
        key_id = ours.vault_key_id
    else:
        theirs = await vaulted.vault.admin.issue_key(_period_key(100_000))
        await _stored_as_the_periods(vaulted, theirs)
        key_id = theirs.id
    await vaulted.pool.execute(
        "UPDATE vault_keys SET spent_cents = 30000, reserved_cents = 20000 WHERE id = $1", key_id
    )
    keeping = partial(
        period_keys.kept_key, vaulted.pool, vaulted.vault.worker, PERIOD, "usd", 50_000 + short_by
    )
    if then == "refused":
        with pytest.raises(period_keys.KeyTooSmallError, match=r"has usd 500\.00 left"):
            await keeping()
        return
    kept = await keeping()
    assert (kept.vault_key_id if kept else None) == (key_id if then == "kept" else None)

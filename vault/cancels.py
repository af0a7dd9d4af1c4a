"""A key's cancel of a PaymentIntent, forwarded only for an intent no one confirmed, of a charge
its period's keys sent and have no answer to.

The worker cancels an intent Stripe left unconfirmed after answering its create with an error
(activities.stripe_gateway), so that it can charge nothing later and the claim can be charged
again once Stripe forgets its key. A cancel moves no money, but on an intent of another
integration it would stop a payment or release a hold. So the vault reads the intent with its
own secret first. It must be `requires_confirmation` (it holds nothing and has moved nothing),
and its metadata must name (KEY_METADATA) the Idempotency-Key of a reservation of a key of this
key's period and label (a renewed key, too) for its customer, amount and currency, still
unknown. Stripe may move the intent on between the read and the cancel; from
`requires_confirmation` only a confirm does, and no key may confirm.
"""

from __future__ import annotations

import aiohttp
from pydantic import BaseModel, ConfigDict, ValidationError
from yarl import URL

from vault import reservations
from vault.endpoints import CHARGE_IN_FLIGHT, KEY_METADATA, NOT_IN_DOUBT, UPSTREAM_REFUSED
from vault.errors import Refusal
from vault.reservations import Charge
from vault.state import VaultState
from vault.store import AuditRecord, KeyGrant

CANCELABLE_STATUS = "requires_confirmation"
_CREATE = "POST /v1/payment_intents"


class _Intent(BaseModel):
    model_config = ConfigDict(extra="ignore")

    status: str
    amount: int
    currency: str
    customer: str | None = None
    metadata: dict[str, str] = {}


async def check(state: VaultState, grant: KeyGrant, intent_id: str, record: AuditRecord) -> None:
    """Refuses the cancel of `intent_id` unless the key may make it (above)."""
    intent = await _read(state, intent_id)
    sent_with = intent.metadata.get(KEY_METADATA)
    charge = Charge(_CREATE, intent.amount, intent.currency, intent.customer)
    reserved = None
    if sent_with is not None and intent.customer is not None:
        async with state.pool.acquire() as conn:
            reserved = await reservations.charge_state_for(conn, grant.id, sent_with, charge)
    if reserved == "pending":
        # A retry of the charge is on its way now: its answer may settle it.
        raise Refusal(
            "refused_in_flight",
            409,
            CHARGE_IN_FLIGHT,
            f"the charge {intent_id} was made for is being sent again right now; retry once"
            " it has its answer",
            error_type="api_error",
            should_retry=True,
        )
    if reserved == "unknown":
        # The charge the intent was made for (the path names the intent).
        record.customer, record.amount_cents, record.currency = (
            charge.customer,
            charge.amount_cents,
            charge.currency,
        )
    else:
        raise Refusal(
            "refused_request",
            403,
            NOT_IN_DOUBT,
            f"this vault key may cancel only a PaymentIntent made by a charge its period's keys"
            f" sent and have no answer to, and {intent_id} is not one",
        )
    if intent.status != CANCELABLE_STATUS:
        # Stripe's code for a cancel in the wrong state: the caller looks the intent up again.
        raise Refusal(
            "refused_request",
            400,
            "payment_intent_unexpected_state",
            f"this vault key may cancel only a PaymentIntent in {CANCELABLE_STATUS}, and"
            f" {intent_id} is {intent.status}",
        )


async def _read(state: VaultState, intent_id: str) -> _Intent:
    url = URL(f"{state.settings.upstream_stripe_base}/v1/payment_intents/{intent_id}", encoded=True)
    headers = {"Authorization": state.upstream_authorization}
    try:
        async with state.upstream.get(url, headers=headers, allow_redirects=False) as response:
            status, body = response.status, await response.read()
    except (aiohttp.ClientError, TimeoutError):
        status, body = 0, b""
    if status == 404:
        raise Refusal(
            "refused_request", 404, "resource_missing", f"No such payment_intent: '{intent_id}'"
        )
    if status == 200:
        try:
            return _Intent.model_validate_json(body)
        except ValidationError:
            pass
    if status in (401, 403):
        # The vault's own key may not read intents: no retry mends that.
        raise Refusal(
            "refused_request",
            502,
            UPSTREAM_REFUSED,
            f"Stripe refused the vault's own key reading {intent_id} ({status}), so the vault"
            " cannot check it before cancelling it: nothing was cancelled. Give"
            " VAULT_UPSTREAM_STRIPE_SECRET a key that may read and cancel PaymentIntents",
            error_type="api_error",
        )
    raise Refusal(
        "refused_request",
        502 if status == 0 else 503,
        "upstream_unavailable",
        f"the vault could not read {intent_id} on Stripe to check it before cancelling it"
        f" ({status or 'no answer'}): nothing was cancelled; retry",
        error_type="api_error",
        should_retry=True,
    )

"""A key's cancel of a PaymentIntent, forwarded only for an intent no one confirmed that one of
the key's own charges could have made.

The worker cancels an intent Stripe left unconfirmed after answering its create with an error
(activities.stripe_gateway), so that it can charge nothing later and the claim fails without a
person. A cancel moves no money, but on an intent of another integration it would stop a
payment or release a hold: so the vault reads the intent with its own secret first. The intent
must be `requires_confirmation` (it holds nothing and has moved nothing), and the key must have
reserved a charge of its customer, amount and currency: Stripe does not say which key made an
intent, so that is as close as the vault can tie it to the key.
"""

from __future__ import annotations

import aiohttp
from pydantic import BaseModel, ConfigDict, ValidationError
from yarl import URL

from vault import reservations
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


async def check(state: VaultState, grant: KeyGrant, intent_id: str, record: AuditRecord) -> None:
    """Refuses the cancel of `intent_id` unless the key may make it (above)."""
    intent = await _read(state, intent_id)
    record.amount_cents, record.currency, record.customer = (
        intent.amount,
        intent.currency,
        intent.customer,
    )
    charge = Charge(_CREATE, intent.amount, intent.currency, intent.customer)
    async with state.pool.acquire() as conn:
        ours = intent.customer is not None and await reservations.asked_for(conn, grant.id, charge)
    if not ours:
        raise Refusal(
            "refused_request",
            403,
            "payment_intent_not_this_keys",
            f"this vault key may cancel only a PaymentIntent one of its own charges made, and it"
            f" sent none for {intent_id}'s customer, amount and currency",
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
    url = URL(f"{state.settings.upstream_base}/v1/payment_intents/{intent_id}", encoded=True)
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
    raise Refusal(
        "refused_request",
        502 if status == 0 else 503,
        "upstream_unavailable",
        f"the vault could not read {intent_id} on Stripe to check it before cancelling it"
        f" ({status or 'no answer'}): nothing was cancelled; retry",
        error_type="api_error",
        should_retry=True,
    )

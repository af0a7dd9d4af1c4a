"""Which Stripe client charges a claim: one direct client, or the period's vault key.

With the vault, workers never hold the Stripe secret: each (period, currency) charges with
its own capped vault key, read from the ledger database the first time it is needed.
"""

from __future__ import annotations

from typing import Protocol

import asyncpg
import stripe

from activities.stripe_gateway import StripeGateway
from billing.models import ChargeApi, Claim
from billing.period_keys import read_secret
from billing.sealing import SecretBox
from billing.stripe_client import stripe_client


class StripeAccess(Protocol):
    async def gateway_for(self, claim: Claim) -> StripeGateway: ...

    async def gateway(self, period: str, currency: str) -> StripeGateway:
        """The gateway that charges (and reads) the period's charges in the currency."""

    def forget(self, claim: Claim) -> None:
        """Drop what is cached for the claim's key (e.g. after the vault refused it)."""


class DirectAccess:
    def __init__(self, gateway: StripeGateway) -> None:
        self._gateway = gateway

    async def gateway_for(self, claim: Claim) -> StripeGateway:
        return self._gateway

    async def gateway(self, period: str, currency: str) -> StripeGateway:
        return self._gateway

    def forget(self, claim: Claim) -> None:
        pass


class VaultAccess:
    def __init__(
        self,
        pool: asyncpg.Pool,
        box: SecretBox,
        vault_url: str,
        api: ChargeApi,
        http: stripe.HTTPClient,
    ) -> None:
        self._pool = pool
        self._box = box
        self._base = vault_url.rstrip("/") + "/stripe"
        self._api = api
        self._http = http
        self._gateways: dict[tuple[str, str], StripeGateway] = {}

    async def gateway_for(self, claim: Claim) -> StripeGateway:
        return await self.gateway(claim.period, claim.currency)

    async def gateway(self, period: str, currency: str) -> StripeGateway:
        slot = (period, currency)
        gateway = self._gateways.get(slot)
        if gateway is None:
            secret = await read_secret(self._pool, self._box, period, currency)
            client = stripe_client(secret.get_secret_value(), self._base, self._http)
            gateway = self._gateways[slot] = StripeGateway(client, self._api)
        return gateway

    def forget(self, claim: Claim) -> None:
        self._gateways.pop((claim.period, claim.currency), None)

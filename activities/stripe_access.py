"""Which Stripe client charges a claim: one direct client, or the period's vault key.

With the vault, workers never hold the Stripe secret: each (period, currency) charges with
its own capped vault key, read from the ledger database the first time it is needed.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import Protocol

import asyncpg
import stripe
from pydantic import SecretStr

from activities.stripe_gateway import StripeGateway
from billing.logs import key_prefix
from billing.models import ChargeApi, Claim
from billing.period_keys import NoPeriodKeyError, issue_lookup_key, read_key, stored_key_id
from billing.sealing import SecretBox
from billing.stripe_client import stripe_client
from vault.client import VaultAdmin, VaultAdminError, VaultForbidden

log = logging.getLogger("billing.stripe_access")
# A lookup key is replaced this long before it expires, so no listing starts on a dying key.
LOOKUP_RENEW_BEFORE = timedelta(minutes=10)


class StripeAccess(Protocol):
    async def gateway_for(self, claim: Claim) -> StripeGateway: ...

    async def gateway(self, period: str, currency: str) -> StripeGateway:
        """The gateway that charges (and reads) the period's charges in the currency."""

    def forget(self, period: str, currency: str) -> None:
        """Drop what is cached for the period's key (e.g. after the vault refused it), so
        that the next call reads a key replaced since."""

    async def replaced(self, period: str, currency: str, refused: str | None) -> bool:
        """After the vault refused the period's key `refused` (a gateway's vault_key_id):
        forget it, and say whether the ledger now stores another (a later run's preparation
        replaced it), which the next call charges with."""

    async def lookup_gateway(self, period: str, currency: str) -> StripeGateway:
        """A gateway that reads the period's charges in the currency, once the period's own
        key has expired or was revoked."""

    def forget_lookup(self, period: str, currency: str) -> None:
        """Drop the lookup key cached for the period (the vault refused it, e.g. revoked with
        every key of the period): the next lookup_gateway issues another."""

    async def fence_off(self, idempotency_key: str, vault_key_ids: list[str], below: int) -> bool:
        """Have the vault refuse the claim's attempts numbered below `below` through these
        keys from now on: one held up on its way may no longer send. False if some key that
        can still send could not be fenced (the reason is logged)."""


class DirectAccess:
    def __init__(self, gateway: StripeGateway) -> None:
        self._gateway = gateway

    async def gateway_for(self, claim: Claim) -> StripeGateway:
        return self._gateway

    async def gateway(self, period: str, currency: str) -> StripeGateway:
        return self._gateway

    def forget(self, period: str, currency: str) -> None:
        pass

    async def replaced(self, period: str, currency: str, refused: str | None) -> bool:
        return False

    async def lookup_gateway(self, period: str, currency: str) -> StripeGateway:
        return self._gateway

    def forget_lookup(self, period: str, currency: str) -> None:
        pass

    async def fence_off(self, idempotency_key: str, vault_key_ids: list[str], below: int) -> bool:
        return True  # Stripe straight: nothing stands between an attempt and Stripe to fence


class VaultAccess:
    def __init__(
        self,
        pool: asyncpg.Pool,
        box: SecretBox,
        vault_url: str,
        api: ChargeApi,
        http: stripe.HTTPClient,
        admin: VaultAdmin | None = None,
    ) -> None:
        self._pool = pool
        self._box = box
        self._base = vault_url.rstrip("/") + "/stripe"
        self._api = api
        self._http = http
        self._admin = admin
        self._gateways: dict[tuple[str, str], StripeGateway] = {}
        self._lookups: dict[tuple[str, str], tuple[StripeGateway, datetime]] = {}
        self._lookup_lock = asyncio.Lock()

    async def gateway_for(self, claim: Claim) -> StripeGateway:
        return await self.gateway(claim.period, claim.currency)

    async def gateway(self, period: str, currency: str) -> StripeGateway:
        slot = (period, currency)
        gateway = self._gateways.get(slot)
        if gateway is None:
            key = await read_key(self._pool, self._box, period, currency)
            gateway = self._gateways[slot] = self._through(key.secret, key.vault_key_id)
        return gateway

    def _through(
        self, secret: SecretStr, vault_key_id: str | None = None, may_cancel: bool = True
    ) -> StripeGateway:
        """A gateway calling Stripe through the vault with this vault key."""
        client = stripe_client(secret.get_secret_value(), self._base, self._http)
        return StripeGateway(client, self._api, vault_key_id, may_cancel)

    def forget(self, period: str, currency: str) -> None:
        self._gateways.pop((period, currency), None)

    async def replaced(self, period: str, currency: str, refused: str | None) -> bool:
        slot = (period, currency)
        cached = self._gateways.get(slot)
        if cached is not None and cached.vault_key_id == refused:
            del self._gateways[slot]
        if refused is None:
            return False
        stored = await stored_key_id(self._pool, period, currency)
        return stored is not None and stored != refused

    async def lookup_gateway(self, period: str, currency: str) -> StripeGateway:
        if self._admin is None:
            raise NoPeriodKeyError(
                f"the vault key for {period} ({currency}) can no longer be used, and without"
                " BILLING_VAULT_WORKER_TOKEN no key to read its charges can be issued"
            )
        slot = (period, currency)
        # One issue for the listings that ask at once.
        async with self._lookup_lock:
            cached = self._lookups.get(slot)
            if cached is not None and cached[1] - datetime.now(UTC) > LOOKUP_RENEW_BEFORE:
                return cached[0]
            try:
                issued = await issue_lookup_key(self._admin, period, currency)
            except VaultForbidden as exc:
                # E.g. a currency the vault's worker policy does not list: no retry changes it.
                raise NoPeriodKeyError(
                    f"the vault key for {period} ({currency}) can no longer be used, and the"
                    f" vault refused a key to read its charges: {exc.message}"
                ) from None
            gateway = self._through(issued.secret, may_cancel=False)
            self._lookups[slot] = (gateway, issued.expires_at)
            return gateway

    def forget_lookup(self, period: str, currency: str) -> None:
        self._lookups.pop((period, currency), None)

    async def fence_off(self, idempotency_key: str, vault_key_ids: list[str], below: int) -> bool:
        fenced = True
        for key_id in vault_key_ids:
            if self._admin is None or not await self._fenced(
                self._admin, key_id, idempotency_key, below
            ):
                log.warning(
                    "could not fence off the earlier attempts of charge %s through vault key %s",
                    key_prefix(idempotency_key),
                    key_id,
                )
                fenced = False
        return fenced

    @staticmethod
    async def _fenced(admin: VaultAdmin, key_id: str, idempotency_key: str, below: int) -> bool:
        try:
            await admin.fence(key_id, idempotency_key, below)
        except VaultForbidden:
            # Issued with the admin token, which workers do not hold: no fence is needed only
            # if the key can send nothing more.
            try:
                info = await admin.get_key(key_id)
            except VaultAdminError as exc:
                log.warning("vault key %s: %s", key_id, exc)
                return False
            return info.revoked or info.expired
        except VaultAdminError as exc:
            log.warning("vault key %s: %s", key_id, exc)
            return False
        return True

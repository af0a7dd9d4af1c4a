"""Requests to the proxy that present no known vault key, counted per peer in memory.

Audited one by one, each would cost an audit row and a database connection to write it, so
anyone who can reach the port could grow the audit log at will. Instead each window writes one
row per peer saying how many (`vault_unauthenticated`). A key is still looked up for every
request that presents one: a limit on those lookups per address would throttle honest workers
behind the same address, or every new key once a flood from enough addresses shares one count.
Limit requests per client in front of the vault instead (docs/vault.md, "Slow clients").
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from vault import store
from vault.endpoints import DATABASE_UNAVAILABLE
from vault.errors import Refusal
from vault.store import PeerRefusals

logger = logging.getLogger("vault.unauthenticated")

# Where peers past _MAX_PEERS in a window are counted, together: memory and rows per window
# stay bounded whatever number of addresses a flood comes from.
OVERFLOW_PEER = "other"
_MAX_PEERS = 10_000
# How long writing a window's rows may keep trying through a database outage.
_WRITE_WITHIN = timedelta(seconds=5)


class Unauthenticated(Refusal):
    """A proxied request that presented no known vault key: counted here rather than
    audited, as it has no key to be audited under."""

    def __init__(
        self, message: str, status: int = 401, code: str = "vault_key_invalid", **kwargs: Any
    ) -> None:
        super().__init__("refused_auth", status, code, message, **kwargs)


class KeyUncheckable(Unauthenticated):
    """A request whose key could not be looked up, the vault's database away: no more known
    than an unknown key, so counted the same way, not audited. Its audit row would only wait
    behind answers among the settles of charges sent before the outage, and could crowd
    them out in a flood."""

    def __init__(self) -> None:
        super().__init__(
            "the vault cannot check vault keys now (its database cannot be reached); nothing"
            " was sent: retry shortly",
            503,
            DATABASE_UNAVAILABLE,
            error_type="api_error",
            should_retry=True,
        )


def peer_of(remote: str | None) -> str:
    """Who sent a request, as counted: its IPv4 address, or the /64 its IPv6 address is in
    (one host commonly holds a whole /64, so one address each would count nothing)."""
    try:
        address = ipaddress.ip_address(remote or "")
    except ValueError:
        return "unknown"
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class Tally:
    """This window's counts of requests with no known vault key, per peer."""

    def __init__(self) -> None:
        self._peers: dict[str, PeerRefusals] = {}

    def count(self, peer: str) -> None:
        if peer not in self._peers and len(self._peers) >= _MAX_PEERS:
            peer = OVERFLOW_PEER
        counted = self._peers.get(peer)
        now = datetime.now(UTC)
        if counted is None:
            counted = self._peers[peer] = PeerRefusals(peer, first_at=now, last_at=now)
        # A wall clock stepped back does not put last_at before first_at.
        counted.last_at = max(counted.last_at, now)
        counted.requests += 1

    def drain(self) -> list[PeerRefusals]:
        """The window's counts; the next window starts with none."""
        drained = list(self._peers.values())
        self._peers = {}
        return drained


async def keep_writing(pool: asyncpg.Pool, tally: Tally, window: timedelta) -> None:
    """Write the tally's rows at the end of every window, until cancelled."""
    while True:
        await asyncio.sleep(window.total_seconds())
        await write(pool, tally)


async def write(pool: asyncpg.Pool, tally: Tally) -> None:
    rows = tally.drain()
    if not rows:
        return
    try:
        await store.through_outage(
            pool, _WRITE_WITHIN, lambda conn: store.insert_unauthenticated(conn, rows)
        )
    except (*store.DATABASE_ERRORS, TimeoutError):
        # The metrics (vault_refusals_total) have counted them all the same.
        logger.exception(
            "could not record %d requests with no known vault key from %d peers",
            sum(row.requests for row in rows),
            len(rows),
        )

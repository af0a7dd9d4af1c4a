"""Requests to the proxy that present no known vault key, counted per peer in memory.

Audited one by one, each would cost an audit row and a database connection, so anyone who
can reach the port could grow the audit log, and hold connections real charges need, at will.
Instead each window writes one row per peer saying how many (`vault_unauthenticated`). And
past VAULT_UNAUTHENTICATED_LOOKUPS_PER_PEER unknown keys in a window, a peer's keys are refused
(429) without a lookup: all but those that authenticated here lately, so that honest workers
sharing an address with the flood (behind a NAT or a reverse proxy) keep charging.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Literal

import asyncpg

from vault import store
from vault.errors import Refusal
from vault.store import PeerRefusals

logger = logging.getLogger("vault.unauthenticated")

# No Authorization a vault key could be in; a key no row has; one not looked up.
Kind = Literal["no_key", "unknown_key", "throttled"]
# Where peers past _MAX_PEERS in a window are counted, together: memory and rows per window
# stay bounded whatever number of addresses a flood comes from.
OVERFLOW_PEER = "other"
_MAX_PEERS = 10_000
_RECENT_KEYS = 10_000
# How long writing a window's rows may keep trying through a database outage.
_WRITE_WITHIN = timedelta(seconds=5)


class Unauthenticated(Refusal):
    """A proxied request that presented no known vault key: counted here rather than
    audited, as it has no key to be audited under."""

    def __init__(self, kind: Kind, message: str) -> None:
        throttled = kind == "throttled"
        super().__init__(
            "refused_auth",
            429 if throttled else 401,
            "too_many_unknown_keys" if throttled else "vault_key_invalid",
            message,
        )
        self.kind: Kind = kind


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
    """This window's counts per peer, the lookups under way, and the keys seen lately."""

    def __init__(self, lookups_per_peer: int) -> None:
        self._lookups_per_peer = lookups_per_peer
        self._peers: dict[str, PeerRefusals] = {}
        # Per peer, the digests being looked up now, each with how many requests wait on it.
        self._pending: dict[str, Counter[bytes]] = {}
        self._recent = RecentKeys()

    def authenticated(self, digest: bytes) -> None:
        """A key row has this digest: its requests are looked up whatever their peer's count."""
        self._recent.add(digest)

    @contextmanager
    def lookup(self, peer: str, digest: bytes) -> Iterator[bool]:
        """Whether the key may be looked up for the peer. A key seen lately may; another not
        once the unknown keys the peer sent this window and the other keys it has being looked
        up reach its limit. Those under way count, so that requests arriving together cannot
        all pass; a key already being looked up for the peer costs nothing more, so that a
        worker's burst with a new key does pass."""
        if digest in self._recent:
            yield True
            return
        pending = self._pending.setdefault(peer, Counter())
        counted = self._peers.get(self._slot(peer))
        unknown = 0 if counted is None else counted.unknown
        if digest not in pending and unknown + len(pending) >= self._lookups_per_peer:
            if not pending:
                del self._pending[peer]
            yield False
            return
        pending[digest] += 1
        try:
            yield True
        finally:
            pending[digest] -= 1
            if not pending[digest]:
                del pending[digest]
            if not pending:
                del self._pending[peer]

    def count(self, peer: str, kind: Kind) -> None:
        slot = self._slot(peer)
        counted = self._peers.get(slot)
        now = datetime.now(UTC)
        if counted is None:
            counted = self._peers[slot] = PeerRefusals(slot, first_at=now, last_at=now)
        counted.last_at = now
        counted.requests += 1
        counted.unknown += kind == "unknown_key"
        counted.throttled += kind == "throttled"

    def drain(self) -> list[PeerRefusals]:
        """The window's counts; the next window starts with none."""
        drained = list(self._peers.values())
        self._peers = {}
        return drained

    def _slot(self, peer: str) -> str:
        return peer if peer in self._peers or len(self._peers) < _MAX_PEERS else OVERFLOW_PEER


class RecentKeys:
    """Digests of the keys that authenticated here lately, least recent first. They decide
    only whether a throttled peer's key is looked up, never whether it is good: every request
    still reads its key's row, so a revoke stops the key at once."""

    def __init__(self) -> None:
        self._digests: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._digests

    def add(self, digest: bytes) -> None:
        self._digests[digest] = None
        self._digests.move_to_end(digest)
        if len(self._digests) > _RECENT_KEYS:
            self._digests.popitem(last=False)


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

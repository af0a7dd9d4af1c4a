"""What the handlers share for the life of the app: settings, the database, the upstream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import timedelta

import aiohttp
import aiojobs
import asyncpg
from aiohttp import web

from vault import store, unauthenticated
from vault.budget import WorkerPolicy
from vault.send_deadline import DeadlineConnector
from vault.settings import VaultSettings
from vault.unauthenticated import Tally

# How long past the upstream timeout a pending reservation may stay pending before it is
# treated as unknown: only a vault stopped mid-request leaves one that old. A charge is sent
# within this margin of its reservation or not at all, so its wait on Stripe ends before it can
# be found stale.
_STALE_MARGIN = timedelta(seconds=10)
# How long each write after an upstream answer (settle, then audit) keeps trying through a
# database outage: both inside the margin above, so a reservation settled late is not yet
# taken for stale, and a client waits at most this much longer, twice, for its answer.
_OUTAGE_RETRY = timedelta(seconds=5)
# How long such a write goes on trying behind the answer, when the outage lasts longer: a
# settle that lands saves reconciliation its work, and the cap its wait.
_LATE_WRITE_WITHIN = timedelta(minutes=5)
# At shutdown, how long writes still trying behind an answer have to land.
_LATE_WRITE_DRAIN_SECONDS = 5.0
# A few at a time, so a long outage costs the database a few tries a second, and its return
# a few connections, whatever the backlog; past the backlog's bound a write is given up.
_LATE_WRITES_AT_ONCE = 4
_LATE_WRITES_WAITING = 10_000


@dataclass(frozen=True)
class VaultState:
    settings: VaultSettings
    pool: asyncpg.Pool
    upstream: aiohttp.ClientSession
    upstream_authorization: str = field(repr=False)
    upstream_secret: bytes = field(repr=False)
    admin_token_digest: bytes = field(repr=False)
    worker_token_digest: bytes | None = field(repr=False)
    worker_policy: WorkerPolicy | None
    stale_after: timedelta
    # How long after its reservation a charge may still be sent.
    send_within: timedelta
    # The writes that go on trying behind an answer.
    behind: aiojobs.Scheduler
    # Requests with no known vault key, counted per peer (vault/unauthenticated.py).
    unauthenticated: Tally
    outage_retry: timedelta = _OUTAGE_RETRY
    late_write_within: timedelta = _LATE_WRITE_WITHIN


STATE = web.AppKey("vault_state", VaultState)


def longest_request(settings: VaultSettings) -> timedelta:
    """The longest a request in flight may still take: its body, its wait to be sent, Stripe's
    answer, then its settle and its audit each through a database outage. A vault stopping
    waits this long, or a charge that may have gone through would leave no audit row."""
    return (
        timedelta(seconds=settings.body_timeout_seconds + settings.upstream_timeout_seconds)
        + _STALE_MARGIN
        + 2 * _OUTAGE_RETRY
    )


# How long the vault waits for a TCP connection to Stripe (at most half its whole wait).
CONNECT_SECONDS = 10.0


def lifecycle(settings: VaultSettings) -> Callable[[web.Application], AsyncIterator[None]]:
    """An aiohttp cleanup context opening the pool and the upstream session, and closing them
    after the last in-flight request has finished."""

    async def run(app: web.Application) -> AsyncIterator[None]:
        pool = await store.create_pool(settings.database_url, settings.database_pool_size)
        try:
            await store.check_schema(pool)
        except BaseException:
            await pool.close()
            raise
        upstream = aiohttp.ClientSession(
            connector=DeadlineConnector(limit=settings.upstream_max_connections),
            timeout=aiohttp.ClientTimeout(
                total=settings.upstream_timeout_seconds,
                # A connect of its own, so that a connect that hangs (Stripe's address
                # blackholed) ends as one never made, which sent nothing (vault.proxy), not as
                # a request that may have gone out.
                sock_connect=min(CONNECT_SECONDS, settings.upstream_timeout_seconds / 2),
            ),
        )
        secret = settings.upstream_stripe_secret.get_secret_value()
        app[STATE] = VaultState(
            settings=settings,
            pool=pool,
            upstream=upstream,
            upstream_authorization=f"Bearer {secret}",
            upstream_secret=secret.encode(),
            admin_token_digest=store.secret_digest(settings.admin_token.get_secret_value()),
            worker_token_digest=(
                None
                if settings.worker_token is None
                else store.secret_digest(settings.worker_token.get_secret_value())
            ),
            worker_policy=settings.worker_policy(),
            stale_after=timedelta(seconds=settings.upstream_timeout_seconds) + _STALE_MARGIN,
            send_within=_STALE_MARGIN,
            behind=aiojobs.Scheduler(
                limit=_LATE_WRITES_AT_ONCE, pending_limit=_LATE_WRITES_WAITING
            ),
            unauthenticated=Tally(),
        )
        tally = app[STATE].unauthenticated
        writing = asyncio.create_task(
            unauthenticated.keep_writing(
                pool, tally, timedelta(seconds=settings.unauthenticated_window_seconds)
            )
        )
        try:
            yield
        finally:
            writing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writing
            # The last window's counts, cut short: no more requests come.
            await unauthenticated.write(pool, tally)
            await app[STATE].behind.wait_and_close(_LATE_WRITE_DRAIN_SECONDS)
            await upstream.close()
            await pool.close()

    return run

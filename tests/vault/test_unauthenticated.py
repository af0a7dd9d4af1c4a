"""The per-peer counts of requests with no known vault key (vault/unauthenticated.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from vault import unauthenticated
from vault.unauthenticated import OVERFLOW_PEER, Tally, peer_of


@pytest.mark.parametrize(
    ("remote", "peer"),
    [
        ("192.0.2.7", "192.0.2.7"),
        ("::ffff:192.0.2.7", "192.0.2.7"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),
        (None, "unknown"),
        ("not an address", "unknown"),
    ],
)
def test_a_peer_is_its_ipv4_address_or_its_ipv6_64(remote: str | None, peer: str) -> None:
    assert peer_of(remote) == peer


def test_peers_past_the_bound_are_counted_together() -> None:
    tally = Tally()
    bound = unauthenticated._MAX_PEERS
    for i in range(bound + 5):
        tally.count(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    tally.count("10.0.0.0")  # counted apart already: stays apart
    rows = tally.drain()
    assert len(rows) == bound + 1
    assert {r.peer: r.requests for r in rows}["10.0.0.0"] == 2
    assert [(r.peer, r.requests) for r in rows if r.peer == OVERFLOW_PEER] == [(OVERFLOW_PEER, 5)]
    assert tally.drain() == []


def test_a_clock_stepped_back_keeps_a_rows_last_after_its_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    start = datetime(2026, 12, 4, 12, tzinfo=UTC)
    times = iter([start, start - timedelta(seconds=30)])

    class SteppedBack:
        @staticmethod
        def now(tz: object) -> datetime:
            return next(times)

    monkeypatch.setattr(unauthenticated, "datetime", SteppedBack)
    tally = Tally()
    tally.count("192.0.2.7")
    tally.count("192.0.2.7")
    [row] = tally.drain()
    assert (row.first_at, row.last_at, row.requests) == (start, start, 2)

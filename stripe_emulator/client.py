"""A client of a running emulator's ``/_emulator/*`` endpoints: faults, ledger, request log,
bank debits."""

from __future__ import annotations

from typing import Any

import aiohttp

JSON = dict[str, Any]


class EmulatorClient:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    async def _call(self, method: str, path: str, body: JSON | None = None) -> Any:
        # A session per call: calls are rare and may outlive an event loop (tests, scripts).
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, f"{self.url}/_emulator/{path}", json=body) as response,
        ):
            response.raise_for_status()
            return await response.json()

    async def configure(self, **changes: Any) -> JSON:
        """A partial update of the fault settings; returns the whole configuration."""
        config: JSON = await self._call("POST", "faults", changes)
        return config

    async def charges(self) -> list[JSON]:
        """Every charge the emulator holds, with the idempotency key that created it."""
        charges: list[JSON] = (await self._call("GET", "ledger"))["charges"]
        return charges

    async def faults_injected(self) -> dict[str, int]:
        """How many faults of each kind were injected so far (429s included)."""
        counts: dict[str, int] = (await self._call("GET", "ledger"))["faults_injected"]
        return counts

    async def requests(self) -> list[JSON]:
        """Every request received: method, path, key, parameters, status, fault."""
        requests: list[JSON] = (await self._call("GET", "requests"))["requests"]
        return requests

    async def settle_debits(self, charge: str | None = None) -> list[JSON]:
        """Settle the pending bank debit `charge`, or every one: returns them as settled."""
        body = {} if charge is None else {"charge": charge}
        settled: list[JSON] = (await self._call("POST", "settle_debits", body))["settled"]
        return settled

"""A dry run: who a period's run would charge and for how much, charging nothing."""

from __future__ import annotations

import asyncpg

from billing import ledger
from billing.models import Preview, ShortKey


async def preview_period(pool: asyncpg.Pool, period: str, cap_multiplier: float) -> Preview:
    async with pool.acquire() as conn:
        lines = await ledger.preview_lines(conn, period)
        keys = await ledger.stored_keys(conn, period)
        unsent = await ledger.unsent_totals(conn, period)
    to_charge = [line for line in lines if line.open]
    billed = [line for line in lines if line.status == "charged"]
    other = [line for line in lines if not line.open and line.status != "charged"]
    return Preview(
        period=period,
        to_charge=to_charge,
        already_billed=billed,
        not_billable=other,
        cap_multiplier=cap_multiplier,
        issued_caps_by_currency={k.currency: k.cap_cents for k in keys},
        short_keys=[
            ShortKey(**k.model_dump(exclude={"issued_here"}), unsent_cents=unsent[k.currency])
            for k in keys
            if not k.issued_here and k.cap_cents - k.charged_cents < unsent.get(k.currency, 0)
        ],
    )

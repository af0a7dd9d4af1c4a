"""Period-level I/O: plan the run, page through due customers, read outcomes, close."""

from __future__ import annotations

import asyncpg
from temporalio import activity

from billing import ledger
from billing.models import CustomerOutcome, DuePage, PeriodPlan, PeriodSummary, Record


class PrepareRequest(Record):
    period: str
    workflow_id: str


class DuePageRequest(Record):
    period: str
    after: str | None
    limit: int


class OutcomesRequest(Record):
    period: str
    customer_ids: list[str]


class PeriodActivities:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @activity.defn(name="prepare_period")
    async def prepare(self, request: PrepareRequest) -> PeriodPlan:
        async with self._pool.acquire() as conn:
            plan = await ledger.plan_period(conn, request.period)
            await ledger.start_period(conn, plan, request.workflow_id)
            return plan

    @activity.defn(name="due_customers")
    async def due_customers(self, request: DuePageRequest) -> DuePage:
        async with self._pool.acquire() as conn:
            return await ledger.due_page(conn, request.period, request.after, request.limit)

    @activity.defn(name="ledger_outcomes")
    async def ledger_outcomes(self, request: OutcomesRequest) -> list[CustomerOutcome]:
        async with self._pool.acquire() as conn:
            return await ledger.outcomes(conn, request.period, request.customer_ids)

    @activity.defn(name="close_period")
    async def close(self, summary: PeriodSummary) -> None:
        async with self._pool.acquire() as conn:
            await ledger.finish_period(conn, summary.period, summary.model_dump_json())

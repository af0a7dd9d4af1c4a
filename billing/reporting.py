"""How a period's counts read to a person, and where to look in the Web UI."""

from __future__ import annotations

from billing.config import TemporalSettings
from billing.models import PeriodProgress, PeriodSummary


def describe(summary: PeriodSummary | PeriodProgress) -> str:
    dollars = summary.total_charged_cents / 100
    lines = [
        f"period {summary.period} ({summary.workflow_id})",
        f"  due {summary.due}: charged {summary.charged}, already billed"
        f" {summary.already_billed}, failed {summary.failed}, skipped {summary.skipped},"
        f" cancelled {summary.cancelled}",
        f"  total charged {dollars:,.2f} (cents: {summary.total_charged_cents})",
    ]
    if isinstance(summary, PeriodProgress):
        lines.insert(1, f"  state {summary.state}, in flight {summary.in_flight}")
    return "\n".join(lines)


def ui_link(temporal: TemporalSettings, workflow_id: str) -> str:
    return f"{temporal.ui_url}/namespaces/{temporal.namespace}/workflows/{workflow_id}"

"""How a period's counts read to a person, and where to look in the Web UI."""

from __future__ import annotations

from billing.config import TemporalSettings
from billing.models import PeriodCounts, PeriodProgress, Preview


def describe(summary: PeriodCounts) -> str:
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


def describe_preview(preview: Preview, shown: int = 20) -> str:
    lines = [
        f"preview of {preview.period}: nothing is charged",
        f"  would charge {len(preview.to_charge)} customers, {preview.expected_total_cents}"
        f" cents in all; the period's key would be capped at {preview.cap_cents} cents",
    ]
    lines += [
        f"    {x.customer_id}: {x.amount_cents} {x.currency}" for x in preview.to_charge[:shown]
    ]
    if len(preview.to_charge) > shown:
        lines.append(f"    ... and {len(preview.to_charge) - shown} more (--json lists all)")
    lines.append(f"  already billed: {len(preview.already_billed)}")
    lines.append(f"  not billable this period (failed or skipped): {len(preview.not_billable)}")
    return "\n".join(lines)

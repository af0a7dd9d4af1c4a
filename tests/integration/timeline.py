"""A workflow run's history for a failing test's message: in a few lines, where its time
went when a wait that usually takes seconds ran out in CI; or an event a line, where a
replay parted from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHandle, WorkflowHistory


@dataclass
class _Entry:
    name: str
    first: float  # seconds from the run's first event
    last: float
    count: int = 1

    def __str__(self) -> str:
        folded = f" x{self.count} over {self.last - self.first:.1f}s" if self.count > 1 else ""
        return f"+{self.first:.1f}s {self.name}{folded}"


async def timeline(handle: WorkflowHandle[Any, Any]) -> str:
    """`ID RUN: +0.0s WORKFLOW_EXECUTION_STARTED, +0.0s WORKFLOW_TASK x3 over 0.2s, ...`:
    consecutive events of one type fold into one entry, a workflow task's three events
    count as one type."""
    entries: list[_Entry] = []
    begun: float | None = None
    async for event in handle.fetch_history_events():
        at = event.event_time.ToDatetime().timestamp()
        begun = at if begun is None else begun
        name = _name(event.event_type)
        if entries and entries[-1].name == name:
            entries[-1].last = at - begun
            entries[-1].count += 1
        else:
            entries.append(_Entry(name, at - begun, at - begun))
    return f"{handle.id} {handle.run_id or 'latest'}: " + ", ".join(map(str, entries))


def _name(event_type: EventType.ValueType) -> str:
    name = EventType.Name(event_type).removeprefix("EVENT_TYPE_")
    return "WORKFLOW_TASK" if name.startswith("WORKFLOW_TASK_") else name


def events(history: WorkflowHistory) -> str:
    """The history an event a line, with what each event names (a patch, an activity, a
    child, an update): where a replay parted from it."""
    lines = [f"{history.workflow_id} {history.run_id}:"]
    for event in history.events:
        name = EventType.Name(event.event_type).removeprefix("EVENT_TYPE_")
        lines.append(f"  {event.event_id} {name} {_named(event)}".rstrip())
    return "\n".join(lines)


def _named(event: HistoryEvent) -> str:
    if event.HasField("marker_recorded_event_attributes"):
        details = event.marker_recorded_event_attributes.details
        for key in ("patch-data", "data"):
            if key in details and details[key].payloads:
                return details[key].payloads[0].data.decode(errors="replace")[:120]
        return event.marker_recorded_event_attributes.marker_name
    if event.HasField("activity_task_scheduled_event_attributes"):
        return event.activity_task_scheduled_event_attributes.activity_type.name
    if event.HasField("start_child_workflow_execution_initiated_event_attributes"):
        return event.start_child_workflow_execution_initiated_event_attributes.workflow_id
    if event.HasField("workflow_execution_update_accepted_event_attributes"):
        attributes = event.workflow_execution_update_accepted_event_attributes
        return attributes.accepted_request.input.name
    return ""

"""``turnstile runs RUN --events``: a run's event log, as lines for people or as JSON.

Rendered from the events alone (no text is parsed): each kind says what happened in a
line of its own, with the local time it happened.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from engine.humane import words
from engine.store.events import EventKind, EventLog, RunEvent
from engine.store.runs import RunRecord

__all__ = ["describe", "print_events", "what_happened"]


def _first_line(text: object, most: int = 160) -> str:
    line = next((part.strip() for part in str(text or "").splitlines() if part.strip()), "")
    return line if len(line) <= most else line[: most - 1] + "…"


def _turn(data: Mapping[str, Any]) -> str:
    said = f"turn {data.get('seq')}"
    if (data.get("attempt") or 1) > 1:
        said += f" (attempt {data['attempt']})"
    return said


def _why(data: Mapping[str, Any], key: str = "reason") -> str:
    """``: the reason`` (its first line) when the event carries one."""
    return f": {_first_line(data[key])}" if data.get(key) else ""


def _by(data: Mapping[str, Any]) -> str:
    return f" by {data['by']}" if data.get("by") not in (None, "") else ""


def _task(event: RunEvent) -> str:
    return f"task {event.task}" if event.task else "the task"


def _run_started(event: RunEvent, data: Mapping[str, Any]) -> str:
    said = f"{data.get('mode')} run started with {data.get('agent')}"
    if event.task:
        said += f" on task {event.task}"
    if data.get("parent"):
        said += f" (under {data['parent']})"
    if data.get("objective"):
        said += f": {_first_line(data['objective'], 120)}"
    return said


def _turn_started(event: RunEvent, data: Mapping[str, Any]) -> str:
    said = f"{_turn(data)} started"
    if data.get("phase"):
        said += f" ({words(str(data['phase']))})"
    return said + (f": {_first_line(data['prompt'], 100)}" if data.get("prompt") else "")


def _turn_ended(event: RunEvent, data: Mapping[str, Any]) -> str:
    state = data.get("state")
    if state == "finished":
        said = f"{_turn(data)} finished"
        if data.get("exit_code") not in (None, 0):
            said += f", the agent exited with code {data['exit_code']}"
        if data.get("size") is not None:
            said += f", {data['size']:,} bytes of output"
        return said
    word = {"interrupted": "was cut off", "failed": "failed"}.get(str(state), str(state))
    return f"{_turn(data)} {word}{_why(data, 'error')}"


_NOTES = {
    "note": "note",
    "step": "step",
    "verdict": "completion not accepted",
    "final": "result",
    "person": "waiting for a person",
}


def _note(event: RunEvent, data: Mapping[str, Any]) -> str:
    return f"{_NOTES.get(str(data.get('note')), 'note')}: {_first_line(data.get('text'))}"


def _phase(value: object) -> str:
    """A phase (or a task's label) as people say it: "test design", never "test_design"."""
    return words(str(value))


def _gate_opened(event: RunEvent, data: Mapping[str, Any]) -> str:
    said = f"{_task(event)} waits for approval of its {_phase(data.get('phase'))}"
    if data.get("sha256"):
        said += f" (sha256 {str(data['sha256'])[:12]})"
    if data.get("change") == "reopen":
        said += ": the artifact changed, earlier approvals no longer count"
    return said


def _gate_decided(event: RunEvent, data: Mapping[str, Any]) -> str:
    decision = data.get("decision")
    phase = _phase(data.get("phase"))
    if decision == "rejected":
        rejected = _phase(data.get("from")) if data.get("from") else phase
        return f"{_task(event)}: {rejected} rejected{_by(data)}{_why(data)}"
    count = f" ({data.get('approvers')} of {data.get('quorum')})" if data.get("quorum") else ""
    if decision == "approved":
        return f"{_task(event)}: {phase} approved{_by(data)}{count}"
    return f"{_task(event)}: an approval of {phase}{_by(data)} counted{count}"


def _task_moved(event: RunEvent, data: Mapping[str, Any]) -> str:
    moved = f"moved from {_phase(data.get('from'))} to {_phase(data.get('phase'))}"
    return f"{_task(event)} {moved}{_why(data)}"


def _tool_requested(event: RunEvent, data: Mapping[str, Any]) -> str:
    said = f"the agent asks to use {data.get('tool')}"
    if data.get("input"):
        said += f" {_first_line(data['input'], 100)}"
    if data.get("scope") == "preset":
        said += " (its preset lets it run)"
    elif data.get("decision") == "allowed":
        said += " (allowed for this session earlier)"
    elif data.get("why"):
        said += f": it {data['why']}"
    return said


def _question_asked(event: RunEvent, data: Mapping[str, Any]) -> str:
    said = f"the agent asks: {_first_line(str(data.get('question', '')), 120)}"
    options = data.get("options") or ()
    if options:
        said += " (" + " / ".join(str(o) for o in options) + ")"
    return said


def _question_answered(event: RunEvent, data: Mapping[str, Any]) -> str:
    if data.get("answer") is None:
        return f"the agent's question went unanswered{_why(data)}"
    return f"answered{_by(data)}: {_first_line(str(data['answer']), 120)}"


def _tool_decided(event: RunEvent, data: Mapping[str, Any]) -> str:
    decision = str(data.get("decision"))
    scope = {"once": " once", "session": " for the rest of the run"}.get(str(data.get("scope")), "")
    return f"tool request {data.get('request_id')} {decision}{scope}{_by(data)}{_why(data)}"


def _run_ended(event: RunEvent, data: Mapping[str, Any]) -> str:
    said = f"ended: {data.get('status')}"
    # only a failure's exit code says something (a stopped agent ends with 130)
    if data.get("exit_code") and data.get("status") not in ("completed", "stopped"):
        said += f" (exit {data['exit_code']})"
    return said + _why(data)


_SAY: dict[str, Callable[[RunEvent, Mapping[str, Any]], str]] = {
    EventKind.RUN_STARTED: _run_started,
    EventKind.RUN_RESUMED: lambda e, d: f"resumed (it was {d.get('from')})",
    EventKind.PHASE: lambda e, d: f"now in {d.get('phase')}",
    EventKind.PARKED: lambda e, d: "waiting" + (f" in {d['phase']}" if d.get("phase") else ""),
    EventKind.TURN_STARTED: _turn_started,
    EventKind.TURN_ENDED: _turn_ended,
    EventKind.NOTE: _note,
    EventKind.TASK_MOVED: _task_moved,
    EventKind.GATE_OPENED: _gate_opened,
    EventKind.GATE_DECIDED: _gate_decided,
    EventKind.TOOL_REQUESTED: _tool_requested,
    EventKind.TOOL_DECIDED: _tool_decided,
    EventKind.QUESTION_ASKED: _question_asked,
    EventKind.QUESTION_ANSWERED: _question_answered,
    EventKind.PAUSED: lambda e, d: f"paused{_by(d)}: it waits after the tool call it is in",
    EventKind.PAUSE_ENDED: lambda e, d: f"goes on{_by(d)}",
    EventKind.FILE_OUT: lambda e, d: "files handed over: " + ", ".join(d.get("paths") or ()),
    EventKind.INSTRUCTION: lambda e, d: (
        f"instruction for the next Execute turn{_by(d)}: {_first_line(str(d.get('text', '')), 120)}"
    ),
    EventKind.RUN_ENDED: _run_ended,
}


def what_happened(event: RunEvent) -> str:
    """What the event says happened, in words (no time)."""
    say = _SAY.get(event.kind)
    return say(event, event.data) if say is not None else event.kind.replace("_", " ")


def describe(event: RunEvent) -> str:
    """One line for people: the local time, then what happened."""
    return f"{time.strftime('%H:%M:%S', time.localtime(event.at))}  {what_happened(event)}"


async def print_events(log: EventLog, record: RunRecord, *, as_json: bool, follow: bool) -> int:
    """Print the run's events (an autopilot drive's: its task's gates too); with ``follow``,
    go on as they are written until the run ends."""
    task = record.task if record.mode == "autopilot" else None
    since = record.created_at if task is not None else None

    def show(event: RunEvent) -> None:
        print(json.dumps(event.to_json()) if as_json else describe(event), flush=True)

    cursor = 0
    ended = False  # what the newest of its starts, resumes and ends says
    while batch := await log.read(record.id, task=task, after=cursor, since=since):
        for event in batch:
            show(event)
            if event.run_id == record.id and event.kind in _LIFE:
                ended = event.ends_run
        cursor = batch[-1].id
    if not follow or ended:
        return 0
    async for event in log.follow(record.id, task=task, after=cursor, since=since):
        show(event)
    return 0


_LIFE = frozenset({EventKind.RUN_STARTED, EventKind.RUN_RESUMED, EventKind.RUN_ENDED})

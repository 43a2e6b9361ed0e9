"""The texts of chat messages, whatever the messenger renders them with: a Markdown
excerpt, a run's live status, a status line."""

from __future__ import annotations

import time

from engine.humane import format_elapsed, turn_count, words
from engine.sink import StatusUpdate

__all__ = ["excerpt", "last_line", "status_ended", "status_text"]

_ICONS = {"auto": "🤖", "autopilot": "🛂", "chat": "💬"}


def excerpt(markdown: str, *, lines: int = 8, chars: int = 600) -> str:
    """The head of a Markdown text, cut on a line (an unclosed code fence is closed)."""
    kept = markdown.strip().splitlines()[:lines]
    out = "\n".join(kept)
    if len(out) > chars:
        out = out[:chars].rsplit("\n", 1)[0] if "\n" in out[:chars] else out[:chars]
    if sum(line.lstrip().startswith("```") for line in out.splitlines()) % 2:
        out += "\n```"
    if out != markdown.strip():
        out += "\n…"
    return out


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def last_line(text: str) -> str:
    """The last non-empty line of ``text`` (Markdown marks stripped), for a status line."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip().lstrip("#>*-` ").rstrip("`* ")
        if line:
            return _one_line(line)
    return ""


def status_text(update: StatusUpdate, now: float | None = None) -> str:
    """The live status message: mode, run, turn of how many, elapsed, state, last event."""
    icon = _ICONS.get(update.mode, "▶️")
    mode = {"auto": "Auto run", "autopilot": "Autopilot", "chat": "Chat session"}.get(
        update.mode, update.mode
    )
    name = update.run_id.removeprefix(f"{update.mode}:")
    head = f"{icon} {mode} {name}"
    if update.task and update.task != name:
        head += f" · task {update.task}"
    parts = [words(update.status)]
    if update.phase:
        parts.append(
            words(update.phase).capitalize() if update.mode == "auto" else words(update.phase)
        )
    if update.turn or update.round:
        parts.append(
            turn_count(update.turn, round_=update.round, limit=update.max_turns, of=" of ")
        )
    if update.started_at is not None:
        parts.append(format_elapsed((now or time.time()) - update.started_at))
    if update.spent:
        parts.append(f"{update.spent} so far")
    text = head + "\n" + " · ".join(parts)
    if update.last_event:
        text += "\n" + _one_line(update.last_event, 300)
    return text


def status_ended(body: str) -> bool:
    """Whether a run's live status message says it ended (its second line, the state)."""
    lines = body.splitlines()
    if len(lines) < 2:
        return False
    ended = [words(s) for s in ("completed", "stopped", "error", "crashed")]
    return any(lines[1].startswith(w) for w in ended)

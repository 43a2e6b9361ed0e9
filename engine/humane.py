"""How people say a run's facts: elapsed time and states in words, never internal labels.

Every front end words runs the same way (the chat, the terminal, a web page).
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["exit_note", "format_elapsed", "humane", "turn_count", "words"]

_STATES: Final = {
    "running": "⏳ running",
    "completed": "✅ finished",
    "complete": "✅ complete",
    "stopped": "⏹ stopped",
    "turn_limit": "⏹ stopped at its round limit",
    "parked": "⏸ paused (the bot restarts)",
    "error": "⚠️ failed",
    "crashed": "⚠️ failed",
    "awaiting_approval": "🛂 waiting for approval",
    "human_intervention": "✋ waiting for a person",
}
_LABEL: Final = re.compile(r"\b([a-z][a-z_]*):awaiting_approval\b")


def format_elapsed(seconds: float) -> str:
    """``7s``, ``2m05s``, ``1h02m``."""
    whole = max(0, int(seconds))
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def exit_note(exit_code: int | None, stderr_tail: str = "") -> str:
    """Why a turn failed, as every front end says it: the agent's exit code and the end of
    its error output ("" for a turn that exited 0 or has no code). ``stderr_tail`` is
    redacted by the caller."""
    if exit_code in (None, 0):
        return ""
    said = f"⚠️ the agent exited with code {exit_code}"
    if stderr_tail.strip():
        said += f"\nIts error output ended with:\n{stderr_tail.strip()}"
    return said


def turn_count(
    turn: int, *, round_: int = 0, limit: int | None = None, of: str = "/", named: bool = True
) -> str:
    """How far a run is, counted one way everywhere: a turn is one agent turn.

    An auto run's limit counts rounds (Clarify is round 1, Plan 2, then each Execute and
    Evaluate, with its Adjust, one round): ``turn 4 · round 3/10``. Another run's limit, if
    any, counts turns: ``turn 4/10``; without one ``turn 4``. ``of`` joins a count and its
    limit (``" of "`` in a chat's sentence). ``named=False`` leaves out the leading word
    "turn" (a table's column says it): ``4 · round 3/10``.
    """
    head = "turn " if named else ""
    if round_:
        said = f"round {round_}{of}{limit}" if limit else f"round {round_}"
        return f"{head}{turn} · {said}" if turn else said
    return f"{head}{turn}{of}{limit}" if limit else f"{head}{turn}"


def words(state: str, *, icon: bool = True) -> str:
    """A run's or phase's state as people say it (never ``research:awaiting_approval``),
    with its icon (``✅ finished``) unless ``icon`` is False (where a front end marks states
    itself)."""
    said = _STATES.get(state)
    if said is not None:
        return said if icon else said.split(" ", 1)[1]
    phase, _, rest = state.partition(":")
    if rest:
        return f"{phase.replace('_', ' ')}, {words(rest, icon=False)}"
    return state.replace("_", " ")


def humane(text: str) -> str:
    """A run's text with the phase labels said in words (``design:awaiting_approval`` →
    ``design, waiting for approval``)."""
    pieces = re.split(r"(`[^`\n]*`)", text)
    for i in range(0, len(pieces), 2):  # commands in backquotes are typed as they are
        piece = _LABEL.sub(lambda m: f"{m[1].replace('_', ' ')}, waiting for approval", pieces[i])
        pieces[i] = piece.replace("human_intervention", "waiting for a person")
    return "".join(pieces)

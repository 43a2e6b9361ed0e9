"""The buttons of the chat sink's live messages, as Telegram's inline keyboards
(:class:`chatfront.sink.Controls`)."""

from __future__ import annotations

from typing import Any

from chatfront.progress import AUTO_STOP_DATA, AUTOPILOT_STOP_DATA, stop_button

__all__ = ["RAISE_BUDGET", "InlineControls"]

#: The button data of "raise the budget and go on" (then the run id).
RAISE_BUDGET = "bg:"

#: Telegram's limit on a button's callback data.
_MAX_DATA = 64


class InlineControls:
    """Stop (and Pause) buttons whose callback data the bot's handlers read."""

    def stop_drive(self, task: str) -> dict[str, Any] | None:
        """None: the task's name is too long for a button's 64 bytes (``/stop TASK``
        still stops it)."""
        if len(f"{AUTOPILOT_STOP_DATA}{task}".encode()) > _MAX_DATA:
            return None
        return stop_button(task, AUTOPILOT_STOP_DATA, paused=None)

    def stop_auto(self, run_id: str, *, paused: bool) -> dict[str, Any] | None:
        return stop_button(run_id, AUTO_STOP_DATA, paused=paused)

    def raise_budget(self, run_id: str, more: str) -> dict[str, Any] | None:
        button = {"text": f"⬆️ Raise to {more} and go on", "callback_data": RAISE_BUDGET + run_id}
        return {"inline_keyboard": [[button]]}

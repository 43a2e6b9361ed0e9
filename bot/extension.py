"""What a run front end (auto mode, autopilot) plugs into the bot's handlers."""

from __future__ import annotations

import asyncio
from typing import Any

from telegram import Update

__all__ = ["Extension"]


class Extension:
    """Default answers for every hook: nothing handled, nothing to stop or report.

    Subclasses override the hooks they serve; command hooks are ``cmd_<verb>(update, args)``.
    """

    async def on_text(self, update: Update, text: str, thread: int) -> bool:
        """A plain message; True when it was consumed."""
        return False

    async def on_media(self, update: Update, context: Any) -> bool:
        """A file, photo, video or voice note; True when it was consumed."""
        return False

    async def on_button(self, update: Update, data: str) -> bool:
        """A button press; True when the data was ours (and the query answered)."""
        return False

    async def stop(self, run_id: str, *, chat_id: int, by: int) -> bool:
        """Stop one run of this chat; True when it existed."""
        return False

    async def stop_chat(self, chat_id: int, thread: int, *, by: int) -> list[str]:
        """Stop every run of this chat or topic; returns their ids."""
        return []

    async def status_lines(self, chat_id: int) -> list[str]:
        return []

    async def recover(self) -> None:
        """At start-up: resume parked and crashed runs, refresh what people see."""

    async def shutdown(self, *, park: bool, preempt: asyncio.Event) -> None:
        """Stop starting turns; finish (or, with ``park``, pre-empt) the running ones."""

    async def park_all(self) -> None:
        """Pre-empt every running turn now (a second SIGTERM)."""

    def describe(self) -> dict[str, Any]:
        return {}

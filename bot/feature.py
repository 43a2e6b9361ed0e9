"""What every feature of the bot is: its handlers, its runs' stop and status, its life cycle."""

from __future__ import annotations

import asyncio

from bot.handlers import Dispatch
from engine.runs import Recovery
from engine.runs.spec import PlaceId

__all__ = ["Feature"]


class Feature:
    """Default answers for every hook: no handlers, nothing to stop or report.

    A feature receives the :class:`~bot.context.BotContext` when it is built, registers its
    handlers in :meth:`register`, and overrides the hooks it serves.
    """

    def register(self, dispatch: Dispatch) -> None:
        """Add this feature's commands, text and media filters and button patterns."""

    async def stop(self, run_id: str, *, chat_id: PlaceId, by: int) -> bool:
        """Stop one run of this chat; True when it existed."""
        return False

    async def stop_chat(self, chat_id: PlaceId, thread: PlaceId | None, *, by: int) -> list[str]:
        """Stop every run of this chat or topic; returns their ids."""
        return []

    async def status_lines(self, chat_id: PlaceId, thread: PlaceId | None) -> list[str]:
        """This feature's lines of ``/status`` in the chat (and topic)."""
        return []

    async def pending_for(self, user_id: int, chat_id: PlaceId) -> list[str]:
        """What waits for ``user_id`` (asking in ``chat_id``) that this feature posted, one
        item each, with how to act on it (``/pending``)."""
        return []

    async def recover(self, report: Recovery) -> None:
        """At start-up, after the supervisor's recovery (``report``): resume and announce
        this feature's runs, refresh what people see."""

    async def shutdown(self, *, park: bool, preempt: asyncio.Event) -> None:
        """Stop starting turns; finish (or, with ``park``, pre-empt) the running ones."""

    async def park_all(self) -> None:
        """Pre-empt every running turn now (a second SIGTERM)."""

"""The bot's :class:`engine.sink.RunSink`: a run's texts, live status and gates as chat messages."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bot.publish import Publisher, format_elapsed
from engine.errors import NotFoundError
from engine.runs import ChatPlace
from engine.sink import GateRequest, StatusUpdate
from engine.store.runs import SqliteRunStore

__all__ = ["BotSink", "ChatPlace", "status_text"]

_LOGGER = logging.getLogger(__name__)

_ICONS = {"auto": "🤖", "autopilot": "🛂", "chat": "💬"}


def status_text(update: StatusUpdate, now: float | None = None) -> str:
    """The live status message: mode, run, phase, turn, elapsed, last event."""
    icon = _ICONS.get(update.mode, "▶️")
    name = update.run_id.removeprefix(f"{update.mode}:")
    head = f"{icon} {update.mode} {name}"
    if update.task and update.task != name:
        head += f" · task {update.task}"
    parts = [update.status]
    if update.phase:
        parts.append(f"phase {update.phase}")
    if update.turn:
        parts.append(
            f"turn {update.turn}/{update.max_turns}" if update.max_turns else f"turn {update.turn}"
        )
    if update.started_at is not None:
        parts.append(format_elapsed((now or time.time()) - update.started_at))
    text = head + "\n" + " · ".join(parts)
    if update.last_event:
        event = " ".join(update.last_event.split())
        text += "\n" + (event if len(event) <= 300 else event[:299] + "…")
    return text


# Posts a gate in its chat (bot.autopilot).
GateHandler = Callable[[GateRequest, ChatPlace], Awaitable[None]]
# Sends files of a run's folder to its chat: (place, run id, workdir, paths) (bot.files).
FilesHandler = Callable[[ChatPlace, str, Path, list[str]], Awaitable[None]]
# The chat of a run the runs table does not place (an autopilot drive's sub-task); None:
# not known to this resolver.
PlaceResolver = Callable[[str], Awaitable["ChatPlace | None"]]


class BotSink:
    """Routes each run's reports to the chat (and topic) it belongs to."""

    def __init__(self, publisher: Publisher, runs: SqliteRunStore) -> None:
        self._publisher = publisher
        self._runs = runs
        self._places: dict[str, ChatPlace] = {}
        self._tasks: dict[str, ChatPlace] = {}
        self._on_gate: GateHandler | None = None
        self._on_files: FilesHandler | None = None
        self._resolvers: list[PlaceResolver] = []

    # -- what features plug in ---------------------------------------------------------

    def post_gates_with(self, handler: GateHandler) -> None:
        """The one feature that posts gates.

        Raises:
            RuntimeError: another one already does.
        """
        if self._on_gate is not None:
            raise RuntimeError("gates are already posted by another feature")
        self._on_gate = handler

    def send_files_with(self, handler: FilesHandler) -> None:
        """The one feature that sends a run's files.

        Raises:
            RuntimeError: another one already does.
        """
        if self._on_files is not None:
            raise RuntimeError("files are already sent by another feature")
        self._on_files = handler

    def resolve_places_with(self, resolver: PlaceResolver) -> None:
        """Asked, in order, for a run the sink has not placed yet (before the runs table)."""
        self._resolvers.append(resolver)

    # -- places ------------------------------------------------------------------------

    def register(self, run_id: str, place: ChatPlace, *, task: str | None = None) -> None:
        self._places[run_id] = place
        if task is not None:
            self._tasks[task] = place

    def place_of_task(self, task: str) -> ChatPlace | None:
        return self._tasks.get(task)

    async def place(self, run_id: str) -> ChatPlace | None:
        place = self._places.get(run_id)
        if place is not None:
            return place
        for resolve in self._resolvers:
            place = await resolve(run_id)
            if place is not None:
                self._places[run_id] = place
                return place
        try:
            run = await self._runs.get_run(run_id)
        except NotFoundError:
            return None
        if run.chat_id is None:
            return None
        place = ChatPlace(run.chat_id, run.thread_id)
        self._places[run_id] = place
        return place

    async def publish_text(self, run_id: str, text: str) -> None:
        place = await self.place(run_id)
        if place is None:
            _LOGGER.info("%s", text, extra={"run_id": run_id})
            return
        await self._publisher.say(
            place.chat_id, text, thread_id=place.thread_id, markdown=True, run_id=run_id
        )

    async def send_files(self, run_id: str, workdir: Path, paths: list[str]) -> None:
        place = await self.place(run_id)
        if place is None or self._on_files is None:
            _LOGGER.info("files %s of run %s have no chat to go to", paths, run_id)
            return
        await self._on_files(place, run_id, workdir, paths)

    async def update_status(self, update: StatusUpdate) -> None:
        place = await self.place(update.run_id)
        if place is None:
            return
        await self._publisher.live(
            f"status:{update.run_id}",
            status_text(update),
            chat_id=place.chat_id,
            thread_id=place.thread_id,
            run_id=update.run_id,
        )

    async def request_gate(self, request: GateRequest) -> None:
        place = self._tasks.get(request.task)
        if place is None and request.run_id is not None:
            place = await self.place(request.run_id)
        if place is None or self._on_gate is None:
            _LOGGER.warning(
                "gate for task %s phase %s has no chat to go to", request.task, request.phase
            )
            return
        await self._on_gate(request, place)

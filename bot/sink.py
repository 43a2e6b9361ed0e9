"""The bot's :class:`engine.sink.RunSink`: a run's texts, live status and gates as chat messages."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from bot.publish import Publisher, format_elapsed
from engine.errors import NotFoundError
from engine.sink import GateRequest, StatusUpdate
from engine.store.runs import SqliteRunStore

__all__ = ["BotSink", "ChatPlace", "status_text"]

_LOGGER = logging.getLogger(__name__)

_ICONS = {"auto": "🤖", "autopilot": "🛂", "chat": "💬"}


@dataclass(frozen=True, slots=True)
class ChatPlace:
    chat_id: int
    thread_id: int | None


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


GateHandler = Callable[[GateRequest, ChatPlace], Awaitable[None]]
# Sends files of a run's folder to its chat: (place, run id, workdir, paths).
FilesHandler = Callable[[ChatPlace, str, Path, list[str]], Awaitable[None]]


class BotSink:
    """Routes each run's reports to the chat (and topic) it belongs to."""

    def __init__(
        self,
        publisher: Publisher,
        runs: SqliteRunStore,
        *,
        on_gate: GateHandler | None = None,
    ) -> None:
        self._publisher = publisher
        self._runs = runs
        self._places: dict[str, ChatPlace] = {}
        self._tasks: dict[str, ChatPlace] = {}
        self.on_gate = on_gate
        self.on_files: FilesHandler | None = None
        self.resolve: Callable[[str], Awaitable[ChatPlace | None]] | None = None

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
        if self.resolve is not None:
            place = await self.resolve(run_id)
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
        if place is None or self.on_files is None:
            _LOGGER.info("files %s of run %s have no chat to go to", paths, run_id)
            return
        await self.on_files(place, run_id, workdir, paths)

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
        if place is None or self.on_gate is None:
            _LOGGER.warning(
                "gate for task %s phase %s has no chat to go to", request.task, request.phase
            )
            return
        await self.on_gate(request, place)

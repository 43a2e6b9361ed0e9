"""A turn's progress in the chat: one message under the message that asked, edited live.

The message shows the elapsed time, the tool the agent is running and the last line of
its text, with a ⏹ Stop button (operators). It is created the moment the turn starts and
edited as often as the outbox allows (about once a second in a private chat, slower in a
group); when the turn ends it is finalized in place ("done in 12s", "stopped by Ann")
and loses its button. A progress message left by a bot that stopped mid-turn is settled
at the next start ("stopped by a restart"), never left saying "running".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from chatfront.publish import Publisher
from chatfront.store import BotStore
from engine.agents.stream import AgentEvent, EventKind
from engine.errors import StoreUnreachableError
from engine.humane import format_elapsed
from engine.runs.spec import PlaceId

_LOGGER = logging.getLogger(__name__)

__all__ = [
    "AUTOPILOT_STOP_DATA",
    "AUTO_STOP_DATA",
    "GO_ON_DATA",
    "PAUSE_DATA",
    "PREFIX",
    "STOP_DATA",
    "TurnProgress",
    "pause_button",
    "settle_leftovers",
    "stop_button",
]

PREFIX: Final = "progress:"
# callback_data of the Stop button: "st:" + the run id (well under Telegram's 64 bytes).
STOP_DATA: Final = "st:"
_RUNNING: Final = "⏳"
_LINE: Final = 160


# callback_data of an auto run's Stop button (on its live message; wherever it runs).
AUTO_STOP_DATA: Final = "sw:"
# callback_data of an autopilot drive's Stop button (its running phase, its wave): the task.
AUTOPILOT_STOP_DATA: Final = "sx:"
# callback_data of Pause and Go on: the prefix and the run id.
PAUSE_DATA: Final = "pz:"
GO_ON_DATA: Final = "go:"


def pause_button(run_id: str, *, paused: bool) -> dict[str, str]:
    """⏸ Pause, or (paused) ▶ Go on."""
    if paused:
        return {"text": "▶ Go on", "callback_data": f"{GO_ON_DATA}{run_id}"}
    return {"text": "⏸ Pause", "callback_data": f"{PAUSE_DATA}{run_id}"}


def stop_button(
    run_id: str, data: str = STOP_DATA, *, paused: bool | None = False
) -> dict[str, Any]:
    """Stop, and Pause (or Go on) unless ``paused`` is None (the run cannot pause)."""
    row = [{"text": "⏹ Stop", "callback_data": f"{data}{run_id}"}]
    if paused is not None:
        row.append(pause_button(run_id, paused=paused))
    return {"inline_keyboard": [row]}


# What names a tool call best, of the inputs a CLI reports as JSON (Claude Code's
# ``{"command": …, "description": …}``), first found first.
_DETAIL_KEYS: Final = ("command", "file_path", "path", "pattern", "url", "query", "description")
_JSON_STRING: Final = r'"{key}"\s*:\s*"((?:[^"\\]|\\.)*)'


def _tool_detail(text: str) -> str:
    """The command, path or pattern of a tool call rather than its raw JSON input."""
    if not text.lstrip().startswith("{"):
        return text
    with contextlib.suppress(ValueError):
        data = json.loads(text)
        if isinstance(data, dict):
            for key in _DETAIL_KEYS:
                if isinstance(data.get(key), str) and data[key].strip():
                    return str(data[key])
            return text
    for key in _DETAIL_KEYS:  # cut short by the adapter: read what is there
        found = re.search(_JSON_STRING.format(key=key), text)
        if found and found[1].strip():
            return found[1].replace('\\"', '"').replace("\\n", " ")
    return text


def _line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _LINE else line[: _LINE - 1] + "…"


class TurnProgress:
    """The progress message of one turn."""

    def __init__(
        self,
        publisher: Publisher,
        *,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        run_id: str,
        turn: int,
        reply_to: int | None,
        clock: Callable[[], float] = time.time,
        prefix: str = PREFIX,
        stop_data: str = STOP_DATA,
        paused: Mapping[str, str] | None = None,
    ) -> None:
        self._publisher = publisher
        self.chat_id = chat_id
        self.thread_id = thread_id
        self.run_id = run_id
        self.turn = turn
        self.reply_to = reply_to
        self.ref = f"{prefix}{run_id}:{turn}"
        self._stop_data = stop_data
        # Runs paused now, and what their message says of it (kept by the front end).
        self._paused = paused if paused is not None else {}
        self._clock = clock
        self.started = clock()
        # Where the turn runs, when not here (a worker's name): a line of its own.
        self.where: str | None = None
        self.tool: str | None = None
        self.text: str | None = None
        self.tools = 0
        #: What the turn waits for a person for (a tool request, a question), while it does.
        self.waiting: str | None = None
        self.finished = False
        self._opening: asyncio.Task[None] | None = None

    def open_soon(self, reply_to: Awaitable[int | None]) -> None:
        """Post the message without holding up the turn: the agent is spawned meanwhile
        (finding the message it answers and queueing it are two database round trips)."""

        async def opening() -> None:
            try:
                self.reply_to = await reply_to
                await self.show()
            except StoreUnreachableError as exc:  # an outage: said in one line
                _LOGGER.warning("could not post the progress of %s: %s", self.ref, exc)
            except Exception:  # a progress message never fails the turn it shows
                _LOGGER.warning("could not post the progress of %s", self.ref, exc_info=True)

        self._opening = asyncio.create_task(opening(), name=f"progress {self.ref}")

    async def opened(self) -> None:
        """Once the message is queued (and ``reply_to`` known)."""
        task = self._opening
        if task is not None and task is not asyncio.current_task():
            await asyncio.shield(task)

    async def wait_for_person(self, what: str | None) -> None:
        """The turn waits for a person (``what``: for what), or no longer (None)."""
        if self.waiting == what:
            return
        self.waiting = what
        await self.show()

    def on_event(self, event: AgentEvent) -> bool:
        """Take one agent event; True when the message should change."""
        if event.kind is EventKind.TOOL_USE:
            self.tools += 1
            detail = _line(_tool_detail(event.text))[:80]
            self.tool = f"🔧 {event.tool or 'tool'}" + (f": {detail}" if detail else "")
            return True
        if event.kind is EventKind.TOOL_RESULT and event.is_error:
            self.tool = f"⚠️ {event.tool or 'tool'} failed"
            return True
        if event.kind is EventKind.TEXT:
            lines = [line for line in event.text.splitlines() if line.strip()]
            if lines:
                self.text = _line(lines[-1])
                return True
        return False

    def body(self, final: str | None = None) -> str:
        elapsed = format_elapsed(self._clock() - self.started)
        if final is not None:
            state = f"{final} · {elapsed}"
            if self.tools:
                state += f" · {self.tools} tool call{'s' if self.tools != 1 else ''}"
            return state
        if self.waiting:  # a tool request or a question: the turn waits for a person
            lines = [f"{_RUNNING} waits for a person · {elapsed}", self.waiting]
        else:
            lines = [f"{_RUNNING} working · {elapsed}"]
        if self.run_id in self._paused:
            lines.append(self._paused[self.run_id])
        if self.where:
            lines.append(f"🖥 {self.where}")
        if self.tool:
            lines.append(self.tool)
        if self.text:
            lines.append(f"💬 {self.text}")
        return "\n".join(lines)

    async def show(self) -> None:
        await self.opened()
        if self.finished:
            return
        await self._publisher.live(
            self.ref,
            self.body(),
            chat_id=self.chat_id,
            thread_id=self.thread_id,
            markup=stop_button(self.run_id, self._stop_data, paused=self.run_id in self._paused),
            run_id=self.run_id,
            reply_to=self.reply_to,
        )

    async def finish(self, final: str) -> None:
        """Finalize the message in place (no button any more)."""
        await self.opened()
        if self.finished:
            return
        self.finished = True
        await self._publisher.live(
            self.ref,
            self.body(final),
            chat_id=self.chat_id,
            thread_id=self.thread_id,
            run_id=self.run_id,
            reply_to=self.reply_to,
        )


async def settle_leftovers(store: BotStore, publisher: Publisher) -> int:
    """Progress messages of turns a stopped bot left running say so; returns how many."""
    settled = 0
    for live in await store.live_with_prefix(PREFIX):
        if live.markup is None:
            continue  # finalized already
        await store.set_live(
            live.ref,
            chat_id=live.chat_id,
            thread_id=live.thread_id,
            body=live.body.split("\n", 1)[0]
            .replace(_RUNNING, "⏹", 1)
            .replace("working", "stopped by a restart", 1),
        )
        settled += 1
    if settled:
        publisher.wake()
    return settled

"""Fakes for tests and benchmarks, shipped with the engine (like httpx's MockTransport).

No mocks: each fake is a small real implementation of a port.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable

from engine.errors import ChannelError, TurnError
from engine.turn import BaseChannel, Closed, Idle, NextPrompt, Ready, TurnOutput

__all__ = ["FakeClock", "QueueChannel", "RecordingChannel", "ScriptedSession"]


class ScriptedSession:
    """An :class:`~engine.turn.AgentSession` that answers from a script.

    Each reply is a string, a :class:`TurnOutput`, a :class:`TurnError` to raise, or a
    callable taking the prompt. With no script left it echoes ``echo: PROMPT``.
    """

    def __init__(
        self,
        replies: Iterable[str | TurnOutput | TurnError | Callable[[str], TurnOutput]] = (),
        *,
        session_id: str = "scripted",
    ) -> None:
        self._replies = deque(replies)
        self._session_id = session_id
        self.prompts: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.gate: asyncio.Event | None = None

    @property
    def session_id(self) -> str:
        return self._session_id

    async def run_turn(self, prompt: str) -> TurnOutput:
        self.prompts.append(prompt)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            reply = self._replies.popleft() if self._replies else None
            if reply is None:
                return TurnOutput.from_text(f"echo: {prompt}")
            if isinstance(reply, TurnError):
                raise reply
            if isinstance(reply, TurnOutput):
                return reply
            if isinstance(reply, str):
                return TurnOutput.from_text(reply)
            return reply(prompt)
        finally:
            self.in_flight -= 1


class RecordingChannel(BaseChannel):
    """Yields a fixed list of prompts, then ``Closed``; records what was published.

    ``events`` interleaves ``("next", n)`` and ``("publish", text)`` so tests can check order.
    """

    def __init__(
        self,
        prompts: Iterable[str] = (),
        *,
        publish_error: ChannelError | None = None,
        channel_id: str = "recording",
    ) -> None:
        super().__init__(channel_id)
        self._prompts = deque(prompts)
        self._publish_error = publish_error
        self.published: list[TurnOutput] = []
        self.events: list[tuple[str, object]] = []
        self.polls = 0

    async def next_prompt(self) -> NextPrompt:
        self.polls += 1
        self.events.append(("next", self.polls))
        if self._prompts:
            return Ready(self._prompts.popleft())
        return Closed()

    async def publish_output(self, out: TurnOutput) -> None:
        self.events.append(("publish", out.text))
        if self._publish_error is not None:
            raise self._publish_error
        self.published.append(out)


class QueueChannel(BaseChannel):
    """An inbound queue: ``Idle`` while empty, ``Closed`` after :meth:`close`."""

    def __init__(self, channel_id: str = "queue") -> None:
        super().__init__(channel_id)
        self._queue: deque[str] = deque()
        self._closed = False
        self.published: list[TurnOutput] = []
        self.polls = 0
        self.idle_polls = 0
        self.published_event = asyncio.Event()

    def push(self, prompt: str) -> None:
        self._queue.append(prompt)
        self.notify_inbound()

    def close(self) -> None:
        self._closed = True
        self.notify_inbound()

    async def next_prompt(self) -> NextPrompt:
        self.polls += 1
        if self._queue:
            return Ready(self._queue.popleft())
        if self._closed:
            return Closed()
        self.idle_polls += 1
        return Idle()

    async def publish_output(self, out: TurnOutput) -> None:
        self.published.append(out)
        self.published_event.set()


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

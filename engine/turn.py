"""The turn model: an agent session driven one prompt at a time by a channel.

A turn runs to natural completion (the agent process exits); the same session is
resumed every turn; every failure is a typed error that propagates.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, TypeAlias, runtime_checkable

from engine.errors import (
    ChannelError,
    ChannelPublishError,
    ChannelRecvError,
    InvalidPromptError,
    TurnError,
    TurnExecError,
    TurnIOError,
    TurnPreempted,
)
from engine.logs import log_context

__all__ = [
    "AgentSession",
    "BaseChannel",
    "Channel",
    "ChannelError",
    "ChannelId",
    "ChannelPublishError",
    "ChannelRecvError",
    "Closed",
    "Idle",
    "InvalidPromptError",
    "NextPrompt",
    "Ready",
    "TurnError",
    "TurnExecError",
    "TurnIOError",
    "TurnOutput",
    "TurnPreempted",
    "run_session_loop",
]

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChannelId:
    """An opaque identifier for a channel, for logs and correlation."""

    value: str

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Ready:
    """A prompt is ready to run this turn."""

    prompt: str


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing to run yet: wait for inbound activity, then poll again."""


@dataclass(frozen=True, slots=True)
class Closed:
    """The channel is permanently done."""


NextPrompt: TypeAlias = Ready | Idle | Closed


@dataclass(frozen=True, slots=True)
class TurnOutput:
    """What one turn produced, captured verbatim.

    Attributes:
        text: the agent's response (the head of it when ``spill_path`` is set).
        exit_code: the process exit code when one was recorded.
        spill_path: the file holding the whole stdout when it exceeded the in-memory cap.
        size: the full size of stdout in bytes (equals ``len(text.encode())`` unless spilled).
        metadata: adapter facts about the turn (model turns, usage, cost, agent session id).
    """

    text: str
    exit_code: int | None = None
    spill_path: Path | None = None
    size: int | None = None
    metadata: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_text(cls, text: str) -> TurnOutput:
        """Wrap a response body verbatim, with no exit code."""
        return cls(text=text)

    def with_exit_code(self, code: int) -> TurnOutput:
        """Return a copy carrying ``code`` (last write wins)."""
        return replace(self, exit_code=code)

    @property
    def stderr_tail(self) -> str:
        """The redacted end of the agent's stderr (at most 1 KB; empty when it printed none)."""
        value = self.metadata.get("stderr_tail")
        return value if isinstance(value, str) else ""

    @property
    def spilled(self) -> bool:
        """Whether the full output lives in ``spill_path`` rather than in ``text``."""
        return self.spill_path is not None

    def full_text(self) -> str:
        """The whole output, reading the spill file when there is one."""
        if self.spill_path is None:
            return self.text
        return self.spill_path.read_bytes().decode("utf-8", errors="replace")


@runtime_checkable
class AgentSession(Protocol):
    """One agent session, resumed every turn."""

    @property
    def session_id(self) -> str:
        """The stable id of the resumed session."""
        ...

    async def run_turn(self, prompt: str) -> TurnOutput:
        """Run one turn to natural completion, resuming the same session."""
        ...


@runtime_checkable
class Channel(Protocol):
    """Feeds prompts to a session and publishes what each turn produced."""

    @property
    def id(self) -> ChannelId:
        """A stable id for logs."""
        ...

    async def next_prompt(self) -> NextPrompt:
        """Ready(prompt), Idle when there is nothing yet, Closed once done."""
        ...

    async def publish_output(self, out: TurnOutput) -> None:
        """Publish a finished turn's output."""
        ...

    async def wait_for_inbound(self) -> None:
        """Return when something arrived that may make the next poll Ready or Closed."""
        ...


class BaseChannel:
    """A channel base: ``publish_output`` is a no-op; inbound is an ``asyncio.Event``.

    Subclasses call :meth:`notify_inbound` whenever something arrives; the driver
    loop waits in :meth:`wait_for_inbound` and wakes at once, without a timeout.
    """

    def __init__(self, channel_id: ChannelId | str) -> None:
        self._id = channel_id if isinstance(channel_id, ChannelId) else ChannelId(channel_id)
        self._inbound = asyncio.Event()

    @property
    def id(self) -> ChannelId:
        return self._id

    async def next_prompt(self) -> NextPrompt:
        raise NotImplementedError

    async def publish_output(self, out: TurnOutput) -> None:
        return None

    def notify_inbound(self) -> None:
        """Wake a loop waiting for inbound activity."""
        self._inbound.set()

    async def wait_for_inbound(self) -> None:
        await self._inbound.wait()
        self._inbound.clear()


async def run_session_loop(session: AgentSession, channel: Channel) -> None:
    """Drive ``session`` from ``channel`` until the channel closes.

    ``Ready`` runs one turn, then publishes it, before the next poll; ``Idle`` waits
    for inbound activity (no timeout, no spinning); ``Closed`` returns. The first
    ``TurnError`` or ``ChannelError`` propagates unchanged.
    """
    _LOGGER.debug("session loop start channel=%s session=%s", channel.id, session.session_id)
    # Every line logged by the turns (process, adapter, channel) carries the session id.
    with log_context(session_id=session.session_id):
        while True:
            match await channel.next_prompt():
                case Ready(prompt=prompt):
                    out = await session.run_turn(prompt)
                    await channel.publish_output(out)
                case Idle():
                    await channel.wait_for_inbound()
                case Closed():
                    _LOGGER.debug("session loop closed channel=%s", channel.id)
                    return
                case other:  # pragma: no cover - guarded by the type
                    raise ChannelRecvError(f"channel {channel.id} yielded {other!r}")

"""How runs report to a front end (the terminal, the Telegram bot) without knowing it.

Auto mode and the autopilot driver take a :class:`RunSink`; the terminal uses
:class:`LogSink`, the bot implements the protocol with chat messages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = ["FileSink", "GateRequest", "LogSink", "NullSink", "RunSink", "StatusUpdate"]

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StatusUpdate:
    """A run's live status: what a status message shows, edited in place."""

    run_id: str
    mode: str
    status: str
    phase: str | None = None
    turn: int = 0
    max_turns: int | None = None
    started_at: float | None = None
    last_event: str | None = None
    task: str | None = None


@dataclass(frozen=True, slots=True)
class GateRequest:
    """A phase waits for a person's approval of one artifact."""

    task: str
    phase: str
    artifact_name: str
    artifact_path: Path
    sha256: str
    excerpt: str
    run_id: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def short_hash(self) -> str:
        return self.sha256[:12]


class RunSink(Protocol):
    """Where a run's texts, status and gate requests go."""

    async def publish_text(self, run_id: str, text: str) -> None:
        """A message for the people following the run (turn output, warnings, results)."""
        ...

    async def update_status(self, update: StatusUpdate) -> None:
        """The run's live status changed."""
        ...

    async def request_gate(self, request: GateRequest) -> None:
        """A gate opened: show the artifact and ask for approval."""
        ...


@runtime_checkable
class FileSink(Protocol):
    """A sink that can hand files of the run's folder to the people following the run
    (the agent's ``TURNSTILE-SEND: path`` lines)."""

    async def send_files(self, run_id: str, workdir: Path, paths: list[str]) -> None:
        """Send ``paths`` (relative to ``workdir``, untrusted: checked by the sink)."""
        ...


class NullSink:
    """Discards everything."""

    async def publish_text(self, run_id: str, text: str) -> None:
        return None

    async def update_status(self, update: StatusUpdate) -> None:
        return None

    async def request_gate(self, request: GateRequest) -> None:
        return None


class LogSink:
    """The terminal's sink: everything goes to the log."""

    async def send_files(self, run_id: str, workdir: Path, paths: list[str]) -> None:
        for path in paths:
            _LOGGER.info("the agent hands over %s (in %s)", path, workdir, extra={"run_id": run_id})

    async def publish_text(self, run_id: str, text: str) -> None:
        _LOGGER.info("%s", text, extra={"run_id": run_id})

    async def update_status(self, update: StatusUpdate) -> None:
        _LOGGER.info(
            "status %s phase=%s turn=%s",
            update.status,
            update.phase,
            update.turn,
            extra={"run_id": update.run_id},
        )

    async def request_gate(self, request: GateRequest) -> None:
        _LOGGER.info(
            "gate open: task %s phase %s awaits approval of %s (sha256 %s); approve with "
            "`turnstile status --task %s --approve --by USER_ID`",
            request.task,
            request.phase,
            request.artifact_name,
            request.short_hash,
            request.task,
            extra={"task": request.task, "phase": request.phase},
        )

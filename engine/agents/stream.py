"""What the three real agent CLIs share: JSON-lines output, progress events, sessions.

Claude Code, the Copilot CLI and Codex each print one JSON object per stdout line while
a turn runs. :class:`JsonStreamAgent` parses every line as it arrives (a malformed line
ends the turn with :class:`~engine.errors.TurnIOError` naming the line), turns the CLI's
own records into :class:`AgentEvent` progress events for an ``on_event`` callback, and
tracks whether the CLI already knows the session (first turn creates it, every later
turn resumes it).

The prompt always reaches the CLI on stdin, never in argv: Linux caps one argv element at
128 KiB (a 1 MB prompt would not even spawn), stdin cannot be mistaken for a flag when the
prompt starts with ``-``, and the prompt stays out of ``ps`` listings.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import uuid
from abc import abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

from engine.agents.base import AgentOptions, Invocation, ProcessAgent, without_settings
from engine.agents.registry import AGENTS
from engine.errors import ConfigError, TurnExecError, TurnIOError
from engine.process import PreemptHandle, ProcessResult, default_spill_dir
from engine.reaper import TURN_MARKER_VAR, kill_marked
from engine.redact import redact, tail
from engine.turn import TurnOutput

__all__ = [
    "TURN_MARKER_VAR",
    "AgentEvent",
    "EventCallback",
    "EventKind",
    "EventStream",
    "JsonLines",
    "JsonStreamAgent",
    "find_binary",
    "kill_marked",
]

_LOGGER = logging.getLogger(__name__)

# How much of a bad line an error message quotes.
_QUOTE = 200
# How much of the CLI's own error text our plain-words messages carry.
_DETAIL = 2048


class EventKind(StrEnum):
    """What a progress event reports."""

    SESSION = "session"  # the CLI opened (or resumed) the session
    TEXT = "text"  # assistant text
    TOOL_USE = "tool_use"  # the agent asked to run a tool
    TOOL_RESULT = "tool_result"  # a tool finished (``is_error`` when it failed or was denied)
    ERROR = "error"  # the CLI reported an error (model API, turn failure)
    RESULT = "result"  # the CLI's final record of the turn
    TURN_END = "turn_end"  # the process is gone; always the last event of a turn


@dataclass(frozen=True, slots=True)
class AgentEvent:
    """One progress event of a running turn.

    Attributes:
        kind: what happened.
        session_id: the agent session the turn belongs to.
        text: assistant text, a tool's command or output, or an error message.
        tool: the tool's name as the CLI calls it (``Write``, ``create``, ``command``...).
        tool_id: pairs a ``TOOL_RESULT`` with its ``TOOL_USE``.
        is_error: the tool failed or was denied, or the turn failed.
        line: the stdout line the event came from (0 for ``TURN_END``).
        raw: the CLI's own record, for callers that need more.
    """

    kind: EventKind
    session_id: str
    text: str = ""
    tool: str | None = None
    tool_id: str | None = None
    is_error: bool = False
    line: int = 0
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


EventCallback = Callable[[AgentEvent], None]


class EventStream:
    """An ``on_event`` callback that can be read as an async iterator.

    Iteration ends after a ``TURN_END`` event, so one ``async for`` covers one turn::

        stream = EventStream()
        agent.on_event = stream
        task = asyncio.create_task(agent.run_turn("fix the bug"))
        async for event in stream:
            ...
        out = await task
    """

    def __init__(self) -> None:
        self._queue: asyncio.Queue[AgentEvent] = asyncio.Queue()

    def __call__(self, event: AgentEvent) -> None:
        self._queue.put_nowait(event)

    def __aiter__(self) -> AsyncIterator[AgentEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[AgentEvent]:
        while True:
            event = await self._queue.get()
            yield event
            if event.kind is EventKind.TURN_END:
                return


class JsonLines:
    """Parses one turn's stdout, one JSON object per line, counting lines from 1."""

    def __init__(self, program: str) -> None:
        self.program = program
        self.line = 0

    def parse(self, raw: bytes) -> dict[str, Any] | None:
        """The object on this line; None for a blank line.

        Raises:
            TurnIOError: the line is not a JSON object (``line`` says which one).
        """
        self.line += 1
        text = raw.strip()
        if not text:
            return None
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise TurnIOError(
                f"{self.program} printed malformed JSON on stdout line {self.line}: {_quote(text)}",
                line=self.line,
            ) from exc
        if not isinstance(value, dict):
            raise TurnIOError(
                f"{self.program} printed JSON that is not an object on stdout line "
                f"{self.line}: {_quote(text)}",
                line=self.line,
            )
        return value


def _quote(raw: bytes) -> str:
    shown = raw[:_QUOTE].decode("utf-8", errors="replace")
    more = f"... ({len(raw)} bytes)" if len(raw) > _QUOTE else ""
    return repr(redact(shown)) + more


def find_binary(binary: str, path: str | None) -> str | None:
    """The program's full path, or None when it cannot be run.

    A name with a slash is a path (relative ones resolve against our cwd); anything
    else is looked up on ``path`` (the turn's ``PATH``).
    """
    if os.sep in binary:
        candidate = Path(binary).expanduser()
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return os.path.abspath(candidate)
        return None
    return shutil.which(binary, path=path)


@dataclass(slots=True)
class TurnState:
    """What one turn's stream said so far (reset before every turn)."""

    texts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    result: dict[str, Any] | None = None
    session_missing: bool = False
    events: int = 0
    tool_calls: int = 0
    model_turns: int = 0
    usage: dict[str, Any] | None = None


class JsonStreamAgent(ProcessAgent):
    """A real agent CLI driven one process per turn, printing JSON lines.

    Subclasses give the CLI's argv for a turn (:meth:`turn_argv`), its isolation
    environment (:meth:`isolation_env`), read each JSON record (:meth:`handle`) and
    compose the output (:meth:`compose`).

    Attributes:
        on_event: called with each :class:`AgentEvent` while the turn runs (in the
            event loop's thread; keep it quick). May be set after construction.
        started: whether the CLI already knows this session (the next turn resumes it).
    """

    cli_name: ClassVar[str]
    agent_name: ClassVar[str]  # its entry in engine.agents.registry.AGENTS
    requires_uuid: ClassVar[bool] = True

    def __init__(
        self,
        options: AgentOptions,
        *,
        session_id: str | None = None,
        preempt: PreemptHandle | None = None,
        resume: bool = False,
        on_event: EventCallback | None = None,
    ) -> None:
        if resume and not session_id:
            raise ConfigError(f"resuming a {self.cli_name} session needs its session id")
        if session_id is not None and self.requires_uuid and not resume:
            try:
                uuid.UUID(session_id)
            except ValueError as exc:
                raise ConfigError(
                    f"{self.cli_name} session ids are UUIDs; got {session_id!r}"
                ) from exc
        super().__init__(options, session_id=session_id, preempt=preempt)
        self.on_event = on_event
        self.started = resume
        self._parser = JsonLines(self.cli_name)
        self.turn = TurnState()

    # -- what subclasses provide --------------------------------------------------------
    @abstractmethod
    def turn_argv(self, program: str) -> list[str]:
        """The argv of the next turn (the prompt goes to stdin)."""

    def isolation_env(self) -> dict[str, str]:
        """Variables that keep this session's CLI state apart (from ``config_dir``)."""
        return {}

    def default_env(self) -> dict[str, str]:
        """Variables the adapter sets unless the user's ``extra_env`` says otherwise."""
        return {}

    def turn_env(self) -> dict[str, str]:
        """Variables this turn needs whatever the user says (e.g. for the allowlist)."""
        return {}

    @abstractmethod
    def handle(self, record: dict[str, Any]) -> None:
        """Read one JSON record of the running turn (call :meth:`emit` for progress)."""

    @abstractmethod
    def compose(self, result: ProcessResult) -> TurnOutput:
        """The turn's output from :attr:`turn` and the finished process."""

    def check_prompt(self, prompt: str) -> None:
        """Refuse a prompt this CLI cannot take (raise ``InvalidPromptError``)."""

    # -- the template ------------------------------------------------------------------
    @property
    def line(self) -> int:
        """The stdout line being read (1-based) in the running turn."""
        return self._parser.line

    def emit(
        self,
        kind: EventKind,
        *,
        text: str = "",
        tool: str | None = None,
        tool_id: str | None = None,
        is_error: bool = False,
        raw: Mapping[str, Any] | None = None,
    ) -> None:
        """Deliver one progress event to :attr:`on_event`."""
        if self.on_event is None:
            return
        self.on_event(
            AgentEvent(
                kind=kind,
                session_id=self.session_id,
                text=text,
                tool=tool,
                tool_id=tool_id,
                is_error=is_error,
                line=self._parser.line if kind is not EventKind.TURN_END else 0,
                raw=raw or {},
            )
        )

    def environment(self, invocation: Invocation) -> dict[str, str]:
        env = self.base_environment()
        env.update(self.default_env())
        env.update(self.isolation_env())
        env.update(self.options.extra_env)
        env.update(invocation.env)
        return without_settings(env)

    def build_invocation(self, prompt: str) -> Invocation:
        self.check_prompt(prompt)
        path = self.options.extra_env.get("PATH", os.environ.get("PATH"))
        program = find_binary(self.options.binary, path)
        if program is None:
            spec = AGENTS[self.agent_name]
            raise TurnExecError(
                f"{self.cli_name} CLI {self.options.binary!r} was not found or is not "
                f"executable. Install it with `npm install -g {spec.npm_package}` (or into a "
                f"folder with `npm install --prefix DIR {spec.npm_package}`) and set "
                f"{spec.env_var} to the binary's path if it is not on PATH.",
                binary=self.options.binary,
            )
        self._parser = JsonLines(self.cli_name)
        self.turn = TurnState()
        # engine.process gives the turn its TURN_MARKER_VAR: Claude Code and the Copilot
        # CLI start tools in sessions of their own, and a stop finds them through it.
        return Invocation(
            argv=self.turn_argv(program),
            stdin=prompt.encode("utf-8"),
            env=self.turn_env(),
        )

    def on_stdout_line(self, line: bytes) -> None:
        record = self._parser.parse(line)
        if record is None:
            return
        self.turn.events += 1
        self.handle(record)

    def to_output(self, result: ProcessResult) -> TurnOutput:
        return self.compose(result)

    async def run_turn(self, prompt: str) -> TurnOutput:
        try:
            return await super().run_turn(prompt)
        finally:
            self.emit(EventKind.TURN_END)

    # -- helpers for compose -------------------------------------------------------------
    def missing_session_output(self, result: ProcessResult, detail: str) -> TurnOutput:
        """The plain-words output for a session the CLI no longer knows."""
        text = (
            f"{self.cli_name} no longer knows session {self.session_id} (its files under "
            f"the CLI's config folder were removed or belong to another folder), so this "
            f"turn could not resume it. The CLI exited with code {result.exit_code}: "
            f"{redact(detail.strip()[:_DETAIL])} Start a new session to continue."
        )
        return self.output(
            text,
            result,
            {"session_id": self.session_id, "is_error": True, "session_missing": True},
        )

    def failure_text(self, result: ProcessResult) -> str:
        """Plain words for a non-zero exit with no result record."""
        errors = redact("; ".join(self.turn.errors)[:_DETAIL])
        detail = errors or result.stderr_tail.strip() or "(nothing on stderr)"
        return f"{self.cli_name} exited with code {result.exit_code}: {detail}"

    def require_exit(self, result: ProcessResult, what: str) -> None:
        """A zero exit with no final record means we could not read the turn.

        Raises:
            TurnIOError: the CLI exited 0 but printed no ``what``.
        """
        if result.exit_code == 0:
            raise TurnIOError(
                f"{self.cli_name} exited 0 but printed no {what} "
                f"({self._parser.line} stdout lines); stderr: {result.stderr_tail.strip()}",
                line=self._parser.line,
            )

    def output(self, text: str, result: ProcessResult, metadata: dict[str, object]) -> TurnOutput:
        """A :class:`TurnOutput` carrying ``text``, spilled beyond the spill limit."""
        meta: dict[str, object] = {"agent": self.cli_name, **metadata}
        meta.setdefault("session_id", self.session_id)
        meta["stdout_bytes"] = result.stdout_size
        meta["duration_s"] = round(result.duration, 3)
        if result.stderr_tail.strip():
            meta["stderr_tail"] = tail(result.stderr_tail, 1024)
        if result.spill_path is not None:
            meta["stream_spill_path"] = str(result.spill_path)
        data = text.encode("utf-8")
        limit = self.options.spill_limit
        if len(data) <= limit:
            return TurnOutput(text=text, exit_code=result.exit_code, size=len(data), metadata=meta)
        directory = self.options.spill_dir or default_spill_dir()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"turn-{uuid.uuid4().hex}.txt"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        head = data[:limit].decode("utf-8", errors="ignore")
        return TurnOutput(
            text=head,
            exit_code=result.exit_code,
            spill_path=path,
            size=len(data),
            metadata=meta,
        )


def text_of(content: object) -> str:
    """Text of a tool result's ``content`` (a string or a list of text blocks)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            str(block.get("text", ""))
            for block in content
            if isinstance(block, dict) and block.get("type") == "text"
        ]
        return "\n".join(parts)
    return "" if content is None else json.dumps(content)

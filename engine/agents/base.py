"""The template every subprocess-backed agent follows."""

from __future__ import annotations

import asyncio
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engine.agents.allowlist import ToolAllowlist
from engine.approvals.route import ApprovalRoute
from engine.process import (
    DEFAULT_SPILL_LIMIT,
    PreemptHandle,
    ProcessResult,
    ProcessSpec,
    run_process,
    validate_prompt,
)
from engine.redact import is_credential_name, redact
from engine.settings import SECRET_SETTINGS
from engine.turn import TurnOutput

__all__ = ["AgentOptions", "Invocation", "ProcessAgent", "inherited_environment"]

# An agent may run shell commands and print its environment, so turnstile's secrets never
# reach it: the secret settings (bot token, webhook secret, project URLs that may hold
# credentials), any TURNSTILE_ variable named like a credential, and any whose value holds
# one (a database URL with a password). The rest stays: an agent may run `turnstile
# status`, which needs the database and folders. The per-turn marker is set per turn.
_PREFIX = "TURNSTILE_"


def _withheld(name: str, value: str) -> bool:
    upper = name.upper()
    if not upper.startswith(_PREFIX):
        return False
    return upper in SECRET_SETTINGS or is_credential_name(upper) or redact(value) != value


def inherited_environment() -> dict[str, str]:
    """This process's environment, less turnstile's secrets."""
    return {k: v for k, v in os.environ.items() if not _withheld(k, v)}


@dataclass(frozen=True, slots=True)
class AgentOptions:
    """Per-session settings of a process-backed agent.

    Attributes:
        binary: program to run (a name on PATH or a path).
        cwd: the session's working directory, pinned for its whole life.
        extra_env: variables added to the inherited environment.
        config_dir: the CLI's own state folder, for isolation between sessions.
        model: model name passed to the CLI, if any.
        passthrough: extra arguments appended to every turn.
        allowlist: which tools the agent may run.
        spill_limit: stdout bytes kept in memory before spilling to a file.
        spill_dir: where spilled outputs go.
        approval: where tool calls outside the allowlist ask a person (CLIs that can ask).
    """

    binary: str
    cwd: Path
    extra_env: Mapping[str, str] = field(default_factory=dict)
    config_dir: Path | None = None
    model: str | None = None
    passthrough: tuple[str, ...] = ()
    allowlist: ToolAllowlist = field(default_factory=ToolAllowlist.read_only_default)
    spill_limit: int = DEFAULT_SPILL_LIMIT
    spill_dir: Path | None = None
    approval: ApprovalRoute | None = None


@dataclass(frozen=True, slots=True)
class Invocation:
    """One turn's argv, stdin and environment additions."""

    argv: list[str]
    stdin: bytes | None = None
    env: Mapping[str, str] = field(default_factory=dict)


class ProcessAgent(ABC):
    """An :class:`~engine.turn.AgentSession` whose turn is one subprocess.

    Subclasses say how to invoke a turn (:meth:`build_invocation`) and how to read the
    result (:meth:`to_output`); this class validates the prompt, pins the cwd, serialises
    turns and owns pre-emption.
    """

    #: Whether a turn of this session has finished, here or in an earlier process. An
    #: adapter whose CLI keeps its own session store uses it to tell a session whose files
    #: were removed (report it) from one whose first turn never finished (create it).
    finished_turn: bool = False

    def __init__(
        self,
        options: AgentOptions,
        *,
        session_id: str | None = None,
        preempt: PreemptHandle | None = None,
    ) -> None:
        self.options = options
        self._session_id = session_id or str(uuid.uuid4())
        self.preempt = preempt or PreemptHandle(session_id=self._session_id)
        self.turns_started = 0
        self._lock = asyncio.Lock()

    @property
    def session_id(self) -> str:
        return self._session_id

    @abstractmethod
    def build_invocation(self, prompt: str) -> Invocation:
        """The argv (and stdin) for the next turn."""

    def on_stdout_line(self, line: bytes) -> None:  # noqa: B027 - an optional hook
        """Called for each stdout line while the turn runs (no-op by default)."""

    def to_output(self, result: ProcessResult) -> TurnOutput:
        """Turn a finished process into the turn's output (stdout verbatim by default)."""
        return result.to_turn_output()

    def environment(self, invocation: Invocation) -> dict[str, str]:
        env = inherited_environment()
        env.update(self.options.extra_env)
        env.update(invocation.env)
        return env

    async def run_turn(self, prompt: str) -> TurnOutput:
        validate_prompt(prompt)
        async with self._lock:
            invocation = self.build_invocation(prompt)
            spec = ProcessSpec(
                argv=invocation.argv,
                cwd=self.options.cwd,
                env=self.environment(invocation),
                stdin=invocation.stdin,
            )
            self.turns_started += 1
            result = await run_process(
                spec,
                preempt=self.preempt,
                spill_limit=self.options.spill_limit,
                spill_dir=self.options.spill_dir,
                on_stdout_line=self.on_stdout_line,
            )
            return self.to_output(result)

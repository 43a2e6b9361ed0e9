"""The template every subprocess-backed agent follows."""

from __future__ import annotations

import asyncio
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

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
from engine.sandbox import Walls
from engine.turn import TurnOutput

__all__ = [
    "AGENT_ENV_NAMES",
    "AgentOptions",
    "Invocation",
    "ProcessAgent",
    "agent_environment",
    "without_settings",
]

# What an agent gets of this process's environment: an allowlist, never the rest. Its CLI
# needs its key and endpoint, PATH, the locale, proxies and CA bundles; git needs an
# identity. turnstile's own settings (TURNSTILE_*: the database, the bot token, the
# folders) never reach it, nor anything else this process holds (PG*, DATABASE_URL...).
AGENT_ENV_NAMES: Final = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM",
        "COLORTERM", "NO_COLOR", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
        "http_proxy", "https_proxy", "no_proxy", "all_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR",
        "NODE_EXTRA_CA_CERTS", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GH_TOKEN",
        "GITHUB_TOKEN", "GH_HOST", "GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL",
        "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL", "DISABLE_AUTOUPDATER",
    }
)  # fmt: skip
AGENT_ENV_PREFIXES: Final = ("LC_", "ANTHROPIC_", "CLAUDE_", "OPENAI_", "CODEX_", "COPILOT_")
_PREFIX: Final = "TURNSTILE_"


def _passes(name: str, extra: Sequence[str]) -> bool:
    if name.upper().startswith(_PREFIX):
        return False
    if name in AGENT_ENV_NAMES or name.startswith(AGENT_ENV_PREFIXES):
        return True
    return any(
        name.startswith(pattern[:-1]) if pattern.endswith("*") else name == pattern
        for pattern in extra
    )


def without_settings(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less any turnstile setting, wherever it came from (a run's extra variables)."""
    return {k: v for k, v in env.items() if not k.upper().startswith(_PREFIX)}


def agent_environment(extra: Sequence[str] = ()) -> dict[str, str]:
    """The variables of this process an agent may have (``extra``: names or ``NAME*``
    prefixes a person configured, ``TURNSTILE_AGENT_ENV``)."""
    return {k: v for k, v in os.environ.items() if _passes(k, extra)}


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
        walls: the sandbox every process of the session runs in (None: unconfined).
        pass_env: variables (names, ``NAME*`` prefixes) the agent gets besides its CLI's.
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
    walls: Walls | None = None
    pass_env: tuple[str, ...] = ()


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

    def base_environment(self) -> dict[str, str]:
        """The allowlisted variables, and inside walls a home and ``/tmp`` that exist there."""
        env = agent_environment(self.options.pass_env)
        if self.options.walls is not None:
            env["TMPDIR"] = "/tmp"  # noqa: S108 - the sandbox's own, private /tmp
            if self.options.config_dir is not None:
                env["HOME"] = str(self.options.config_dir)
        return env

    def environment(self, invocation: Invocation) -> dict[str, str]:
        env = self.base_environment()
        env.update(self.options.extra_env)
        env.update(invocation.env)
        return without_settings(env)

    def confine(self, argv: Sequence[str]) -> list[str]:
        """``argv`` inside the session's walls (unchanged when it has none)."""
        walls = self.options.walls
        if walls is None:
            return list(argv)
        return walls.adding(readable=self.turn_paths()).wrap(argv, self.options.cwd)

    def turn_paths(self) -> tuple[Path, ...]:
        """Paths a turn needs shown read-only inside the walls (a permission relay's)."""
        return ()

    async def run_turn(self, prompt: str) -> TurnOutput:
        validate_prompt(prompt)
        async with self._lock:
            invocation = self.build_invocation(prompt)
            spec = ProcessSpec(
                argv=self.confine(invocation.argv),
                cwd=self.options.cwd,
                env=self.environment(invocation),
                stdin=invocation.stdin,
                sandboxed=self.options.walls is not None,
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

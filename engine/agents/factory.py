"""Build an agent session by name from settings (the agents themselves are described in
:mod:`engine.agents.registry`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import AgentOptions, ProcessAgent
from engine.agents.command import CommandAgent
from engine.agents.registry import AGENT_NAMES, agent_spec
from engine.agents.stream import JsonStreamAgent
from engine.approvals.route import ApprovalRoute
from engine.errors import ConfigError
from engine.process import PreemptHandle
from engine.sandbox import agent_home, walls_for
from engine.settings import Settings

if TYPE_CHECKING:
    from engine.agents.warm import WarmPool, WarmSupport

__all__ = [
    "AGENT_NAMES",
    "TurnMode",
    "create_agent",
    "new_warm_pool",
    "probe_agents",
    "probe_cache",
    "probe_turn_mode",
    "turn_mode",
]

_LOGGER = logging.getLogger(__name__)

# The CLIs whose support for warm sessions is asked of the installed binary.
_PROBED: Final = ("claude", "codex")
_PROBE_FILE: Final = "cli-probes.json"


@dataclass(frozen=True, slots=True)
class TurnMode:
    """How an agent's turns run here: a resident (warm) process or one process per turn."""

    warm: bool
    reason: str

    @property
    def label(self) -> str:
        return "warm" if self.warm else "per turn"


def _binary(tool: str, settings: Settings) -> str:
    return {
        "claude": settings.claude_bin,
        "copilot": settings.copilot_bin,
        "codex": settings.codex_bin,
    }.get(tool, settings.agent_command.split()[0] if settings.agent_command else "")


def probe_cache(settings: Settings) -> Path:
    """The file where what the installed CLIs support is kept (every process shares it)."""
    return settings.runs_dir / _PROBE_FILE


def _asks(tool: str, settings: Settings) -> TurnMode | None:
    """The mode when the CLI need not be asked; None when its answer decides."""
    if tool not in settings.warm_sessions:
        return TurnMode(False, f"TURNSTILE_WARM_SESSIONS does not include {tool}")
    if tool not in _PROBED:
        return TurnMode(False, "this CLI cannot stay resident between turns")
    return None


def _support(tool: str, settings: Settings, path: str | None) -> WarmSupport:
    if tool == "codex":
        from engine.agents.warm_codex import codex_warm_support

        return codex_warm_support(_binary(tool, settings), path=path, cache=probe_cache(settings))
    from engine.agents.warm import claude_warm_support

    return claude_warm_support(_binary(tool, settings), path=path, cache=probe_cache(settings))


def turn_mode(tool: str, settings: Settings, *, path: str | None = None) -> TurnMode:
    """Which mode ``tool`` gets from ``TURNSTILE_WARM_SESSIONS`` and the installed CLI.

    Detected, not assumed: a Claude Code whose ``--help`` lacks stream-json input, or a
    Codex whose app-server schema lacks threads and turns, runs one process per turn (the
    answer is kept per binary file and version, :mod:`engine.agents.probe`). Inside a
    running event loop the CLI is never waited for: async code awaits
    :func:`probe_turn_mode` first (or :func:`probe_agents` ahead of the first turn).
    """
    fixed = _asks(tool, settings)
    if fixed is not None:
        return fixed
    support = _support(tool, settings, path)
    return TurnMode(support.supported, support.reason)


async def probe_turn_mode(tool: str, settings: Settings, *, path: str | None = None) -> TurnMode:
    """:func:`turn_mode` for async code: the CLI is asked off the event loop, and the
    answer is kept, so a later :func:`turn_mode` or :func:`create_agent` finds it."""
    fixed = _asks(tool, settings)
    if fixed is not None:
        return fixed
    binary, cache = _binary(tool, settings), probe_cache(settings)
    support: WarmSupport
    if tool == "codex":
        from engine.agents.warm_codex import codex_warm_support_async

        support = await codex_warm_support_async(binary, path=path, cache=cache)
    else:
        from engine.agents.warm import claude_warm_support_async

        support = await claude_warm_support_async(binary, path=path, cache=cache)
    return TurnMode(support.supported, support.reason)


async def probe_agents(settings: Settings) -> dict[str, TurnMode]:
    """Ask every CLI ``TURNSTILE_WARM_SESSIONS`` names what it supports, concurrently
    (at start-up, so that the first turn finds the answer ready)."""
    tools = tuple(settings.warm_sessions)
    modes = await asyncio.gather(*(probe_turn_mode(tool, settings) for tool in tools))
    return dict(zip(tools, modes, strict=True))


def new_warm_pool(settings: Settings) -> WarmPool:
    """The pool that bounds resident agent processes, from the settings."""
    from engine.agents.warm import WarmPool

    return WarmPool(
        max_sessions=settings.max_warm_sessions, idle_seconds=settings.warm_idle_minutes * 60
    )


def create_agent(
    tool: str,
    settings: Settings,
    *,
    cwd: Path,
    session_id: str | None = None,
    agent_cmd: str | None = None,
    passthrough: tuple[str, ...] = (),
    allowlist: ToolAllowlist | None = None,
    extra_env: Mapping[str, str] | None = None,
    config_dir: Path | None = None,
    resume: bool = False,
    turns_finished: bool = False,
    preempt: PreemptHandle | None = None,
    approval: ApprovalRoute | None = None,
    warm_pool: WarmPool | None = None,
) -> ProcessAgent:
    """A new session of ``tool`` pinned to ``cwd``.

    Args:
        resume: the session already exists (its first turn ran before, maybe in an
            earlier process): the next turn resumes it instead of creating it.
        turns_finished: a turn of the session is recorded as finished (the store says
            so), so a CLI that no longer knows the session is reported, not restarted.
        approval: where tool calls ask a person (``TURNSTILE_TOOL_APPROVAL``); only
            Claude Code can ask, the other CLIs keep their allowlist (docs/agents.md).
        warm_pool: where a warm session's resident process is counted (see
            :func:`turn_mode`); without one, a warm session gets a pool of its own.

    Raises:
        ConfigError: unknown tool, missing command template, or a missing cwd.
    """
    spec = agent_spec(tool)
    if not cwd.is_dir():
        raise ConfigError(f"working directory {cwd} does not exist")
    tools = allowlist or ToolAllowlist.from_flags(settings.allowed_tools, settings.dangerous_tools)
    support = None
    if preempt is None and _asks(tool, settings) is None:
        support = _support(tool, settings, None)
        if not support.supported:
            _LOGGER.info(
                "%s session %s runs one process per turn: %s", tool, session_id, support.reason
            )
    warm = support is not None and support.supported
    if warm:
        from engine.agents.warm import WarmPreemptHandle

        preempt = WarmPreemptHandle(grace=settings.preempt_grace, session_id=session_id)
    preempt = preempt or PreemptHandle(grace=settings.preempt_grace, session_id=session_id)
    template = (agent_cmd or spec.configured(settings)) if spec.template else None
    if spec.template and not template:
        raise ConfigError(
            f"the command agent needs a template: set {spec.env_var} or pass "
            "--agent-cmd, e.g. 'my-agent --session {session_id} -p {prompt}'",
            setting=spec.env_var,
        )
    binary = template.split()[0] if template else spec.configured(settings)
    walls = None
    if settings.sandbox == "on":
        # Inside the walls the CLI writes only its worktree and a home of its own.
        config_dir = config_dir or agent_home(settings, cwd)
        program = template.split() if template else []
        walls = walls_for(
            settings, cwd=cwd, home=config_dir, binary=binary or None, program=program
        )
    if template:
        options = AgentOptions(
            binary=template.split()[0],
            cwd=cwd,
            extra_env=dict(extra_env or {}),
            config_dir=config_dir,
            passthrough=passthrough,
            allowlist=tools,
            spill_limit=settings.spill_limit,
            walls=walls,
            pass_env=settings.agent_env,
        )
        agent: ProcessAgent = CommandAgent(
            template, cwd=cwd, options=options, session_id=session_id, preempt=preempt
        )
        agent.finished_turn = turns_finished
        return agent
    options = AgentOptions(
        binary=spec.configured(settings),
        cwd=cwd,
        extra_env=dict(extra_env or {}),
        config_dir=config_dir,
        model=settings.agent_model,
        passthrough=passthrough,
        allowlist=tools,
        spill_limit=settings.spill_limit,
        approval=approval if tool == "claude" else None,
        walls=walls,
        pass_env=settings.agent_env,
    )
    if warm and tool == "codex":
        from engine.agents.warm_codex import CodexWarmSupport, WarmCodexAgent

        assert isinstance(support, CodexWarmSupport)
        agent = WarmCodexAgent(
            options,
            session_id=session_id,
            preempt=preempt,
            resume=resume,
            pool=warm_pool if warm_pool is not None else new_warm_pool(settings),
            support=support,
        )
    elif warm:
        # Imported here: the warm adapter is only loaded when a session is warm.
        from engine.agents.warm import WarmClaudeAgent

        agent = WarmClaudeAgent(
            options,
            session_id=session_id,
            preempt=preempt,
            resume=resume,
            pool=warm_pool if warm_pool is not None else new_warm_pool(settings),
        )
    else:
        adapter = spec.load()
        if not issubclass(adapter, JsonStreamAgent):
            raise ConfigError(f"agent {tool!r} has no CLI adapter ({spec.adapter})")
        agent = adapter(options, session_id=session_id, preempt=preempt, resume=resume)
    agent.finished_turn = turns_finished
    return agent

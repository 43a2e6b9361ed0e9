"""Build an agent session by name from settings (the agents themselves are described in
:mod:`engine.agents.registry`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import AgentOptions, ProcessAgent
from engine.agents.command import CommandAgent
from engine.agents.registry import AGENT_NAMES, agent_spec
from engine.agents.stream import JsonStreamAgent
from engine.approvals.route import ApprovalRoute
from engine.errors import ConfigError
from engine.process import PreemptHandle
from engine.settings import Settings

__all__ = ["AGENT_NAMES", "create_agent"]


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
) -> ProcessAgent:
    """A new session of ``tool`` pinned to ``cwd``.

    Args:
        resume: the session already exists (its first turn ran before, maybe in an
            earlier process): the next turn resumes it instead of creating it.
        turns_finished: a turn of the session is recorded as finished (the store says
            so), so a CLI that no longer knows the session is reported, not restarted.
        approval: where tool calls ask a person (``TURNSTILE_TOOL_APPROVAL``); only
            Claude Code can ask, the other CLIs keep their allowlist (docs/agents.md).

    Raises:
        ConfigError: unknown tool, missing command template, or a missing cwd.
    """
    spec = agent_spec(tool)
    if not cwd.is_dir():
        raise ConfigError(f"working directory {cwd} does not exist")
    tools = allowlist or ToolAllowlist.from_flags(settings.allowed_tools, settings.dangerous_tools)
    preempt = preempt or PreemptHandle(grace=settings.preempt_grace, session_id=session_id)
    if spec.template:
        template = agent_cmd or spec.configured(settings)
        if not template:
            raise ConfigError(
                f"the command agent needs a template: set {spec.env_var} or pass "
                "--agent-cmd, e.g. 'my-agent --session {session_id} -p {prompt}'",
                setting=spec.env_var,
            )
        options = AgentOptions(
            binary=template.split()[0],
            cwd=cwd,
            extra_env=dict(extra_env or {}),
            passthrough=passthrough,
            allowlist=tools,
            spill_limit=settings.spill_limit,
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
    )
    adapter = spec.load()
    if not issubclass(adapter, JsonStreamAgent):
        raise ConfigError(f"agent {tool!r} has no CLI adapter ({spec.adapter})")
    agent = adapter(options, session_id=session_id, preempt=preempt, resume=resume)
    agent.finished_turn = turns_finished
    return agent

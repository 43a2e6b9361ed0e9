"""Build an agent session by name from settings: the one place that maps a tool to a class."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import AgentOptions, ProcessAgent
from engine.agents.command import CommandAgent
from engine.approvals.route import ApprovalRoute
from engine.errors import ConfigError
from engine.process import PreemptHandle
from engine.settings import Settings

__all__ = ["AGENT_NAMES", "create_agent"]

AGENT_NAMES = ("claude", "copilot", "codex", "command")


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
    if tool not in AGENT_NAMES:
        raise ConfigError(f"unknown agent {tool!r}: choose one of {', '.join(AGENT_NAMES)}")
    if not cwd.is_dir():
        raise ConfigError(f"working directory {cwd} does not exist")
    tools = allowlist or ToolAllowlist.from_flags(settings.allowed_tools, settings.dangerous_tools)
    preempt = preempt or PreemptHandle(grace=settings.preempt_grace, session_id=session_id)
    if tool == "command":
        template = agent_cmd or settings.agent_command
        if not template:
            raise ConfigError(
                "the command agent needs a template: set TURNSTILE_AGENT_COMMAND or pass "
                "--agent-cmd, e.g. 'my-agent --session {session_id} -p {prompt}'",
                setting="TURNSTILE_AGENT_COMMAND",
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
    binary = {
        "claude": settings.claude_bin,
        "copilot": settings.copilot_bin,
        "codex": settings.codex_bin,
    }[tool]
    options = AgentOptions(
        binary=binary,
        cwd=cwd,
        extra_env=dict(extra_env or {}),
        config_dir=config_dir,
        model=settings.agent_model,
        passthrough=passthrough,
        allowlist=tools,
        spill_limit=settings.spill_limit,
        approval=approval if tool == "claude" else None,
    )
    # Imported here so that a broken or absent adapter never blocks the others.
    if tool == "claude":
        from engine.agents.claude import ClaudeAgent

        agent = ClaudeAgent(options, session_id=session_id, preempt=preempt, resume=resume)
    elif tool == "copilot":
        from engine.agents.copilot import CopilotAgent

        agent = CopilotAgent(options, session_id=session_id, preempt=preempt, resume=resume)
    else:
        from engine.agents.codex import CodexAgent

        agent = CodexAgent(options, session_id=session_id, preempt=preempt, resume=resume)
    agent.finished_turn = turns_finished
    return agent

"""What differs between the agent CLIs, for the one contract suite they all pass.

``tests/test_agents_contract.py`` runs the same cases over every :class:`Profile`; a
profile holds only what a CLI does its own way (tool names, how a denial shows, where it
keeps sessions, what metadata it reports). Cases that only one CLI has stay in its own
file (``tests/test_agents_claude.py``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import AgentOptions
from engine.agents.claude import ClaudeAgent
from engine.agents.codex import CodexAgent
from engine.agents.copilot import CopilotAgent
from engine.agents.stream import JsonStreamAgent
from engine.process import PreemptHandle
from tests.fakes.model_api import FakeModelAPI, ToolCall
from tests.fakes.realcli import Sandbox

__all__ = [
    "PROFILES",
    "READ_ONLY",
    "SHELL",
    "WRITE",
    "Profile",
    "make_agent",
]

WRITE = ToolAllowlist.from_flags(["view", "create"])
READ_ONLY = ToolAllowlist.read_only_default()
SHELL = ToolAllowlist.from_flags(["bash"])

Conversation = list[tuple[str, str]]


def _said_exactly(conversation: Conversation, role: str, text: str) -> bool:
    return (role, text) in conversation


def _said_after_a_preamble(conversation: Conversation, role: str, text: str) -> bool:
    """Copilot prefixes user text with ``<current_datetime>…</current_datetime>``."""
    return any(r == role and (t == text or t.endswith("\n\n" + text)) for r, t in conversation)


def _forget_claude(config: Path) -> None:
    shutil.rmtree(config / "projects")


def _forget_copilot(config: Path) -> None:
    shutil.rmtree(config / "session-state")
    for store in config.glob("session-store.db*"):
        store.unlink()


def _forget_codex(config: Path) -> None:
    shutil.rmtree(config / ".codex" / "sessions")


@dataclass(frozen=True, slots=True)
class Profile:
    """One CLI as the contract suite sees it.

    Attributes:
        name: the agent (and the ``ensure_cli`` name).
        adapter: its adapter class.
        env: the fake model API's environment for it.
        said: whether a conversation holds ``(role, text)`` as this CLI sends it.
        write: a tool call that writes ``target`` with the text ``content``.
        shell: a tool call that runs a shell command.
        tool_name: the tool name its progress events give for ``write``.
        clean_write: metadata a turn whose write was allowed reports.
        denial: the words of the tool result the model gets for a denied write.
        denial_metadata_tool: the tool ``permission_denials`` names (None: not reported).
        denial_event: a denial is also a TOOL_RESULT event with ``is_error``.
        background: a tool call that leaves a child outside the CLI's process group
            (None: the CLI starts no such child, the pre-emption case holds only).
        hold_final: the final answer of the progress case is held until the events
            before it were seen (the CLI streams them while it waits).
        output_tokens: the fake's output tokens as the CLI reports them (None: not).
        reports_cost: ``cost_usd`` is in the metadata.
        mints_session: the CLI, not the adapter, makes the session id on the first turn.
        reports_api_status: ``api_error_status`` is in the metadata of a failed turn.
        forget: removes the CLI's stored sessions from its config folder.
    """

    name: str
    adapter: type[JsonStreamAgent]
    env: Callable[[FakeModelAPI, Path], dict[str, str]]
    said: Callable[[Conversation, str, str], bool]
    write: Callable[[Path, str], ToolCall]
    shell: Callable[[str], ToolCall]
    tool_name: str
    clean_write: Mapping[str, object]
    denial: str
    denial_metadata_tool: str | None
    denial_event: bool
    background: ToolCall | None
    hold_final: bool
    output_tokens: int | None
    reports_cost: bool
    mints_session: bool
    reports_api_status: bool
    forget: Callable[[Path], None]


PROFILES = (
    Profile(
        name="claude",
        adapter=ClaudeAgent,
        env=lambda api, config: api.claude_env(config),
        said=_said_exactly,
        write=lambda target, content: ToolCall(
            "Write", {"file_path": str(target), "content": content}
        ),
        shell=lambda command: ToolCall("Bash", {"command": command, "description": "write"}),
        tool_name="Write",
        clean_write={"permission_denials": []},
        denial="permission",
        denial_metadata_tool="Write",
        denial_event=False,
        # claude runs tools in a session of their own: the child leaves the CLI's group.
        background=ToolCall(
            "Bash", {"command": "sleep 300", "description": "bg", "run_in_background": True}
        ),
        hold_final=True,
        output_tokens=7,
        reports_cost=True,
        mints_session=False,
        reports_api_status=True,
        forget=_forget_claude,
    ),
    Profile(
        name="copilot",
        adapter=CopilotAgent,
        env=lambda api, config: api.copilot_env(config),
        said=_said_after_a_preamble,
        write=lambda target, content: ToolCall(
            "create", {"path": str(target), "file_text": content}
        ),
        shell=lambda command: ToolCall("bash", {"command": command, "description": "write"}),
        tool_name="create",
        clean_write={"tool_calls": 1},
        denial="Permission denied",
        denial_metadata_tool=None,
        denial_event=True,
        # copilot runs tools in a session of their own too.
        background=ToolCall("bash", {"command": "sleep 300 &", "description": "bg"}),
        hold_final=False,
        output_tokens=None,
        reports_cost=False,
        mints_session=False,
        reports_api_status=False,
        forget=_forget_copilot,
    ),
    Profile(
        name="codex",
        adapter=CodexAgent,
        env=lambda api, config: api.codex_env(config),
        said=_said_exactly,
        # Relative to the pinned cwd: codex writes files through its shell tool.
        write=lambda target, content: ToolCall(
            "exec_command", {"cmd": f"printf {content} > {target.name}"}
        ),
        shell=lambda command: ToolCall("exec_command", {"cmd": command}),
        tool_name="command_execution",
        clean_write={"tool_calls": 1},
        denial="Read-only file system",
        denial_metadata_tool=None,
        denial_event=False,
        background=None,
        hold_final=False,
        output_tokens=7,
        reports_cost=False,
        mints_session=True,
        reports_api_status=False,
        forget=_forget_codex,
    ),
)


def make_agent(
    profile: Profile,
    binary: Path,
    api: FakeModelAPI,
    sandbox: Sandbox,
    *,
    allowlist: ToolAllowlist = READ_ONLY,
    session_id: str | None = None,
    resume: bool = False,
    preempt: PreemptHandle | None = None,
) -> JsonStreamAgent:
    """``profile``'s adapter on ``binary``, talking to ``api``, working in ``sandbox``."""
    options = AgentOptions(
        binary=str(binary),
        cwd=sandbox.workspace,
        config_dir=sandbox.config,
        extra_env=sandbox.env(profile.env(api, sandbox.config)),
        allowlist=allowlist,
        walls=sandbox.walls(str(binary)),
    )
    return profile.adapter(options, session_id=session_id, resume=resume, preempt=preempt)

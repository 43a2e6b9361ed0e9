"""Claude Code (``claude``), one ``claude -p`` process per turn.

First turn ``--session-id <uuid>``, every later turn ``--resume <uuid>``, always from the
session's pinned cwd (Claude keeps sessions per working directory). Output is
``--output-format stream-json --verbose``: ``system/init``, ``assistant`` and ``user``
messages (tool calls and their results) while the turn runs, then one ``result`` record
with the final text, error flag, model turns, usage and cost.
"""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar

from engine.agents.allowlist import ToolAllowlist
from engine.agents.stream import EventKind, JsonStreamAgent, text_of
from engine.process import ProcessResult
from engine.turn import TurnOutput

__all__ = ["CLAUDE_TOOL_NAMES", "ClaudeAgent", "claude_permission_args"]

# Our allowlist speaks the lower-case names of the Copilot CLI; Claude Code's tools are
# capitalised and a few differ. Names not listed here pass through unchanged, so a
# Claude-specific rule such as ``Bash(git:*)`` works as it is.
CLAUDE_TOOL_NAMES: dict[str, tuple[str, ...]] = {
    "view": ("Read",),
    "read": ("Read",),
    "grep": ("Grep",),
    "glob": ("Glob",),
    "ls": ("LS",),
    "edit": ("Edit", "MultiEdit"),
    "create": ("Write",),
    "write": ("Write", "Edit", "MultiEdit"),
    "bash": ("Bash",),
    "shell": ("Bash",),
    "fetch": ("WebFetch",),
    "web_fetch": ("WebFetch",),
    "web_search": ("WebSearch",),
}

_MISSING = "No conversation found with session ID"
_IN_USE = "is already in use"


def _claude_tool(name: str) -> tuple[str, ...]:
    if name in CLAUDE_TOOL_NAMES:
        return CLAUDE_TOOL_NAMES[name]
    lower = name.lower()
    # Copilot's ``shell(git)`` is Claude's ``Bash(git:*)``.
    if lower.startswith("shell(") and lower.endswith(")"):
        return (f"Bash({name[6:-1]}:*)",)
    return (name,)


def claude_permission_args(allowlist: ToolAllowlist) -> tuple[list[str], dict[str, str]]:
    """Claude Code flags and environment for ``allowlist``.

    Listed tools become one ``--allowedTools`` value (anything not listed is denied in
    ``-p`` mode, and the turn goes on without it). "Dangerous" is
    ``--dangerously-skip-permissions``; Claude refuses that as root unless ``IS_SANDBOX=1``
    is set, so it is set then.
    """
    if allowlist.dangerous:
        env = {"IS_SANDBOX": "1"} if hasattr(os, "geteuid") and os.geteuid() == 0 else {}
        return ["--dangerously-skip-permissions"], env
    names: dict[str, None] = {}
    for tool in allowlist.tools:
        for mapped in _claude_tool(tool):
            names.setdefault(mapped, None)
    if not names:
        return [], {}
    return [f"--allowedTools={','.join(names)}"], {}


class ClaudeAgent(JsonStreamAgent):
    """A Claude Code session, resumed every turn."""

    cli_name: ClassVar[str] = "Claude Code"
    npm_package: ClassVar[str] = "@anthropic-ai/claude-code"
    binary_setting: ClassVar[str] = "TURNSTILE_CLAUDE_BIN"

    def turn_argv(self, program: str) -> list[str]:
        argv = [program, "-p", "--output-format", "stream-json", "--verbose"]
        if self.started:
            argv += ["--resume", self.session_id]
        else:
            argv += ["--session-id", self.session_id]
        if self.options.model:
            argv += ["--model", self.options.model]
        argv += claude_permission_args(self.options.allowlist)[0]
        argv += list(self.options.passthrough)
        return argv

    def default_env(self) -> dict[str, str]:
        return {"DISABLE_AUTOUPDATER": "1"}

    def isolation_env(self) -> dict[str, str]:
        if self.options.config_dir is None:
            return {}
        return {"CLAUDE_CONFIG_DIR": str(self.options.config_dir)}

    def turn_env(self) -> dict[str, str]:
        return claude_permission_args(self.options.allowlist)[1]

    def handle(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        if kind == "system" and record.get("subtype") == "init":
            self.started = True
            self.emit(EventKind.SESSION, text=str(record.get("model", "")), raw=record)
        elif kind == "assistant":
            self.turn.model_turns += 1
            for block in _blocks(record):
                if block.get("type") == "text" and block.get("text"):
                    self.turn.texts.append(str(block["text"]))
                    self.emit(EventKind.TEXT, text=str(block["text"]), raw=record)
                elif block.get("type") == "tool_use":
                    self.turn.tool_calls += 1
                    self.emit(
                        EventKind.TOOL_USE,
                        text=_short_json(block.get("input")),
                        tool=str(block.get("name", "")),
                        tool_id=str(block.get("id", "")),
                        raw=record,
                    )
        elif kind == "user":
            for block in _blocks(record):
                if block.get("type") == "tool_result":
                    self.emit(
                        EventKind.TOOL_RESULT,
                        text=text_of(block.get("content")),
                        tool_id=str(block.get("tool_use_id", "")),
                        is_error=bool(block.get("is_error", False)),
                        raw=record,
                    )
        elif kind == "result":
            self.started = True
            self.turn.result = record
            errors = record.get("errors")
            if isinstance(errors, list):
                self.turn.errors += [str(e) for e in errors]
                if any(_MISSING in str(e) for e in errors):
                    self.turn.session_missing = True
            if record.get("is_error"):
                self.emit(
                    EventKind.ERROR,
                    text=str(record.get("result") or "; ".join(self.turn.errors)),
                    is_error=True,
                    raw=record,
                )
            self.emit(
                EventKind.RESULT,
                text=str(record.get("result", "")),
                is_error=bool(record.get("is_error", False)),
                raw=record,
            )

    def compose(self, result: ProcessResult) -> TurnOutput:
        record = self.turn.result
        if self.turn.session_missing or (record is None and _MISSING in result.stderr_tail):
            detail = "; ".join(self.turn.errors) or result.stderr_tail
            return self.missing_session_output(result, detail)
        if record is None and _IN_USE in result.stderr_tail:
            # The session exists already (e.g. created by an earlier process that was not
            # told to resume): this turn failed, the next one resumes it.
            self.started = True
            message = (
                f"{self.cli_name} already has session {self.session_id}, so it could not be "
                f"created again; the next turn will resume it. {self.failure_text(result)}"
            )
            return self.output(message, result, {"is_error": True, "num_turns": 0})
        if record is None:
            self.require_exit(result, "result record")
            return self.output(
                self.failure_text(result), result, {"is_error": True, "num_turns": 0}
            )
        text = record.get("result")
        if not isinstance(text, str):
            text = "; ".join(self.turn.errors) or self.failure_text(result)
        metadata: dict[str, object] = {
            "session_id": record.get("session_id", self.session_id),
            "is_error": bool(record.get("is_error", False)),
            "subtype": record.get("subtype"),
            "num_turns": record.get("num_turns"),
            "usage": record.get("usage"),
            "cost_usd": record.get("total_cost_usd"),
            "duration_ms": record.get("duration_ms"),
            "stop_reason": record.get("stop_reason"),
            "permission_denials": record.get("permission_denials") or [],
        }
        if record.get("api_error_status") is not None:
            metadata["api_error_status"] = record["api_error_status"]
        if self.turn.errors:
            metadata["errors"] = list(self.turn.errors)
        return self.output(text, result, metadata)


def _blocks(record: dict[str, Any]) -> list[dict[str, Any]]:
    message = record.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return []
    return [block for block in content if isinstance(block, dict)]


def _short_json(value: object, limit: int = 2000) -> str:
    text = json.dumps(value, ensure_ascii=False) if value is not None else ""
    return text if len(text) <= limit else text[:limit] + "..."

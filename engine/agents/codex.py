"""OpenAI Codex (``codex``), one ``codex exec --json`` process per turn.

Codex names its threads itself: the first turn runs ``codex exec`` and the thread id
comes from its first event (``thread.started``); from then on :attr:`CodexAgent.session_id`
is that thread id, and every later turn runs ``codex exec resume THREAD_ID -``. Persist
the id after the first turn (it is also ``TurnOutput.metadata["session_id"]``) to resume
from another process with ``resume=True``.

Tools map to a sandbox mode: read-only unless the allowlist lets the agent edit files or
run commands (then ``workspace-write``); "dangerous" adds network access to
``workspace-write``. ``danger-full-access`` and
``--dangerously-bypass-approvals-and-sandbox`` are never used.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Final

from engine.agents.allowlist import ToolAllowlist
from engine.agents.stream import EventKind, JsonStreamAgent
from engine.errors import InvalidPromptError
from engine.process import ProcessResult
from engine.redact import redact
from engine.turn import TurnOutput

__all__ = ["CODEX_MAX_PROMPT_CHARS", "WRITE_TOOLS", "CodexAgent", "codex_sandbox_args"]

# Codex refuses longer input ("input_too_large"); we refuse it before spawning.
CODEX_MAX_PROMPT_CHARS: Final = 1_048_576

# Allowlist entries that need a writable workspace.
WRITE_TOOLS: frozenset[str] = frozenset(
    {"edit", "create", "write", "bash", "shell", "Edit", "Write", "MultiEdit", "Bash"}
)

_MISSING = "no rollout found for thread id"


def codex_sandbox_args(allowlist: ToolAllowlist) -> list[str]:
    """Codex's sandbox flags for ``allowlist``."""
    if allowlist.dangerous:
        return ["-s", "workspace-write", "-c", "sandbox_workspace_write.network_access=true"]
    if any(tool in WRITE_TOOLS or tool.startswith("shell(") for tool in allowlist.tools):
        return ["-s", "workspace-write"]
    return ["-s", "read-only"]


class CodexAgent(JsonStreamAgent):
    """A Codex thread, resumed every turn."""

    cli_name: ClassVar[str] = "Codex"
    agent_name: ClassVar[str] = "codex"
    requires_uuid: ClassVar[bool] = False

    def check_prompt(self, prompt: str) -> None:
        if len(prompt) > CODEX_MAX_PROMPT_CHARS:
            raise InvalidPromptError(
                f"the prompt has {len(prompt)} characters; Codex accepts at most "
                f"{CODEX_MAX_PROMPT_CHARS}"
            )

    def turn_argv(self, program: str) -> list[str]:
        argv = [program, "exec", "--json", "--skip-git-repo-check"]
        argv += ["-c", "check_for_update_on_startup=false", "-c", "analytics.enabled=false"]
        argv += codex_sandbox_args(self.options.allowlist)
        if self.options.model:
            argv += ["-m", self.options.model]
        argv += list(self.options.passthrough)
        if self.started:
            argv += ["resume", self.session_id]
        argv.append("-")
        return argv

    def isolation_env(self) -> dict[str, str]:
        if self.options.config_dir is None:
            return {}
        home = self.options.config_dir
        return {"HOME": str(home), "CODEX_HOME": str(home / ".codex")}

    def handle(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        if kind == "thread.started":
            thread = record.get("thread_id")
            if isinstance(thread, str) and thread:
                if not self.started:
                    self._session_id = thread
                    self.preempt.session_id = thread
                self.started = True
            self.emit(EventKind.SESSION, text=str(thread or ""), raw=record)
        elif kind in ("item.started", "item.completed"):
            self._item(kind, record)
        elif kind == "turn.completed":
            self.turn.result = record
            usage = record.get("usage")
            self.turn.usage = usage if isinstance(usage, dict) else None
            self.emit(
                EventKind.RESULT, text=self.turn.texts[-1] if self.turn.texts else "", raw=record
            )
        elif kind == "turn.failed":
            self.turn.result = record
            error = record.get("error")
            message = error.get("message") if isinstance(error, dict) else None
            self.turn.errors.append(str(message or "turn failed"))
            self.emit(EventKind.RESULT, text=self.turn.errors[-1], is_error=True, raw=record)
        elif kind == "error":
            message = str(record.get("message", "error"))
            if not self.turn.errors or self.turn.errors[-1] != message:
                self.emit(EventKind.ERROR, text=message, is_error=True, raw=record)

    def _item(self, kind: str, record: dict[str, Any]) -> None:
        item = record.get("item")
        if not isinstance(item, dict):
            return
        item_type = item.get("type")
        item_id = str(item.get("id", ""))
        done = kind == "item.completed"
        if item_type == "agent_message" and done:
            self.turn.model_turns += 1
            text = str(item.get("text", ""))
            if text:
                self.turn.texts.append(text)
                self.emit(EventKind.TEXT, text=text, raw=record)
        elif item_type == "error" and done:
            # Codex reports warnings (e.g. unknown model metadata) as error items; the
            # turn goes on, so they are progress, not the turn's failure.
            self.emit(EventKind.ERROR, text=str(item.get("message", "")), raw=record)
        elif item_type in ("command_execution", "file_change", "mcp_tool_call", "web_search"):
            text = str(item.get("command") or json.dumps(item.get("changes", "")))
            if not done:
                self.turn.tool_calls += 1
                self.emit(
                    EventKind.TOOL_USE, text=text, tool=str(item_type), tool_id=item_id, raw=record
                )
            else:
                code = item.get("exit_code")
                failed = item.get("status") in ("failed", "declined") or code not in (0, None)
                self.emit(
                    EventKind.TOOL_RESULT,
                    text=str(item.get("aggregated_output", "")),
                    tool=str(item_type),
                    tool_id=item_id,
                    is_error=failed,
                    raw=record,
                )

    def compose(self, result: ProcessResult) -> TurnOutput:
        if self.turn.result is None and _MISSING in result.stderr_tail:
            line = next(
                (ln for ln in result.stderr_tail.splitlines() if _MISSING in ln),
                result.stderr_tail,
            )
            return self.missing_session_output(result, line.strip())
        if self.turn.result is None:
            self.require_exit(result, "turn.completed record")
            return self.output(self.failure_text(result), result, {"is_error": True})
        failed = self.turn.result.get("type") == "turn.failed"
        if failed:
            errors = redact("; ".join(self.turn.errors))
            text = f"{self.cli_name} turn failed (exit code {result.exit_code}): {errors}"
        else:
            text = self.turn.texts[-1] if self.turn.texts else ""
        metadata: dict[str, object] = {
            "session_id": self.session_id,
            "is_error": failed or result.exit_code != 0,
            "num_turns": self.turn.model_turns,
            "tool_calls": self.turn.tool_calls,
            "usage": self.turn.usage,
        }
        if self.turn.errors:
            metadata["errors"] = list(self.turn.errors)
        return self.output(text, result, metadata)

"""GitHub Copilot CLI (``copilot``), one ``copilot -s --no-color`` process per turn.

First turn ``--session-id <uuid>`` (names the new session), every later turn
``--resume <uuid>``: ``--resume`` fails when the session is gone, where ``--session-id``
would silently start a fresh one. Output is ``--output-format json`` (one event per
line, ending with a ``result`` record carrying the session id and exit code). The prompt
is piped on stdin, which Copilot reads as the prompt in non-interactive mode.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from engine.agents.allowlist import ToolAllowlist
from engine.agents.stream import EventKind, JsonStreamAgent
from engine.process import ProcessResult
from engine.turn import TurnOutput

__all__ = ["COPILOT_PERMISSION_NAMES", "CopilotAgent", "copilot_allowlist"]

# Copilot's ``--allow-tool`` takes permission kinds, not tool names: creating or editing a
# file needs ``write``, running a command ``shell``. Names not listed pass through.
COPILOT_PERMISSION_NAMES: dict[str, str] = {
    "create": "write",
    "edit": "write",
    "write": "write",
    "bash": "shell",
}

_MISSING = "No session, task, or name matched"


def copilot_allowlist(allowlist: ToolAllowlist) -> ToolAllowlist:
    """``allowlist`` with tool names translated to Copilot's permission kinds.

    Its :meth:`~engine.agents.allowlist.ToolAllowlist.to_copilot_args` then gives the
    flags: ``--allow-tool X`` each, or ``--allow-all-tools`` when dangerous (never
    ``--allow-all``, which would also open every path and URL).
    """
    names: dict[str, None] = {}
    for tool in allowlist.tools:
        names.setdefault(COPILOT_PERMISSION_NAMES.get(tool, tool), None)
    return ToolAllowlist(tools=tuple(names), dangerous=allowlist.dangerous)


class CopilotAgent(JsonStreamAgent):
    """A GitHub Copilot CLI session, resumed every turn."""

    cli_name: ClassVar[str] = "Copilot CLI"
    agent_name: ClassVar[str] = "copilot"

    def turn_argv(self, program: str) -> list[str]:
        argv = [program, "-s", "--no-color", "--output-format", "json"]
        if self.started:
            argv.append(f"--resume={self.session_id}")
        else:
            argv += ["--session-id", self.session_id]
        if self.options.model:
            argv += ["--model", self.options.model]
        argv += copilot_allowlist(self.options.allowlist).to_copilot_args()
        argv += list(self.options.passthrough)
        return argv

    def default_env(self) -> dict[str, str]:
        return {"COPILOT_AUTO_UPDATE": "false"}

    def isolation_env(self) -> dict[str, str]:
        if self.options.config_dir is None:
            return {}
        return {"COPILOT_HOME": str(self.options.config_dir)}

    def handle(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        data = record.get("data")
        data = data if isinstance(data, dict) else {}
        if kind == "user.message":
            # The session exists (and will be saved) once the CLI accepted the prompt.
            self.started = True
            self.emit(EventKind.SESSION, raw=record)
        elif kind == "assistant.message":
            self.turn.model_turns += 1
            content = data.get("content")
            if isinstance(content, str) and content:
                self.turn.texts.append(content)
                self.emit(EventKind.TEXT, text=content, raw=record)
        elif kind == "tool.execution_start":
            self.turn.tool_calls += 1
            self.emit(
                EventKind.TOOL_USE,
                text=_arguments(data),
                tool=str(data.get("toolName", "")),
                tool_id=str(data.get("toolCallId", "")),
                raw=record,
            )
        elif kind == "tool.execution_complete":
            ok = bool(data.get("success", False))
            body = data.get("result") if ok else data.get("error")
            text = body.get("content") or body.get("message") if isinstance(body, dict) else ""
            self.emit(
                EventKind.TOOL_RESULT,
                text=str(text or ""),
                tool_id=str(data.get("toolCallId", "")),
                is_error=not ok,
                raw=record,
            )
        elif kind == "session.error":
            message = str(data.get("message", "session error"))
            self.turn.errors.append(message)
            self.emit(EventKind.ERROR, text=message, is_error=True, raw=record)
        elif kind == "result":
            self.started = True
            self.turn.result = record
            code = record.get("exitCode")
            self.emit(
                EventKind.RESULT,
                text=self.turn.texts[-1] if self.turn.texts else "",
                is_error=code not in (0, None) or bool(self.turn.errors),
                raw=record,
            )

    def compose(self, result: ProcessResult) -> TurnOutput:
        record = self.turn.result
        if record is None and _MISSING in result.stderr_tail:
            return self.missing_session_output(result, _first_line(result.stderr_tail))
        if record is None:
            self.require_exit(result, "result record")
            return self.output(self.failure_text(result), result, {"is_error": True})
        if self.turn.errors:
            text = "; ".join(self.turn.errors)
            if result.exit_code != 0:
                text = f"{self.cli_name} exited with code {result.exit_code}: {text}"
        else:
            text = self.turn.texts[-1] if self.turn.texts else ""
        code = record.get("exitCode")
        metadata: dict[str, object] = {
            "session_id": record.get("sessionId", self.session_id),
            "is_error": code not in (0, None) or bool(self.turn.errors),
            "num_turns": self.turn.model_turns,
            "tool_calls": self.turn.tool_calls,
            "usage": record.get("usage"),
            "cli_exit_code": code,
        }
        if self.turn.errors:
            metadata["errors"] = list(self.turn.errors)
        return self.output(text, result, metadata)


def _arguments(data: dict[str, Any]) -> str:
    args = data.get("arguments")
    return json.dumps(args, ensure_ascii=False)[:2000] if args is not None else ""


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return text.strip()

"""Claude Code (``claude``), one ``claude -p`` process per turn.

First turn ``--session-id <uuid>``, every later turn ``--resume <uuid>``, always from the
session's pinned cwd (Claude keeps sessions per working directory). Which flag a turn
uses is decided before spawning from the CLI's own session store: the session exists
when its transcript, ``<config dir>/projects/<cwd slug>/<id>.jsonl``, holds anything
(see :func:`claude_transcript_path`). A first turn killed before the CLI wrote its
transcript therefore leads to a fresh ``--session-id`` turn, not a failing ``--resume``;
one killed after leads to ``--resume``, not an "already in use" failure. Output is
``--output-format stream-json --verbose``: ``system/init``, ``assistant`` and ``user``
messages (tool calls and their results) while the turn runs, then one ``result`` record
with the final text, error flag, model turns, usage and cost.
"""

from __future__ import annotations

import json
import logging
import os
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import Invocation
from engine.agents.stream import EventKind, JsonStreamAgent, text_of
from engine.approvals.listener import ApprovalListener
from engine.approvals.policy import ApprovalPolicy
from engine.approvals.route import claude_approval_args
from engine.errors import TurnExecError
from engine.process import ProcessResult
from engine.turn import TurnOutput

__all__ = [
    "CLAUDE_TOOL_NAMES",
    "ClaudeAgent",
    "claude_config_dir",
    "claude_permission_args",
    "claude_project_slug",
    "claude_transcript_path",
]

_LOGGER = logging.getLogger(__name__)

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

# Claude Code cuts a project folder name at this many characters and appends a hash.
_SLUG_LIMIT = 200
_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"


def _utf16_units(text: str) -> list[int]:
    data = text.encode("utf-16-le", errors="surrogatepass")
    return [int.from_bytes(data[i : i + 2], "little") for i in range(0, len(data), 2)]


def _string_hash(text: str) -> int:
    """Java's ``String.hashCode`` over UTF-16 code units (what Claude Code computes)."""
    value = 0
    for unit in _utf16_units(text):
        value = (value * 31 + unit) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _base36(number: int) -> str:
    digits = ""
    while True:
        number, rest = divmod(number, 36)
        digits = _BASE36[rest] + digits
        if number == 0:
            return digits


def claude_project_slug(cwd: str) -> str:
    """The folder name Claude Code keeps a working directory's sessions under.

    Measured against Claude Code 2.1.197: every UTF-16 code unit of the (already
    resolved) path that is not an ASCII letter or digit becomes ``-`` (so an emoji gives
    two); a name longer than 200 characters is cut to 200, then ``-`` and the base-36
    absolute value of the path's 32-bit Java-style string hash are appended.
    """
    slug = "".join(
        chr(unit) if unit < 128 and chr(unit).isalnum() else "-" for unit in _utf16_units(cwd)
    )
    if len(slug) <= _SLUG_LIMIT:
        return slug
    return f"{slug[:_SLUG_LIMIT]}-{_base36(abs(_string_hash(cwd)))}"


def claude_config_dir(env: Mapping[str, str], cwd: Path) -> Path:
    """Claude Code's state folder for a process started with ``env`` in ``cwd``.

    ``$CLAUDE_CONFIG_DIR`` (a relative one is taken from the CLI's cwd), else
    ``$HOME/.claude``; Claude Code NFC-normalises it.
    """
    configured = env.get("CLAUDE_CONFIG_DIR")
    if configured is None:
        home = env.get("HOME") or str(Path.home())
        configured = os.path.join(home, ".claude")
    return cwd / unicodedata.normalize("NFC", configured)


def claude_transcript_path(config_dir: Path, cwd: Path, session_id: str) -> Path:
    """Where Claude Code writes session ``session_id`` started in ``cwd``.

    ``<config_dir>/projects/<slug of the resolved cwd>/<session_id>.jsonl``: the CLI
    resolves symlinks in its working directory before naming the folder.
    """
    resolved = os.path.realpath(cwd)
    return config_dir / "projects" / claude_project_slug(resolved) / f"{session_id}.jsonl"


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
    agent_name: ClassVar[str] = "claude"
    #: The permission server of the running process, while a person decides tool calls.
    _listener: ApprovalListener | None = None

    async def run_turn(self, prompt: str) -> TurnOutput:
        if self.options.approval is None:
            return await super().run_turn(prompt)
        async with ApprovalListener(self.options.approval, worktree=self.options.cwd) as listener:
            self._listener = listener
            try:
                return await super().run_turn(prompt)
            finally:
                self._listener = None

    def turn_paths(self) -> tuple[Path, ...]:
        return self._listener.shown_paths() if self._listener is not None else ()

    def transcript_path(self) -> Path:
        """The session's transcript in the CLI's store, for this agent's environment."""
        env = self.environment(Invocation(argv=[]))
        config = claude_config_dir(env, self.options.cwd)
        return claude_transcript_path(config, self.options.cwd, self.session_id)

    def _session_known(self) -> bool:
        """Whether the next turn resumes (True) or creates (False) the session.

        The CLI resumes only a non-empty transcript and refuses to create a session whose
        transcript file exists at all, so an empty leftover (a process killed between
        creating and filling it) is removed: it holds no conversation.
        """
        path = self.transcript_path()
        try:
            size: int | None = path.stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            size = None
        except OSError as exc:
            # The store cannot be read (permissions?): go by what this object saw.
            _LOGGER.warning(
                "cannot read Claude Code's transcript of session %s at %s (%s); %s it",
                self.session_id,
                path,
                exc,
                "resuming" if self.started else "creating",
            )
            return self.started
        if size:
            return True
        if self.finished_turn:
            # Turns finished in this session, yet the transcript is gone: resume anyway,
            # and the CLI's "no conversation found" becomes the plain-words report.
            return True
        if size == 0:
            path.unlink(missing_ok=True)
        if self.started:
            _LOGGER.info(
                "Claude Code has no transcript of session %s at %s: its first turn never "
                "finished, so this turn creates the session",
                self.session_id,
                path,
            )
            self.started = False
        return False

    def io_args(self) -> list[str]:
        """How the prompt goes in and the records come out (a resident session differs)."""
        return ["-p", "--output-format", "stream-json", "--verbose"]

    def turn_argv(self, program: str) -> list[str]:
        argv = [program, *self.io_args()]
        if self._session_known():
            argv += ["--resume", self.session_id]
        else:
            argv += ["--session-id", self.session_id]
        if self.options.model:
            argv += ["--model", self.options.model]
        argv += self._permission_args()[0]
        argv += list(self.options.passthrough)
        return argv

    def default_env(self) -> dict[str, str]:
        return {"DISABLE_AUTOUPDATER": "1"}

    def isolation_env(self) -> dict[str, str]:
        if self.options.config_dir is None:
            return {}
        return {"CLAUDE_CONFIG_DIR": str(self.options.config_dir)}

    def turn_env(self) -> dict[str, str]:
        return self._permission_args()[1]

    def _permission_args(self) -> tuple[list[str], dict[str, str]]:
        """The allowlist's flags, plus the permission prompt tool when a person decides.

        ``all`` and the presets: the allowlist is not passed, so every tool call the CLI
        gates reaches the permission server (which, under a preset, lets most run).
        """
        route = self.options.approval
        if route is None:
            return claude_permission_args(self.options.allowlist)
        if self._listener is None:
            raise TurnExecError("the permission server of this turn is not running")
        argv, env = claude_approval_args(self._listener.mcp_config(), route.policy)
        if route.policy is ApprovalPolicy.ALL or route.policy.is_preset:
            return argv, env
        listed, listed_env = claude_permission_args(self.options.allowlist)
        return [*listed, *argv], {**listed_env, **env}

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
        self.finished_turn = True
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

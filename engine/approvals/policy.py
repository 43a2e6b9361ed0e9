"""What asks, what a grant covers, and how a request reads on a phone: pure functions."""

from __future__ import annotations

import difflib
import json
import shlex
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Final

from engine.approvals.presets import Assessment, Reach, assess

__all__ = [
    "ApprovalPolicy",
    "Decision",
    "Scope",
    "command_prefix",
    "describe_key",
    "grant_key",
    "summarize",
]

# Commands whose first argument is a subcommand: "allow for this session" on ``git status``
# covers ``git status -s`` but not ``git push``.
_SUBCOMMAND_TOOLS: Final = frozenset(
    {
        "git",
        "gh",
        "npm",
        "npx",
        "pnpm",
        "yarn",
        "cargo",
        "go",
        "docker",
        "kubectl",
        "pip",
        "pip3",
        "uv",
        "poetry",
        "dotnet",
        "bundle",
        "make",
    }
)
# Anything that lets one command line run more than one program, redirect, substitute or
# set the environment: such a command is only ever covered by a grant for exactly itself.
_SHELL_SYNTAX: Final = ("&", "|", ";", "<", ">", "$", "`", "\n", "(", ")", "{", "}", "*", "?")
_SUMMARY_LIMIT: Final = 1500
_EXCERPT_LINES: Final = 12


class ApprovalPolicy(StrEnum):
    """``TURNSTILE_TOOL_APPROVAL``: when an agent's tool call waits for a person.

    ``off``: only the allowlist decides (anything else is refused). ``unlisted``: tools on
    the allowlist run, any other tool call asks. ``all``: every tool call the CLI would
    gate asks, listed or not. The presets judge each call (engine/approvals/presets.py):
    ``guarded``: every call that writes asks; ``trusted``: only destructive or outward
    ones ask; ``free``: nothing asks. Under every policy but ``off``, a catastrophic call
    asks and no session grant covers it.
    """

    OFF = "off"
    UNLISTED = "unlisted"
    ALL = "all"
    GUARDED = "guarded"
    TRUSTED = "trusted"
    FREE = "free"

    @property
    def is_preset(self) -> bool:
        """Whether this policy judges each call itself (the CLI's allowlist is not passed)."""
        return self in _ASKS_FROM

    def asks(self, assessment: Assessment) -> bool:
        """Whether a call judged ``assessment`` waits for a person under this policy."""
        if assessment.reach is Reach.CATASTROPHIC:
            return True
        return assessment.reach >= _ASKS_FROM.get(self, Reach.READS)

    @property
    def label(self) -> str:
        """The policy in a sentence a person reads."""
        return _LABELS[self]


class Decision(StrEnum):
    PENDING = "pending"
    ALLOWED = "allowed"
    DENIED = "denied"
    CANCELLED = "cancelled"


class Scope(StrEnum):
    """How far an allow reaches: this call, the rest of the run, an earlier grant, or the
    run's preset (nobody was asked)."""

    ONCE = "once"
    SESSION = "session"
    GRANT = "grant"
    PRESET = "preset"


def command_prefix(command: str) -> str:
    """The part of a shell command that "allow for this session" remembers.

    The program (and, for tools like git or npm, its subcommand) of a simple command. A
    command with shell syntax (pipes, ``;``, ``&&``, redirections, substitutions, globs,
    variable assignments) gets its whole text: a grant never stretches over a second program.
    """
    text = command.strip()
    if not text or any(mark in text for mark in _SHELL_SYNTAX):
        return "=" + text
    try:
        words = shlex.split(text)
    except ValueError:
        return "=" + text
    if not words or "=" in words[0]:
        return "=" + text
    if words[0] in _SUBCOMMAND_TOOLS and len(words) > 1:
        # ``git -C dir push``: options before the subcommand hide it; only exact matches.
        if words[1].startswith("-"):
            return "=" + text
        return f"{words[0]} {words[1]}"
    return words[0]


_ASKS_FROM: Final = {
    ApprovalPolicy.GUARDED: Reach.WRITES,
    ApprovalPolicy.TRUSTED: Reach.OUTWARD,
    ApprovalPolicy.FREE: Reach.CATASTROPHIC,
}
_LABELS: Final = {
    ApprovalPolicy.OFF: "off: only the allowed tools run, nothing asks",
    ApprovalPolicy.UNLISTED: "the allowed tools run, any other tool call asks",
    ApprovalPolicy.ALL: "every tool call asks",
    ApprovalPolicy.GUARDED: "guarded: every tool call that changes something asks",
    ApprovalPolicy.TRUSTED: "trusted: only destructive or outward actions ask",
    ApprovalPolicy.FREE: "free: nothing asks but the catastrophic (still sandboxed)",
}


def grant_key(tool: str, tool_input: Mapping[str, Any]) -> str:
    """The key a session grant is stored under: a command prefix for Bash, else ``""``.

    A command that destroys something or reaches outward (``rm``, a push) is covered by a
    grant for exactly itself, never its prefix.
    """
    if tool == "Bash":
        command = str(tool_input.get("command", ""))
        judged = assess(tool, tool_input)
        if judged.destructive or judged.reach >= Reach.OUTWARD:
            return "=" + command.strip()
        return command_prefix(command)
    return ""


def describe_key(tool: str, key: str) -> str:
    """How a grant reads: "Bash commands starting with git status", "every Write"."""
    if not key:
        return f"every {tool} call"
    if key.startswith("="):
        return f"exactly this {tool} command"
    return f"{tool} commands starting with “{key}”"


def _cap(text: str, limit: int = _SUMMARY_LIMIT) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _excerpt(text: str, lines: int = _EXCERPT_LINES) -> str:
    parts = text.splitlines()
    shown = "\n".join(parts[:lines])
    if len(parts) > lines:
        shown += f"\n… ({len(parts) - lines} more lines)"
    return shown


def _diff(old: str, new: str, path: str) -> str:
    diff = difflib.unified_diff(
        old.splitlines(), new.splitlines(), fromfile=path, tofile=path, lineterm="", n=1
    )
    body = [line for line in diff if not line.startswith(("---", "+++"))]
    return _excerpt("\n".join(body), 20)


def summarize(tool: str, tool_input: Mapping[str, Any]) -> str:
    """A short, plain rendering of a tool call: the command, or the file and a diff excerpt."""
    if tool == "Bash":
        text = f"$ {tool_input.get('command', '')}"
        description = tool_input.get("description")
        if description:
            text += f"\n({description})"
        return _cap(text)
    path = str(tool_input.get("file_path") or tool_input.get("notebook_path") or "")
    if tool == "Write":
        content = str(tool_input.get("content", ""))
        return _cap(f"{path} ({len(content.encode())} bytes)\n{_excerpt(content)}")
    if tool == "Edit":
        old = str(tool_input.get("old_string", ""))
        new = str(tool_input.get("new_string", ""))
        return _cap(f"{path}\n{_diff(old, new, path)}")
    if tool == "MultiEdit":
        edits = tool_input.get("edits")
        chunks = [path]
        if isinstance(edits, list):
            for edit in edits[:3]:
                if isinstance(edit, Mapping):
                    old = str(edit.get("old_string", ""))
                    chunks.append(_diff(old, str(edit.get("new_string", "")), path))
            if len(edits) > 3:
                chunks.append(f"… and {len(edits) - 3} more edits")
        return _cap("\n".join(chunks))
    return _cap(json.dumps(dict(tool_input), ensure_ascii=False, indent=1, default=str))

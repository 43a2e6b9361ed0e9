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

Codex runs every shell command of the model through its Linux sandbox helper
(``codex-linux-sandbox``, a name for the ``codex`` binary itself) under bubblewrap, in a
user namespace of its own; see :func:`codex_tmpdir_redirect` for what that needs when
``CODEX_HOME`` is in a temp dir. It nests inside an outer bubblewrap sandbox (the agent's
walls) as long as the process there may map its uid into a new user namespace: not uid 0
without ``CAP_SETFCAP`` (root with every capability dropped and no user namespace), where
each command fails with ``bwrap: setting up uid map: Operation not permitted``; a user
namespace with a non-zero uid around it (``--unshare-user --uid 1000``) works.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import Invocation
from engine.agents.stream import EventKind, JsonStreamAgent
from engine.errors import InvalidPromptError
from engine.process import ProcessResult
from engine.redact import redact
from engine.turn import TurnOutput

__all__ = [
    "CODEX_MAX_PROMPT_CHARS",
    "WRITE_TOOLS",
    "CodexAgent",
    "TmpdirRedirect",
    "codex_sandbox_args",
    "codex_tmpdir_redirect",
]

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


@dataclass(frozen=True, slots=True)
class TmpdirRedirect:
    """Where Codex's own ``TMPDIR`` points, and the one its commands keep.

    Attributes:
        codex: Codex's own ``TMPDIR`` (``$CODEX_HOME/tmp``).
        tools: the ``TMPDIR`` the model's commands get (what they would have had).
    """

    codex: str
    tools: str


def _within(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it, as Rust's ``Path::starts_with`` sees it
    (either spelling: as given, or with symlinks resolved)."""
    if root == "":
        return True  # Rust: every path starts with the empty path
    if not os.path.isabs(root):
        return False
    paths = {Path(os.path.abspath(path)), Path(os.path.realpath(path))}
    roots = {Path(os.path.abspath(root)), Path(os.path.realpath(root))}
    return any(p.is_relative_to(r) for p in paths for r in roots)


def codex_tmpdir_redirect(env: Mapping[str, str]) -> TmpdirRedirect | None:
    """The ``TMPDIR`` Codex needs for its sandbox to run commands, given its environment
    ``env`` (None: it needs nothing).

    Codex (0.171.0) runs each shell command as ``bwrap ... -- codex-linux-sandbox ...``,
    the sandbox helper being its own binary under that name. With a bubblewrap that has
    ``--argv0`` (0.9.0 and later, or the copy bundled with Codex, used when none is on
    PATH) it names the binary by path. The system bubblewrap Codex prefers when one is on
    PATH may be older (Debian 12's is 0.8.0): then Codex names the helper through the
    aliases it makes at start-up in ``$CODEX_HOME/tmp/arg0-linux`` and puts first on
    PATH. It refuses to make them when ``CODEX_HOME`` is inside its temp dir
    (``$TMPDIR``, else ``/tmp``: "Refusing to create helper binaries under temporary
    dir"), and then every command fails with ``bwrap: execvp codex-linux-sandbox: No
    such file or directory``. Codex reports that only to the model (no
    ``command_execution`` item): the turn succeeds and nothing was run.

    So when ``CODEX_HOME`` is inside the temp dir Codex's own ``TMPDIR`` becomes
    ``$CODEX_HOME/tmp`` (not an ancestor of ``CODEX_HOME``, and already writable by the
    sandboxed commands, being inside the temp dir), and its commands keep the temp dir
    they had (``shell_environment_policy.set.TMPDIR``, :meth:`CodexAgent.codex_config_args`).
    The sandbox itself is unchanged: read-only writes nothing, workspace-write writes the
    working directory, ``/tmp`` and ``$TMPDIR`` (now ``$CODEX_HOME/tmp``; a ``TMPDIR``
    outside ``/tmp`` that held ``CODEX_HOME`` is no longer writable to them).
    """
    home = env.get("CODEX_HOME") or (os.path.join(env["HOME"], ".codex") if env.get("HOME") else "")
    if not home or not os.path.isabs(home):
        return None
    temp = env.get("TMPDIR", "/tmp")  # noqa: S108 - Rust's temp_dir(), even an empty TMPDIR
    if not _within(home, temp):
        return None
    return TmpdirRedirect(
        codex=os.path.join(os.path.realpath(home), "tmp"),
        tools=temp or "/tmp",  # noqa: S108 - the default temp dir
    )


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
        argv += self.codex_config_args()
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

    def _tmpdir_redirect(self, env: Mapping[str, str] | None = None) -> TmpdirRedirect | None:
        if env is None:
            env = super().environment(Invocation(argv=[], env=self.turn_env()))
        return codex_tmpdir_redirect(env)

    def codex_config_args(self) -> list[str]:
        """``-c`` overrides every Codex process of this session gets (both modes): the
        model's commands keep their ``TMPDIR`` when Codex's own is redirected
        (:func:`codex_tmpdir_redirect`)."""
        redirect = self._tmpdir_redirect()
        if redirect is None:
            return []
        value = json.dumps(redirect.tools, ensure_ascii=False)  # a TOML string
        return ["-c", f"shell_environment_policy.set.TMPDIR={value}"]

    def environment(self, invocation: Invocation) -> dict[str, str]:
        env = super().environment(invocation)
        redirect = self._tmpdir_redirect(env)
        if redirect is not None:
            # Codex makes it at start-up (its aliases go in tmp/arg0-linux); made here
            # too, so Codex's TMPDIR exists even if it could not.
            with contextlib.suppress(OSError):
                os.mkdir(redirect.codex, mode=0o700)
            env["TMPDIR"] = redirect.codex
        return env

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

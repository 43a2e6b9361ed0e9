"""Running git: argv only, output captured, errors typed and redacted.

```
TurnstileError
├── WorkspaceError            a workspace operation failed
│   ├── GitError              git exited non-zero (subcommand, exit code, redacted stderr)
│   │   └── DiskFullError     ... because the disk is full (retrying after freeing space helps)
│   ├── WorkspaceBusyError    another run or process holds the worktree's lock
│   └── WorkspaceStateError   the worktree is not what turnstile left (damaged, dirty parent)
└── ConfigError
    └── ProjectError          unknown or badly configured project (engine.workspace.projects)
```
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from engine.errors import TurnstileError
from engine.redact import Redactor, tail

__all__ = [
    "DiskFullError",
    "GitError",
    "GitResult",
    "GitRunner",
    "WorkspaceBusyError",
    "WorkspaceError",
    "WorkspaceStateError",
]

_TAIL: Final = 1500
_DISK_FULL = ("no space left on device", "disk quota exceeded", "file too large")


class WorkspaceError(TurnstileError):
    """A workspace (clone cache, worktree, branch) operation failed."""

    def __init__(self, message: str, *, workspace: str | None = None) -> None:
        super().__init__(message)
        self.workspace = workspace


class GitError(WorkspaceError):
    """git exited non-zero.

    Attributes:
        command: the git subcommand (``clone``, ``worktree``, ...), never the full argv.
        exit_code: git's exit code.
        stderr: the redacted tail of what git wrote to stderr.
    """

    def __init__(
        self,
        message: str,
        *,
        command: str,
        exit_code: int,
        stderr: str,
        workspace: str | None = None,
    ) -> None:
        super().__init__(message, workspace=workspace)
        self.command = command
        self.exit_code = exit_code
        self.stderr = stderr


class DiskFullError(GitError):
    """git ran out of disk space; freeing space and retrying can help."""

    retryable = True


class WorkspaceBusyError(WorkspaceError):
    """The worktree is in use by another run (in this process or another)."""

    retryable = True


class WorkspaceStateError(WorkspaceError):
    """The worktree is not in the state the operation needs."""


@dataclass(frozen=True, slots=True)
class GitResult:
    """What a finished git process left behind."""

    exit_code: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stdout.splitlines() if line]


class GitRunner:
    """Runs ``git`` with a non-interactive environment.

    Prompts are disabled (a missing credential fails fast instead of hanging), hooks are
    off, the locale is fixed so messages can be recognised, and everything shown is
    redacted.
    """

    def __init__(self, *, binary: str = "git", redactor: Redactor | None = None) -> None:
        self.binary = binary
        self.redactor = redactor or Redactor()

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["GIT_TERMINAL_PROMPT"] = "0"
        env["GCM_INTERACTIVE"] = "never"
        env["LC_ALL"] = "C"
        env.setdefault("GIT_SSH_COMMAND", "ssh -o BatchMode=yes")
        # No hooks in the engine's own git commands: hooks live in the shared clone, where
        # any run's agent could have put one that would then run on every checkout and
        # merge of every other run.
        count = int(env.get("GIT_CONFIG_COUNT", "0") or "0")
        env[f"GIT_CONFIG_KEY_{count}"] = "core.hooksPath"
        env[f"GIT_CONFIG_VALUE_{count}"] = os.devnull
        env["GIT_CONFIG_COUNT"] = str(count + 1)
        if extra:
            env.update(extra)
        return env

    async def run(
        self,
        args: Sequence[str],
        *,
        cwd: Path | None = None,
        check: bool = True,
        env: Mapping[str, str] | None = None,
        workspace: str | None = None,
    ) -> GitResult:
        """Run ``git ARGS`` to completion.

        Raises:
            WorkspaceError: git could not be started.
            GitError: git exited non-zero and ``check`` is set.
            DiskFullError: ... and its message says the disk is full.
        """
        command = next((a for a in args if not a.startswith("-")), "git")
        try:
            proc = await asyncio.create_subprocess_exec(
                self.binary,
                *args,
                cwd=cwd,
                env=self.env(env),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except FileNotFoundError as exc:
            raise WorkspaceError(
                f"cannot run {self.binary!r}: not found (is git installed?)"
            ) from exc
        except OSError as exc:
            raise WorkspaceError(f"cannot run {self.binary!r}: {exc.strerror}") from exc
        try:
            out, err = await proc.communicate()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.shield(proc.wait())
            raise
        code = proc.returncode if proc.returncode is not None else -1
        result = GitResult(
            exit_code=code,
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
        )
        if check and code != 0:
            raise self.error(command, result, workspace=workspace)
        return result

    def error(self, command: str, result: GitResult, *, workspace: str | None = None) -> GitError:
        """The typed, redacted error for a failed git ``command``."""
        stderr = self.redactor(tail(result.stderr, _TAIL)).strip()
        lowered = result.stderr.lower()
        if any(marker in lowered for marker in _DISK_FULL):
            return DiskFullError(
                f"git {command} failed: no space left on device (free some disk space and "
                f"retry): {stderr}",
                command=command,
                exit_code=result.exit_code,
                stderr=stderr,
                workspace=workspace,
            )
        return GitError(
            f"git {command} failed (exit {result.exit_code}): {stderr or 'no message'}",
            command=command,
            exit_code=result.exit_code,
            stderr=stderr,
            workspace=workspace,
        )

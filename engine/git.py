"""Running git: the one runner every git call of the engine goes through.

Argv only (never a shell), no prompts, hooks off, a fixed locale, output captured into one
:class:`GitResult`, errors typed and redacted. A git that exits non-zero is a result (or a
:class:`~engine.errors.GitError` when the caller asks for ``check``); a git that cannot be
started at all is always a :class:`~engine.errors.GitError`, never a made-up exit code.
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

from engine.errors import DiskFullError, GitError
from engine.redact import Redactor, tail

__all__ = ["GitResult", "GitRunner"]

_TAIL: Final = 1500
_DISK_FULL = ("no space left on device", "disk quota exceeded", "file too large")


@dataclass(frozen=True, slots=True)
class GitResult:
    """What a finished git process left behind (its output as bytes, decoded on demand)."""

    exit_code: int
    raw_stdout: bytes = b""
    raw_stderr: bytes = b""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def stdout(self) -> str:
        return self.raw_stdout.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.raw_stderr.decode("utf-8", errors="replace")

    @property
    def lines(self) -> list[str]:
        """The non-empty lines of stdout."""
        return [line for line in self.stdout.splitlines() if line]


class GitRunner:
    """Runs ``git`` with a non-interactive environment.

    Prompts are disabled (a missing credential fails fast instead of hanging), hooks are
    off, the locale is fixed so messages can be recognised, and everything shown is
    redacted.

    Args:
        optional_locks: let git take its optional locks (index refresh); off for reading
            a tree an agent may be running git in at the same moment.
    """

    def __init__(
        self,
        *,
        binary: str = "git",
        redactor: Redactor | None = None,
        optional_locks: bool = True,
    ) -> None:
        self.binary = binary
        self.redactor = redactor or Redactor()
        self.optional_locks = optional_locks

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["GIT_TERMINAL_PROMPT"] = "0"
        env["GCM_INTERACTIVE"] = "never"
        env["LC_ALL"] = "C"
        env.setdefault("GIT_SSH_COMMAND", "ssh -o BatchMode=yes")
        if not self.optional_locks:
            env["GIT_OPTIONAL_LOCKS"] = "0"
        # No hooks in the engine's own git commands: hooks live in the shared clone, where
        # any run's agent could have put one that would then run on every checkout and
        # merge of every other run.
        # Nor a file-system monitor: a program a repository's config names, run by `git
        # status` (the agent's sandbox keeps the config read-only; this holds regardless).
        count = int(env.get("GIT_CONFIG_COUNT", "0") or "0")
        for key, value in (("core.hooksPath", os.devnull), ("core.fsmonitor", "false")):
            env[f"GIT_CONFIG_KEY_{count}"] = key
            env[f"GIT_CONFIG_VALUE_{count}"] = value
            count += 1
        env["GIT_CONFIG_COUNT"] = str(count)
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
    ) -> GitResult:
        """Run ``git ARGS`` to completion; cancelling kills its process group.

        Raises:
            GitError: git could not be started (``exit_code`` None), or it exited non-zero
                and ``check`` is set.
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
        except OSError as exc:
            raise self._start_error(command, exc, cwd) from exc
        try:
            out, err = await proc.communicate()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.shield(proc.wait())
            raise
        code = proc.returncode if proc.returncode is not None else -1
        result = GitResult(exit_code=code, raw_stdout=out, raw_stderr=err)
        if check and code != 0:
            raise self.error(command, result)
        return result

    def error(self, command: str, result: GitResult) -> GitError:
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
            )
        return GitError(
            f"git {command} failed (exit {result.exit_code}): {stderr or 'no message'}",
            command=command,
            exit_code=result.exit_code,
            stderr=stderr,
        )

    def _start_error(self, command: str, exc: OSError, cwd: Path | None) -> GitError:
        if cwd is not None and not cwd.is_dir():
            reason = f"the folder {cwd} does not exist"
        elif isinstance(exc, FileNotFoundError):
            reason = "not found (is git installed?)"
        else:
            reason = exc.strerror or type(exc).__name__
        return GitError(
            f"cannot run {self.binary!r}: {reason}",
            command=command,
            exit_code=None,
            stderr="",
        )

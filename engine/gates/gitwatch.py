"""A fingerprint of a git workspace's code, to notice edits made in phases that forbid them.

git runs through :class:`engine.git.GitRunner` (argv only, hooks off, no optional locks:
the agent may be running git in the same tree). The fingerprint covers the committed and
staged files' contents (the index), the working tree diff and untracked files, excluding
the task folder (artifacts are not code). It does not cover the commit itself: committing
the task folder alone, as a worker does after every step, changes no code.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Final

from engine import safefile
from engine.errors import UnsafeFileError
from engine.git import GitRunner

__all__ = ["FINGERPRINT_VERSION", "comparable", "fingerprint", "is_git_workdir"]

#: The form of a fingerprint: those of another form (recorded by an older version, which
#: hashed the commit) are not compared with it.
FINGERPRINT_VERSION: Final = "2:"


def is_git_workdir(workdir: Path) -> bool:
    """Whether ``workdir`` is the top of a git work tree (a ``.git`` dir or worktree file)."""
    return (workdir / ".git").exists()


async def _git(runner: GitRunner, workdir: Path, *args: str) -> bytes | None:
    result = await runner.run(args, cwd=workdir, check=False)
    return result.raw_stdout if result.ok else None


def _pathspec(workdir: Path, exclude: Path | None) -> list[str]:
    spec = ["--", "."]
    if exclude is not None:
        try:
            rel = exclude.resolve().relative_to(workdir.resolve())
        except ValueError:
            return spec
        if str(rel) != ".":
            spec.append(f":(exclude){rel.as_posix()}")
    return spec


async def fingerprint(workdir: Path, exclude: Path | None = None) -> str | None:
    """A hash of the code state of ``workdir``, or None when it is not a git work tree.

    Args:
        exclude: a folder inside ``workdir`` left out (the task folder).

    Raises:
        GitError: git could not be started.
    """
    if not is_git_workdir(workdir):
        return None
    git = GitRunner(optional_locks=False)
    spec = _pathspec(workdir, exclude)
    head = await _git(git, workdir, "rev-parse", "--verify", "-q", "HEAD")
    # The files' contents, not the commit: a commit of the task folder alone (a worker
    # commits it after every step) changes no code.
    tracked = await _git(git, workdir, "ls-files", "-s", "-z", *spec)
    status = await _git(
        git, workdir, "status", "--porcelain=v1", "-z", "--untracked-files=all", *spec
    )
    diff = await _git(git, workdir, "diff", "HEAD", "--binary", *spec) if head else b""
    if status is None:
        return None
    digest = hashlib.sha256()
    for part in (tracked or b"", status, diff or b""):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    # Untracked files' contents matter too (status lists only their names).
    for entry in status.split(b"\0"):
        if entry.startswith(b"?? "):
            relative = os.fsdecode(entry[3:])
            try:
                # An agent's file: no pipe may block this, no link to /dev/zero be read.
                digest.update(safefile.read_head(workdir, relative, 1024 * 1024))
            except UnsafeFileError as exc:
                digest.update(f"!{exc.reason}".encode())
                with contextlib.suppress(OSError):
                    digest.update(os.fsencode(os.readlink(workdir / relative)))
            except (OSError, ValueError):
                digest.update(b"-")
    return FINGERPRINT_VERSION + digest.hexdigest()


def comparable(before: str | None, after: str | None) -> bool:
    """Whether two fingerprints can say if the code changed between them (both taken, and
    of one form)."""
    if not before or not after:
        return False
    return before.startswith(FINGERPRINT_VERSION) == after.startswith(FINGERPRINT_VERSION)

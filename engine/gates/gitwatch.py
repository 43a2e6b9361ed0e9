"""A fingerprint of a git workspace's code, to notice edits made in phases that forbid them.

Plain ``git`` subprocesses (argv only). The fingerprint covers HEAD, the index, the working
tree diff and untracked files, excluding the task folder (artifacts are not code).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from pathlib import Path

from engine import safefile
from engine.errors import UnsafeFileError

__all__ = ["fingerprint", "is_git_workdir"]


def is_git_workdir(workdir: Path) -> bool:
    """Whether ``workdir`` is the top of a git work tree (a ``.git`` dir or worktree file)."""
    return (workdir / ".git").exists()


async def _git(workdir: Path, *args: str) -> bytes | None:
    proc = await asyncio.create_subprocess_exec(
        "git",
        "-C",
        str(workdir),
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"},
    )
    out, _ = await proc.communicate()
    return out if proc.returncode == 0 else None


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
    """
    if not is_git_workdir(workdir):
        return None
    spec = _pathspec(workdir, exclude)
    head = await _git(workdir, "rev-parse", "--verify", "-q", "HEAD")
    status = await _git(workdir, "status", "--porcelain=v1", "-z", "--untracked-files=all", *spec)
    diff = await _git(workdir, "diff", "HEAD", "--binary", *spec) if head else b""
    if status is None:
        return None
    digest = hashlib.sha256()
    for part in (head or b"", status, diff or b""):
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
    return digest.hexdigest()

"""The few git facts auto mode measures in a workspace (argv only, never a shell)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engine.errors import TurnExecError
from engine.process import PreemptHandle, ProcessSpec, run_process

__all__ = ["Git", "GitResult"]

# The id of git's empty tree: "everything" when the repository had no commit at the start.
_EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
_ENV_OVERRIDES = {
    # The agent may be running git in the same tree: never take its locks.
    "GIT_OPTIONAL_LOCKS": "0",
    "GIT_TERMINAL_PROMPT": "0",
    "LC_ALL": "C",
}


@dataclass(frozen=True, slots=True)
class GitResult:
    code: int
    out: str


class Git:
    """Runs git in one working directory."""

    def __init__(self, workdir: Path, *, binary: str = "git") -> None:
        self.workdir = workdir
        self.binary = binary

    async def run(self, *args: str, preempt: PreemptHandle | None = None) -> GitResult:
        env = dict(os.environ)
        env.update(_ENV_OVERRIDES)
        try:
            result = await run_process(
                ProcessSpec(argv=[self.binary, *args], cwd=self.workdir, env=env),
                preempt=preempt,
            )
        except TurnExecError:
            return GitResult(127, "")
        return GitResult(result.exit_code, result.stdout)

    async def is_repo(self) -> bool:
        result = await self.run("rev-parse", "--is-inside-work-tree")
        return result.code == 0 and result.out.strip() == "true"

    async def head(self) -> str | None:
        result = await self.run("rev-parse", "--verify", "--quiet", "HEAD")
        return result.out.strip() or None if result.code == 0 else None

    async def commits_since(self, base: str | None) -> list[str]:
        """``sha subject`` of each commit in HEAD and not in ``base``, newest first."""
        if await self.head() is None:
            return []
        args = ["log", "--format=%h %s"]
        args.append(f"{base}..HEAD" if base else "HEAD")
        result = await self.run(*args)
        if result.code != 0:
            return []
        return [line for line in result.out.splitlines() if line.strip()]

    async def dirty_paths(self, exclude: list[Path]) -> list[str] | None:
        """Uncommitted and untracked paths (None when the status cannot be read)."""
        pathspec = ["--", "."]
        for path in exclude:
            rel = _relative(path, self.workdir)
            if rel is not None:
                pathspec.append(f":(exclude){rel}")
        result = await self.run("status", "--porcelain=v1", "--untracked-files=all", *pathspec)
        if result.code != 0:
            return None
        return [line[3:] for line in result.out.splitlines() if line.strip()]

    async def diff_stat(self, base: str | None) -> tuple[int, int, int]:
        """(files changed, insertions, deletions) between ``base`` and HEAD."""
        if await self.head() is None:
            return (0, 0, 0)
        result = await self.run("diff", "--numstat", base or _EMPTY_TREE, "HEAD")
        files = ins = dels = 0
        for line in result.out.splitlines():
            parts = line.split("\t")
            if len(parts) < 3:
                continue
            files += 1
            ins += int(parts[0]) if parts[0].isdigit() else 0
            dels += int(parts[1]) if parts[1].isdigit() else 0
        return (files, ins, dels)

    async def has_remote(self) -> bool:
        result = await self.run("remote")
        return result.code == 0 and bool(result.out.strip())


def _relative(path: Path, root: Path) -> str | None:
    try:
        rel = path.resolve().relative_to(root.resolve())
    except ValueError:
        return None
    return str(rel) if str(rel) != "." else None

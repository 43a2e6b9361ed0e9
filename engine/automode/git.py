"""The few git facts auto mode measures in a workspace (through :class:`engine.git.GitRunner`)."""

from __future__ import annotations

from pathlib import Path

from engine.git import GitResult, GitRunner

__all__ = ["Git"]

# The id of git's empty tree: "everything" when the repository had no commit at the start.
_EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"


class Git:
    """Reads git facts of one working directory.

    A git that exits non-zero answers "no" (not a repository, no commit); a git that
    cannot be started raises :class:`~engine.errors.GitError`.
    """

    def __init__(self, workdir: Path, *, runner: GitRunner | None = None) -> None:
        self.workdir = workdir
        # The agent may be running git in the same tree: never take its locks.
        self.runner = runner or GitRunner(optional_locks=False)

    async def run(self, *args: str) -> GitResult:
        return await self.runner.run(args, cwd=self.workdir, check=False)

    async def is_repo(self) -> bool:
        result = await self.run("rev-parse", "--is-inside-work-tree")
        return result.ok and result.stdout.strip() == "true"

    async def head(self) -> str | None:
        result = await self.run("rev-parse", "--verify", "--quiet", "HEAD")
        return result.stdout.strip() or None if result.ok else None

    async def commits_since(self, base: str | None) -> list[str]:
        """``sha subject`` of each commit in HEAD and not in ``base``, newest first."""
        if await self.head() is None:
            return []
        args = ["log", "--format=%h %s"]
        args.append(f"{base}..HEAD" if base else "HEAD")
        result = await self.run(*args)
        if not result.ok:
            return []
        return [line for line in result.stdout.splitlines() if line.strip()]

    async def dirty_paths(self, exclude: list[Path]) -> list[str] | None:
        """Uncommitted and untracked paths (None when the status cannot be read)."""
        pathspec = ["--", "."]
        for path in exclude:
            rel = _relative(path, self.workdir)
            if rel is not None:
                pathspec.append(f":(exclude){rel}")
        result = await self.run("status", "--porcelain=v1", "--untracked-files=all", *pathspec)
        if not result.ok:
            return None
        return [line[3:] for line in result.stdout.splitlines() if line.strip()]

    async def diff_stat(self, base: str | None) -> tuple[int, int, int]:
        """(files changed, insertions, deletions) between ``base`` and HEAD."""
        if await self.head() is None:
            return (0, 0, 0)
        result = await self.run("diff", "--numstat", base or _EMPTY_TREE, "HEAD")
        files = ins = dels = 0
        for line in result.stdout.splitlines():
            parts = line.split("\t")
            if len(parts) < 3:
                continue
            files += 1
            ins += int(parts[0]) if parts[0].isdigit() else 0
            dels += int(parts[1]) if parts[1].isdigit() else 0
        return (files, ins, dels)

    async def has_remote(self) -> bool:
        result = await self.run("remote")
        return result.ok and bool(result.stdout.strip())


def _relative(path: Path, root: Path) -> str | None:
    try:
        rel = path.resolve().relative_to(root.resolve())
    except ValueError:
        return None
    return str(rel) if str(rel) != "." else None

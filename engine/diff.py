"""What a run changed in its workdir: the files, git's summary line and the patch.

One reading for every front end: the web view highlights the patch, the chat sends it as a
document, a run's final report carries the summary and the files.

Read-only: git runs without its optional locks, so an agent's git in the same tree at the
same moment never meets a lock of ours; external diff programs and text conversions are
off, so a repository's settings cannot make us run anything.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from engine.errors import GitError
from engine.git import GitResult, GitRunner

__all__ = ["DiffFile", "RunDiff", "run_diff"]

_QUIET: Final = ("--no-color", "--no-ext-diff", "--no-textconv", "--find-renames")


@dataclass(frozen=True, slots=True)
class DiffFile:
    """One changed file (a binary one counts no lines)."""

    path: str
    added: int
    removed: int
    binary: bool
    old_path: str | None = None  # where a renamed file was

    def line(self) -> str:
        """``app.py | +2 -1`` (a rename: ``old → new``; a binary file: ``binary``)."""
        name = f"{self.old_path} → {self.path}" if self.old_path else self.path
        counts = "binary" if self.binary else f"+{self.added} -{self.removed}"
        return f"{name} | {counts}"


@dataclass(frozen=True, slots=True)
class RunDiff:
    """The workdir against ``base``; ``problem`` says why there is nothing to show.

    ``patch`` is cut at a line's end within the asked-for size (``truncated`` says so);
    the figures are always whole.
    """

    base: str | None
    files: tuple[DiffFile, ...] = ()
    stat_text: str = ""
    patch: bytes = b""
    truncated: bool = False
    #: The whole patch's size in bytes (more than ``patch`` holds when it was cut).
    patch_size: int = 0
    #: New files not yet added to git (they are in no patch).
    untracked: tuple[str, ...] = ()
    problem: str | None = None

    @property
    def changed(self) -> bool:
        return bool(self.files or self.untracked)

    def stat_lines(self, limit: int = 20) -> list[str]:
        """The summary line, then a line per file (at most ``limit``), then the new files
        not yet added to git, in words."""
        lines = [self.stat_text]
        lines += [f"  {f.line()}" for f in self.files[:limit]]
        if len(self.files) > limit:
            lines.append(f"  … and {len(self.files) - limit} more files")
        if self.untracked:
            shown = ", ".join(self.untracked[:5])
            more = f" and {len(self.untracked) - 5} more" if len(self.untracked) > 5 else ""
            count = len(self.untracked)
            lines.append(
                f"{_plural(count, 'new file', 'new files')} not yet added to git: {shown}{more}"
            )
        return lines


async def run_diff(
    workdir: Path, base: str | None, *, max_bytes: int = 400_000, git: GitRunner | None = None
) -> RunDiff:
    """What changed in ``workdir`` since ``base`` (or HEAD), uncommitted changes included.

    Args:
        workdir: the run's working tree.
        base: the commit or ref the run started from; None: HEAD.
        max_bytes: the most of the patch kept; the rest is cut.
        git: the runner (default: one that takes no optional locks).
    """
    git = git or GitRunner(optional_locks=False)
    try:
        inside = await git.run(["rev-parse", "--is-inside-work-tree"], cwd=workdir, check=False)
        if not inside.ok or inside.stdout.strip() != "true":
            return RunDiff(base=None, problem=_not_a_repo(workdir, inside, git))
        ref = base or "HEAD"
        # Resolved to a commit id first: the ref is then never read as an option by git.
        resolved = await git.run(
            ["rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}"],
            cwd=workdir,
            check=False,
        )
        if not resolved.ok:
            said = "The repository has no commits yet." if base is None else None
            return RunDiff(base=None, problem=said or f"The commit {base} is not known here.")
        numstat, patch, others = await _changes(git, workdir, resolved.stdout.strip())
    except GitError as error:
        # A folder that is gone fails git's start (or takes the tree away mid-way).
        gone = not await asyncio.to_thread(workdir.is_dir)
        said = f"The folder {workdir} is gone." if gone else f"git could not read it: {error}"
        return RunDiff(base=None, problem=said)
    files = _numstat(numstat.raw_stdout)
    raw = patch.raw_stdout
    truncated = len(raw) > max_bytes
    if truncated:
        cut = raw.rfind(b"\n", 0, max_bytes)
        raw = raw[: cut + 1] if cut >= 0 else raw[:max_bytes]
    new = others.raw_stdout.decode("utf-8", errors="replace").split("\0")
    return RunDiff(
        base=ref,
        files=files,
        stat_text=_stat(files),
        patch=raw,
        truncated=truncated,
        patch_size=len(patch.raw_stdout),
        untracked=tuple(n for n in new if n),
    )


async def _changes(
    git: GitRunner, workdir: Path, commit: str
) -> tuple[GitResult, GitResult, GitResult]:
    """The numstat, the patch and the untracked files against ``commit``, read at once."""
    try:
        async with asyncio.TaskGroup() as group:
            numstat = group.create_task(
                git.run(["diff", *_QUIET, "--numstat", "-z", commit, "--"], cwd=workdir),
                name="diff numstat",
            )
            patch = group.create_task(
                git.run(["diff", *_QUIET, commit, "--"], cwd=workdir), name="diff patch"
            )
            untracked = ["ls-files", "--others", "--exclude-standard", "-z"]
            others = group.create_task(git.run(untracked, cwd=workdir), name="diff untracked")
    except* GitError as failed:
        raise failed.exceptions[0] from None  # the group cancelled the others
    return numstat.result(), patch.result(), others.result()


def _not_a_repo(workdir: Path, result: GitResult, git: GitRunner) -> str:
    """Why git found no working tree in ``workdir`` (inside ``.git`` it says "false")."""
    said = result.stderr.strip()
    if result.ok or "not a git repository" in said.lower():
        return f"The folder {workdir} is not a git repository."
    first = git.redactor(said.splitlines()[0]) if said else "no message"
    return f"git could not read the folder {workdir}: {first}"


def _numstat(raw: bytes) -> tuple[DiffFile, ...]:
    """Parse ``--numstat -z``: ``ADDED\\tREMOVED\\tPATH\\0``, or for a rename
    ``ADDED\\tREMOVED\\t\\0OLD\\0NEW\\0``; a binary file counts ``-`` lines."""
    fields = raw.decode("utf-8", errors="replace").split("\0")
    files: list[DiffFile] = []
    i = 0
    while i < len(fields) and fields[i]:
        added, removed, path = fields[i].split("\t", 2)
        old: str | None = None
        if not path:  # a rename: the two paths follow
            old, path = fields[i + 1], fields[i + 2]
            i += 2
        i += 1
        binary = added == "-"
        files.append(
            DiffFile(
                path=path,
                added=0 if binary else int(added),
                removed=0 if binary else int(removed),
                binary=binary,
                old_path=old,
            )
        )
    return tuple(files)


def _plural(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def _stat(files: tuple[DiffFile, ...]) -> str:
    """git's own summary line (``diff --stat``): a zero count is left out unless both are."""
    if not files:
        return "no changes"
    added = sum(f.added for f in files)
    removed = sum(f.removed for f in files)
    parts = [_plural(len(files), "file changed", "files changed")]
    if added or not removed:
        parts.append(_plural(added, "insertion(+)", "insertions(+)"))
    if removed or not added:
        parts.append(_plural(removed, "deletion(-)", "deletions(-)"))
    return ", ".join(parts)

"""A short summary of a run's work, for logs and the final report."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from engine.automode.git import Git
from engine.diff import RunDiff, run_diff
from engine.workspace.manager import BranchPush

__all__ = ["BranchPusher", "WorkSummary", "WorkSummaryGenerator"]

_SHOWN_COMMITS = 10
_SHOWN_FILES = 15
_EVALUATION_EXCERPT = 600

#: Pushes the run's branch back where its project came from (None: the run has no branch).
BranchPusher = Callable[[], Awaitable[BranchPush | None]]


@dataclass(frozen=True, slots=True)
class WorkSummary:
    commits: tuple[str, ...]
    files_changed: int
    insertions: int
    deletions: int
    last_evaluation: str
    is_repo: bool = True
    #: The workdir against the run's start, uncommitted changes included.
    changes: RunDiff | None = None
    branch: BranchPush | None = None

    def render(self) -> str:
        lines = []
        if not self.is_repo:
            lines.append("Workspace: not a git repository (no commit history measured)")
        else:
            lines.append(
                f"Commits since start: {len(self.commits)}; files changed: "
                f"{self.files_changed} (+{self.insertions} -{self.deletions})"
            )
            for commit in self.commits[:_SHOWN_COMMITS]:
                lines.append(f"  {commit}")
            if len(self.commits) > _SHOWN_COMMITS:
                lines.append(f"  … and {len(self.commits) - _SHOWN_COMMITS} more")
        if self.changes is not None and self.changes.changed:
            stat = self.changes.stat_lines(_SHOWN_FILES)
            lines.append(f"Changed since the start: {stat[0]}")
            lines += stat[1:]
        if self.branch is not None:
            lines.append(self.branch.line())
        if self.last_evaluation:
            lines.append("Last evaluation: " + self.last_evaluation)
        return "\n".join(lines)


class WorkSummaryGenerator:
    """Summarises commits and changes since ``base_commit`` plus the last evaluation.

    Args:
        push: pushes the run's branch back (called once the run has commits); None: the
            branch is not pushed or named.
    """

    def __init__(
        self, workdir: Path, *, base_commit: str | None, push: BranchPusher | None = None
    ) -> None:
        self.base_commit = base_commit
        self._workdir = workdir
        self._git = Git(workdir)
        self._push = push

    async def generate(self, last_evaluation: str = "") -> WorkSummary:
        excerpt = " ".join(last_evaluation.split())
        if len(excerpt) > _EVALUATION_EXCERPT:
            excerpt = "…" + excerpt[-_EVALUATION_EXCERPT:]
        if not await self._git.is_repo():
            return WorkSummary((), 0, 0, 0, excerpt, is_repo=False)
        commits = await self._git.commits_since(self.base_commit)
        files, ins, dels = await self._git.diff_stat(self.base_commit)
        changes = None
        if self.base_commit is not None:
            found = await run_diff(self._workdir, self.base_commit, max_bytes=0)
            changes = found if found.problem is None else None
        # Nothing committed: nothing worth a branch in the project's repository.
        branch = await self._push() if self._push is not None and commits else None
        return WorkSummary(
            tuple(commits), files, ins, dels, excerpt, changes=changes, branch=branch
        )

"""A short summary of a run's work, for logs and the final report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.automode.git import Git

__all__ = ["WorkSummary", "WorkSummaryGenerator"]

_SHOWN_COMMITS = 10
_EVALUATION_EXCERPT = 600


@dataclass(frozen=True, slots=True)
class WorkSummary:
    commits: tuple[str, ...]
    files_changed: int
    insertions: int
    deletions: int
    last_evaluation: str
    is_repo: bool = True

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
        if self.last_evaluation:
            lines.append("Last evaluation: " + self.last_evaluation)
        return "\n".join(lines)


class WorkSummaryGenerator:
    """Summarises commits and changes since ``base_commit`` plus the last evaluation."""

    def __init__(self, workdir: Path, *, base_commit: str | None) -> None:
        self.base_commit = base_commit
        self._git = Git(workdir)

    async def generate(self, last_evaluation: str = "") -> WorkSummary:
        excerpt = " ".join(last_evaluation.split())
        if len(excerpt) > _EVALUATION_EXCERPT:
            excerpt = "…" + excerpt[-_EVALUATION_EXCERPT:]
        if not await self._git.is_repo():
            return WorkSummary((), 0, 0, 0, excerpt, is_repo=False)
        commits = await self._git.commits_since(self.base_commit)
        files, ins, dels = await self._git.diff_stat(self.base_commit)
        return WorkSummary(tuple(commits), files, ins, dels, excerpt)

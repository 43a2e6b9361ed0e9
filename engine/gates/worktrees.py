"""Git worktrees for gated tasks checked out with ``--checkout-repo`` (engine.workspace).

A task created with ``turnstile autopilot --init --checkout-repo PROJECT`` works in the
worktree whose run id is the task name. While a drive runs, it holds that worktree's lock.
Each sub-task of a wave gets its own worktree and branch (``turnstile/<task>--<name>``, cut
from the parent's branch); when a wave ends, the complete sub-tasks' branches are merged
back into the parent's branch (``--no-ff``); a conflict sends that sub-task to
human_intervention. Tasks without a worktree are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from engine.gates.tasks import TaskRecord

if TYPE_CHECKING:
    from engine.settings import Settings
    from engine.store.database import Database

__all__ = ["TaskWorktrees", "WaveWorkspaces", "workspace_id"]


def workspace_id(task: TaskRecord) -> str:
    """The workspace id of a task: its name, or ``PARENT--NAME`` for a sub-task."""
    if task.parent is None:
        return task.name
    return f"{task.parent}--{task.name[len(task.parent) + 1 :]}"


class WaveWorkspaces(Protocol):
    """What the autopilot asks of a workspace provider (all no-ops without worktrees)."""

    def hold(self, task: TaskRecord) -> contextlib.AbstractAsyncContextManager[Any]:
        """Hold the task's worktree while it is driven."""
        ...

    async def before_wave(
        self, parent: TaskRecord, subtasks: Sequence[TaskRecord]
    ) -> dict[str, Path]:
        """Worktrees for a wave's sub-tasks: ``{sub-task name: workdir}``."""
        ...

    async def after_wave(
        self, parent: TaskRecord, subtasks: Sequence[TaskRecord]
    ) -> dict[str, str]:
        """Merge a finished wave back; ``{sub-task name: problem}`` for those that failed."""
        ...


class TaskWorktrees:
    """:class:`WaveWorkspaces` over :class:`engine.workspace.WorkspaceManager`."""

    def __init__(self, settings: Settings, db: Database) -> None:
        self._settings = settings
        self._db = db
        self._manager: Any = None

    def _get_manager(self) -> Any:
        if self._manager is None:
            from engine.workspace import SqliteWorkspaceStore, WorkspaceManager

            self._manager = WorkspaceManager.from_settings(
                self._settings, store=SqliteWorkspaceStore(self._db)
            )
        return self._manager

    async def _find(self, task: TaskRecord) -> Any:
        # Cheap check first: most tasks have no worktree, and TURNSTILE_PROJECTS may be unset.
        row = await self._db.fetchone(
            "SELECT id FROM workspaces WHERE id = ? AND removed_at IS NULL",
            (workspace_id(task),),
        )
        if row is None:
            return None
        return await self._get_manager().get(workspace_id(task))

    @contextlib.asynccontextmanager
    async def hold(self, task: TaskRecord) -> AsyncIterator[Any]:
        workspace = await self._find(task)
        if workspace is None:
            yield None
            return
        async with self._get_manager().lock(workspace):
            yield workspace

    async def before_wave(
        self, parent: TaskRecord, subtasks: Sequence[TaskRecord]
    ) -> dict[str, Path]:
        parent_ws = await self._find(parent)
        if parent_ws is None:
            return {}
        manager = self._get_manager()
        out: dict[str, Path] = {}
        for sub in subtasks:
            short = sub.name[len(parent.name) + 1 :]
            workspace = await manager.get(workspace_id(sub))
            if workspace is None or workspace.removed_at is not None:
                workspace = await manager.provision_subtask(parent_ws, short)
            out[sub.name] = Path(workspace.path)
        return out

    async def after_wave(
        self, parent: TaskRecord, subtasks: Sequence[TaskRecord]
    ) -> dict[str, str]:
        parent_ws = await self._find(parent)
        if parent_ws is None:
            return {}
        manager = self._get_manager()
        done = [s for s in subtasks if s.phase == "complete"]
        workspaces = [await manager.get(workspace_id(s)) for s in done]
        report = await manager.merge_wave(parent_ws, [w for w in workspaces if w is not None])
        by_id = {workspace_id(s): s.name for s in done}
        problems: dict[str, str] = {}
        for result in report.results:
            if result.outcome.value in ("merged", "up_to_date"):
                continue
            name = by_id.get(result.workspace, result.workspace)
            detail = ", ".join(result.conflicts) if result.conflicts else (result.detail or "")
            problems[name] = f"merging {result.branch} into {report.branch}: " + (
                f"{result.outcome.value} ({detail})" if detail else result.outcome.value
            )
        return problems

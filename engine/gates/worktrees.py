"""Git worktrees for gated tasks checked out with ``--checkout-repo`` (engine.workspace).

A task created with ``turnstile autopilot --init --checkout-repo PROJECT`` works in the
worktree whose run id is the task name. While a drive runs, it holds that worktree's lock.
Each sub-task of a wave gets its own worktree and branch (``turnstile/<task>--<name>``, cut
from the parent's branch); when a wave ends, the complete sub-tasks' branches are merged
back into the parent's branch (``--no-ff``); a conflict sends that sub-task to
human_intervention. Tasks without a worktree are left alone.

Workspace ids follow the task tree, not the task's dotted name: sub-task ``b`` of sub-task
``a`` of task ``t`` (task ``t.a.b``) works in ``t--a--b``, the id
:func:`engine.workspace.subtask_workspace_id` gives under its parent's workspace ``t--a``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from engine.errors import ConfigError
from engine.gates.records import TaskRecord
from engine.gates.refusals import GateRefused, Refusal
from engine.gates.store import GateStore, SqlGateStore

if TYPE_CHECKING:
    from engine.settings import Settings
    from engine.store.backend import AnyDatabase

__all__ = ["TaskWorktrees", "WaveWorkspaces", "short_name", "workspace_id"]

# Deeper than any real plan; a cycle in the parent column (a damaged database) stops here.
_MAX_DEPTH = 32


def short_name(task: TaskRecord) -> str:
    """A sub-task's own name (``b`` of ``t.a.b``); a top-level task's full name."""
    return task.name if task.parent is None else task.name[len(task.parent) + 1 :]


def workspace_id(root: str, shorts: Sequence[str] = ()) -> str:
    """The workspace id of task ``root`` or of its sub-task reached through ``shorts``
    (the short names from the top down): ``root--a--b`` for ``shorts == ("a", "b")``."""
    from engine.workspace.manager import subtask_workspace_id

    out = root
    for name in shorts:
        out = subtask_workspace_id(out, name)
    return out


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

    def __init__(self, settings: Settings, db: AnyDatabase, tasks: GateStore | None = None) -> None:
        self._settings = settings
        self._db = db
        self._tasks: GateStore = tasks if tasks is not None else SqlGateStore(db)
        self._manager: Any = None

    def _get_manager(self) -> Any:
        if self._manager is None:
            from engine.workspace import SqliteWorkspaceStore, WorkspaceManager

            self._manager = WorkspaceManager.from_settings(
                self._settings, store=SqliteWorkspaceStore(self._db)
            )
        return self._manager

    async def workspace_id(self, task: TaskRecord) -> str:
        """The task's workspace id, found up its chain of parents (see the module doc)."""
        shorts: list[str] = []
        current, parent = task.name, task.parent
        while parent is not None:
            if len(shorts) >= _MAX_DEPTH:
                raise GateRefused(
                    Refusal.INVALID_NAME, f"task {task.name!r} is nested too deep", task=task.name
                )
            shorts.append(current[len(parent) + 1 :])
            current, parent = parent, await self._tasks.parent_of(parent)
        try:
            return workspace_id(current, shorts[::-1])
        except ConfigError as exc:  # a name from before '--' was refused in sub-task names
            raise GateRefused(Refusal.INVALID_NAME, str(exc), task=task.name) from exc

    async def _find(self, task: TaskRecord) -> Any:
        try:
            wanted = await self.workspace_id(task)
        except GateRefused:
            return None  # a name no worktree can have: it has none
        # Cheap check first: most tasks have no worktree, and TURNSTILE_PROJECTS may be unset.
        from engine.workspace import SqliteWorkspaceStore

        known = await SqliteWorkspaceStore(self._db).get(wanted)
        if known is None or known.removed_at is not None:
            return None
        return await self._get_manager().get(wanted)

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
            workspace = await manager.get(self._sub_id(parent_ws, sub))
            if workspace is None or workspace.removed_at is not None:
                workspace = await manager.provision_subtask(parent_ws, short_name(sub))
            out[sub.name] = Path(workspace.path)
        return out

    @staticmethod
    def _sub_id(parent_ws: Any, sub: TaskRecord) -> str:
        try:
            return workspace_id(parent_ws.id, [short_name(sub)])
        except ConfigError as exc:
            raise GateRefused(Refusal.INVALID_NAME, str(exc), task=sub.name) from exc

    async def after_wave(
        self, parent: TaskRecord, subtasks: Sequence[TaskRecord]
    ) -> dict[str, str]:
        parent_ws = await self._find(parent)
        if parent_ws is None:
            return {}
        manager = self._get_manager()
        done = [s for s in subtasks if s.phase == "complete"]
        by_id = {self._sub_id(parent_ws, s): s.name for s in done}
        workspaces = [await manager.get(i) for i in by_id]
        report = await manager.merge_wave(parent_ws, [w for w in workspaces if w is not None])
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

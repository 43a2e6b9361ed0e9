"""Where workspaces are recorded: the ``workspaces`` table (migration 0005), or memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from engine.errors import StoreError

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = ["MemoryWorkspaceStore", "SqliteWorkspaceStore", "Workspace", "WorkspaceStore"]


@dataclass(frozen=True, slots=True)
class Workspace:
    """One git worktree on its own branch.

    Attributes:
        id: the run id, or ``PARENT--NAME`` for a sub-task of a wave.
        run_id: the run this worktree belongs to (a sub-task's top-level run).
        project: the project name.
        path: the worktree folder: the agent's pinned cwd.
        branch: ``turnstile/<id>``.
        base: the commit the branch was cut from.
        base_ref: what ``base`` was read from (``origin/main``, or the parent's branch).
        parent_id: the parent workspace of a sub-task, else None.
        created_at: when the worktree was first made (kept across resumes).
        released_at: when its run or sub-task finished (retention counts from here).
        removed_at: when cleanup removed the folder.
        rescue_branch: where uncommitted changes went before removal, if there were any.
    """

    id: str
    run_id: str
    project: str
    path: Path
    branch: str
    base: str
    base_ref: str
    parent_id: str | None = None
    created_at: float = 0.0
    released_at: float | None = None
    removed_at: float | None = None
    rescue_branch: str | None = None

    @property
    def name(self) -> str:
        """The sub-task name (last ``--`` component), or the run id."""
        return self.id.rsplit("--", 1)[-1]


class WorkspaceStore(Protocol):
    """Persistence of workspace records."""

    async def get(self, workspace_id: str) -> Workspace | None: ...

    async def save(self, workspace: Workspace) -> None: ...

    async def list(
        self, *, run_id: str | None = None, include_removed: bool = False
    ) -> list[Workspace]: ...

    async def run_finished_at(self, run_ids: Iterable[str]) -> dict[str, float]: ...


class MemoryWorkspaceStore:
    """A :class:`WorkspaceStore` in a dict: for tests, benchmarks and one-shot commands."""

    def __init__(self) -> None:
        self._rows: dict[str, Workspace] = {}
        self.finished: dict[str, float] = {}

    async def get(self, workspace_id: str) -> Workspace | None:
        return self._rows.get(workspace_id)

    async def save(self, workspace: Workspace) -> None:
        self._rows[workspace.id] = workspace

    async def list(
        self, *, run_id: str | None = None, include_removed: bool = False
    ) -> list[Workspace]:
        return [
            w
            for w in sorted(self._rows.values(), key=lambda w: (w.created_at, w.id))
            if (run_id is None or w.run_id == run_id) and (include_removed or w.removed_at is None)
        ]

    async def run_finished_at(self, run_ids: Iterable[str]) -> dict[str, float]:
        return {r: self.finished[r] for r in run_ids if r in self.finished}


_COLUMNS = (
    "id",
    "run_id",
    "project",
    "path",
    "branch",
    "base",
    "base_ref",
    "parent_id",
    "created_at",
    "released_at",
    "removed_at",
    "rescue_branch",
)


def _from_row(row: Any) -> Workspace:
    values = {name: row[name] for name in _COLUMNS}
    values["path"] = Path(values["path"])
    return Workspace(**values)


class SqliteWorkspaceStore:
    """:class:`WorkspaceStore` on a :class:`~engine.store.Database` (portable SQL)."""

    def __init__(self, db: AnyDatabase) -> None:
        self._db = db

    async def get(self, workspace_id: str) -> Workspace | None:
        row = await self._db.fetchone("SELECT * FROM workspaces WHERE id = ?", (workspace_id,))
        return _from_row(row) if row is not None else None

    async def save(self, workspace: Workspace) -> None:
        values = dataclasses.asdict(workspace)
        values["path"] = str(workspace.path)
        updates = ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS if c != "id")
        await self._db.execute(
            f"INSERT INTO workspaces ({', '.join(_COLUMNS)})"  # noqa: S608 - fixed names
            f" VALUES ({', '.join('?' * len(_COLUMNS))})"
            f" ON CONFLICT (id) DO UPDATE SET {updates}",
            [values[c] for c in _COLUMNS],
        )

    async def list(
        self, *, run_id: str | None = None, include_removed: bool = False
    ) -> list[Workspace]:
        clauses = []
        params: list[Any] = []
        if run_id is not None:
            clauses.append("run_id = ?")
            params.append(run_id)
        if not include_removed:
            clauses.append("removed_at IS NULL")
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = await self._db.fetchall(
            f"SELECT * FROM workspaces{where} ORDER BY created_at, id",  # noqa: S608
            params,
        )
        return [_from_row(r) for r in rows]

    async def run_finished_at(self, run_ids: Iterable[str]) -> dict[str, float]:
        """When each run (``runs.finished_at``) or gated task (phase complete) finished."""
        ids = sorted(set(run_ids))
        if not ids:
            return {}
        marks = ", ".join("?" * len(ids))
        rows = await self._db.fetchall(
            "SELECT id, finished_at FROM runs WHERE finished_at IS NOT NULL"  # noqa: S608
            f" AND id IN ({marks})",
            ids,
        )
        found = {r["id"]: float(r["finished_at"]) for r in rows}
        # A gated task (autopilot) is no run: it is finished once its phase is complete.
        try:
            tasks = await self._db.fetchall(
                "SELECT name, updated_at FROM gate_tasks WHERE phase = ?"  # noqa: S608
                f" AND name IN ({marks})",
                ["complete", *ids],
            )
        except StoreError:
            tasks = []  # no gates schema in this database
        for row in tasks:
            found.setdefault(row["name"], float(row["updated_at"]))
        return found

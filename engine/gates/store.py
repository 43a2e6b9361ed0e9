"""The gate store: tasks, their history, approvals; the drives' agent sessions. SQL lives here only.

:class:`GateStore` is what the rest of the gates use; :class:`SqlGateStore` implements it
over either database (a SQLite file or PostgreSQL, :data:`engine.store.backend.AnyDatabase`)
with one text of SQL in the form both accept.

Every change is one transaction that compares-and-sets the task's ``version`` and appends
exactly one history row carrying the new version: of two concurrent writers exactly one
wins, the other gets :attr:`Refusal.CONFLICT`. That holds under PostgreSQL's READ
COMMITTED too: the ``UPDATE … WHERE version = ?`` of the loser waits on the winner's row
lock and then matches nothing; an approval locks the task row (``SELECT … FOR UPDATE``)
before it counts approvals, and inserts with ``ON CONFLICT … DO NOTHING``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from engine.gates.records import (
    MAX_REASON,
    ApprovalRecord,
    SessionRecord,
    TaskRecord,
    TransitionRecord,
)
from engine.gates.refusals import GateRefused, Refusal
from engine.runs.spec import PlaceId
from engine.store.backend import execute_later
from engine.store.events import EventKind, add_event, events_written

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = [
    "LIST_QUERY",
    "SETTABLE",
    "ApprovalRequest",
    "Change",
    "GateStore",
    "HistoryEntry",
    "NewTask",
    "SqlGateStore",
    "Tally",
]

#: The task columns a change may set (the rest are set on creation or by their own call).
SETTABLE: Final = frozenset(
    {
        "phase",
        "sub_state",
        "gate_round",
        "gate_sha256",
        "gate_opened_at",
        "return_phase",
        "revision_notes",
    }
)


@dataclass(frozen=True, slots=True)
class NewTask:
    """A task to create at ``phase``, version 1 (with its ``init`` history row)."""

    name: str
    folder: Path
    workdir: Path
    phase: str
    at: float
    parent: str | None = None
    wave: int | None = None
    summary: str | None = None
    started_by: str | None = None


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    """What the history row of a change says besides the move itself."""

    kind: str
    actor: str | None = None
    reason: str | None = None
    sha256: str | None = None
    git_fingerprint: str | None = None


@dataclass(frozen=True, slots=True)
class Change:
    """Set ``sets`` on ``task`` if it is still at ``task.version``; record ``entry``.

    ``sets`` keys are :data:`SETTABLE` columns.
    """

    task: TaskRecord
    sets: Mapping[str, Any]
    entry: HistoryEntry
    at: float

    def __post_init__(self) -> None:
        unknown = set(self.sets) - SETTABLE
        if unknown:
            raise ValueError(f"not settable: {sorted(unknown)}")

    @property
    def to_phase(self) -> str:
        return str(self.sets.get("phase", self.task.phase))

    @property
    def to_sub(self) -> str | None:
        value = self.sets.get("sub_state", self.task.sub_state)
        return None if value is None else str(value)

    @property
    def to_label(self) -> str:
        return self.to_phase + (f":{self.to_sub}" if self.to_sub else "")


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """One person's approval of the gate ``task`` shows (its phase, round and hash).

    ``subtasks`` are created, in the same transaction, when this approval reaches the
    quorum; a name someone took meanwhile is passed to ``clash``, which says why it may
    not stand for the planned sub-task (the whole approval is then refused) or None.
    """

    task: TaskRecord
    approver: str
    sha256: str
    quorum: int
    at: float
    chat_id: PlaceId | None = None
    update_id: int | None = None
    subtasks: tuple[NewTask, ...] = ()
    clash: Callable[[TaskRecord], str | None] = field(default=lambda _existing: None)


@dataclass(frozen=True, slots=True)
class Tally:
    """What the store did with an approval."""

    fresh: bool
    """False: this person had already approved this hash; nothing changed."""
    approvers: int
    """Distinct approvers of the hash, this one included."""
    created: tuple[str, ...] = ()
    """Sub-tasks created by this approval."""


# Column lists and queries are constants of this module (no outside text reaches them).
_TASK_COLS: Final = (
    "name, folder, workdir, phase, sub_state, version, parent, wave, summary, started_by, "
    "gate_round, gate_sha256, gate_opened_at, return_phase, revision_notes, created_at, "
    "updated_at"
)
_SELECT_TASK: Final = f"SELECT {_TASK_COLS} FROM gate_tasks WHERE name = ?"  # noqa: S608
_SELECT_ALL: Final = (
    f"SELECT {_TASK_COLS} FROM gate_tasks "  # noqa: S608
    "ORDER BY COALESCE(parent, name), parent IS NOT NULL, wave, name"
)
_SELECT_SUBS: Final = f"SELECT {_TASK_COLS} FROM gate_tasks WHERE parent = ? ORDER BY wave, name"  # noqa: S608
_APPROVAL_COLS: Final = "task, phase, gate_round, sha256, approver, chat_id, update_id, at"
_INSERT_HISTORY: Final = (
    "INSERT INTO gate_transitions (task, version, kind, from_phase, from_sub, to_phase, "
    "to_sub, actor, reason, sha256, git_fingerprint, at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)

#: The columns a listing needs, nothing more (10,000 rows must list in milliseconds), in
#: listing order: each group (a task and its sub-tasks) together, the task first, then its
#: sub-tasks by wave and name (see :mod:`engine.gates.listing`).
LIST_QUERY: Final = (
    "SELECT name, phase, sub_state, version, parent, wave, gate_sha256, revision_notes, "
    "updated_at FROM gate_tasks "
    "ORDER BY COALESCE(parent, name), parent IS NOT NULL, COALESCE(wave, 1), name"
)


class _Conn(Protocol):
    """A connection inside a transaction (aiosqlite's or :class:`PgConnection`)."""

    async def execute(self, sql: str, parameters: Any = ...) -> Any: ...


class SqlGateStore:
    """Gated tasks over a SQLite or PostgreSQL database (migration 0003 applied).

    Args:
        db: an open database of either backend.
        clock: seconds since the epoch (sessions' ``updated_at``).
    """

    def __init__(self, db: AnyDatabase, *, clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self._clock = clock

    @property
    def db(self) -> AnyDatabase:
        """The database (the drive's other stores open on it)."""
        return self._db

    # -- reads ---------------------------------------------------------------------------

    async def find(self, name: str) -> TaskRecord | None:
        row = await self._db.fetchone(_SELECT_TASK, (name,))
        return TaskRecord.from_row(row) if row is not None else None

    async def list_tasks(self) -> list[TaskRecord]:
        return [TaskRecord.from_row(r) for r in await self._db.fetchall(_SELECT_ALL)]

    async def subtasks(self, parent: str) -> list[TaskRecord]:
        rows = await self._db.fetchall(_SELECT_SUBS, (parent,))
        return [TaskRecord.from_row(r) for r in rows]

    async def parent_of(self, name: str) -> str | None:
        row = await self._db.fetchone("SELECT parent FROM gate_tasks WHERE name = ?", (name,))
        return None if row is None else row["parent"]

    async def history(self, name: str) -> list[TransitionRecord]:
        rows = await self._db.fetchall(
            "SELECT task, version, kind, from_phase, from_sub, to_phase, to_sub, actor, reason, "
            "sha256, git_fingerprint, at FROM gate_transitions WHERE task = ? ORDER BY id",
            (name,),
        )
        return [TransitionRecord(*tuple(r)) for r in rows]

    async def approvals(self, name: str) -> list[ApprovalRecord]:
        rows = await self._db.fetchall(
            f"SELECT {_APPROVAL_COLS} FROM gate_approvals WHERE task = ? ORDER BY id",  # noqa: S608
            (name,),
        )
        return [ApprovalRecord(*tuple(r)) for r in rows]

    async def gate_approvals(self, task: TaskRecord) -> list[ApprovalRecord]:
        """Approvals of ``task``'s open gate bound to the hash it shows."""
        if not task.awaiting_approval or task.gate_sha256 is None:
            return []
        rows = await self._db.fetchall(
            f"SELECT {_APPROVAL_COLS} FROM gate_approvals "  # noqa: S608
            "WHERE task = ? AND phase = ? AND gate_round = ? AND sha256 = ? ORDER BY id",
            (task.name, task.phase, task.gate_round, task.gate_sha256),
        )
        return [ApprovalRecord(*tuple(r)) for r in rows]

    async def listing_rows(self) -> list[tuple[Any, ...]]:
        """The rows of :data:`LIST_QUERY` (what ``status --list`` shows), in its order."""
        return await self._db.fetch_tuples(LIST_QUERY)

    # -- writes --------------------------------------------------------------------------

    async def insert_task(self, task: NewTask) -> bool:
        """Create ``task``; False when the name is taken (nothing written)."""
        async with self._db.transaction() as conn:
            return await self._insert(conn, task)

    async def _insert(self, conn: _Conn, task: NewTask) -> bool:
        cursor = await conn.execute(
            "INSERT INTO gate_tasks (name, folder, workdir, phase, sub_state, version, parent, "
            "wave, summary, started_by, gate_round, created_at, updated_at) "
            "VALUES (?, ?, ?, ?, NULL, 1, ?, ?, ?, ?, 0, ?, ?) ON CONFLICT (name) DO NOTHING",
            (
                task.name,
                str(task.folder),
                str(task.workdir),
                task.phase,
                task.parent,
                task.wave,
                task.summary,
                task.started_by,
                task.at,
                task.at,
            ),
        )
        if cursor.rowcount != 1:
            return False
        reason = f"sub-task of {task.parent}" if task.parent else None
        await conn.execute(
            _INSERT_HISTORY,
            (task.name, 1, "init", None, None, task.phase, None, task.started_by, reason, None,
             None, task.at),
        )  # fmt: skip
        return True

    async def commit(self, change: Change) -> TaskRecord:
        """Apply ``change``; the task as it now is. Raises GateRefused(CONFLICT) when the
        task moved on."""
        task = change.task
        columns = "".join(f"{key} = ?, " for key in change.sets)
        entry = change.entry
        async with self._db.transaction() as conn:
            # The row as changed comes back with the change: no read after it.
            cursor = await conn.execute(
                f"UPDATE gate_tasks SET {columns}version = version + 1, "  # noqa: S608
                f"updated_at = ? WHERE name = ? AND version = ? RETURNING {_TASK_COLS}",
                [*change.sets.values(), change.at, task.name, task.version],
            )
            changed = list(await cursor.fetchall())
            if len(changed) != 1:
                raise GateRefused(
                    Refusal.CONFLICT,
                    f"task {task.name} changed concurrently (it is no longer at version "
                    f"{task.version}); read it again",
                    task=task.name,
                )
            reason = entry.reason[:MAX_REASON] if entry.reason else entry.reason
            # Sent with the COMMIT (one round trip on PostgreSQL).
            await execute_later(
                conn,
                _INSERT_HISTORY,
                (task.name, task.version + 1, entry.kind, task.phase, task.sub_state,
                 change.to_phase, change.to_sub, entry.actor, reason, entry.sha256,
                 entry.git_fingerprint, change.at),
            )  # fmt: skip
            kind, data = _change_event(change, reason)
            await add_event(conn, self._db, kind, task=task.name, data=data, at=change.at)
        events_written(self._db)
        return TaskRecord.from_row(changed[0])

    async def record_approval(self, request: ApprovalRequest) -> Tally:
        """Record an approval (idempotent per person and hash), bump the version, create
        the sub-tasks at the quorum. Raises GateRefused: CONFLICT (the gate changed since
        ``request.task`` was read), INVALID_ARTIFACT (a sub-task's name clashes)."""
        task = request.task
        created: list[str] = []
        async with self._db.transaction() as conn:
            # The row lock: two approvers at once (on PostgreSQL) count each other in turn.
            cursor = await conn.execute(_SELECT_TASK + self._db.for_update, (task.name,))
            row = await cursor.fetchone()
            if row is None:
                raise GateRefused(Refusal.UNKNOWN_TASK, f"{task.name} disappeared", task=task.name)
            live = TaskRecord.from_row(row)
            if _gate(live) != _gate(task):
                raise GateRefused(
                    Refusal.CONFLICT,
                    f"{task.name} changed while approving (now {live.label}); look again",
                    task=task.name,
                )
            cursor = await conn.execute(
                f"INSERT INTO gate_approvals ({_APPROVAL_COLS}) "  # noqa: S608
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (task, phase, gate_round, sha256, approver) DO NOTHING",
                (task.name, task.phase, task.gate_round, request.sha256, request.approver,
                 request.chat_id, request.update_id, request.at),
            )  # fmt: skip
            fresh = cursor.rowcount == 1
            cursor = await conn.execute(
                "SELECT COUNT(DISTINCT approver) FROM gate_approvals WHERE task = ? AND "
                "phase = ? AND gate_round = ? AND sha256 = ?",
                (task.name, task.phase, task.gate_round, request.sha256),
            )
            count_row = await cursor.fetchone()
            count = int(count_row[0]) if count_row else 0
            if not fresh:
                return Tally(fresh=False, approvers=count)
            cursor = await conn.execute(
                "UPDATE gate_tasks SET version = version + 1, updated_at = ? "
                "WHERE name = ? AND version = ?",
                (request.at, task.name, live.version),
            )
            if cursor.rowcount != 1:  # the row lock above makes this unreachable
                raise GateRefused(
                    Refusal.CONFLICT, f"{task.name} changed while approving", task=task.name
                )
            await conn.execute(
                _INSERT_HISTORY,
                (task.name, live.version + 1, "approve", task.phase, task.sub_state, task.phase,
                 task.sub_state, request.approver, f"{count}/{request.quorum}", request.sha256,
                 None, request.at),
            )  # fmt: skip
            if count >= request.quorum:
                for sub in request.subtasks:
                    if await self._insert(conn, sub):
                        created.append(sub.name)
                        continue
                    # Someone took the name since the check: refuse, approval and all.
                    cursor = await conn.execute(_SELECT_TASK, (sub.name,))
                    taken = await cursor.fetchone()
                    clash = (
                        request.clash(TaskRecord.from_row(taken))
                        if taken is not None
                        else f"sub-task {sub.name!r} could not be created"
                    )
                    if clash is not None:
                        raise GateRefused(Refusal.INVALID_ARTIFACT, clash, task=task.name)
            # Last: its event takes the log's lock, held to the commit (engine.store.events).
            decided = {
                "decision": "approved" if count >= request.quorum else "approval counted",
                "phase": task.phase,
                "by": request.approver,
                "approvers": count,
                "quorum": request.quorum,
                "sha256": request.sha256,
            }
            await add_event(
                conn, self._db, EventKind.GATE_DECIDED, task=task.name, data=decided, at=request.at
            )
        events_written(self._db)
        return Tally(fresh=True, approvers=count, created=tuple(created))

    async def set_workdir(self, name: str, workdir: Path) -> None:
        await self._db.execute(
            "UPDATE gate_tasks SET workdir = ? WHERE name = ?", (str(workdir), name)
        )

    async def set_location(self, name: str, folder: Path, workdir: Path) -> None:
        """Point the task at its folder and workdir on this machine (a drive on a worker
        works in a worktree of its own; the task's files travel on the pushed branch)."""
        await self._db.execute(
            "UPDATE gate_tasks SET folder = ?, workdir = ? WHERE name = ?",
            (str(folder), str(workdir), name),
        )

    # -- agent sessions ------------------------------------------------------------------
    # A drive's agent session is its run's: ``runs.session_id`` of the task's newest
    # autopilot run (a later drive opens its run with it and resumes it); no table of its
    # own. The session's agent is that of the first run that carried it.

    async def get_session(self, name: str) -> SessionRecord | None:
        """The agent session of the task's drives; None until one was made, or after it
        was given up (an empty session id: the next turn starts a new one)."""
        row = await self._db.fetchone(_SELECT_SESSION, (name,))
        if row is None or not row[0]:
            return None
        return SessionRecord(name, row[1], row[0], True)

    async def save_session(self, name: str, agent: str, session_id: str, started: bool) -> None:
        """Give the task's newest run ``session_id``; not ``started``: the session is new,
        so none is recorded (the drive's next turn starts it and records it)."""
        del agent  # the run's own (its agent column, set when it opened)
        await self._db.execute(_SAVE_SESSION, (session_id if started else "", name))


# The task's newest autopilot run (``?``: the task) holds its drives' session.
_SELECT_SESSION: Final = (
    "SELECT r.session_id, (SELECT f.agent FROM runs f WHERE f.mode = 'autopilot'"
    " AND f.task = r.task AND f.session_id = r.session_id"
    " ORDER BY f.created_at, f.id LIMIT 1) AS agent"
    " FROM runs r WHERE r.id = (SELECT n.id FROM runs n WHERE n.mode = 'autopilot'"
    " AND n.task = ? ORDER BY n.created_at DESC, n.id DESC LIMIT 1)"
)
_SAVE_SESSION: Final = (
    "UPDATE runs SET session_id = ? WHERE id = (SELECT n.id FROM runs n"
    " WHERE n.mode = 'autopilot' AND n.task = ? ORDER BY n.created_at DESC, n.id DESC LIMIT 1)"
)


def _change_event(change: Change, reason: str | None) -> tuple[EventKind, dict[str, Any]]:
    """The event of one committed change of a task (its history row, as the log has it)."""
    entry = change.entry
    data: dict[str, Any] = {
        "phase": change.to_phase,
        "from": change.task.phase,
        "by": entry.actor,
        "reason": reason,
    }
    if entry.kind in ("gate", "reopen"):
        data.update(sha256=entry.sha256, round=change.sets.get("gate_round"), change=entry.kind)
        return EventKind.GATE_OPENED, data
    if entry.kind == "reject":
        data.update(decision="rejected", sha256=entry.sha256)
        return EventKind.GATE_DECIDED, data
    data.update(change=entry.kind)
    if change.task.awaiting_approval and entry.sha256 is not None:
        data["sha256"] = entry.sha256  # the approved artifact the task moved on with
    return EventKind.TASK_MOVED, data


def _gate(task: TaskRecord) -> tuple[str, str | None, int, str | None]:
    return task.phase, task.sub_state, task.gate_round, task.gate_sha256


#: Gated tasks in a database: reads, creation, compare-and-set changes, approvals (one
#: implementation serves both databases).
GateStore = SqlGateStore

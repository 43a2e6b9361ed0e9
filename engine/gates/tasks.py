"""The task store: phase state, append-only history, approvals and audit events in SQLite.

Every change is one ``BEGIN IMMEDIATE`` transaction that compares-and-sets the task's
``version`` (of two concurrent writers exactly one wins; the other gets
:attr:`Refusal.CONFLICT`) and appends exactly one history row carrying the new version.
After each commit the folder's ``.state`` mirror is rewritten atomically from the store.

Long: to be split by concern (store, approval policy, folder side) as issue 11 asks;
until then the compare-and-set transaction and what it mirrors stay together.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import aiosqlite

from engine import safefile
from engine.errors import UnsafeFileError
from engine.gates.decomposition import SubtaskDecl, parse_decomposition
from engine.gates.folder import Violation, effective_phase, inspect_folder, validate_folder
from engine.gates.gitwatch import fingerprint
from engine.gates.hashing import sha256_file_async
from engine.gates.machine import Facts, Target, check_transition, parse_target
from engine.gates.names import check_subtask_name, check_task_name
from engine.gates.refusals import GateRefused, Refusal
from engine.gates.state_file import write_state
from engine.gates.workflow import (
    AWAITING_APPROVAL,
    COMPLETE,
    HUMAN_INTERVENTION,
    Workflow,
)
from engine.locks import FileLock, hold
from engine.settings import Settings
from engine.store.audit import AuditLog, AuditRecord, SqliteAuditLog
from engine.store.database import Database

__all__ = [
    "ApprovalOutcome",
    "ApprovalRecord",
    "ApprovalResult",
    "AuditEvent",
    "GatePolicy",
    "SessionRecord",
    "TaskRecord",
    "TaskStore",
    "TransitionRecord",
]

_LOGGER = logging.getLogger(__name__)
MAX_REASON = 4000


@dataclass(frozen=True, slots=True)
class GatePolicy:
    """Who may approve, how many approvals a gate needs, and how long it stays open."""

    approvers: frozenset[str] = frozenset()
    quorum: int = 1
    expiry_seconds: float | None = None
    forbid_self_approval: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> GatePolicy:
        # An admin holds every role, approving included (self-approval rules still apply).
        return cls(
            approvers=frozenset(str(i) for i in (*settings.approvers, *settings.admins)),
            quorum=settings.approval_quorum,
            expiry_seconds=settings.approval_expiry_seconds,
            forbid_self_approval=settings.forbid_self_approval,
        )


@dataclass(frozen=True, slots=True)
class TaskRecord:
    name: str
    folder: Path
    workdir: Path
    phase: str
    sub_state: str | None
    version: int
    parent: str | None
    wave: int | None
    summary: str | None
    started_by: str | None
    gate_round: int
    gate_sha256: str | None
    gate_opened_at: float | None
    return_phase: str | None
    revision_notes: str | None
    created_at: float
    updated_at: float

    @property
    def label(self) -> str:
        """``phase`` or ``phase:awaiting_approval``."""
        return f"{self.phase}:{self.sub_state}" if self.sub_state else self.phase

    @property
    def awaiting_approval(self) -> bool:
        return self.sub_state == AWAITING_APPROVAL

    @property
    def finished(self) -> bool:
        """Complete or waiting for a person: a wave does not wait for it any more."""
        return self.phase in (COMPLETE, HUMAN_INTERVENTION)

    @classmethod
    def from_row(cls, row: aiosqlite.Row) -> TaskRecord:
        return cls(
            name=row["name"],
            folder=Path(row["folder"]),
            workdir=Path(row["workdir"]),
            phase=row["phase"],
            sub_state=row["sub_state"],
            version=row["version"],
            parent=row["parent"],
            wave=row["wave"],
            summary=row["summary"],
            started_by=row["started_by"],
            gate_round=row["gate_round"],
            gate_sha256=row["gate_sha256"],
            gate_opened_at=row["gate_opened_at"],
            return_phase=row["return_phase"],
            revision_notes=row["revision_notes"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
        )


@dataclass(frozen=True, slots=True)
class TransitionRecord:
    task: str
    version: int
    kind: str
    from_phase: str | None
    from_sub: str | None
    to_phase: str
    to_sub: str | None
    actor: str | None
    reason: str | None
    sha256: str | None
    git_fingerprint: str | None
    at: float


@dataclass(frozen=True, slots=True)
class ApprovalRecord:
    task: str
    phase: str
    gate_round: int
    sha256: str
    approver: str
    chat_id: int | None
    update_id: int | None
    at: float


#: One entry of the audit log (the gates' events are in the system's one log).
AuditEvent = AuditRecord


@dataclass(frozen=True, slots=True)
class SessionRecord:
    task: str
    agent: str
    session_id: str
    started: bool


class ApprovalOutcome(StrEnum):
    APPROVED = "approved"
    """Quorum reached with this approval: the gate may be passed."""
    RECORDED = "recorded"
    """Recorded; more approvals are needed for the quorum."""
    ALREADY_APPROVED = "already_approved"
    """This person already approved this hash: nothing changed."""
    REJECTED = "rejected"
    """A rejection was recorded; the phase re-runs with the reason as revision notes."""
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class ApprovalResult:
    """What an approve or reject request did."""

    outcome: ApprovalOutcome
    task: str
    phase: str | None = None
    sha256: str | None = None
    approvals: int = 0
    quorum: int = 1
    reason: Refusal | None = None
    detail: str = ""
    subtasks_created: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.outcome is not ApprovalOutcome.REFUSED

    def as_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome.value,
            "task": self.task,
            "phase": self.phase,
            "sha256": self.sha256,
            "approvals": self.approvals,
            "quorum": self.quorum,
            "reason": self.reason.value if self.reason else None,
            "detail": self.detail,
            "subtasks_created": list(self.subtasks_created),
        }


# Column lists and queries are constants of this module (no outside text reaches them).
_TASK_COLS = (
    "name, folder, workdir, phase, sub_state, version, parent, wave, summary, started_by, "
    "gate_round, gate_sha256, gate_opened_at, return_phase, revision_notes, created_at, "
    "updated_at"
)


_SELECT_TASK = f"SELECT {_TASK_COLS} FROM gate_tasks WHERE name = ?"  # noqa: S608
_SELECT_ALL = (
    f"SELECT {_TASK_COLS} FROM gate_tasks "  # noqa: S608
    "ORDER BY COALESCE(parent, name), parent IS NOT NULL, wave, name"
)
_SELECT_SUBS = f"SELECT {_TASK_COLS} FROM gate_tasks WHERE parent = ? ORDER BY wave, name"  # noqa: S608
_SETTABLE = frozenset(
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


def _norm_actor(by: str | int) -> str:
    text = str(by).strip()
    return text[:64]


class TaskStore:
    """Gated tasks over a :class:`Database` (SQL kept portable: ``?`` parameters only).

    Args:
        db: an open database (migration 0003 applied).
        workflow: the phases.
        tasks_root: where task folders are created by default.
        policy: approvers, quorum, expiry, self-approval ban.
        clock: seconds since the epoch (a :class:`engine.testing.FakeClock` in tests).
        track_git: record a code fingerprint of git workdirs on every transition.
    """

    def __init__(
        self,
        db: Database,
        workflow: Workflow,
        *,
        tasks_root: Path,
        policy: GatePolicy | None = None,
        clock: Callable[[], float] = time.time,
        track_git: bool = True,
        audit_log: AuditLog | None = None,
    ) -> None:
        self.db = db
        self.audit_log: AuditLog = audit_log or SqliteAuditLog(db, clock=clock)
        self.workflow = workflow
        self.tasks_root = tasks_root
        self.policy = policy or GatePolicy()
        self.clock = clock
        self.track_git = track_git
        self._listeners: list[Callable[[str], None]] = []
        self._locks: dict[Path, asyncio.Lock] = {}
        self._hashes: dict[Path, tuple[tuple[int, int, int, int], str]] = {}

    # -- change notification (in-process) -------------------------------------------

    def add_listener(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call ``callback(task)`` after every change committed through this store.

        Returns a function that removes the listener. Other processes are not seen here:
        drivers also poll (see :mod:`engine.gates.autopilot`).
        """
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback)

    def _notify(self, name: str) -> None:
        for callback in list(self._listeners):
            callback(name)

    # -- reads -------------------------------------------------------------------------

    async def find(self, name: str) -> TaskRecord | None:
        row = await self.db.fetchone(_SELECT_TASK, (name,))
        return TaskRecord.from_row(row) if row is not None else None

    async def get(self, name: str) -> TaskRecord:
        """Raises GateRefused(unknown_task)."""
        task = await self.find(name)
        if task is None:
            raise GateRefused(Refusal.UNKNOWN_TASK, f"no task named {name[:128]!r}", task=name)
        return task

    async def list_tasks(self) -> list[TaskRecord]:
        rows = await self.db.fetchall(_SELECT_ALL)
        return [TaskRecord.from_row(r) for r in rows]

    async def subtasks(self, parent: str) -> list[TaskRecord]:
        rows = await self.db.fetchall(_SELECT_SUBS, (parent,))
        return [TaskRecord.from_row(r) for r in rows]

    async def history(self, name: str) -> list[TransitionRecord]:
        rows = await self.db.fetchall(
            "SELECT task, version, kind, from_phase, from_sub, to_phase, to_sub, actor, reason, "
            "sha256, git_fingerprint, at FROM gate_transitions WHERE task = ? ORDER BY id",
            (name,),
        )
        return [TransitionRecord(*tuple(r)) for r in rows]

    async def approvals(self, name: str) -> list[ApprovalRecord]:
        rows = await self.db.fetchall(
            "SELECT task, phase, gate_round, sha256, approver, chat_id, update_id, at "
            "FROM gate_approvals WHERE task = ? ORDER BY id",
            (name,),
        )
        return [ApprovalRecord(*tuple(r)) for r in rows]

    async def gate_approvals(self, task: TaskRecord) -> list[ApprovalRecord]:
        """Approvals of the open gate bound to the hash it shows."""
        if not task.awaiting_approval or task.gate_sha256 is None:
            return []
        rows = await self.db.fetchall(
            "SELECT task, phase, gate_round, sha256, approver, chat_id, update_id, at "
            "FROM gate_approvals WHERE task = ? AND phase = ? AND gate_round = ? AND sha256 = ? "
            "ORDER BY id",
            (task.name, task.phase, task.gate_round, task.gate_sha256),
        )
        return [ApprovalRecord(*tuple(r)) for r in rows]

    async def audit_events(self, task: str | None = None, limit: int = 1000) -> list[AuditEvent]:
        """The latest audit entries (of ``task``), oldest first; every origin's."""
        return await self.audit_log.entries(task=task, limit=limit)

    # -- the .state mirror -----------------------------------------------------------------

    def snapshot(self, task: TaskRecord, approvals: Sequence[ApprovalRecord]) -> dict[str, Any]:
        """What ``.state`` must hold for ``task`` (the store's view)."""
        return {
            "task": task.name,
            "phase": task.phase,
            "sub_state": task.sub_state,
            "version": task.version,
            "parent": task.parent,
            "wave": task.wave,
            "gate_sha256": task.gate_sha256,
            "approvals": [
                {"approver": a.approver, "sha256": a.sha256, "at": a.at} for a in approvals
            ],
            "updated": task.updated_at,
        }

    async def expected_state(self, task: TaskRecord) -> dict[str, Any]:
        return self.snapshot(task, await self.gate_approvals(task))

    @asynccontextmanager
    async def folder_lock(self, folder: Path, *, exclusive: bool = True) -> AsyncIterator[None]:
        """Hold the task folder's lock (``.state.lock``, flock) across processes.

        Writers hold it exclusively from before their transaction until the ``.state``
        mirror is rewritten; readers that compare ``.state`` with the store hold it shared,
        so nobody ever sees a committed change whose mirror is not written yet. One
        coroutine per folder per process waits on the flock (an asyncio lock in front).

        Raises:
            LockError: the lock file cannot be used (an agent replaced it by a link, ...).
        """
        local = self._locks.setdefault(folder, asyncio.Lock())
        async with local:
            if not exclusive and not await asyncio.to_thread(folder.is_dir):
                yield  # a reader must not create a missing folder (it is a finding)
                return
            await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
            lock = FileLock(
                folder / ".state.lock", shared=not exclusive, make_parent=False, mode=0o644
            )
            async with hold(lock):
                yield

    async def _write_mirror(self, name: str) -> None:
        latest = await self.get(name)
        snap = await self.expected_state(latest)
        await asyncio.to_thread(write_state, latest.folder, snap)

    async def sync_state(self, name: str) -> None:
        """Rewrite ``name``'s ``.state`` from the store (under the folder lock)."""
        task = await self.get(name)
        async with self.folder_lock(task.folder):
            await self._write_mirror(name)

    async def validate(self, name: str) -> tuple[TaskRecord, list[Violation]]:
        """The task and its folder violations, read consistently under the folder lock."""
        task = await self.get(name)
        async with self.folder_lock(task.folder, exclusive=False):
            task = await self.get(name)
            expected = await self.expected_state(task)
            found = await asyncio.to_thread(
                validate_folder,
                task.folder,
                self.workflow,
                task.phase,
                task.return_phase,
                expected,
            )
        return task, found

    # -- audit log ---------------------------------------------------------------------------

    async def record_audit(
        self,
        event: str,
        outcome: str,
        *,
        task: str | None = None,
        phase: str | None = None,
        actor: str | None = None,
        chat_id: int | None = None,
        update_id: int | None = None,
        sha256: str | None = None,
        detail: str | None = None,
    ) -> None:
        """Append one audit event (append-only: no statement here updates or deletes)."""
        await self.audit_log.record(
            event,
            outcome,
            task=task,
            phase=phase,
            actor=actor,
            chat_id=chat_id,
            update_id=update_id,
            sha256=sha256,
            detail=detail,
        )

    async def set_workdir(self, name: str, workdir: Path) -> None:
        """Point a task at another code workspace (a wave sub-task's own worktree). Not a
        state change: no version bump, not in ``.state``."""
        await self.db.execute(
            "UPDATE gate_tasks SET workdir = ? WHERE name = ?", (str(workdir), name)
        )

    # -- agent sessions ----------------------------------------------------------------------

    async def get_session(self, name: str) -> SessionRecord | None:
        row = await self.db.fetchone(
            "SELECT task, agent, session_id, started FROM gate_sessions WHERE task = ?", (name,)
        )
        if row is None:
            return None
        return SessionRecord(row[0], row[1], row[2], bool(row[3]))

    async def save_session(self, name: str, agent: str, session_id: str, started: bool) -> None:
        async with self.db.transaction() as conn:
            await conn.execute(
                "INSERT INTO gate_sessions (task, agent, session_id, started, updated_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (task) DO UPDATE SET agent = excluded.agent, "
                "session_id = excluded.session_id, started = excluded.started, "
                "updated_at = excluded.updated_at",
                (name, agent, session_id, int(started), self.clock()),
            )

    # -- creating tasks ----------------------------------------------------------------------

    async def init_task(
        self,
        name: str,
        *,
        folder: Path | None = None,
        workdir: Path | None = None,
        parent: str | None = None,
        wave: int | None = None,
        summary: str | None = None,
        started_by: str | None = None,
    ) -> TaskRecord:
        """Create a task at the first phase (its folder too).

        Raises:
            GateRefused: ``invalid_name``, ``task_exists``, ``unknown_task`` (parent).
        """
        check_task_name(name)
        if (parent is None) != (wave is None):
            raise GateRefused(
                Refusal.ILLEGAL_TRANSITION, "--parent and --wave go together", task=name
            )
        if wave is not None and wave < 1:
            raise GateRefused(Refusal.ILLEGAL_TRANSITION, "waves start at 1", task=name)
        phase = self.workflow.first
        if parent is not None:
            # A sub-task is named PARENT.NAME, NAME by the sub-task rules (as in a plan).
            if not name.startswith(f"{parent}."):
                raise GateRefused(
                    Refusal.INVALID_NAME,
                    f"sub-task name {name!r} must be {parent!r}, '.', then its own name",
                    task=name,
                )
            check_subtask_name(name[len(parent) + 1 :])
            await self.get(parent)
            phase = self.workflow.subtask_start
        folder = (folder or self.tasks_root / name).absolute()
        workdir = (workdir or folder).absolute()
        folder.mkdir(parents=True, exist_ok=True)
        now = self.clock()
        async with self.folder_lock(folder):
            async with self.db.transaction() as conn:
                await self._insert_task(
                    conn, name, folder, workdir, phase, parent, wave, summary, started_by, now
                )
            await self._write_mirror(name)
        self._notify(name)
        return await self.get(name)

    async def _insert_task(
        self,
        conn: aiosqlite.Connection,
        name: str,
        folder: Path,
        workdir: Path,
        phase: str,
        parent: str | None,
        wave: int | None,
        summary: str | None,
        started_by: str | None,
        now: float,
    ) -> bool:
        cursor = await conn.execute(
            "INSERT INTO gate_tasks (name, folder, workdir, phase, sub_state, version, parent, "
            "wave, summary, started_by, gate_round, created_at, updated_at) "
            "VALUES (?, ?, ?, ?, NULL, 1, ?, ?, ?, ?, 0, ?, ?) ON CONFLICT (name) DO NOTHING",
            (name, str(folder), str(workdir), phase, parent, wave, summary, started_by, now, now),
        )
        if cursor.rowcount != 1:
            if parent is None:
                raise GateRefused(Refusal.TASK_EXISTS, f"task {name!r} exists", task=name)
            return False
        await conn.execute(
            "INSERT INTO gate_transitions (task, version, kind, from_phase, from_sub, to_phase, "
            "to_sub, actor, reason, sha256, git_fingerprint, at) "
            "VALUES (?, 1, 'init', NULL, NULL, ?, NULL, ?, ?, NULL, NULL, ?)",
            (name, phase, started_by, f"sub-task of {parent}" if parent else None, now),
        )
        return True

    # -- facts -------------------------------------------------------------------------------

    async def facts(self, task: TaskRecord) -> Facts:
        """The folder and approval facts the rules need, for the task's current phase."""
        rules = effective_phase(task.phase, task.return_phase)
        if rules in (COMPLETE, HUMAN_INTERVENTION) or not self.workflow.has(rules):
            return Facts(return_phase=task.return_phase, quorum=self.policy.quorum)
        folder = await asyncio.to_thread(
            inspect_folder, task.folder, self.workflow, rules, hash_artifact=False
        )
        spec = self.workflow.phase(rules)
        artifact_error = None
        try:
            digest = await sha256_file_async(task.folder / spec.artifact, root=task.folder)
        except UnsafeFileError as exc:
            digest = None
            artifact_error = await self._unsafe_artifact(task, exc, "check")
        if digest is not None and rules == self.workflow.decomposition:
            try:
                decls = await asyncio.to_thread(self._decls, task, digest)
                artifact_error = await self._subtask_clash(task, decls)
            except GateRefused as exc:
                artifact_error = exc.detail
        approvals = len({a.approver for a in await self.gate_approvals(task)})
        return Facts(
            artifact_sha256=digest,
            blocked=folder.blocked,
            gate_sha256=task.gate_sha256,
            approvals=approvals,
            quorum=self.policy.quorum,
            return_phase=task.return_phase,
            artifact_error=artifact_error,
        )

    async def _unsafe_artifact(self, task: TaskRecord, exc: UnsafeFileError, when: str) -> str:
        """Audit a refused artifact (a link out of the folder, a pipe, ...); the text to
        show: the gate does not open on it."""
        await self.record_audit(
            "unsafe_artifact",
            f"refused:{exc.reason}",
            task=task.name,
            phase=task.label,
            detail=f"{when}: {exc.message}",
        )
        _LOGGER.warning("task %s: %s", task.name, exc.message, extra={"task": task.name})
        return f"{exc.message}: it was not read; write {exc.path} as a plain file in the folder"

    def _decls(self, task: TaskRecord, expected_sha256: str) -> tuple[SubtaskDecl, ...]:
        """Parse the decomposition artifact, checking it is the content with that hash."""
        assert self.workflow.decomposition is not None
        artifact = self.workflow.phase(self.workflow.decomposition).artifact
        path = task.folder / artifact
        try:
            raw = safefile.read_bytes(task.folder, artifact, limit=1024 * 1024)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise GateRefused(
                Refusal.MISSING_ARTIFACT,
                f"{path.name} disappeared while it was read",
                task=task.name,
            ) from exc
        except UnsafeFileError as exc:
            raise GateRefused(
                Refusal.INVALID_ARTIFACT, exc.message, task=task.name, line=1
            ) from exc
        if hashlib.sha256(raw).hexdigest() != expected_sha256:
            raise GateRefused(
                Refusal.STALE_APPROVAL, f"{path.name} changed while it was read", task=task.name
            )
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GateRefused(
                Refusal.INVALID_ARTIFACT, f"{path.name} is not UTF-8", task=task.name, line=1
            ) from exc
        return parse_decomposition(text)

    async def _subtask_clash(self, task: TaskRecord, decls: Sequence[SubtaskDecl]) -> str | None:
        """Why the declared sub-tasks cannot be created, if a task already has one's name."""
        for decl in decls:
            existing = await self.find(f"{task.name}.{decl.name}")
            if existing is not None:
                problem = self._clash(task, decl, existing)
                if problem is not None:
                    return problem
        return None

    def _clash(self, task: TaskRecord, decl: SubtaskDecl, existing: TaskRecord) -> str | None:
        """None when ``existing`` may stand for ``decl`` (it is an untouched sub-task of
        ``task`` in the same wave); otherwise the clash, naming the line and the task.

        Anything else is refused rather than adopted: a task someone started by hand under
        that name (``/autopilot c1.x``) is not the sub-task the decomposition plans.
        """
        where = f"decomposition block, line {decl.line}: sub-task {decl.name!r}"
        if existing.parent != task.name:
            return (
                f"{where} clashes with the existing task {existing.name!r}, which is not a "
                f"sub-task of {task.name}: rename the sub-task"
            )
        untouched = existing.version == 1 and existing.phase == self.workflow.subtask_start
        if not untouched or existing.wave != decl.wave:
            return (
                f"{where} clashes with the existing sub-task {existing.name!r} (wave "
                f"{existing.wave}, at {existing.label}): rename the sub-task"
            )
        return None

    # -- transitions -------------------------------------------------------------------------

    async def transition(
        self,
        name: str,
        target: str | Target,
        *,
        actor: str | None = None,
        reason: str | None = None,
        expected_version: int | None = None,
    ) -> TaskRecord:
        """Move ``name`` to ``target`` if the rules allow it.

        Args:
            expected_version: refuse with ``concurrent_change`` unless the task is still at
                this version (the version the caller based its decision on).

        Raises:
            GateRefused: the reason; a stale approval also re-opens the gate for the
                artifact's new hash.
        """
        task = await self.get(name)
        goal = target if isinstance(target, Target) else parse_target(self.workflow, target)
        try:
            if expected_version is not None and expected_version != task.version:
                raise GateRefused(
                    Refusal.CONFLICT,
                    f"task {name} is at version {task.version}, not {expected_version}",
                    task=name,
                )
            facts = await self.facts(task)
            refused = check_transition(self.workflow, task.phase, task.sub_state, goal, facts)
            if refused is not None:
                if refused[0] is Refusal.STALE_APPROVAL and facts.artifact_sha256 is not None:
                    await self._reopen(task, facts.artifact_sha256, actor)
                    raise GateRefused(
                        refused[0], refused[1] + "; the gate was re-opened", task=name
                    )
                raise GateRefused(refused[0], refused[1], task=name)
            updated = await self._apply(task, goal, facts, actor=actor, reason=reason)
        except GateRefused as exc:
            await self.record_audit(
                "transition",
                f"refused:{exc.reason.value}",
                task=name,
                phase=task.label,
                actor=actor,
                detail=f"→ {goal}: {exc.detail}",
            )
            raise
        return updated

    async def _apply(
        self,
        task: TaskRecord,
        goal: Target,
        facts: Facts,
        *,
        actor: str | None,
        reason: str | None,
    ) -> TaskRecord:
        now = self.clock()
        sets: dict[str, Any] = {"phase": goal.phase, "sub_state": goal.sub_state}
        sha = facts.artifact_sha256
        kind = "transition"
        if goal.sub_state == AWAITING_APPROVAL:
            kind = "gate"
            sets.update(
                gate_round=task.gate_round + 1,
                gate_sha256=facts.artifact_sha256,
                gate_opened_at=now,
                revision_notes=None,
            )
        elif goal.phase == HUMAN_INTERVENTION:
            sets.update(return_phase=task.phase, gate_sha256=None, gate_opened_at=None)
            sha = None
        else:
            sets.update(
                gate_sha256=None, gate_opened_at=None, revision_notes=None, return_phase=None
            )
            if task.phase == HUMAN_INTERVENTION:
                sha = None
            elif task.awaiting_approval:
                sha = task.gate_sha256
        git = await self._fingerprint(task)
        await self._commit(task, sets, kind, actor, reason, sha, git, now)
        return await self.get(task.name)

    async def _fingerprint(self, task: TaskRecord) -> str | None:
        if not self.track_git:
            return None
        return await fingerprint(task.workdir, exclude=task.folder)

    async def _commit(
        self,
        task: TaskRecord,
        sets: dict[str, Any],
        kind: str,
        actor: str | None,
        reason: str | None,
        sha: str | None,
        git: str | None,
        now: float,
    ) -> None:
        """Compare-and-set the task row and append the history row, in one transaction."""
        unknown = set(sets) - _SETTABLE
        if unknown:
            raise ValueError(f"not settable: {sorted(unknown)}")
        columns = ", ".join(f"{k} = ?" for k in sets)
        params = [*sets.values(), now, task.name, task.version]
        new_version = task.version + 1
        async with self.folder_lock(task.folder):
            await self._commit_locked(
                task, columns, params, new_version, kind, sets, actor, reason, sha, git, now
            )
            await self._write_mirror(task.name)
        to_sub = sets.get("sub_state", task.sub_state)
        to_label = str(sets.get("phase", task.phase)) + (f":{to_sub}" if to_sub else "")
        _LOGGER.info(
            "task %s v%d %s → %s (%s)",
            task.name,
            new_version,
            task.label,
            to_label,
            kind,
            extra={"task": task.name},
        )
        self._notify(task.name)

    async def _commit_locked(
        self,
        task: TaskRecord,
        columns: str,
        params: list[Any],
        new_version: int,
        kind: str,
        sets: dict[str, Any],
        actor: str | None,
        reason: str | None,
        sha: str | None,
        git: str | None,
        now: float,
    ) -> None:
        async with self.db.transaction() as conn:
            cursor = await conn.execute(
                f"UPDATE gate_tasks SET {columns}, version = version + 1, "  # noqa: S608
                "updated_at = ? WHERE name = ? AND version = ?",
                params,
            )
            if cursor.rowcount != 1:
                raise GateRefused(
                    Refusal.CONFLICT,
                    f"task {task.name} changed concurrently (it is no longer at version "
                    f"{task.version}); read it again",
                    task=task.name,
                )
            await conn.execute(
                "INSERT INTO gate_transitions (task, version, kind, from_phase, from_sub, "
                "to_phase, to_sub, actor, reason, sha256, git_fingerprint, at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    task.name,
                    new_version,
                    kind,
                    task.phase,
                    task.sub_state,
                    sets.get("phase", task.phase),
                    sets.get("sub_state", task.sub_state),
                    actor,
                    reason[:MAX_REASON] if reason else reason,
                    sha,
                    git,
                    now,
                ),
            )

    async def _reopen(self, task: TaskRecord, new_sha: str, actor: str | None) -> None:
        """The artifact changed under an open gate: void its approvals (new round) and show
        the new hash."""
        sets = {
            "gate_round": task.gate_round + 1,
            "gate_sha256": new_sha,
            "gate_opened_at": self.clock(),
        }
        try:
            await self._commit(
                task,
                sets,
                "reopen",
                actor,
                f"artifact changed from {str(task.gate_sha256)[:12]} to {new_sha[:12]}",
                new_sha,
                None,
                self.clock(),
            )
        except GateRefused as exc:
            if exc.reason is not Refusal.CONFLICT:
                raise
        await self.record_audit(
            "gate_reopened",
            "artifact_changed",
            task=task.name,
            phase=task.phase,
            actor=actor,
            sha256=new_sha,
            detail=f"was {task.gate_sha256}",
        )

    async def reopen_if_changed(self, task: TaskRecord) -> TaskRecord:
        """Re-open ``task``'s gate if its artifact no longer has the gate's hash."""
        if not task.awaiting_approval or not self.workflow.has(task.phase):
            return task
        path = task.folder / self.workflow.phase(task.phase).artifact
        try:
            digest = await self._cached_hash(path, task.folder)
        except UnsafeFileError:
            # Not hashed, not re-opened on: an approval re-checks it and is refused.
            return task
        if digest is not None and digest != task.gate_sha256:
            await self._reopen(task, digest, None)
            return await self.get(task.name)
        return task

    async def _cached_hash(self, path: Path, folder: Path) -> str | None:
        """The artifact's hash, re-read only when its size, mtime or inode changed (a parked
        driver polls this; a 1 GB artifact must not be re-hashed every second)."""
        try:
            st = await asyncio.to_thread(path.stat)
        except FileNotFoundError:
            return None
        except OSError:
            # A link that loops and the like: hashing says why it is refused.
            return await sha256_file_async(path, root=folder)
        key = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
        cached = self._hashes.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        digest = await sha256_file_async(path, root=folder)
        if digest is not None:
            self._hashes[path] = (key, digest)
        return digest

    # -- approvals -----------------------------------------------------------------------------

    async def approve(
        self,
        name: str,
        *,
        by: str | int,
        chat_id: int | None = None,
        update_id: int | None = None,
        expected_sha256: str | None = None,
    ) -> ApprovalResult:
        """Record ``by``'s approval of the open gate (idempotent per person and hash).

        The approval and the version bump are one transaction; when the approval completes
        the quorum of the decomposition phase, the declared sub-tasks are created in the
        same transaction. Every attempt, refused or not, is audited.
        """
        actor = _norm_actor(by)
        quorum = self.policy.quorum
        task: TaskRecord | None = None
        try:
            task = await self.get(name)
            self._authorize(task, actor)
            if not task.awaiting_approval or task.gate_sha256 is None:
                raise GateRefused(
                    Refusal.NOT_AWAITING, f"{name} is at {task.label}, no gate is open", task=name
                )
            if (
                self.policy.expiry_seconds is not None
                and task.gate_opened_at is not None
                and self.clock() - task.gate_opened_at > self.policy.expiry_seconds
            ):
                raise GateRefused(
                    Refusal.EXPIRED,
                    f"the gate of {task.phase} opened {self.clock() - task.gate_opened_at:.0f}s "
                    f"ago and expired after {self.policy.expiry_seconds:.0f}s",
                    task=name,
                )
            if expected_sha256 is not None:
                want = expected_sha256.strip().lower()
                if len(want) < 8 or not task.gate_sha256.startswith(want):
                    raise GateRefused(
                        Refusal.STALE_APPROVAL,
                        f"you approved {want[:12]!r} but the gate now shows "
                        f"{task.gate_sha256[:12]}",
                        task=name,
                    )
            if not self.workflow.has(task.phase):
                raise GateRefused(
                    Refusal.UNKNOWN_PHASE,
                    f"{name} is at {task.phase!r}, which the workflow no longer has",
                    task=name,
                )
            artifact = task.folder / self.workflow.phase(task.phase).artifact
            try:
                digest = await sha256_file_async(artifact, root=task.folder)
            except UnsafeFileError as exc:
                text = await self._unsafe_artifact(task, exc, f"approval by {actor}")
                raise GateRefused(Refusal.INVALID_ARTIFACT, text, task=name) from exc
            if digest is None:
                raise GateRefused(
                    Refusal.MISSING_ARTIFACT, f"{artifact.name} has disappeared", task=name
                )
            if digest != task.gate_sha256:
                await self._reopen(task, digest, actor)
                raise GateRefused(
                    Refusal.STALE_APPROVAL,
                    f"{artifact.name} changed since the gate opened (gate "
                    f"{task.gate_sha256[:12]}, now {digest[:12]}); the gate was re-opened: "
                    "review it again",
                    task=name,
                )
            decls: tuple[SubtaskDecl, ...] = ()
            if task.phase == self.workflow.decomposition:
                decls = await asyncio.to_thread(self._decls, task, digest)
                clash = await self._subtask_clash(task, decls)
                if clash is not None:
                    raise GateRefused(Refusal.INVALID_ARTIFACT, clash, task=name)
            result = await self._record_approval(task, actor, digest, chat_id, update_id, decls)
        except GateRefused as exc:
            await self.record_audit(
                "approve",
                f"refused:{exc.reason.value}",
                task=name,
                phase=task.label if task else None,
                actor=actor,
                chat_id=chat_id,
                update_id=update_id,
                sha256=task.gate_sha256 if task else None,
                detail=exc.detail,
            )
            return ApprovalResult(
                ApprovalOutcome.REFUSED,
                name,
                phase=task.phase if task else None,
                sha256=task.gate_sha256 if task else None,
                quorum=quorum,
                reason=exc.reason,
                detail=exc.detail,
            )
        await self.record_audit(
            "approve",
            result.outcome.value,
            task=name,
            phase=task.phase,
            actor=actor,
            chat_id=chat_id,
            update_id=update_id,
            sha256=result.sha256,
            detail=f"{result.approvals}/{result.quorum}",
        )
        for sub in result.subtasks_created:
            await self.sync_state(sub)
        return result

    def _authorize(self, task: TaskRecord, actor: str) -> None:
        if actor not in self.policy.approvers:
            raise GateRefused(
                Refusal.NOT_APPROVER,
                f"user {actor!r} is not an approver (TURNSTILE_APPROVERS)",
                task=task.name,
            )
        if self.policy.forbid_self_approval and task.started_by == actor:
            raise GateRefused(
                Refusal.SELF_APPROVAL,
                f"user {actor!r} started {task.name} and may not approve its gates",
                task=task.name,
            )

    async def _record_approval(
        self,
        task: TaskRecord,
        actor: str,
        digest: str,
        chat_id: int | None,
        update_id: int | None,
        decls: tuple[SubtaskDecl, ...],
    ) -> ApprovalResult:
        now = self.clock()
        async with self.folder_lock(task.folder):
            result = await self._record_locked(task, actor, digest, chat_id, update_id, decls, now)
            if result.outcome is not ApprovalOutcome.ALREADY_APPROVED:
                await self._write_mirror(task.name)
        if result.outcome is not ApprovalOutcome.ALREADY_APPROVED:
            self._notify(task.name)
        return result

    async def _record_locked(
        self,
        task: TaskRecord,
        actor: str,
        digest: str,
        chat_id: int | None,
        update_id: int | None,
        decls: tuple[SubtaskDecl, ...],
        now: float,
    ) -> ApprovalResult:
        quorum = self.policy.quorum
        created: list[str] = []
        outcome = ApprovalOutcome.RECORDED
        count = 0
        async with self.db.transaction() as conn:
            # Locked on PostgreSQL: two approvers at once count each other (SQLite's
            # BEGIN IMMEDIATE already serialises them).
            cursor = await conn.execute(_SELECT_TASK + self.db.for_update, (task.name,))
            row = await cursor.fetchone()
            assert row is not None
            live = TaskRecord.from_row(row)
            if (live.phase, live.sub_state, live.gate_round, live.gate_sha256) != (
                task.phase,
                task.sub_state,
                task.gate_round,
                task.gate_sha256,
            ):
                raise GateRefused(
                    Refusal.CONFLICT,
                    f"{task.name} changed while approving (now {live.label}); look again",
                    task=task.name,
                )
            cursor = await conn.execute(
                "INSERT INTO gate_approvals (task, phase, gate_round, sha256, approver, chat_id, "
                "update_id, at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (task, phase, gate_round, sha256, approver) DO NOTHING",
                (task.name, task.phase, task.gate_round, digest, actor, chat_id, update_id, now),
            )
            fresh = cursor.rowcount == 1
            cursor = await conn.execute(
                "SELECT COUNT(DISTINCT approver) FROM gate_approvals WHERE task = ? AND "
                "phase = ? AND gate_round = ? AND sha256 = ?",
                (task.name, task.phase, task.gate_round, digest),
            )
            count_row = await cursor.fetchone()
            count = int(count_row[0]) if count_row else 0
            if not fresh:
                outcome = ApprovalOutcome.ALREADY_APPROVED
            else:
                if count >= quorum:
                    outcome = ApprovalOutcome.APPROVED
                cursor = await conn.execute(
                    "UPDATE gate_tasks SET version = version + 1, updated_at = ? "
                    "WHERE name = ? AND version = ?",
                    (now, task.name, live.version),
                )
                await conn.execute(
                    "INSERT INTO gate_transitions (task, version, kind, from_phase, from_sub, "
                    "to_phase, to_sub, actor, reason, sha256, git_fingerprint, at) "
                    "VALUES (?, ?, 'approve', ?, ?, ?, ?, ?, ?, ?, NULL, ?)",
                    (
                        task.name,
                        live.version + 1,
                        task.phase,
                        task.sub_state,
                        task.phase,
                        task.sub_state,
                        actor,
                        f"{count}/{quorum}",
                        digest,
                        now,
                    ),
                )
                if outcome is ApprovalOutcome.APPROVED and decls:
                    for decl in decls:
                        sub = f"{task.name}.{decl.name}"
                        if await self._insert_task(
                            conn,
                            sub,
                            task.folder / "subtasks" / decl.name,
                            # A parent working in its own folder gives each sub-task its
                            # own; a parent with a code workspace shares it.
                            task.folder / "subtasks" / decl.name
                            if task.workdir == task.folder
                            else task.workdir,
                            self.workflow.subtask_start,
                            task.name,
                            decl.wave,
                            decl.summary or None,
                            task.started_by,
                            now,
                        ):
                            created.append(sub)
                            continue
                        # Someone took the name since the check: refuse, approval and all.
                        cursor = await conn.execute(_SELECT_TASK, (sub,))
                        taken = await cursor.fetchone()
                        assert taken is not None
                        clash = self._clash(task, decl, TaskRecord.from_row(taken))
                        if clash is not None:
                            raise GateRefused(Refusal.INVALID_ARTIFACT, clash, task=task.name)
        return ApprovalResult(
            outcome,
            task.name,
            phase=task.phase,
            sha256=digest,
            approvals=count,
            quorum=quorum,
            detail=f"{count} of {quorum} approvals for {digest[:12]}",
            subtasks_created=tuple(created),
        )

    async def reject(
        self,
        name: str,
        *,
        by: str | int,
        reason: str,
        chat_id: int | None = None,
        update_id: int | None = None,
    ) -> ApprovalResult:
        """Reject the open gate: the phase re-runs with ``reason`` as revision notes."""
        actor = _norm_actor(by)
        task: TaskRecord | None = None
        try:
            task = await self.get(name)
            self._authorize_reject(task, actor)
            if not task.awaiting_approval:
                raise GateRefused(
                    Refusal.NOT_AWAITING, f"{name} is at {task.label}, no gate is open", task=name
                )
            text = reason.strip()
            if not text:
                raise GateRefused(Refusal.ILLEGAL_TRANSITION, "a rejection needs a reason")
            approvers = {a.approver for a in await self.gate_approvals(task)}
            if len(approvers) >= self.policy.quorum:
                # Decided (and, for a decomposition, its sub-tasks exist): too late.
                raise GateRefused(
                    Refusal.NOT_AWAITING,
                    f"the {task.phase} gate of {name} is already approved; move the task to "
                    f"{HUMAN_INTERVENTION} instead",
                    task=name,
                )
            sets = {"sub_state": None, "revision_notes": text[:MAX_REASON]}
            await self._commit(
                task, sets, "reject", actor, text, task.gate_sha256, None, self.clock()
            )
        except GateRefused as exc:
            await self.record_audit(
                "reject",
                f"refused:{exc.reason.value}",
                task=name,
                phase=task.label if task else None,
                actor=actor,
                chat_id=chat_id,
                update_id=update_id,
                detail=exc.detail,
            )
            return ApprovalResult(
                ApprovalOutcome.REFUSED,
                name,
                phase=task.phase if task else None,
                reason=exc.reason,
                detail=exc.detail,
                quorum=self.policy.quorum,
            )
        await self.record_audit(
            "reject",
            "rejected",
            task=name,
            phase=task.phase,
            actor=actor,
            chat_id=chat_id,
            update_id=update_id,
            sha256=task.gate_sha256,
            detail=reason[:MAX_REASON],
        )
        return ApprovalResult(
            ApprovalOutcome.REJECTED,
            name,
            phase=task.phase,
            sha256=task.gate_sha256,
            quorum=self.policy.quorum,
            detail=reason[:MAX_REASON],
        )

    def _authorize_reject(self, task: TaskRecord, actor: str) -> None:
        if actor not in self.policy.approvers:
            raise GateRefused(
                Refusal.NOT_APPROVER,
                f"user {actor!r} is not an approver (TURNSTILE_APPROVERS)",
                task=task.name,
            )

"""The gatekeeper's core: reads, checked moves, the mirror, facts and the audit trail.

:class:`GateKeeper` puts the parts together and keeps none of their work: the facts come
from the task folder (:mod:`engine.gates.folder`, :mod:`engine.gates.taskfolder`), the
rules decide (:mod:`engine.gates.machine`), the gate store writes
(:class:`engine.gates.store.GateStore`, one compare-and-set transaction per change), then
the folder's ``.state`` mirror is rewritten under the folder lock and the change is
logged, audited and announced to listeners. Approving and rejecting a gate are added by
:class:`engine.gates.tasks.TaskStore`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import safefile
from engine.errors import UnsafeFileError
from engine.gates import policy as rules
from engine.gates.artifacts import ArtifactStore, SqlArtifactStore, StoredArtifact
from engine.gates.decomposition import SubtaskDecl
from engine.gates.folder import Violation, effective_phase, inspect_folder, validate_folder
from engine.gates.gitwatch import fingerprint
from engine.gates.hashing import sha256_file_async
from engine.gates.machine import Facts, Target, check_transition, parse_target
from engine.gates.names import check_subtask_name, check_task_name
from engine.gates.policy import GatePolicy
from engine.gates.records import (
    ApprovalRecord,
    AuditEvent,
    SessionRecord,
    TaskRecord,
    TransitionRecord,
)
from engine.gates.refusals import GateRefused, Refusal
from engine.gates.store import Change, GateStore, HistoryEntry, NewTask
from engine.gates.taskfolder import TaskFolders, read_decls, snapshot
from engine.gates.workflow import AWAITING_APPROVAL, COMPLETE, HUMAN_INTERVENTION, Workflow
from engine.runs.spec import PlaceId
from engine.store.audit import AuditLog, SqliteAuditLog

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = ["GateKeeper", "raise_verdict"]

_LOGGER = logging.getLogger(__name__)


class GateKeeper:
    """Gated tasks: create, move, check; over a :class:`GateStore`.

    Args:
        store: the gate store (the caller opens it: :class:`engine.gates.store.SqlGateStore`).
        workflow: the phases.
        tasks_root: where task folders are created by default.
        policy: approvers, quorum, expiry, self-approval ban.
        clock: seconds since the epoch (a :class:`engine.testing.FakeClock` in tests).
        track_git: record a code fingerprint of git workdirs on every transition.
        audit_log: the system's audit log (default: over the gate store's database).
        folders: the process's folder locks and hash cache.
        artifacts: where gates keep their artifacts (default: over the gate store's
            database).
    """

    def __init__(
        self,
        store: GateStore,
        workflow: Workflow,
        *,
        tasks_root: Path,
        policy: GatePolicy | None = None,
        clock: Callable[[], float] = time.time,
        track_git: bool = True,
        audit_log: AuditLog | None = None,
        folders: TaskFolders | None = None,
        artifacts: ArtifactStore | None = None,
    ) -> None:
        self.gate_store = store
        self.artifacts: ArtifactStore = artifacts or SqlArtifactStore(store.db, clock=clock)
        self.audit_log: AuditLog = audit_log or SqliteAuditLog(store.db, clock=clock)
        self.workflow = workflow
        self.tasks_root = tasks_root
        self.policy = policy or GatePolicy()
        self.clock = clock
        self.track_git = track_git
        self.folders = folders or TaskFolders(store.db)
        self._listeners: list[Callable[[str], None]] = []

    @property
    def db(self) -> AnyDatabase:
        """The database under the gate store (a drive's run and workspace stores use it)."""
        return self.gate_store.db

    # -- change notification (in-process) ------------------------------------------------

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

    # -- reads ---------------------------------------------------------------------------

    async def find(self, name: str) -> TaskRecord | None:
        return await self.gate_store.find(name)

    async def get(self, name: str) -> TaskRecord:
        """Raises GateRefused(unknown_task)."""
        task = await self.gate_store.find(name)
        if task is None:
            raise GateRefused(Refusal.UNKNOWN_TASK, f"no task named {name[:128]!r}", task=name)
        return task

    async def list_tasks(self) -> list[TaskRecord]:
        return await self.gate_store.list_tasks()

    async def subtasks(self, parent: str) -> list[TaskRecord]:
        return await self.gate_store.subtasks(parent)

    async def history(self, name: str) -> list[TransitionRecord]:
        return await self.gate_store.history(name)

    async def approvals(self, name: str) -> list[ApprovalRecord]:
        return await self.gate_store.approvals(name)

    async def gate_approvals(self, task: TaskRecord) -> list[ApprovalRecord]:
        """Approvals of the open gate bound to the hash it shows."""
        return await self.gate_store.gate_approvals(task)

    async def audit_events(self, task: str | None = None, limit: int = 1000) -> list[AuditEvent]:
        """The latest audit entries (of ``task``), oldest first; every origin's."""
        return await self.audit_log.entries(task=task, limit=limit)

    async def get_session(self, name: str) -> SessionRecord | None:
        return await self.gate_store.get_session(name)

    async def save_session(self, name: str, agent: str, session_id: str, started: bool) -> None:
        await self.gate_store.save_session(name, agent, session_id, started)

    async def set_workdir(self, name: str, workdir: Path) -> None:
        """Point a task at another code workspace (a wave sub-task's own worktree). Not a
        state change: no version bump, not in ``.state``."""
        await self.gate_store.set_workdir(name, workdir)

    # -- the .state mirror ---------------------------------------------------------------

    def snapshot(self, task: TaskRecord, approvals: Sequence[ApprovalRecord]) -> dict[str, Any]:
        """What ``.state`` must hold for ``task`` (the store's view)."""
        return snapshot(task, approvals)

    async def expected_state(self, task: TaskRecord) -> dict[str, Any]:
        return snapshot(task, await self.gate_approvals(task))

    @asynccontextmanager
    async def folder_lock(self, folder: Path, *, exclusive: bool = True) -> AsyncIterator[None]:
        """Hold the task folder's lock (see :meth:`TaskFolders.lock`)."""
        async with self.folders.lock(folder, exclusive=exclusive):
            yield

    async def _write_mirror(self, name: str, latest: TaskRecord | None = None) -> None:
        """Rewrite ``name``'s ``.state``; ``latest``: the task as just committed, if known."""
        if latest is None:
            latest = await self.get(name)
        await self.folders.write_mirror(latest, await self.gate_approvals(latest))

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

    # -- audit log -----------------------------------------------------------------------

    async def record_audit(
        self,
        event: str,
        outcome: str,
        *,
        task: str | None = None,
        phase: str | None = None,
        actor: str | None = None,
        chat_id: PlaceId | None = None,
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

    # -- creating tasks ------------------------------------------------------------------

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
        new = NewTask(
            name=name,
            folder=folder,
            workdir=(workdir or folder).absolute(),
            phase=phase,
            at=self.clock(),
            parent=parent,
            wave=wave,
            summary=summary,
            started_by=started_by,
        )
        folder.mkdir(parents=True, exist_ok=True)
        async with self.folder_lock(folder):
            if not await self.gate_store.insert_task(new):
                raise GateRefused(Refusal.TASK_EXISTS, f"task {name!r} exists", task=name)
            await self._write_mirror(name)
        self._notify(name)
        return await self.get(name)

    # -- facts ---------------------------------------------------------------------------

    async def facts(self, task: TaskRecord) -> Facts:
        """The folder and approval facts the rules need, for the task's current phase."""
        phase = effective_phase(task.phase, task.return_phase)
        if phase in (COMPLETE, HUMAN_INTERVENTION) or not self.workflow.has(phase):
            return Facts(return_phase=task.return_phase, quorum=self.policy.quorum)
        folder = await asyncio.to_thread(
            inspect_folder, task.folder, self.workflow, phase, hash_artifact=False
        )
        spec = self.workflow.phase(phase)
        artifact_error = None
        try:
            digest = await sha256_file_async(task.folder / spec.artifact, root=task.folder)
        except UnsafeFileError as exc:
            digest = None
            artifact_error = await self._unsafe_artifact(task, exc, "check")
        if digest is not None and spec.approval and artifact_error is None:
            artifact_error = await self._too_large(task.folder / spec.artifact)
        if digest is not None and artifact_error is None and phase == self.workflow.decomposition:
            try:
                decls = await self._decls(task, digest)
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

    async def _too_large(self, path: Path) -> str | None:
        """Why the artifact at ``path`` is too large for its gate to store, or None."""
        try:
            size = (await asyncio.to_thread(os.stat, path)).st_size
        except OSError:
            return None  # gone meanwhile: storing it says so
        return rules.artifact_too_large(self.policy, path.name, size)

    # -- stored artifacts ----------------------------------------------------------------

    async def artifact(self, sha256: str) -> StoredArtifact | None:
        """The artifact content a gate stored under ``sha256``, or None."""
        return await self.artifacts.get(sha256)

    async def excerpt(self, sha256: str | None, limit: int) -> str:
        """The first ``limit`` characters of the stored artifact ("" when none is stored)."""
        head = await self.artifacts.head(sha256, limit * 4) if sha256 is not None else None
        return "" if head is None else head.decode("utf-8", errors="replace")[:limit]

    async def _capture(self, task: TaskRecord, phase: str) -> str:
        """Store the content of ``phase``'s artifact in ``task``'s folder; its SHA-256.

        Raises:
            GateRefused: ``missing_artifact``, or ``invalid_artifact`` (unsafe, too large).
        """
        artifact = self.workflow.phase(phase).artifact
        limit = self.policy.artifact_max_bytes
        try:
            content = await asyncio.to_thread(
                safefile.read_bytes, task.folder, artifact, limit=limit
            )
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise GateRefused(
                Refusal.MISSING_ARTIFACT,
                f"{artifact} disappeared while it was read",
                task=task.name,
            ) from exc
        except UnsafeFileError as exc:
            if exc.reason == safefile.Unsafe.TOO_LARGE:
                text = await self._too_large(task.folder / artifact) or (
                    f"{artifact} is larger than {limit} bytes"
                )
                await self.record_audit(
                    "gate_artifact", "refused:too_large", task=task.name, phase=phase, detail=text
                )
            else:
                text = await self._unsafe_artifact(task, exc, "store")
            raise GateRefused(Refusal.INVALID_ARTIFACT, text, task=task.name) from exc
        return await self.artifacts.put(content)

    async def ensure_artifact(self, task: TaskRecord) -> str | None:
        """None when the content of ``task``'s open gate is in the database; else why not.

        A gate stores its artifact when it opens; one opened before gates did (an older
        version) is stored now from the task folder, if the file still has the gate's hash.
        """
        if task.gate_sha256 is None or not self.workflow.has(task.phase):
            return f"{task.name} has no open gate"
        if await self.artifacts.has(task.gate_sha256):
            return None
        what = f"{self.workflow.phase(task.phase).artifact} (sha256 {task.gate_sha256[:12]})"
        try:
            stored = await self._capture(task, task.phase)
        except GateRefused as exc:
            return f"{what} is not in the database: {exc.detail}"
        if stored != task.gate_sha256:
            return f"{what} is not in the database, and the file now has sha256 {stored[:12]}"
        return None

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

    async def _decls(self, task: TaskRecord, digest: str) -> tuple[SubtaskDecl, ...]:
        assert self.workflow.decomposition is not None
        artifact = self.workflow.phase(self.workflow.decomposition).artifact
        return await asyncio.to_thread(read_decls, task, artifact, digest)

    async def _subtask_clash(self, task: TaskRecord, decls: Sequence[SubtaskDecl]) -> str | None:
        """Why the declared sub-tasks cannot be created, if a task already has one's name."""
        for decl in decls:
            existing = await self.find(f"{task.name}.{decl.name}")
            if existing is not None:
                problem = rules.subtask_clash(self.workflow, task, decl, existing)
                if problem is not None:
                    return problem
        return None

    # -- transitions ---------------------------------------------------------------------

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
            if goal.sub_state == AWAITING_APPROVAL:
                # The gate shows what the database holds: people review, and approve, that.
                stored = await self._capture(task, goal.phase)
                if stored != facts.artifact_sha256:
                    raise GateRefused(
                        Refusal.CONFLICT,
                        "the artifact changed while its gate was opening; look again",
                        task=name,
                    )
            git = None
            if self.track_git:
                git = await fingerprint(task.workdir, exclude=task.folder)
            await self._commit(self._move(task, goal, facts, actor, reason, git))
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
        return await self.get(task.name)

    def _move(
        self,
        task: TaskRecord,
        goal: Target,
        facts: Facts,
        actor: str | None,
        reason: str | None,
        git: str | None,
    ) -> Change:
        """The change that moves ``task`` to ``goal``; ``git``: the workdir's fingerprint."""
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
        entry = HistoryEntry(kind, actor=actor, reason=reason, sha256=sha, git_fingerprint=git)
        return Change(task, sets, entry, now)

    async def _commit(self, change: Change) -> None:
        """Write ``change`` (compare-and-set), then the mirror, under the folder lock."""
        task = change.task
        async with self.folder_lock(task.folder):
            latest = await self.gate_store.commit(change)
            await self._write_mirror(task.name, latest)
        _LOGGER.info(
            "task %s v%d %s → %s (%s)",
            task.name,
            task.version + 1,
            task.label,
            change.to_label,
            change.entry.kind,
            extra={"task": task.name},
        )
        self._notify(task.name)

    async def _reopen(self, task: TaskRecord, new_sha: str, actor: str | None) -> None:
        """The artifact changed under an open gate: void its approvals (new round) and show
        the new hash, stored in the database (if it can be: approvals are refused until
        it is)."""
        problem = None
        try:
            new_sha = await self._capture(task, task.phase)
        except GateRefused as exc:
            problem = exc.detail
        now = self.clock()
        sets = {"gate_round": task.gate_round + 1, "gate_sha256": new_sha, "gate_opened_at": now}
        reason = f"artifact changed from {str(task.gate_sha256)[:12]} to {new_sha[:12]}"
        if problem is not None:
            reason += f"; not stored: {problem}"
        entry = HistoryEntry("reopen", actor=actor, reason=reason, sha256=new_sha)
        try:
            await self._commit(Change(task, sets, entry, now))
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
            digest = await self.folders.cached_hash(path, task.folder)
        except UnsafeFileError:
            # Not hashed, not re-opened on: an approval re-checks it and is refused.
            return task
        if digest is not None and digest != task.gate_sha256:
            await self._reopen(task, digest, None)
            return await self.get(task.name)
        return task


def raise_verdict(verdict: rules.Verdict, task: str) -> None:
    """Raise the refusal a rule gave, if it gave one."""
    if verdict is not None:
        raise GateRefused(verdict[0], verdict[1], task=task)

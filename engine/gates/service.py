"""The gates API for front ends: the CLI and the Telegram bot call only this."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.gates.artifacts import StoredArtifact
from engine.gates.audit import AuditReport, run_audit
from engine.gates.autopilot import (
    AgentFactory,
    Autopilot,
    DriveHandle,
    DriveOutcome,
    drive_alive,
    next_step,
)
from engine.gates.folder import Violation
from engine.gates.listing import ListEntry, TaskGroup, group_tasks
from engine.gates.policy import GatePolicy
from engine.gates.records import (
    ApprovalRecord,
    ApprovalResult,
    AuditEvent,
    TaskRecord,
    TransitionRecord,
)
from engine.gates.refusals import GateRefused, Refusal
from engine.gates.store import GateStore, SqlGateStore
from engine.gates.tasks import TaskStore
from engine.gates.workflow import Workflow, load_workflow
from engine.gates.worktrees import TaskWorktrees, WaveWorkspaces
from engine.logs import log_context
from engine.runs import RunMode, RunSupervisor
from engine.runs.spec import PlaceId
from engine.settings import Settings
from engine.sink import GateRequest, RunSink
from engine.spend import Budget
from engine.store.runs import SqliteRunStore

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = ["Gates", "TaskView", "workflow_from_settings"]


@dataclass(frozen=True, slots=True)
class TaskView:
    """What ``turnstile status --task T`` shows of a task (see :meth:`Gates.show`)."""

    task: TaskRecord
    approvals: tuple[ApprovalRecord, ...]
    approvers: int
    """Distinct approvers of the open gate."""
    quorum: int
    history: tuple[TransitionRecord, ...]
    next_step: str
    snapshot: Mapping[str, Any]
    """The task as the ``.state`` mirror holds it."""


def workflow_from_settings(settings: Settings) -> Workflow:
    """The operator's workflow (``TURNSTILE_WORKFLOW_FILE``) or the shipped default."""
    path = settings.workflow_file
    if path is not None and str(path) in ("", "."):
        path = None
    return load_workflow(path)


class Gates:
    """Gated tasks, approvals, audits and autopilot drives over one database.

    Share one instance per process between the front end and its drives: in-process
    approvals then wake a parked drive at once (other processes' approvals are noticed by
    polling, every ``poll_interval`` seconds).

    Args:
        db: an open database (either backend).
        settings: approvers, quorum, expiry, tasks root, agents, wave concurrency.
        workflow: the phases (default: :func:`workflow_from_settings`).
        clock: the time source (expiry).
        poll_interval: how often a parked drive reads the store.
        gate_store: the gate store (default: :class:`SqlGateStore` over ``db``).
    """

    def __init__(
        self,
        db: AnyDatabase,
        settings: Settings,
        *,
        workflow: Workflow | None = None,
        clock: Callable[[], float] = time.time,
        poll_interval: float = 1.0,
        track_git: bool = True,
        gate_store: GateStore | None = None,
    ) -> None:
        self.settings = settings
        self.workflow = workflow or workflow_from_settings(settings)
        self.store = TaskStore(
            gate_store if gate_store is not None else SqlGateStore(db, clock=clock),
            self.workflow,
            tasks_root=settings.tasks_root,
            policy=GatePolicy.from_settings(settings),
            clock=clock,
            track_git=track_git,
        )
        self.poll_interval = poll_interval
        self._drives: dict[str, DriveHandle] = {}

    # -- tasks ---------------------------------------------------------------------------

    async def init_task(
        self,
        name: str,
        *,
        folder: Path | None = None,
        workdir: Path | None = None,
        summary: str | None = None,
        started_by: str | int | None = None,
        parent: str | None = None,
        wave: int | None = None,
    ) -> TaskRecord:
        """Create a task at the first phase (raises GateRefused: invalid name, exists)."""
        return await self.store.init_task(
            name,
            folder=folder,
            workdir=workdir,
            summary=summary,
            started_by=str(started_by) if started_by is not None else None,
            parent=parent,
            wave=wave,
        )

    async def task(self, name: str) -> TaskRecord:
        """One task (raises GateRefused(unknown_task))."""
        return await self.store.get(name)

    async def open_gate(self, task: str) -> TaskRecord | None:
        """The task if its gate is open (awaiting approval of a hashed artifact), else None.

        The gate store is the one place a gate's state lives: every front end asks it.
        """
        record = await self.store.find(task)
        if record is None or not record.awaiting_approval or record.gate_sha256 is None:
            return None
        return record

    async def list_tasks(self) -> list[TaskGroup]:
        """Every task grouped by parent and wave; groups awaiting approval first.

        The groups hold light :class:`ListEntry` rows (name, phase, sub-state, version,
        parent, wave, gate hash, notes); use :meth:`task` for a whole record.
        """
        rows = await self.store.gate_store.listing_rows()
        return group_tasks(map(ListEntry._make, rows))

    async def transition(
        self, task: str, target: str, *, actor: str | None = None, reason: str | None = None
    ) -> TaskRecord:
        """Move ``task`` to ``target`` (``PHASE`` or ``PHASE:awaiting_approval``) by hand.

        Raises:
            GateRefused: the rules refuse it (the reason says why).
        """
        return await self.store.transition(task, target, actor=actor, reason=reason)

    async def show(self, task: str) -> TaskView:
        """A task with its gate's approvals, its history and what a person does next."""
        record = await self.store.get(task)
        approvals = await self.store.gate_approvals(record)
        approvers = len({a.approver for a in approvals})
        return TaskView(
            task=record,
            approvals=tuple(approvals),
            approvers=approvers,
            quorum=self.store.policy.quorum,
            history=tuple(await self.store.history(record.name)),
            next_step=next_step(self.store, record, approvers),
            snapshot=self.store.snapshot(record, approvals),
        )

    async def validate_folder(self, task: str) -> tuple[TaskRecord, list[Violation]]:
        """Check the task's folder against its phase; the check is audited."""
        record, violations = await self.store.validate(task)
        await self.store.record_audit(
            "validate_folder",
            "clean" if not violations else "violations",
            task=record.name,
            phase=record.label,
            detail="; ".join(v.detail for v in violations) or None,
        )
        return record, violations

    # -- approvals -----------------------------------------------------------------------

    async def approve(
        self,
        task: str,
        *,
        by: str | int,
        chat_id: PlaceId | None = None,
        update_id: int | None = None,
        expected_sha256: str | None = None,
    ) -> ApprovalResult:
        """Approve the open gate of ``task`` as user ``by``.

        ``expected_sha256`` is the hash (full or >= 8 hex chars) the person saw on the gate
        message: a different current hash is refused as stale. Returns ``approved`` (quorum
        reached: the drive passes the gate), ``recorded`` (more approvals needed),
        ``already_approved`` (idempotent: nothing changed), or ``refused`` with a reason.
        Never raises for a refusal; every attempt is audited with chat and update ids.
        """
        return await self.store.approve(
            task, by=by, chat_id=chat_id, update_id=update_id, expected_sha256=expected_sha256
        )

    async def reject(
        self,
        task: str,
        *,
        by: str | int,
        reason: str,
        chat_id: PlaceId | None = None,
        update_id: int | None = None,
    ) -> ApprovalResult:
        """Reject the open gate; the phase re-runs with ``reason`` as delimited revision
        notes (untrusted data). Returns ``rejected`` or ``refused`` with a reason."""
        return await self.store.reject(
            task, by=by, reason=reason, chat_id=chat_id, update_id=update_id
        )

    async def artifact(self, sha256: str) -> StoredArtifact | None:
        """The artifact content a gate stored under ``sha256`` (what people review)."""
        return await self.store.artifact(sha256)

    async def task_artifact(
        self, task: str, sha256: str | None = None
    ) -> tuple[str, StoredArtifact]:
        """The artifact (its file name and stored content) of ``task``'s open gate, or the
        one with ``sha256`` (full or >= 8 hex characters) among the gates in its history.

        Raises:
            GateRefused: unknown task, no open gate (``not_awaiting_approval``), or no
                such artifact stored (``missing_artifact``).
        """
        record = await self.store.get(task)
        history = await self.store.history(record.name)
        known = {h.sha256: h.to_phase for h in history if h.sha256 is not None}
        if record.gate_sha256 is not None:
            known[record.gate_sha256] = record.phase
        if sha256 is None:
            if not record.awaiting_approval or record.gate_sha256 is None:
                raise GateRefused(
                    Refusal.NOT_AWAITING,
                    f"{record.name} is at {record.label}, no gate is open: name the artifact "
                    "with --sha256 HASH (see its history)",
                    task=record.name,
                )
            want = record.gate_sha256
        else:
            want = sha256.strip().lower()
        matches = [h for h in known if len(want) >= 8 and h.startswith(want)]
        stored = await self.store.artifact(matches[0]) if len(matches) == 1 else None
        if stored is None:
            raise GateRefused(
                Refusal.MISSING_ARTIFACT,
                f"no artifact of {record.name} with sha256 {want[:12]} is stored",
                task=record.name,
            )
        phase = known[stored.sha256]
        name = self.workflow.phase(phase).artifact if self.workflow.has(phase) else phase
        return name, stored

    async def pending_gates(self) -> list[GateRequest]:
        """Every open gate, to re-post or refresh gate messages on start-up."""
        out: list[GateRequest] = []
        runs = SqliteRunStore(self.store.db)
        for task in await self.store.list_tasks():
            if not task.awaiting_approval or task.gate_sha256 is None:
                continue
            if not self.workflow.has(task.phase):
                continue
            spec = self.workflow.phase(task.phase)
            path = task.folder / spec.artifact
            excerpt = await self.store.excerpt(task.gate_sha256, 1500)
            # The gate's drive: the task's latest (None: a gate no drive opened).
            drive = await runs.latest_task_run(RunMode.AUTOPILOT, task.name)
            out.append(
                GateRequest(
                    task=task.name,
                    phase=task.phase,
                    artifact_name=spec.artifact,
                    artifact_path=path,
                    sha256=task.gate_sha256,
                    excerpt=excerpt,
                    run_id=drive.id if drive is not None else None,
                )
            )
        return out

    # -- audit ---------------------------------------------------------------------------

    async def audit(self, tasks: list[str] | None = None) -> AuditReport:
        """Check every task (or the named ones); the run is recorded in the audit log."""
        return await run_audit(self.store, tasks=tasks)

    async def audit_events(self, task: str | None = None, limit: int = 100) -> list[AuditEvent]:
        """The latest audit log entries (oldest first)."""
        return await self.store.audit_events(task, limit)

    # -- autopilot -----------------------------------------------------------------------

    def start_autopilot(
        self,
        task: str,
        sink: RunSink,
        *,
        tool: str | None = None,
        agent_cmd: str | None = None,
        wait_for_approval: bool = True,
        agent_factory: AgentFactory | None = None,
        worktrees: WaveWorkspaces | None = None,
        chat: tuple[PlaceId, PlaceId | None] | None = None,
        supervisor: RunSupervisor | None = None,
        budget: Budget | None = None,
        run_id: str | None = None,
    ) -> DriveHandle:
        """Start (or resume, from the recorded phase) driving ``task``; call from a running
        event loop. A second start for a task already being driven returns the same handle.

        ``budget``: what the drive's turns may spend (the caller checked that its agent
        reports it: :meth:`engine.spend.Budget.refusal_for`). ``run_id``: the id of the
        drive's run, when the caller chose it (the parked run it resumes, or a reserved one).
        """
        current = self._drives.get(task)
        if current is not None and not current.done:
            return current
        pilot = Autopilot(
            self.store,
            self.settings,
            sink,
            tool=tool or self.settings.default_agent,
            agent_cmd=agent_cmd,
            wait_for_approval=wait_for_approval,
            poll_interval=self.poll_interval,
            agent_factory=agent_factory,
            worktrees=worktrees
            or TaskWorktrees(self.settings, self.store.db, self.store.gate_store),
            chat=chat,
            supervisor=supervisor,
            budget=budget,
            run_id=run_id,
        )
        # The task copies the context: every line it logs carries the task name.
        with log_context(task=task):
            future: asyncio.Task[DriveOutcome] = asyncio.create_task(
                pilot.drive(task), name=f"autopilot-{task}"
            )
        handle = DriveHandle(task, future, pilot)
        self._drives[task] = handle
        return handle

    async def drive_alive(self, task: str) -> bool:
        """Whether a drive of ``task`` is alive in any process (its drive lock is held)."""
        return await drive_alive(self.store, task)

    async def stop_all(self) -> None:
        """Stop every drive started here (tasks keep their recorded phases)."""
        for handle in list(self._drives.values()):
            await handle.stop()
        self._drives.clear()

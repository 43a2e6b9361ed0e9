"""The task store: gated tasks created, moved, approved and rejected, each change checked,
stored, mirrored into the folder's ``.state`` and audited.

:class:`TaskStore` is the gatekeeper (:class:`engine.gates.keeper.GateKeeper`) plus the
decisions on a gate: the approval rules are :mod:`engine.gates.policy`, the SQL is
:class:`engine.gates.store.GateStore`'s. The records it hands out are
:mod:`engine.gates.records`' (re-exported here).
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import UnsafeFileError
from engine.gates import policy as rules
from engine.gates.decomposition import SubtaskDecl
from engine.gates.hashing import sha256_file_async
from engine.gates.keeper import GateKeeper, raise_verdict
from engine.gates.policy import GatePolicy
from engine.gates.records import (
    MAX_REASON,
    ApprovalOutcome,
    ApprovalRecord,
    ApprovalResult,
    AuditEvent,
    SessionRecord,
    TaskRecord,
    TransitionRecord,
)
from engine.gates.refusals import GateRefused, Refusal
from engine.gates.store import ApprovalRequest, Change, HistoryEntry, NewTask, Tally
from engine.gates.taskfolder import parse_decls
from engine.runs.spec import PlaceId

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


class TaskStore(GateKeeper):
    """Gated tasks over a :class:`engine.gates.store.GateStore`: the gatekeeper, and the
    approve and reject decisions (same arguments as :class:`GateKeeper`)."""

    # -- approvals -----------------------------------------------------------------------

    async def approve(
        self,
        name: str,
        *,
        by: str | int,
        chat_id: PlaceId | None = None,
        update_id: int | None = None,
        expected_sha256: str | None = None,
    ) -> ApprovalResult:
        """Record ``by``'s approval of the open gate (idempotent per person and hash).

        The approval and the version bump are one transaction; when the approval completes
        the quorum of the decomposition phase, the declared sub-tasks are created in the
        same transaction. Every attempt, refused or not, is audited.
        """
        actor = rules.norm_actor(by)
        quorum = self.policy.quorum
        task: TaskRecord | None = None
        try:
            task = await self.get(name)
            raise_verdict(rules.approver_refusal(self.policy, task, actor), name)
            raise_verdict(
                rules.open_gate_refusal(self.policy, task, self.clock(), expected_sha256), name
            )
            request = await self._approval_request(task, actor, chat_id, update_id)
            tally = await self._record_approval(request)
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
        outcome = rules.approval_outcome(
            fresh=tally.fresh, approvers=tally.approvers, quorum=quorum
        )
        result = ApprovalResult(
            outcome,
            name,
            phase=task.phase,
            sha256=request.sha256,
            approvals=tally.approvers,
            quorum=quorum,
            detail=f"{tally.approvers} of {quorum} approvals for {request.sha256[:12]}",
            subtasks_created=tally.created,
        )
        await self.record_audit(
            "approve",
            outcome.value,
            task=name,
            phase=task.phase,
            actor=actor,
            chat_id=chat_id,
            update_id=update_id,
            sha256=request.sha256,
            detail=f"{tally.approvers}/{quorum}",
        )
        return result

    async def _approval_request(
        self, task: TaskRecord, actor: str, chat_id: PlaceId | None, update_id: int | None
    ) -> ApprovalRequest:
        """Check the gate's artifact is in the database (the approval binds to that content)
        and, where its file is on this machine, that it still has the gate's hash
        (re-opening the gate if not); read the sub-tasks a decomposition declares from the
        stored content. Raises GateRefused."""
        assert task.gate_sha256 is not None
        if not self.workflow.has(task.phase):
            raise GateRefused(
                Refusal.UNKNOWN_PHASE,
                f"{task.name} is at {task.phase!r}, which the workflow no longer has",
                task=task.name,
            )
        artifact = task.folder / self.workflow.phase(task.phase).artifact
        await self._check_file(task, artifact, actor)
        missing = await self.ensure_artifact(task)
        stored = await self.artifact(task.gate_sha256) if missing is None else None
        if stored is None:
            raise GateRefused(
                Refusal.MISSING_ARTIFACT,
                missing or f"{artifact.name} is not in the database",
                task=task.name,
            )
        digest = stored.sha256
        decls: tuple[SubtaskDecl, ...] = ()
        if task.phase == self.workflow.decomposition:
            decls = parse_decls(task, artifact.name, stored.content)
            clash = await self._subtask_clash(task, decls)
            if clash is not None:
                raise GateRefused(Refusal.INVALID_ARTIFACT, clash, task=task.name)
        now = self.clock()
        by_name = {f"{task.name}.{d.name}": d for d in decls}

        def clash_with(existing: TaskRecord) -> str | None:
            return rules.subtask_clash(self.workflow, task, by_name[existing.name], existing)

        return ApprovalRequest(
            task=task,
            approver=actor,
            sha256=digest,
            quorum=self.policy.quorum,
            at=now,
            chat_id=chat_id,
            update_id=update_id,
            subtasks=tuple(self._subtask(task, decl, now) for decl in decls),
            clash=clash_with,
        )

    async def _check_file(self, task: TaskRecord, artifact: Path, actor: str) -> None:
        """Where the artifact's file is on this machine, it still has the gate's hash.
        Raises GateRefused (and re-opens the gate for a changed artifact).

        On a setup with workers the task folder is on a worker's disk, not here; a file
        deleted meanwhile is not here either: the drive checks the file against the
        approved hash before it passes the gate, and a missing one does not pass.
        """
        assert task.gate_sha256 is not None
        try:
            digest = await sha256_file_async(artifact, root=task.folder)
        except UnsafeFileError as exc:
            text = await self._unsafe_artifact(task, exc, f"approval by {actor}")
            raise GateRefused(Refusal.INVALID_ARTIFACT, text, task=task.name) from exc
        if digest is not None and digest != task.gate_sha256:
            await self._reopen(task, digest, actor)
            raise GateRefused(
                Refusal.STALE_APPROVAL,
                f"{artifact.name} changed since the gate opened (gate "
                f"{task.gate_sha256[:12]}, now {digest[:12]}); the gate was re-opened: "
                "review it again",
                task=task.name,
            )

    def _subtask(self, task: TaskRecord, decl: SubtaskDecl, now: float) -> NewTask:
        folder = task.folder / "subtasks" / decl.name
        return NewTask(
            name=f"{task.name}.{decl.name}",
            folder=folder,
            # A parent working in its own folder gives each sub-task its own; a parent with
            # a code workspace shares it.
            workdir=folder if task.workdir == task.folder else task.workdir,
            phase=self.workflow.subtask_start,
            at=now,
            parent=task.name,
            wave=decl.wave,
            summary=decl.summary or None,
            started_by=task.started_by,
        )

    async def _record_approval(self, request: ApprovalRequest) -> Tally:
        async with self.folder_lock(request.task.folder):
            tally = await self.gate_store.record_approval(request)
            if tally.fresh:
                await self._write_mirror(request.task.name)
        # The sub-tasks' mirrors before anyone is told: a drive woken by the approval
        # validates their folders at once (a missing .state sends one to a person).
        for sub in tally.created:
            await self.sync_state(sub)
        if tally.fresh:
            self._notify(request.task.name)
        return tally

    async def reject(
        self,
        name: str,
        *,
        by: str | int,
        reason: str,
        chat_id: PlaceId | None = None,
        update_id: int | None = None,
    ) -> ApprovalResult:
        """Reject the open gate: the phase re-runs with ``reason`` as revision notes."""
        actor = rules.norm_actor(by)
        task: TaskRecord | None = None
        text = reason.strip()
        try:
            task = await self.get(name)
            approvers = len({a.approver for a in await self.gate_approvals(task)})
            raise_verdict(rules.reject_refusal(self.policy, task, actor, text, approvers), name)
            sets = {"sub_state": None, "revision_notes": text[:MAX_REASON]}
            entry = HistoryEntry("reject", actor=actor, reason=text, sha256=task.gate_sha256)
            await self._commit(Change(task, sets, entry, self.clock()))
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

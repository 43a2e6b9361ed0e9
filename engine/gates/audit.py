"""The audit: checks every task for what individual gates can miss.

Per task: out-of-order and forbidden artifacts, a ``.state`` that disagrees with the store,
gaps or breaks in the history, approval phases passed without an approval bound to the
hash that was passed, and code changes (git) made while the task was in a phase that
forbids code edits. Each run is itself recorded in the audit log.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from engine.gates.gitwatch import comparable, fingerprint
from engine.gates.records import TaskRecord, TransitionRecord
from engine.gates.tasks import TaskStore
from engine.gates.workflow import COMPLETE, HUMAN_INTERVENTION, Workflow

__all__ = ["AuditReport", "Finding", "FindingKind", "audit_task", "run_audit"]


class FindingKind(StrEnum):
    OUT_OF_ORDER = "out_of_order_artifact"
    FORBIDDEN = "forbidden_artifact"
    STATE_MISMATCH = "state_mismatch"
    FOLDER_MISSING = "folder_missing"
    UNKNOWN_PHASE = "unknown_phase"
    HISTORY_GAP = "history_gap"
    UNAPPROVED_PASSAGE = "passed_without_approval"
    CODE_CHANGE = "code_change_in_forbidden_phase"


@dataclass(frozen=True, slots=True)
class Finding:
    task: str
    kind: FindingKind
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"task": self.task, "kind": self.kind.value, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class AuditReport:
    tasks: int
    findings: tuple[Finding, ...]

    @property
    def clean(self) -> bool:
        return not self.findings

    def as_dict(self) -> dict[str, Any]:
        return {"tasks": self.tasks, "findings": [f.as_dict() for f in self.findings]}


def _history_findings(
    workflow: Workflow, task: TaskRecord, history: list[TransitionRecord]
) -> list[Finding]:
    found: list[Finding] = []
    versions = [h.version for h in history]
    expected = list(range(1, task.version + 1))
    if versions != expected:
        missing = sorted(set(expected) - set(versions))
        found.append(
            Finding(
                task.name,
                FindingKind.HISTORY_GAP,
                f"history versions {versions[:5]}… do not run 1..{task.version}"
                + (f" (missing {missing[:10]})" if missing else ""),
            )
        )
    for before, after in itertools.pairwise(history):
        if (before.to_phase, before.to_sub) != (after.from_phase, after.from_sub):
            found.append(
                Finding(
                    task.name,
                    FindingKind.HISTORY_GAP,
                    f"v{after.version} starts at {after.from_phase}:{after.from_sub} but "
                    f"v{before.version} ended at {before.to_phase}:{before.to_sub}",
                )
            )
    if history and (history[-1].to_phase, history[-1].to_sub) != (task.phase, task.sub_state):
        found.append(
            Finding(
                task.name,
                FindingKind.HISTORY_GAP,
                f"the task is at {task.label} but its history ends at "
                f"{history[-1].to_phase}:{history[-1].to_sub}",
            )
        )
    return found


async def _approval_findings(
    store: TaskStore, task: TaskRecord, history: list[TransitionRecord]
) -> list[Finding]:
    workflow = store.workflow
    approvals = await store.approvals(task.name)
    found: list[Finding] = []
    for row in history:
        if row.kind != "transition" or row.from_phase is None:
            continue
        if not workflow.has(row.from_phase) or row.to_phase == HUMAN_INTERVENTION:
            continue
        spec = workflow.phase(row.from_phase)
        if not spec.approval or row.to_phase != spec.next:
            continue
        bound = {a.approver for a in approvals if a.phase == spec.name and a.sha256 == row.sha256}
        if row.sha256 is None or not bound:
            found.append(
                Finding(
                    task.name,
                    FindingKind.UNAPPROVED_PASSAGE,
                    f"v{row.version} left {spec.name} for {row.to_phase} without an approval "
                    f"bound to {str(row.sha256)[:12]}",
                )
            )
    # Sitting past an approval phase whose passage is not in the history at all.
    if workflow.has(task.phase) or task.phase == COMPLETE:
        passed = {
            r.from_phase for r in history if r.kind == "transition" and r.from_phase is not None
        }
        first = workflow.index(workflow.subtask_start) if task.parent is not None else 0
        for spec in workflow.earlier_phases(task.phase):
            if workflow.index(spec.name) < first:
                continue
            if spec.approval and spec.name not in passed:
                found.append(
                    Finding(
                        task.name,
                        FindingKind.UNAPPROVED_PASSAGE,
                        f"the task is at {task.phase} but never passed the {spec.name} gate",
                    )
                )
    return found


async def _code_findings(
    store: TaskStore, task: TaskRecord, history: list[TransitionRecord]
) -> list[Finding]:
    workflow = store.workflow
    marks = [(h.to_phase, h.version, h.git_fingerprint) for h in history]
    if not any(m[2] for m in marks):
        return []
    now = await fingerprint(task.workdir, exclude=task.folder)
    marks.append((None, None, now))  # type: ignore[arg-type]
    found: list[Finding] = []
    for (phase, version, before), (_, _, after) in itertools.pairwise(marks):
        if phase is None or not workflow.has(phase) or workflow.phase(phase).code_edits:
            continue
        if comparable(before, after) and before != after:
            found.append(
                Finding(
                    task.name,
                    FindingKind.CODE_CHANGE,
                    f"code in {task.workdir} changed while the task was in {phase} "
                    f"(from v{version}), which forbids code edits",
                )
            )
    return found


async def audit_task(store: TaskStore, task: TaskRecord) -> list[Finding]:
    """Every finding for one task."""
    task, violations = await store.validate(task.name)
    found = [Finding(task.name, FindingKind(v.kind.value), v.detail) for v in violations]
    history = await store.history(task.name)
    found += _history_findings(store.workflow, task, history)
    found += await _approval_findings(store, task, history)
    found += await _code_findings(store, task, history)
    return found


async def run_audit(
    store: TaskStore, *, tasks: list[str] | None = None, reason: str = "manual"
) -> AuditReport:
    """Audit every task (or the named ones) and record the run in the audit log."""
    records = await store.list_tasks()
    if tasks is not None:
        records = [t for t in records if t.name in tasks]
    findings: list[Finding] = []
    for task in records:
        findings += await audit_task(store, task)
    for finding in findings:
        await store.record_audit(
            "audit_finding", finding.kind.value, task=finding.task, detail=finding.detail
        )
    await store.record_audit(
        "audit_run",
        "clean" if not findings else f"{len(findings)} findings",
        detail=f"{reason}: {len(records)} tasks",
    )
    return AuditReport(tasks=len(records), findings=tuple(findings))

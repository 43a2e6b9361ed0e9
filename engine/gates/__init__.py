"""Phase gates and the autopilot driver (seed 003).

Front ends (the ``turnstile`` CLI, the Telegram bot) use :class:`Gates`::

    async with Database(settings.database) as db:
        gates = Gates(db, settings)
        handle = gates.start_autopilot("T", sink, tool="claude")   # resumes from the store
        result = await gates.approve("T", by=user_id, chat_id=c, update_id=u,
                                     expected_sha256=hash_shown)   # ApprovalResult
        result = await gates.reject("T", by=user_id, reason="...")
        groups = await gates.list_tasks()       # TaskGroup: parent + waves, awaiting first
        report = await gates.audit()            # AuditReport(findings=...)
        gates_to_refresh = await gates.pending_gates()   # GateRequest per open gate
        await handle.stop()

``approve``/``reject`` are safe from any process while a drive runs: the change is one
compare-and-set transaction; a drive in the same process (same :class:`Gates`) wakes at
once, a drive in another process notices on its next poll (``poll_interval``, 1 s).
Refusals are :class:`ApprovalResult` values with a :class:`Refusal` reason, never
exceptions. See ``docs/gates.md``.
"""

from engine.gates.audit import AuditReport, Finding, FindingKind, run_audit
from engine.gates.autopilot import Autopilot, DriveHandle, DriveOutcome, next_step
from engine.gates.decomposition import SubtaskDecl, parse_decomposition
from engine.gates.listing import TaskGroup, group_tasks, render_groups
from engine.gates.refusals import EXIT_AUDIT_FINDINGS, EXIT_VIOLATIONS, GateRefused, Refusal
from engine.gates.service import Gates, workflow_from_settings
from engine.gates.tasks import (
    ApprovalOutcome,
    ApprovalRecord,
    ApprovalResult,
    AuditEvent,
    GatePolicy,
    TaskRecord,
    TaskStore,
    TransitionRecord,
)
from engine.gates.workflow import (
    AWAITING_APPROVAL,
    COMPLETE,
    HUMAN_INTERVENTION,
    PhaseSpec,
    Workflow,
    WorkflowError,
    load_workflow,
)

__all__ = [
    "AWAITING_APPROVAL",
    "COMPLETE",
    "EXIT_AUDIT_FINDINGS",
    "EXIT_VIOLATIONS",
    "HUMAN_INTERVENTION",
    "ApprovalOutcome",
    "ApprovalRecord",
    "ApprovalResult",
    "AuditEvent",
    "AuditReport",
    "Autopilot",
    "DriveHandle",
    "DriveOutcome",
    "Finding",
    "FindingKind",
    "GatePolicy",
    "GateRefused",
    "Gates",
    "PhaseSpec",
    "Refusal",
    "SubtaskDecl",
    "TaskGroup",
    "TaskRecord",
    "TaskStore",
    "TransitionRecord",
    "Workflow",
    "WorkflowError",
    "group_tasks",
    "load_workflow",
    "next_step",
    "parse_decomposition",
    "render_groups",
    "run_audit",
    "workflow_from_settings",
]

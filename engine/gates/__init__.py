"""Phase gates and the autopilot driver (seed 003).

Front ends (the ``turnstile`` CLI, the Telegram bot) use :class:`Gates`::

    async with open_database(settings) as db:     # a SQLite file or PostgreSQL
        gates = Gates(db, settings)                 # its gate store: SqlGateStore(db)
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

# The names below load on first use (PEP 562): `turnstile status --list` imports only the
# listing, not the driver and its agents.
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.gates.audit import AuditReport, Finding, FindingKind, run_audit
    from engine.gates.autopilot import Autopilot, DriveHandle, DriveOutcome, next_step
    from engine.gates.decomposition import SubtaskDecl, parse_decomposition
    from engine.gates.listing import ListEntry, TaskGroup, group_tasks, render_groups
    from engine.gates.policy import GatePolicy
    from engine.gates.records import (
        ApprovalOutcome,
        ApprovalRecord,
        ApprovalResult,
        AuditEvent,
        TaskRecord,
        TransitionRecord,
    )
    from engine.gates.refusals import EXIT_AUDIT_FINDINGS, EXIT_VIOLATIONS, GateRefused, Refusal
    from engine.gates.service import Gates, workflow_from_settings
    from engine.gates.store import GateStore, SqlGateStore
    from engine.gates.tasks import TaskStore
    from engine.gates.workflow import (
        AWAITING_APPROVAL,
        COMPLETE,
        HUMAN_INTERVENTION,
        PhaseSpec,
        Workflow,
        WorkflowError,
        load_workflow,
    )

_EXPORTS = {
    "AuditReport": "engine.gates.audit",
    "Finding": "engine.gates.audit",
    "FindingKind": "engine.gates.audit",
    "run_audit": "engine.gates.audit",
    "Autopilot": "engine.gates.autopilot",
    "DriveHandle": "engine.gates.autopilot",
    "DriveOutcome": "engine.gates.autopilot",
    "next_step": "engine.gates.autopilot",
    "SubtaskDecl": "engine.gates.decomposition",
    "parse_decomposition": "engine.gates.decomposition",
    "ListEntry": "engine.gates.listing",
    "TaskGroup": "engine.gates.listing",
    "group_tasks": "engine.gates.listing",
    "render_groups": "engine.gates.listing",
    "EXIT_AUDIT_FINDINGS": "engine.gates.refusals",
    "EXIT_VIOLATIONS": "engine.gates.refusals",
    "GateRefused": "engine.gates.refusals",
    "Refusal": "engine.gates.refusals",
    "Gates": "engine.gates.service",
    "workflow_from_settings": "engine.gates.service",
    "ApprovalOutcome": "engine.gates.records",
    "ApprovalRecord": "engine.gates.records",
    "ApprovalResult": "engine.gates.records",
    "AuditEvent": "engine.gates.records",
    "GatePolicy": "engine.gates.policy",
    "GateStore": "engine.gates.store",
    "SqlGateStore": "engine.gates.store",
    "TaskRecord": "engine.gates.records",
    "TaskStore": "engine.gates.tasks",
    "TransitionRecord": "engine.gates.records",
    "AWAITING_APPROVAL": "engine.gates.workflow",
    "COMPLETE": "engine.gates.workflow",
    "HUMAN_INTERVENTION": "engine.gates.workflow",
    "PhaseSpec": "engine.gates.workflow",
    "Workflow": "engine.gates.workflow",
    "WorkflowError": "engine.gates.workflow",
    "load_workflow": "engine.gates.workflow",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.gates' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
    "GateStore",
    "Gates",
    "ListEntry",
    "PhaseSpec",
    "Refusal",
    "SqlGateStore",
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

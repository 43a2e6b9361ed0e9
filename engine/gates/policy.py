"""The approval rules as pure functions: who may decide a gate, whether it is still open,
what an approval counts for, and whether an existing task may stand for a planned sub-task.

Like :mod:`engine.gates.machine`, nothing here reads a file or the database: the
gatekeeper (:mod:`engine.gates.tasks`) gathers the facts, asks, and applies the answer. A
refusal is ``(Refusal, detail)``; None means allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.gates.artifacts import DEFAULT_MAX_BYTES
from engine.gates.decomposition import SubtaskDecl
from engine.gates.records import ApprovalOutcome, TaskRecord
from engine.gates.refusals import Refusal
from engine.gates.workflow import HUMAN_INTERVENTION, Workflow
from engine.settings import Settings

__all__ = [
    "GatePolicy",
    "Verdict",
    "approval_outcome",
    "approver_refusal",
    "artifact_too_large",
    "gate_expired",
    "norm_actor",
    "open_gate_refusal",
    "reject_refusal",
    "subtask_clash",
]

#: Why not, or None when allowed.
Verdict = tuple[Refusal, str] | None


@dataclass(frozen=True, slots=True)
class GatePolicy:
    """Who may approve, how many approvals a gate needs, how long it stays open, and how
    large an artifact it stores for people to review."""

    approvers: frozenset[str] = frozenset()
    quorum: int = 1
    expiry_seconds: float | None = None
    forbid_self_approval: bool = False
    artifact_max_bytes: int = DEFAULT_MAX_BYTES

    @classmethod
    def from_settings(cls, settings: Settings) -> GatePolicy:
        # An admin holds every role, approving included (self-approval rules still apply).
        return cls(
            approvers=frozenset(str(i) for i in (*settings.approvers, *settings.admins)),
            quorum=settings.approval_quorum,
            expiry_seconds=settings.approval_expiry_seconds,
            forbid_self_approval=settings.forbid_self_approval,
            artifact_max_bytes=settings.artifact_max_bytes,
        )


def norm_actor(by: str | int) -> str:
    """A user id as the store keeps it: text, trimmed, at most 64 characters."""
    return str(by).strip()[:64]


def _not_approver(policy: GatePolicy, actor: str) -> Verdict:
    if actor not in policy.approvers:
        return Refusal.NOT_APPROVER, f"user {actor!r} is not an approver (TURNSTILE_APPROVERS)"
    return None


def approver_refusal(policy: GatePolicy, task: TaskRecord, actor: str) -> Verdict:
    """Whether ``actor`` may approve ``task``'s gates at all."""
    refused = _not_approver(policy, actor)
    if refused is None and policy.forbid_self_approval and task.started_by == actor:
        refused = (
            Refusal.SELF_APPROVAL,
            f"user {actor!r} started {task.name} and may not approve its gates",
        )
    return refused


def gate_expired(policy: GatePolicy, task: TaskRecord, now: float) -> bool:
    """The gate has been open longer than the policy allows."""
    return (
        policy.expiry_seconds is not None
        and task.gate_opened_at is not None
        and now - task.gate_opened_at > policy.expiry_seconds
    )


def open_gate_refusal(
    policy: GatePolicy, task: TaskRecord, now: float, expected_sha256: str | None
) -> Verdict:
    """Whether ``task`` has a gate open for approval, unexpired, showing the hash the
    approver saw (``expected_sha256``, full or at least 8 hex characters; None: not given)."""
    if not task.awaiting_approval or task.gate_sha256 is None:
        return Refusal.NOT_AWAITING, f"{task.name} is at {task.label}, no gate is open"
    if gate_expired(policy, task, now):
        assert task.gate_opened_at is not None
        assert policy.expiry_seconds is not None
        return (
            Refusal.EXPIRED,
            f"the gate of {task.phase} opened {now - task.gate_opened_at:.0f}s "
            f"ago and expired after {policy.expiry_seconds:.0f}s",
        )
    if expected_sha256 is not None:
        want = expected_sha256.strip().lower()
        if len(want) < 8 or not task.gate_sha256.startswith(want):
            return (
                Refusal.STALE_APPROVAL,
                f"you approved {want[:12]!r} but the gate now shows {task.gate_sha256[:12]}",
            )
    return None


def artifact_too_large(policy: GatePolicy, artifact: str, size: int) -> str | None:
    """Why ``artifact`` of ``size`` bytes may not be stored for its gate, or None."""
    limit = policy.artifact_max_bytes
    if size <= limit:
        return None
    return (
        f"{artifact} is {_size(size)}, larger than the {_size(limit)} a gate keeps for "
        f"review (TURNSTILE_ARTIFACT_MAX_BYTES={limit}): make it shorter"
    )


def _size(n: int) -> str:
    if n >= 1024 * 1024:
        return f"{n / (1024 * 1024):.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} bytes"


def approval_outcome(*, fresh: bool, approvers: int, quorum: int) -> ApprovalOutcome:
    """What one approval did: ``fresh`` (not this person's second approval of the hash),
    ``approvers`` (distinct approvers of the hash, this one included)."""
    if not fresh:
        return ApprovalOutcome.ALREADY_APPROVED
    return ApprovalOutcome.APPROVED if approvers >= quorum else ApprovalOutcome.RECORDED


def reject_refusal(
    policy: GatePolicy, task: TaskRecord, actor: str, reason: str, approvers: int
) -> Verdict:
    """Whether ``actor`` may reject ``task``'s open gate now, with ``reason`` (stripped);
    ``approvers``: distinct approvers of the gate so far."""
    refused = _not_approver(policy, actor)
    if refused is not None:
        return refused
    if not task.awaiting_approval:
        return Refusal.NOT_AWAITING, f"{task.name} is at {task.label}, no gate is open"
    if not reason:
        return Refusal.ILLEGAL_TRANSITION, "a rejection needs a reason"
    if approvers >= policy.quorum:
        # Decided (and, for a decomposition, its sub-tasks exist): too late.
        return (
            Refusal.NOT_AWAITING,
            f"the {task.phase} gate of {task.name} is already approved; move the task to "
            f"{HUMAN_INTERVENTION} instead",
        )
    return None


def subtask_clash(
    workflow: Workflow, task: TaskRecord, decl: SubtaskDecl, existing: TaskRecord
) -> str | None:
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
    untouched = existing.version == 1 and existing.phase == workflow.subtask_start
    if not untouched or existing.wave != decl.wave:
        return (
            f"{where} clashes with the existing sub-task {existing.name!r} (wave "
            f"{existing.wave}, at {existing.label}): rename the sub-task"
        )
    return None

"""What the gate store hands out: tasks, history rows, approvals, sessions, outcomes.

Plain frozen values, shared by the store (:mod:`engine.gates.store`), the approval policy
(:mod:`engine.gates.policy`), the folder side (:mod:`engine.gates.taskfolder`) and the
gatekeeper (:mod:`engine.gates.tasks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from engine.gates.refusals import Refusal
from engine.gates.workflow import AWAITING_APPROVAL, COMPLETE, HUMAN_INTERVENTION
from engine.runs.spec import PlaceId
from engine.store.audit import AuditRecord

__all__ = [
    "MAX_REASON",
    "ApprovalOutcome",
    "ApprovalRecord",
    "ApprovalResult",
    "AuditEvent",
    "SessionRecord",
    "TaskRecord",
    "TransitionRecord",
]

#: Reasons and revision notes longer than this are cut.
MAX_REASON = 4000


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
    def from_row(cls, row: Mapping[str, Any] | Any) -> TaskRecord:
        """From a row that answers by column name (either backend's)."""
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
    chat_id: PlaceId | None
    update_id: int | None
    at: float

    def __post_init__(self) -> None:
        # (text, whatever the database driver hands back)
        if self.chat_id is not None:
            object.__setattr__(self, "chat_id", str(self.chat_id))


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

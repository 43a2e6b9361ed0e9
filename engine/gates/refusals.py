"""Why a gate request was refused, and the exit code ``turnstile status`` returns for it."""

from __future__ import annotations

from enum import StrEnum

from engine.errors import TurnstileError

__all__ = ["EXIT_AUDIT_FINDINGS", "EXIT_VIOLATIONS", "GateRefused", "Refusal"]


class Refusal(StrEnum):
    """A refusal reason; each has its own documented exit code (see :attr:`exit_code`)."""

    UNKNOWN_TASK = "unknown_task"
    UNKNOWN_PHASE = "unknown_phase"
    ILLEGAL_TRANSITION = "illegal_transition"
    MISSING_ARTIFACT = "missing_artifact"
    FORBIDDEN_ARTIFACTS = "forbidden_artifacts"
    NOT_APPROVED = "awaiting_approval_without_approval"
    STALE_APPROVAL = "stale_approval"
    NOT_APPROVER = "not_an_approver"
    SELF_APPROVAL = "self_approval"
    EXPIRED = "approval_expired"
    CONFLICT = "concurrent_change"
    NOT_AWAITING = "not_awaiting_approval"
    INVALID_ARTIFACT = "invalid_artifact"
    TASK_EXISTS = "task_exists"
    INVALID_NAME = "invalid_name"

    @property
    def exit_code(self) -> int:
        return _EXIT_CODES[self]


_EXIT_CODES = {
    Refusal.UNKNOWN_TASK: 10,
    Refusal.UNKNOWN_PHASE: 11,
    Refusal.ILLEGAL_TRANSITION: 12,
    Refusal.MISSING_ARTIFACT: 13,
    Refusal.FORBIDDEN_ARTIFACTS: 14,
    Refusal.NOT_APPROVED: 15,
    Refusal.STALE_APPROVAL: 16,
    Refusal.NOT_APPROVER: 17,
    Refusal.SELF_APPROVAL: 18,
    Refusal.EXPIRED: 19,
    Refusal.CONFLICT: 20,
    Refusal.NOT_AWAITING: 21,
    Refusal.INVALID_ARTIFACT: 22,
    Refusal.TASK_EXISTS: 23,
    Refusal.INVALID_NAME: 24,
}
#: ``--validate-folder`` found violations.
EXIT_VIOLATIONS = 25
#: ``--audit`` found problems.
EXIT_AUDIT_FINDINGS = 26


class GateRefused(TurnstileError):
    """A request against a gated task was refused; nothing changed (unless ``detail`` says
    the gate was re-opened).

    Attributes:
        reason: the refusal reason (maps to an exit code).
        task: the task, when known.
        line: a line number in the artifact, for parse errors.
    """

    def __init__(
        self, reason: Refusal, message: str, *, task: str | None = None, line: int | None = None
    ) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.task = task
        self.line = line
        self.detail = message

"""The gate rules as a pure function: (state, request, facts) → refusal or None.

The store gathers the facts (folder contents, artifact hash, approvals) and applies the
change; this module only decides. States are ``(phase, sub_state)`` with ``sub_state``
None or ``awaiting_approval``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.gates.refusals import GateRefused, Refusal
from engine.gates.workflow import (
    AWAITING_APPROVAL,
    COMPLETE,
    HUMAN_INTERVENTION,
    Workflow,
)

__all__ = ["Facts", "Target", "check_transition", "parse_target"]


@dataclass(frozen=True, slots=True)
class Target:
    phase: str
    sub_state: str | None = None

    def __str__(self) -> str:
        return f"{self.phase}:{self.sub_state}" if self.sub_state else self.phase


@dataclass(frozen=True, slots=True)
class Facts:
    """What the store found, for the current phase's rules.

    Attributes:
        artifact_sha256: current hash of the phase's artifact (None: missing).
        blocked: forbidden or later-phase artifacts present.
        gate_sha256: the hash the open gate shows (None when no gate is open).
        approvals: distinct approvals of the open gate bound to ``gate_sha256``.
        quorum: approvals needed.
        return_phase: the phase a task in human_intervention came from.
        artifact_error: why the artifact is unacceptable (a parse error; or it was refused
            unread, ``artifact_sha256`` then None), if it is.
    """

    artifact_sha256: str | None = None
    blocked: tuple[str, ...] = ()
    gate_sha256: str | None = None
    approvals: int = 0
    quorum: int = 1
    return_phase: str | None = None
    artifact_error: str | None = None


def parse_target(workflow: Workflow, text: str) -> Target:
    """``PHASE`` or ``PHASE:awaiting_approval``.

    Raises:
        GateRefused: ``unknown_phase``.
    """
    phase, sep, sub = text.partition(":")
    if not workflow.is_state(phase):
        raise GateRefused(
            Refusal.UNKNOWN_PHASE,
            f"unknown phase {phase!r} (phases: {', '.join(workflow.names)}, "
            f"{COMPLETE}, {HUMAN_INTERVENTION})",
        )
    if sep and sub != AWAITING_APPROVAL:
        raise GateRefused(
            Refusal.UNKNOWN_PHASE, f"unknown sub-state {sub!r} (only {AWAITING_APPROVAL})"
        )
    return Target(phase, AWAITING_APPROVAL if sep else None)


def check_transition(
    workflow: Workflow, phase: str, sub_state: str | None, target: Target, facts: Facts
) -> tuple[Refusal, str] | None:
    """None when moving from ``(phase, sub_state)`` to ``target`` is allowed, else why not."""
    here = f"{phase}:{sub_state}" if sub_state else phase
    if not workflow.is_state(target.phase):
        return Refusal.UNKNOWN_PHASE, f"unknown phase {target.phase!r}"
    if phase == COMPLETE:
        return Refusal.ILLEGAL_TRANSITION, "the task is complete"
    if target.phase == HUMAN_INTERVENTION:
        if target.sub_state is not None or phase == HUMAN_INTERVENTION:
            return Refusal.ILLEGAL_TRANSITION, f"{here} → {target} is not a transition"
        return None
    if phase == HUMAN_INTERVENTION:
        origin = facts.return_phase or workflow.first
        if not workflow.has(origin):
            origin = workflow.names[-1]  # it left a phase the workflow no longer has
        if (
            target.sub_state is None
            and workflow.has(target.phase)
            and workflow.index(target.phase) <= workflow.index(origin)
        ):
            return None
        return (
            Refusal.ILLEGAL_TRANSITION,
            f"from {HUMAN_INTERVENTION} a task goes back to {origin} or an earlier phase",
        )
    if not workflow.has(phase):
        return (
            Refusal.UNKNOWN_PHASE,
            f"the task is at {phase!r}, which the workflow no longer has: move it to "
            f"{HUMAN_INTERVENTION}",
        )
    spec = workflow.phase(phase)
    if target.sub_state == AWAITING_APPROVAL:
        if target.phase != phase or sub_state is not None:
            return Refusal.ILLEGAL_TRANSITION, f"{here} → {target} is not a transition"
        if not spec.approval:
            return Refusal.ILLEGAL_TRANSITION, f"phase {phase} does not need approval"
        return _artifact_checks(spec.artifact, phase, facts)
    if target.phase != spec.next:
        return (
            Refusal.ILLEGAL_TRANSITION,
            f"{here} → {target} is not allowed: the next phase is {spec.next}",
        )
    refused = _artifact_checks(spec.artifact, phase, facts)
    if refused is not None:
        return refused
    if not spec.approval:
        return None
    if sub_state != AWAITING_APPROVAL:
        return (
            Refusal.NOT_APPROVED,
            f"{phase} needs approval: move to {phase}:{AWAITING_APPROVAL} first",
        )
    if facts.gate_sha256 is None or facts.artifact_sha256 != facts.gate_sha256:
        return (
            Refusal.STALE_APPROVAL,
            f"{spec.artifact} changed since the gate opened "
            f"(gate {str(facts.gate_sha256)[:12]}, now {str(facts.artifact_sha256)[:12]})",
        )
    if facts.approvals < facts.quorum:
        return (
            Refusal.NOT_APPROVED,
            f"{phase} is awaiting approval: {facts.approvals} of {facts.quorum} approvals "
            f"for {facts.gate_sha256[:12]}",
        )
    return None


def _artifact_checks(artifact: str, phase: str, facts: Facts) -> tuple[Refusal, str] | None:
    if facts.blocked:
        return (
            Refusal.FORBIDDEN_ARTIFACTS,
            f"forbidden in {phase}: {', '.join(facts.blocked)}",
        )
    # Before "missing": an artifact that was refused unread (a link out of the folder, a
    # pipe) has no hash but must be named as what it is.
    if facts.artifact_error is not None:
        return Refusal.INVALID_ARTIFACT, facts.artifact_error
    if facts.artifact_sha256 is None:
        return Refusal.MISSING_ARTIFACT, f"{phase} must produce {artifact}"
    return None

"""The approval rules as pure functions: no database, no folder."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from engine.gates import AWAITING_APPROVAL, Refusal, load_workflow
from engine.gates.decomposition import SubtaskDecl
from engine.gates.policy import (
    GatePolicy,
    approval_outcome,
    approver_refusal,
    gate_expired,
    norm_actor,
    open_gate_refusal,
    reject_refusal,
    subtask_clash,
)
from engine.gates.records import ApprovalOutcome, TaskRecord

WF = load_workflow()
SHA = "ab" * 32
POLICY = GatePolicy(approvers=frozenset({"42", "43"}), quorum=2, expiry_seconds=60.0)
GATE = TaskRecord(
    name="t",
    folder=Path("/t"),
    workdir=Path("/t"),
    phase="research",
    sub_state=AWAITING_APPROVAL,
    version=2,
    parent=None,
    wave=None,
    summary=None,
    started_by="42",
    gate_round=1,
    gate_sha256=SHA,
    gate_opened_at=1000.0,
    return_phase=None,
    revision_notes=None,
    created_at=1.0,
    updated_at=1.0,
)


def _reason(verdict: tuple[Refusal, str] | None) -> Refusal | None:
    return None if verdict is None else verdict[0]


def test_who_may_approve() -> None:
    assert approver_refusal(POLICY, GATE, "43") is None
    assert _reason(approver_refusal(POLICY, GATE, "99")) is Refusal.NOT_APPROVER
    assert approver_refusal(POLICY, GATE, "42") is None  # self-approval allowed by default
    strict = replace(POLICY, forbid_self_approval=True)
    assert _reason(approver_refusal(strict, GATE, "42")) is Refusal.SELF_APPROVAL
    assert _reason(approver_refusal(strict, GATE, "99")) is Refusal.NOT_APPROVER


@pytest.mark.parametrize(
    ("task", "now", "expected", "reason"),
    [
        (GATE, 1030.0, None, None),
        (GATE, 1030.0, SHA[:8], None),
        (GATE, 1030.0, SHA.upper(), None),
        (GATE, 1061.0, None, Refusal.EXPIRED),
        (GATE, 1030.0, SHA[:7], Refusal.STALE_APPROVAL),  # too short to bind
        (GATE, 1030.0, "cd" * 32, Refusal.STALE_APPROVAL),
        (replace(GATE, sub_state=None), 1030.0, None, Refusal.NOT_AWAITING),
        (replace(GATE, gate_sha256=None), 1030.0, None, Refusal.NOT_AWAITING),
    ],
)
def test_is_the_gate_open_for_this_approval(
    task: TaskRecord, now: float, expected: str | None, reason: Refusal | None
) -> None:
    assert _reason(open_gate_refusal(POLICY, task, now, expected)) is reason


def test_expiry_needs_a_limit_and_an_opening_time() -> None:
    assert gate_expired(POLICY, GATE, 1061.0)
    assert not gate_expired(POLICY, GATE, 1060.0)
    assert not gate_expired(replace(POLICY, expiry_seconds=None), GATE, 10**9)
    assert not gate_expired(POLICY, replace(GATE, gate_opened_at=None), 10**9)


def test_what_an_approval_counts_for() -> None:
    assert approval_outcome(fresh=True, approvers=1, quorum=2) is ApprovalOutcome.RECORDED
    assert approval_outcome(fresh=True, approvers=2, quorum=2) is ApprovalOutcome.APPROVED
    assert approval_outcome(fresh=False, approvers=2, quorum=2) is (
        ApprovalOutcome.ALREADY_APPROVED
    )


def test_who_may_reject_and_when() -> None:
    assert reject_refusal(POLICY, GATE, "43", "redo", approvers=1) is None
    assert _reason(reject_refusal(POLICY, GATE, "99", "redo", 0)) is Refusal.NOT_APPROVER
    assert _reason(reject_refusal(POLICY, GATE, "43", "", 0)) is Refusal.ILLEGAL_TRANSITION
    decided = reject_refusal(POLICY, GATE, "43", "redo", approvers=2)
    assert _reason(decided) is Refusal.NOT_AWAITING
    assert decided is not None
    assert "already approved" in decided[1]
    closed = replace(GATE, sub_state=None)
    assert _reason(reject_refusal(POLICY, closed, "43", "redo", 0)) is Refusal.NOT_AWAITING


def test_actor_ids_are_trimmed_text() -> None:
    assert norm_actor(42) == "42"
    assert norm_actor("  7 ") == "7"
    assert norm_actor("x" * 100) == "x" * 64


def test_an_existing_task_stands_for_a_sub_task_only_when_untouched() -> None:
    parent = replace(GATE, phase="decomposition")
    decl = SubtaskDecl(name="a", wave=1, summary="", line=3)
    untouched = replace(
        GATE,
        name="t.a",
        parent="t",
        wave=1,
        version=1,
        phase=WF.subtask_start,
        sub_state=None,
    )
    assert subtask_clash(WF, parent, decl, untouched) is None
    moved = subtask_clash(WF, parent, decl, replace(untouched, version=2))
    assert moved is not None
    assert "line 3" in moved
    assert subtask_clash(WF, parent, decl, replace(untouched, wave=2)) is not None
    stranger = subtask_clash(WF, parent, decl, replace(untouched, parent=None, wave=None))
    assert stranger is not None
    assert "not a sub-task of t" in stranger

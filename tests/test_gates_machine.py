"""Every (state, request) pair of the default workflow against a hand-written table."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.gates import (
    AWAITING_APPROVAL,
    COMPLETE,
    HUMAN_INTERVENTION,
    ApprovalOutcome,
    Gates,
    Refusal,
    load_workflow,
)
from engine.gates.machine import Facts, Target, check_transition, parse_target
from engine.gates.refusals import GateRefused
from tests.gates_support import make_settings, open_gates

WF = load_workflow()
A = AWAITING_APPROVAL
HI = HUMAN_INTERVENTION

# The only legal moves when the folder is right (artifact present, nothing forbidden,
# the gate approved for the current hash). Everything else must be refused.
LEGAL: dict[tuple[str, str | None], set[tuple[str, str | None]]] = {
    ("research", None): {("research", A), (HI, None)},
    ("research", A): {("decomposition", None), (HI, None)},
    ("decomposition", None): {("decomposition", A), (HI, None)},
    ("decomposition", A): {("design", None), (HI, None)},
    ("design", None): {("design", A), (HI, None)},
    ("design", A): {("test_design", None), (HI, None)},
    ("test_design", None): {("test_design", A), (HI, None)},
    ("test_design", A): {("implement", None), (HI, None)},
    ("implement", None): {("bug_find", None), (HI, None)},
    ("bug_find", None): {("adversarial_bug_find", None), (HI, None)},
    ("adversarial_bug_find", None): {("doc_review", None), (HI, None)},
    ("doc_review", None): {("referee", None), (HI, None)},
    ("referee", None): {(COMPLETE, None), (HI, None)},
    (COMPLETE, None): set(),
    # From human_intervention: back to the phase it left (test_design here) or earlier.
    (HI, None): {
        ("research", None),
        ("decomposition", None),
        ("design", None),
        ("test_design", None),
    },
}
STATES = list(LEGAL)
TARGETS = [(p, s) for p in (*WF.names, COMPLETE, HI) for s in (None, A)]
GOOD = Facts(
    artifact_sha256="a" * 64,
    gate_sha256="a" * 64,
    approvals=1,
    quorum=1,
    return_phase="test_design",
)


def _skips_gate(state: tuple[str, str | None], target: tuple[str, str | None]) -> bool:
    phase, sub = state
    return sub is None and phase in WF.approval_phases() and target == (WF.phase(phase).next, None)


@pytest.mark.parametrize("state", STATES, ids=lambda s: f"{s[0]}:{s[1]}")
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}:{t[1]}")
def test_every_pair(state: tuple[str, str | None], target: tuple[str, str | None]) -> None:
    refused = check_transition(WF, state[0], state[1], Target(*target), GOOD)
    if target in LEGAL[state]:
        assert refused is None
    elif _skips_gate(state, target):
        # Skipping the gate of an approval phase: refused as "awaiting approval without
        # approval", the reason the seed names.
        assert refused is not None
        assert refused[0] is Refusal.NOT_APPROVED
    else:
        assert refused is not None
        assert refused[0] is Refusal.ILLEGAL_TRANSITION


def _next_of(state: tuple[str, str | None]) -> Target:
    phase, sub = state
    spec = WF.phase(phase)
    if spec.approval and sub is None:
        return Target(phase, A)
    return Target(spec.next)


FORWARD = [s for s in STATES if s[0] in WF.names]


@pytest.mark.parametrize("state", FORWARD, ids=lambda s: f"{s[0]}:{s[1]}")
def test_missing_artifact(state: tuple[str, str | None]) -> None:
    facts = Facts(gate_sha256="a" * 64, approvals=1)
    refused = check_transition(WF, *state, _next_of(state), facts)
    assert refused is not None
    assert refused[0] is Refusal.MISSING_ARTIFACT


@pytest.mark.parametrize("state", FORWARD, ids=lambda s: f"{s[0]}:{s[1]}")
def test_forbidden_artifacts(state: tuple[str, str | None]) -> None:
    facts = Facts(
        artifact_sha256="a" * 64, gate_sha256="a" * 64, approvals=1, blocked=("referee.md",)
    )
    refused = check_transition(WF, *state, _next_of(state), facts)
    assert refused is not None
    assert refused[0] is Refusal.FORBIDDEN_ARTIFACTS
    assert "referee.md" in refused[1]


@pytest.mark.parametrize("phase", WF.approval_phases())
def test_approval_phase_without_approval(phase: str) -> None:
    nxt = Target(WF.phase(phase).next)
    no_gate = check_transition(WF, phase, None, nxt, GOOD)
    assert no_gate is not None
    assert no_gate[0] is Refusal.NOT_APPROVED
    facts = Facts(artifact_sha256="a" * 64, gate_sha256="a" * 64, approvals=0)
    unapproved = check_transition(WF, phase, A, nxt, facts)
    assert unapproved is not None
    assert unapproved[0] is Refusal.NOT_APPROVED
    short = Facts(artifact_sha256="a" * 64, gate_sha256="a" * 64, approvals=1, quorum=2)
    below = check_transition(WF, phase, A, nxt, short)
    assert below is not None
    assert below[0] is Refusal.NOT_APPROVED


@pytest.mark.parametrize("phase", WF.approval_phases())
def test_stale_approval(phase: str) -> None:
    facts = Facts(artifact_sha256="b" * 64, gate_sha256="a" * 64, approvals=1)
    refused = check_transition(WF, phase, A, Target(WF.phase(phase).next), facts)
    assert refused is not None
    assert refused[0] is Refusal.STALE_APPROVAL


def test_invalid_artifact_refused() -> None:
    facts = Facts(artifact_sha256="a" * 64, artifact_error="line 3: bad")
    refused = check_transition(WF, "decomposition", None, Target("decomposition", A), facts)
    assert refused == (Refusal.INVALID_ARTIFACT, "line 3: bad")


@pytest.mark.parametrize(
    "text", ["nonsense", "research:approved", "complete:x", "Research", "", ":awaiting_approval"]
)
def test_unknown_phase(text: str) -> None:
    with pytest.raises(GateRefused) as info:
        parse_target(WF, text)
    assert info.value.reason is Refusal.UNKNOWN_PHASE


def test_parse_target() -> None:
    assert parse_target(WF, "design") == Target("design")
    assert parse_target(WF, "design:awaiting_approval") == Target("design", A)


def test_exit_codes_are_distinct() -> None:
    codes = [r.exit_code for r in Refusal]
    assert len(set(codes)) == len(codes)
    assert all(10 <= c < 25 for c in codes)


# -- approve and reject in every state, on the real store ------------------------------

STORE_STATES = [
    *[(p, None) for p in WF.names],
    *[(p, A) for p in WF.approval_phases()],
    (COMPLETE, None),
    (HI, None),
]


async def _reach(gates: Gates, state: tuple[str, str | None]) -> None:
    """Walk a fresh task along the happy path to ``state``."""
    task = await gates.init_task("t")
    if state == (HI, None):
        await gates.store.transition("t", HI)
        return
    while (task.phase, task.sub_state) != state:
        spec = WF.phase(task.phase)
        (task.folder / spec.artifact).write_text("```subtasks\n```\n")
        if spec.approval and task.sub_state is None:
            task = await gates.store.transition("t", f"{spec.name}:{A}")
            continue
        if spec.approval:
            await gates.approve("t", by=42)
        task = await gates.store.transition("t", spec.next)


@pytest.mark.parametrize("state", STORE_STATES, ids=lambda s: f"{s[0]}:{s[1]}")
@pytest.mark.parametrize("request_", ["approve", "reject"])
async def test_approve_and_reject_in_every_state(
    tmp_path: Path, state: tuple[str, str | None], request_: str
) -> None:
    async with open_gates(make_settings(tmp_path), track_git=False) as gates:
        await _reach(gates, state)
        before = await gates.task("t")
        if request_ == "approve":
            result = await gates.approve("t", by=42)
            expected = ApprovalOutcome.APPROVED
        else:
            result = await gates.reject("t", by=42, reason="no")
            expected = ApprovalOutcome.REJECTED
        after = await gates.task("t")
        if state[1] == A:
            assert result.outcome is expected
            assert after.version == before.version + 1
        else:
            assert result.reason is Refusal.NOT_AWAITING
            assert after.version == before.version

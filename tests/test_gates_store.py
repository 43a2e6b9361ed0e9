"""The task store on a real SQLite file and a real PostgreSQL: transitions, approvals, history,
.state, audit."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from engine.gates import (
    AWAITING_APPROVAL,
    ApprovalOutcome,
    FindingKind,
    GateRefused,
    Refusal,
)
from engine.gates.folder import ViolationKind, validate_folder
from engine.gates.state_file import read_state
from engine.store.backend import open_database
from engine.testing import FakeClock
from tests.gates_support import (
    APPROVER,
    DECOMPOSITION_EMPTY,
    gate_backend,  # noqa: F401 - the fixture
    make_settings,
    open_gates,
)

pytestmark = pytest.mark.usefixtures("gate_backend")


async def _to_gate(gates: object, name: str = "t", text: str = "# research\n") -> Path:
    from engine.gates import Gates

    assert isinstance(gates, Gates)
    task = await gates.init_task(name, started_by=7)
    (task.folder / "research.md").write_text(text)
    await gates.store.transition(name, f"research:{AWAITING_APPROVAL}")
    return task.folder


async def test_init_creates_folder_state_and_history(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        task = await gates.init_task("alpha", summary="do it", started_by=7)
        assert task.phase == "research"
        assert task.version == 1
        assert task.folder == (tmp_path / "tasks" / "alpha").absolute()
        state = read_state(task.folder)
        assert state is not None
        assert state["phase"] == "research"
        assert state["version"] == 1
        history = await gates.store.history("alpha")
        assert [h.kind for h in history] == ["init"]
        with pytest.raises(GateRefused) as info:
            await gates.init_task("alpha")
        assert info.value.reason is Refusal.TASK_EXISTS


@pytest.mark.parametrize(
    "name", ["a/b", "..", "a..b", "x\x00y", "tab\tname", "new\nline", "", "-lead", "a" * 200]
)
async def test_bad_task_names_refused(tmp_path: Path, name: str) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        with pytest.raises(GateRefused) as info:
            await gates.init_task(name)
        assert info.value.reason is Refusal.INVALID_NAME
    assert not (tmp_path / "tasks").exists() or list((tmp_path / "tasks").iterdir()) == []


async def test_unknown_task_and_phase(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        with pytest.raises(GateRefused) as info:
            await gates.task("ghost")
        assert info.value.reason is Refusal.UNKNOWN_TASK
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("ghost", "design")
        assert info.value.reason is Refusal.UNKNOWN_TASK
        await gates.init_task("t")
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("t", "deploy")
        assert info.value.reason is Refusal.UNKNOWN_PHASE
        result = await gates.approve("ghost", by=APPROVER)
        assert result.reason is Refusal.UNKNOWN_TASK


async def test_approval_binds_to_hash_and_is_idempotent(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        await _to_gate(gates)
        task = await gates.task("t")
        assert task.gate_sha256 is not None
        first = await gates.approve("t", by=APPROVER, chat_id="-100", update_id=5)
        assert first.outcome is ApprovalOutcome.APPROVED
        assert first.sha256 == task.gate_sha256
        again = await gates.approve("t", by=APPROVER, chat_id="-100", update_id=6)
        assert again.outcome is ApprovalOutcome.ALREADY_APPROVED
        approvals = await gates.store.approvals("t")
        assert len(approvals) == 1
        assert approvals[0].update_id == 5
        # The idempotent repeat changed nothing: no version bump.
        assert (await gates.task("t")).version == task.version + 1
        moved = await gates.store.transition("t", "decomposition")
        assert moved.phase == "decomposition"
        history = await gates.store.history("t")
        assert [h.kind for h in history] == ["init", "gate", "approve", "transition"]
        assert history[-1].sha256 == task.gate_sha256
        events = await gates.audit_events("t")
        outcomes = [(e.event, e.outcome, e.update_id) for e in events if e.event == "approve"]
        assert outcomes == [("approve", "approved", 5), ("approve", "already_approved", 6)]


async def test_changed_artifact_voids_approval_and_reopens_gate(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        folder = await _to_gate(gates)
        old = (await gates.task("t")).gate_sha256
        assert (await gates.approve("t", by=APPROVER)).outcome is ApprovalOutcome.APPROVED
        (folder / "research.md").write_text("# research, edited after approval\n")
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("t", "decomposition")
        assert info.value.reason is Refusal.STALE_APPROVAL
        task = await gates.task("t")
        assert task.awaiting_approval
        assert task.gate_sha256 != old
        assert await gates.store.gate_approvals(task) == []
        # An approval of what the approver saw before is stale.
        stale = await gates.approve("t", by=APPROVER, expected_sha256=old)
        assert stale.reason is Refusal.STALE_APPROVAL
        fresh = await gates.approve("t", by=APPROVER, expected_sha256=task.gate_sha256[:12])
        assert fresh.outcome is ApprovalOutcome.APPROVED
        assert (await gates.store.transition("t", "decomposition")).phase == "decomposition"


async def test_artifact_changed_before_approve_reopens(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        folder = await _to_gate(gates)
        shown = (await gates.task("t")).gate_sha256
        (folder / "research.md").write_text("sneaky edit\n")
        result = await gates.approve("t", by=APPROVER)
        assert result.reason is Refusal.STALE_APPROVAL
        task = await gates.task("t")
        assert task.gate_sha256 != shown
        assert task.gate_round == 2


async def test_only_configured_approvers(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        await _to_gate(gates)
        refused = await gates.approve("t", by=999)
        assert refused.reason is Refusal.NOT_APPROVER
        rejected = await gates.reject("t", by=999, reason="no")
        assert rejected.reason is Refusal.NOT_APPROVER
        events = await gates.audit_events("t")
        assert {e.outcome for e in events if e.actor == "999"} == {"refused:not_an_approver"}
    async with open_gates(make_settings(tmp_path / "empty", approvers=())) as gates:
        await _to_gate(gates)
        nobody = await gates.approve("t", by=APPROVER)
        assert nobody.reason is Refusal.NOT_APPROVER


async def test_self_approval_ban(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, forbid_self_approval=True, approvers=(7, APPROVER))
    async with open_gates(settings) as gates:
        await _to_gate(gates)  # started by 7
        assert (await gates.approve("t", by=7)).reason is Refusal.SELF_APPROVAL
        assert (await gates.approve("t", by=APPROVER)).outcome is ApprovalOutcome.APPROVED


async def test_quorum_needs_distinct_approvers(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path, approval_quorum=2)) as gates:
        await _to_gate(gates)
        one = await gates.approve("t", by=APPROVER)
        assert one.outcome is ApprovalOutcome.RECORDED
        assert (await gates.approve("t", by=APPROVER)).outcome is ApprovalOutcome.ALREADY_APPROVED
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("t", "decomposition")
        assert info.value.reason is Refusal.NOT_APPROVED
        two = await gates.approve("t", by=43)
        assert two.outcome is ApprovalOutcome.APPROVED
        assert two.approvals == 2
        assert (await gates.store.transition("t", "decomposition")).phase == "decomposition"


async def test_expiry_fails_closed(tmp_path: Path) -> None:
    clock = FakeClock()
    settings = make_settings(tmp_path, approval_expiry_seconds=60)
    async with open_gates(settings, clock=clock) as gates:
        await _to_gate(gates)
        clock.advance(61)
        late = await gates.approve("t", by=APPROVER)
        assert late.reason is Refusal.EXPIRED
        assert "expired" in late.detail
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("t", "decomposition")
        assert info.value.reason is Refusal.NOT_APPROVED


async def test_reject_records_reason_and_reopens_the_phase(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        await _to_gate(gates)
        result = await gates.reject("t", by=APPROVER, reason="cite the sources", update_id=9)
        assert result.outcome is ApprovalOutcome.REJECTED
        task = await gates.task("t")
        assert task.label == "research"
        assert task.revision_notes == "cite the sources"
        history = await gates.store.history("t")
        assert history[-1].kind == "reject"
        assert history[-1].reason == "cite the sources"
        assert (await gates.reject("t", by=APPROVER, reason="x")).reason is Refusal.NOT_AWAITING
        assert (await gates.approve("t", by=APPROVER)).reason is Refusal.NOT_AWAITING
        # Re-opening the gate clears the notes and needs a fresh approval.
        await gates.store.transition("t", f"research:{AWAITING_APPROVAL}")
        assert (await gates.task("t")).revision_notes is None
        with pytest.raises(GateRefused):
            await gates.store.transition("t", "decomposition")


async def test_compare_and_set_refuses_a_stale_version(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        task = await gates.init_task("t")
        (task.folder / "research.md").write_text("r")
        with pytest.raises(GateRefused) as info:
            await gates.store.transition(
                "t", f"research:{AWAITING_APPROVAL}", expected_version=task.version + 1
            )
        assert info.value.reason is Refusal.CONFLICT
        moved = await gates.store.transition(
            "t", f"research:{AWAITING_APPROVAL}", expected_version=task.version
        )
        assert moved.version == task.version + 1


async def test_state_file_mirrors_store_and_hand_edits_are_detected(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        folder = await _to_gate(gates)
        await gates.approve("t", by=APPROVER)
        task = await gates.task("t")
        expected = await gates.store.expected_state(task)
        assert read_state(folder) == json.loads(json.dumps(expected))
        # An agent "skips" the gate by editing .state: detected, and never trusted.
        forged = dict(read_state(folder) or {})
        forged.update(phase="implement", sub_state=None)
        (folder / ".state").write_text(json.dumps(forged))
        violations = validate_folder(folder, gates.workflow, task.phase, None, expected)
        assert [v.kind for v in violations] == [ViolationKind.STATE_MISMATCH] * 2
        assert (await gates.task("t")).phase == "research"
        report = await gates.audit()
        assert {f.kind for f in report.findings} == {FindingKind.STATE_MISMATCH}
        (folder / ".state").write_text("{not json")
        violations = validate_folder(folder, gates.workflow, task.phase, None, expected)
        assert "not JSON" in violations[0].detail
        # The next committed change rewrites the mirror from the store.
        await gates.store.transition("t", "decomposition")
        assert (read_state(folder) or {})["phase"] == "decomposition"
        assert not list(folder.glob(".state.*.tmp"))


async def test_validate_reports_out_of_order_and_forbidden(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        task = await gates.init_task("t")
        (task.folder / "research.md").write_text("r")
        (task.folder / "design.md").write_text("skipping ahead")
        expected = await gates.store.expected_state(task)
        violations = validate_folder(task.folder, gates.workflow, "research", None, expected)
        assert [v.kind for v in violations] == [ViolationKind.OUT_OF_ORDER]
        assert "design.md" in violations[0].detail
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("t", f"research:{AWAITING_APPROVAL}")
        assert info.value.reason is Refusal.FORBIDDEN_ARTIFACTS


async def test_subtasks_have_their_state_file_when_the_approval_is_announced(
    tmp_path: Path,
) -> None:
    # A drive woken by the approval validates the new sub-tasks' folders at once: their
    # .state must be there by then (it was written after, and a wave's last sub-task was
    # now and then sent to a person for ".state is missing").
    async with open_gates(make_settings(tmp_path)) as gates:
        folder = await _to_gate(gates)
        await gates.approve("t", by=APPROVER)
        await gates.store.transition("t", "decomposition")
        (folder / "decomposition.md").write_text("```subtasks\nwave 1: a\nwave 1: b\n```\n")
        await gates.store.transition("t", f"decomposition:{AWAITING_APPROVAL}")
        seen: list[tuple[str, bool]] = []

        def announced(name: str) -> None:
            for short in ("a", "b"):
                sub = folder / "subtasks" / short
                seen.append((short, read_state(sub) is not None))

        remove = gates.store.add_listener(announced)
        try:
            result = await gates.approve("t", by=APPROVER)
        finally:
            remove()
        assert result.subtasks_created == ("t.a", "t.b")
        assert seen[:2] == [("a", True), ("b", True)]


async def test_malformed_decomposition_refused_with_line(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        folder = await _to_gate(gates)
        await gates.approve("t", by=APPROVER)
        await gates.store.transition("t", "decomposition")
        bad = "# D\n\n```subtasks\nwave 1: ok - fine\nwave one: broken\n```\n"
        (folder / "decomposition.md").write_text(bad)
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("t", f"decomposition:{AWAITING_APPROVAL}")
        assert info.value.reason is Refusal.INVALID_ARTIFACT
        assert "line 5" in info.value.detail
        (folder / "decomposition.md").write_text(DECOMPOSITION_EMPTY)
        await gates.store.transition("t", f"decomposition:{AWAITING_APPROVAL}")


async def test_subtasks_created_on_approval(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        folder = await _to_gate(gates)
        await gates.approve("t", by=APPROVER)
        await gates.store.transition("t", "decomposition")
        (folder / "decomposition.md").write_text(
            "```subtasks\nwave 1: a - first\nwave 1: b\nwave 2: c - last\n```\n"
        )
        await gates.store.transition("t", f"decomposition:{AWAITING_APPROVAL}")
        assert await gates.store.subtasks("t") == []
        result = await gates.approve("t", by=APPROVER)
        assert result.subtasks_created == ("t.a", "t.b", "t.c")
        subs = await gates.store.subtasks("t")
        assert [(s.name, s.wave, s.phase) for s in subs] == [
            ("t.a", 1, "design"),
            ("t.b", 1, "design"),
            ("t.c", 2, "design"),
        ]
        assert subs[0].summary == "first"
        for sub in subs:
            assert sub.folder == folder / "subtasks" / sub.name.split(".")[1]
            assert (read_state(sub.folder) or {})["task"] == sub.name
        groups = await gates.list_tasks()
        assert [g.name for g in groups] == ["t"]
        assert sorted(groups[0].waves) == [1, 2]


async def test_audit_flags_tampering(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    async with open_gates(settings) as gates:
        await gates.init_task("t")
        assert (await gates.audit()).clean
    # Someone edits the database behind the store's back: jumps past the research gate.
    async with open_database(settings) as db:
        await db.execute("UPDATE gate_tasks SET phase = 'design', version = 3 WHERE name = 't'")
    async with open_gates(settings) as gates:
        report = await gates.audit()
        kinds = {f.kind for f in report.findings}
        assert FindingKind.HISTORY_GAP in kinds
        assert FindingKind.UNAPPROVED_PASSAGE in kinds
        assert FindingKind.STATE_MISMATCH in kinds
        runs = [e for e in await gates.audit_events() if e.event == "audit_run"]
        assert runs[-1].outcome.endswith("findings")


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
    )


async def test_audit_flags_code_changes_in_research(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "app.py").write_text("print(1)\n")
    _git(repo, "add", "app.py")
    _git(repo, "commit", "-q", "-m", "init")
    settings = make_settings(tmp_path)
    async with open_gates(settings) as gates:
        task = await gates.init_task("t", folder=repo / "tasks" / "t", workdir=repo)
        (task.folder / "research.md").write_text("r")
        await gates.store.transition("t", f"research:{AWAITING_APPROVAL}")
        # Artifacts in the task folder are not code: still clean.
        assert (await gates.audit()).clean
        (repo / "app.py").write_text("print(2)\n")
        report = await gates.audit()
        assert [f.kind for f in report.findings] == [FindingKind.CODE_CHANGE]
        assert "research" in report.findings[0].detail


async def test_missing_folder_is_a_finding_and_not_recreated(tmp_path: Path) -> None:
    import shutil

    async with open_gates(make_settings(tmp_path)) as gates:
        task = await gates.init_task("t")
        shutil.rmtree(task.folder)
        report = await gates.audit()
        assert [f.kind for f in report.findings] == [FindingKind.FOLDER_MISSING]
        assert not task.folder.exists()


async def test_an_approved_gate_can_no_longer_be_rejected(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path, approval_quorum=2)) as gates:
        await _to_gate(gates)
        await gates.approve("t", by=APPROVER)
        await gates.approve("t", by=43)  # quorum of 2 reached
        late = await gates.reject("t", by=44, reason="no")
        assert late.reason is Refusal.NOT_AWAITING
        assert "already approved" in late.detail
        assert (await gates.task("t")).awaiting_approval


def test_listing_groups_by_parent_and_wave_gates_first() -> None:
    from engine.gates import ListEntry, group_tasks, render_groups

    def row(
        name: str,
        phase: str,
        parent: str | None = None,
        wave: int | None = None,
        sub: str | None = None,
    ) -> ListEntry:
        return ListEntry(name, phase, sub, 1, parent, wave, "ab" * 32 if sub else None, None, 0.0)

    rows = [
        row("b.x2", "design", "b", 2),
        row("a", "complete"),
        row("b", "design"),
        row("b.x1", "design", "b", 1, AWAITING_APPROVAL),
        row("b.x0", "implement", "b", 2),
        row("c", "research", sub=AWAITING_APPROVAL),
        row("orphan.s", "design", "orphan", 1),
    ]
    groups = group_tasks(rows)
    assert [g.name for g in groups] == ["b", "c", "a", "orphan"]
    assert {w: [t.name for t in ts] for w, ts in groups[0].waves.items()} == {
        1: ["b.x1"],
        2: ["b.x0", "b.x2"],
    }
    text = render_groups(groups)
    lines = text.splitlines()
    assert lines[0].startswith("b ")
    assert lines[1] == "  wave 1:"
    assert "b.x1" in lines[2]
    assert "gate abababababab" in lines[2]
    assert "orphan (parent not found)" in text
    assert render_groups([]) == "no tasks"

"""A Hypothesis state machine over transition / approve / reject / artifact change / restart.

Invariants after every step: never past an approval phase without an approval bound to the
artifact hash that was passed; the history is append-only; the version strictly increases
with every change; ``.state`` equals the store. It runs on a SQLite file and on a fresh
PostgreSQL database per example.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from engine.gates import (
    AWAITING_APPROVAL,
    COMPLETE,
    HUMAN_INTERVENTION,
    FindingKind,
    GateRefused,
    Gates,
    load_workflow,
)
from engine.gates.audit import audit_task
from engine.gates.hashing import sha256_file
from engine.gates.state_file import read_state
from engine.store.backend import AnyDatabase, open_database
from tests.gates_support import make_settings
from tests.pg_support import PgCluster

WF = load_workflow()
TARGETS = [
    *WF.names,
    *(f"{p}:{AWAITING_APPROVAL}" for p in WF.approval_phases()),
    COMPLETE,
    HUMAN_INTERVENTION,
]
CONTENTS = ["alpha\n", "beta\n", "```subtasks\n```\n"]
# The server the PostgreSQL run uses (set by its test while it runs).
_PG_CLUSTER: PgCluster | None = None


class GateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="gates-sm-"))
        self.loop = asyncio.new_event_loop()
        database: Path | str = self.tmp / "gates.db"
        self.pg_url: str | None = None
        if _PG_CLUSTER is not None:
            database = self.pg_url = _PG_CLUSTER.new_database()
        self.settings = make_settings(self.tmp, approvers=(42, 43), database=database)
        self.db: AnyDatabase | None = None
        self._open()
        task = self.run(self.gates.init_task("t"))
        self.folder = task.folder
        self.version = task.version
        self.history: list[Any] = self.run(self.gates.store.history("t"))

    # -- plumbing ----------------------------------------------------------------------

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def _open(self) -> None:
        # synchronous=OFF (SQLite): durability is not under test here, speed is welcome.
        self.db = open_database(self.settings, synchronous="OFF")
        self.run(self.db.open())
        self.gates = Gates(self.db, self.settings, track_git=False)

    def teardown(self) -> None:
        if self.db is not None:
            self.run(self.db.close())
        self.loop.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if _PG_CLUSTER is not None and self.pg_url is not None:
            _PG_CLUSTER.drop_database(self.pg_url)

    def task(self) -> Any:
        return self.run(self.gates.task("t"))

    # -- rules -------------------------------------------------------------------------

    @rule(goal=st.sampled_from(TARGETS))
    def transition(self, goal: str) -> None:
        self._transition(goal)

    @rule()
    def advance(self) -> None:
        """The natural next request, so runs get deep into the workflow."""
        task = self.task()
        if not WF.has(task.phase):
            return
        spec = WF.phase(task.phase)
        if spec.approval and not task.awaiting_approval:
            self._transition(f"{spec.name}:{AWAITING_APPROVAL}")
        else:
            self._transition(spec.next)

    @rule()
    def happy_step(self) -> None:
        """What a well-behaved agent and approver do next: write, gate, approve, advance."""
        task = self.task()
        if not WF.has(task.phase):
            return
        spec = WF.phase(task.phase)
        artifact = self.folder / spec.artifact
        if not artifact.exists():
            artifact.write_text(CONTENTS[-1])
        if spec.approval and task.awaiting_approval:
            self.run(self.gates.approve("t", by=42))
        self.advance()

    def _transition(self, target: str) -> None:
        before = self.task()
        approvals_before = self.run(self.gates.store.gate_approvals(before))
        disk = None
        if WF.has(before.phase):
            disk = sha256_file(self.folder / WF.phase(before.phase).artifact)
        try:
            after = self.run(self.gates.store.transition("t", target))
        except GateRefused:
            return
        if before.awaiting_approval and after.phase == WF.phase(before.phase).next:
            # Passed a gate: the approval was bound to exactly the bytes on disk.
            assert disk == before.gate_sha256
            bound = {a.approver for a in approvals_before if a.sha256 == disk}
            assert len(bound) >= self.settings.approval_quorum
        if WF.has(before.phase) and WF.phase(before.phase).approval:
            assert after.phase in (before.phase, HUMAN_INTERVENTION) or before.awaiting_approval

    @rule(by=st.sampled_from([42, 43, 99]), use_hash=st.booleans())
    def approve(self, by: int, use_hash: bool) -> None:
        task = self.task()
        expected = task.gate_sha256 if use_hash else None
        self.run(self.gates.approve("t", by=by, expected_sha256=expected))

    @rule(by=st.sampled_from([42, 99]))
    def reject(self, by: int) -> None:
        self.run(self.gates.reject("t", by=by, reason="redo it"))

    @rule(content=st.sampled_from(CONTENTS))
    def write_artifact(self, content: str) -> None:
        task = self.task()
        phase = task.return_phase if task.phase == HUMAN_INTERVENTION else task.phase
        if phase and WF.has(phase):
            (self.folder / WF.phase(phase).artifact).write_text(content)

    @rule()
    def delete_artifact(self) -> None:
        task = self.task()
        if WF.has(task.phase):
            (self.folder / WF.phase(task.phase).artifact).unlink(missing_ok=True)

    @precondition(lambda self: self.task().phase == HUMAN_INTERVENTION)
    @rule(back=st.sampled_from(WF.names))
    def resume(self, back: str) -> None:
        with contextlib.suppress(GateRefused):
            self.run(self.gates.store.transition("t", back))

    @rule()
    def restart(self) -> None:
        assert self.db is not None
        self.run(self.db.close())
        self._open()

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def version_and_history(self) -> None:
        task = self.task()
        history = self.run(self.gates.store.history("t"))
        assert task.version >= self.version
        if task.version > self.version:
            assert len(history) > len(self.history)
        # Append-only: what was there is still there, unchanged.
        assert history[: len(self.history)] == self.history
        assert [h.version for h in history] == list(range(1, task.version + 1))
        self.version = task.version
        self.history = history

    @invariant()
    def state_file_mirrors_store(self) -> None:
        task = self.task()
        expected = self.run(self.gates.store.expected_state(task))
        assert read_state(self.folder) == json.loads(json.dumps(expected))

    @invariant()
    def no_unapproved_passage(self) -> None:
        findings = self.run(audit_task(self.gates.store, self.task()))
        bad = {FindingKind.UNAPPROVED_PASSAGE, FindingKind.HISTORY_GAP, FindingKind.STATE_MISMATCH}
        assert [f for f in findings if f.kind in bad] == []


RUNS = settings(
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
GateMachine.TestCase.settings = RUNS
TestGateMachine = GateMachine.TestCase


def test_the_gate_machine_on_postgresql(pg_cluster: PgCluster) -> None:
    global _PG_CLUSTER
    _PG_CLUSTER = pg_cluster
    try:
        # Fewer examples: each step is a few round trips to the server, not a file read.
        run_state_machine_as_test(GateMachine, settings=settings(RUNS, max_examples=20))
    finally:
        _PG_CLUSTER = None


# 30 examples of up to 40 steps on a real SQLite file: ~10 s on an idle machine, several
# times that on CI's two cores shared with other jobs.
pytestmark = pytest.mark.timeout(240)

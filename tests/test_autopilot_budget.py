"""An autopilot drive held to a budget: its phases' turns (its sub-tasks' too) are summed,
it is told once at 80 %, and it stops after the turn that spends it, never in one; a budget
its agent could not be held to is refused before anything is made."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from engine.gates import DriveOutcome, Gates, TaskRecord
from engine.gates.autopilot import Autopilot
from engine.spend import Budget
from engine.store.runs import SqliteRunStore, TurnState
from engine.turn import TurnOutput
from tests.gates_support import (
    APPROVER,
    DECOMPOSITION_EMPTY,
    EventSink,
    cli_env,
    make_settings,
    open_gates,
    run_cli,
)
from tests.support import wait_until

ARTIFACTS = {
    "research": "research.md",
    "decomposition": "decomposition.md",
    "design": "design.md",
    "test_design": "test_plan.md",
    "implement": "implementation.md",
    "bug_find": "bugs.md",
    "adversarial_bug_find": "adversarial_bugs.md",
    "doc_review": "doc_review.md",
    "referee": "referee.md",
}


class CostlySession:
    """An agent session that writes its phase's artifact and reports what the turn cost,
    as Claude Code does (``cost_usd`` in the turn's metadata). ``hold`` (a coroutine
    function) runs before a turn of the phase it names ends."""

    def __init__(
        self,
        task: str,
        folder: Path,
        session_id: str,
        *,
        cost: Callable[[str], float],
        log: list[tuple[str, str]],
        decomposition: str = DECOMPOSITION_EMPTY,
        hold: Mapping[str, Callable[[], object]] | None = None,
    ) -> None:
        self.task = task
        self.folder = folder
        self._session_id = session_id
        self.cost = cost
        self.log = log
        self.decomposition = decomposition
        self.hold = hold or {}
        self.in_flight = 0

    @property
    def session_id(self) -> str:
        return self._session_id

    async def run_turn(self, prompt: str) -> TurnOutput:
        found = re.search(r"Phase: (\w+) \(", prompt)
        assert found is not None, prompt
        phase = found.group(1)
        self.in_flight += 1
        try:
            self.log.append((self.task, f"{phase} started"))
            hold = self.hold.get(phase)
            if hold is not None:
                held = hold()
                assert asyncio.iscoroutine(held)
                await held
            content = self.decomposition if phase == "decomposition" else f"# {phase}\n"
            (self.folder / ARTIFACTS[phase]).write_text(content)
            self.log.append((self.task, f"{phase} ended"))
            return TurnOutput(
                text=f"wrote {ARTIFACTS[phase]}",
                exit_code=0,
                metadata={"cost_usd": self.cost(phase), "usage": {"output_tokens": 10}},
            )
        finally:
            self.in_flight -= 1


async def _approve_all(gates: Gates, sink: EventSink) -> None:
    while True:
        request = await sink.queue.get()
        assert (await gates.approve(request.task, by=APPROVER)).ok


async def test_a_drive_stops_after_the_phase_turn_that_spends_its_budget(
    tmp_path: Path,
) -> None:
    costs = {"research": 0.20, "decomposition": 0.20, "design": 0.45, "test_design": 0.30}
    log: list[tuple[str, str]] = []
    sessions: list[CostlySession] = []

    def factory(task: TaskRecord, session_id: str, resume: bool) -> CostlySession:
        session = CostlySession(
            task.name, task.folder, session_id, cost=lambda p: costs.get(p, 0.5), log=log
        )
        sessions.append(session)
        return session

    sink = EventSink()
    async with open_gates(make_settings(tmp_path), poll_interval=0.02) as gates:
        await gates.init_task("b", summary="a task on a budget")
        handle = gates.start_autopilot("b", sink, agent_factory=factory, budget=Budget(usd=1.0))
        approver = asyncio.create_task(_approve_all(gates, sink), name="approver")
        try:
            outcome = await asyncio.wait_for(handle.wait(), 30)
        finally:
            approver.cancel()
        task = await gates.task("b")
        runs = SqliteRunStore(gates.store.db)
        (run,) = await runs.list_runs()
        turns = await runs.turns(run.id)
        spent = (await runs.spend_of([run.id]))[run.id]
        audit = [e for e in await gates.audit_events("b") if e.event == "budget"]
    assert outcome is DriveOutcome.STOPPED_BY_BUDGET
    # Not before: at $0.85 (past 80 %) it went on; the test_design turn spent it, and
    # nothing was started after it ended.
    assert [e for _, e in log] == [
        f"{p} {s}"
        for p in ("research", "decomposition", "design", "test_design")
        for s in ("started", "ended")
    ]
    assert [t.phase for t in turns] == ["research", "decomposition", "design", "test_design"]
    assert all(t.state is TurnState.FINISHED for t in turns)  # never stopped in a turn
    assert all(s.in_flight == 0 for s in sessions)
    assert spent.cost_usd == pytest.approx(1.15)
    # The work of the turn that spent it is kept: its gate is open for a later drive.
    assert task.label == "test_design:awaiting_approval"
    assert [g.phase for g in sink.gates] == ["research", "decomposition", "design"]
    assert run.status.value == "stopped"
    # People are told once, at 80 %, then told it stopped and what was spent of what.
    told = [t for t in sink.texts if "💰" in t]
    assert told == [
        "[b] 💰 This drive has spent $0.8500 of its budget ($1.00): it stops after the turn "
        "that reaches it."
    ]
    stopped = [t for t in sink.texts if "Stopped by its budget" in t]
    assert stopped == [
        "[b] Stopped by its budget: $1.15 of $1.00 spent; it stopped after the turn that "
        "reached it, and the task stays at test_design:awaiting_approval."
    ]
    assert sink.texts.index(told[0]) < sink.texts.index(stopped[0])
    assert [e.outcome for e in audit] == ["stopped"]
    assert handle.pilot is not None
    assert handle.pilot.budget is not None
    assert handle.pilot.budget.stopped_text() == "Stopped by its budget: $1.15 of $1.00 spent"


async def test_a_drive_under_its_budget_runs_to_the_end(tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []

    def factory(task: TaskRecord, session_id: str, resume: bool) -> CostlySession:
        return CostlySession(task.name, task.folder, session_id, cost=lambda p: 0.01, log=log)

    sink = EventSink()
    async with open_gates(make_settings(tmp_path), poll_interval=0.02) as gates:
        await gates.init_task("cheap")
        handle = gates.start_autopilot("cheap", sink, agent_factory=factory, budget=Budget(usd=5.0))
        approver = asyncio.create_task(_approve_all(gates, sink), name="approver")
        try:
            assert await asyncio.wait_for(handle.wait(), 30) is DriveOutcome.COMPLETE
        finally:
            approver.cancel()
    assert len(log) == 2 * len(ARTIFACTS)
    assert not [t for t in sink.texts if "💰" in t or "budget" in t]


@pytest.mark.timeout(60)
async def test_a_waves_turns_count_and_its_running_turns_end_before_it_stops(
    tmp_path: Path,
) -> None:
    decomposition = "# Split\n\n```subtasks\nwave 1: a\nwave 1: c\nwave 1: e\nwave 2: d\n```\n"
    log: list[tuple[str, str]] = []
    sessions: dict[str, CostlySession] = {}
    pilot: list[Autopilot] = []

    async def until_spent() -> None:
        # p.c's design turn is still running when p.a's turn spends the budget.
        await wait_until(lambda: pilot[0].spent_budget, what="the budget spent")

    def factory(task: TaskRecord, session_id: str, resume: bool) -> CostlySession:
        cost = {"p.a": 1.0, "p.c": 0.1}.get(task.name, 0.0)
        session = CostlySession(
            task.name,
            task.folder,
            session_id,
            cost=lambda _: cost,
            log=log,
            decomposition=decomposition,
            hold={"design": until_spent} if task.name == "p.c" else None,
        )
        sessions[task.name] = session
        return session

    sink = EventSink()
    settings = make_settings(tmp_path, wave_concurrency=2)
    async with open_gates(settings, poll_interval=0.02) as gates:
        await gates.init_task("p")
        handle = gates.start_autopilot("p", sink, agent_factory=factory, budget=Budget(usd=1.0))
        assert handle.pilot is not None
        pilot.append(handle.pilot)
        approver = asyncio.create_task(_approve_all(gates, sink), name="approver")
        try:
            outcome = await asyncio.wait_for(handle.wait(), 30)
        finally:
            approver.cancel()
        runs = SqliteRunStore(gates.store.db)
        records = {r.task: r for r in await runs.list_runs()}
        turns = [t for r in records.values() for t in await runs.turns(r.id)]
        a, c = await gates.task("p.a"), await gates.task("p.c")
    assert outcome is DriveOutcome.STOPPED_BY_BUDGET
    # p.c's turn, running when the budget was spent, ended on its own and was counted.
    assert ("p.c", "design ended") in log
    assert log.index(("p.a", "design ended")) < log.index(("p.c", "design ended"))
    assert all(t.state is TurnState.FINISHED for t in turns)
    assert all(s.in_flight == 0 for s in sessions.values())
    # Nothing started after: no other phase of p.a or p.c, and p.e (waiting for a slot)
    # and wave 2's p.d never started.
    started = [n for n, e in log if e.endswith("started")]
    assert started[:2] == ["p", "p"]
    assert sorted(started[2:]) == ["p.a", "p.c"]  # (the wave's two slots, in either order)
    assert set(records) == {"p", "p.a", "p.c"}
    assert a.label == c.label == "design:awaiting_approval"
    assert {records[n].status.value for n in records} == {"stopped"}
    stopped = [t for t in sink.texts if "Stopped by its budget" in t]
    assert stopped == [
        "[p] Stopped by its budget: $1.10 of $1.00 spent; it stopped after the turn that "
        "reached it, and the task stays at design."
    ]


async def _cli(tmp_path: Path, *args: str, **extra: str) -> tuple[int, str, str]:
    settings = make_settings(tmp_path)
    env = cli_env(settings, extra)
    return await run_cli("autopilot", "--task", "t", "--init", *args, env=env)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ("--tool", "copilot", "--budget", "2"),
            "cannot keep to this budget: copilot reports neither cost nor tokens",
        ),
        (
            ("--tool", "copilot", "--budget-tokens", "5000"),
            "cannot keep to this budget: copilot reports neither cost nor tokens",
        ),
        (
            ("--tool", "codex", "--budget", "2"),
            "codex reports tokens, not cost: give its budget in tokens (--budget-tokens)",
        ),
        (("--budget", "0"), "--budget: a budget is more than $0"),
        (("--budget", "1", "--manual"), "--manual only reports"),
    ],
)
async def test_a_budget_the_agent_cannot_keep_is_refused_before_anything_starts(
    tmp_path: Path, args: tuple[str, ...], said: str
) -> None:
    rc, out, err = await _cli(tmp_path, *args)
    assert rc == 2, out + err
    assert said in err
    assert "Traceback" not in err
    # Refused before the task was made: no folder, no database row.
    assert not (tmp_path / "tasks" / "t").exists()
    async with open_gates(make_settings(tmp_path)) as gates:
        assert await gates.store.find("t") is None


#: A stand-in for ``claude -p --output-format stream-json``: it writes the phase's artifact
#: and ends with the one ``result`` record Claude Code ends a turn with, its cost in it.
FAKE_CLAUDE = """\
import json, os, re, sys
from pathlib import Path

prompt = sys.stdin.read()
phase = re.search(r"Phase: (\\w+) \\(", prompt).group(1)
artifact = json.loads(os.environ["FAKE_ARTIFACTS"])[phase]
Path(artifact).write_text("# " + phase + "\\n")
with open(os.environ["FAKE_CLAUDE_LOG"], "a") as log:
    log.write(phase + "\\n")
sid = sys.argv[sys.argv.index("--session-id") + 1] if "--session-id" in sys.argv else ""
print(json.dumps({
    "type": "result", "subtype": "success", "is_error": False,
    "result": "wrote " + artifact, "session_id": sid, "num_turns": 1,
    "total_cost_usd": json.loads(os.environ["FAKE_COSTS"]).get(phase, 0.5),
    "usage": {"input_tokens": 100, "output_tokens": 20},
}))
"""


@pytest.mark.timeout(120)
async def test_the_terminal_says_the_budget_stopped_the_drive(tmp_path: Path) -> None:
    import json
    import sys

    claude = tmp_path / "claude"
    claude.write_text(f"#!{sys.executable}\n{FAKE_CLAUDE}")
    claude.chmod(0o755)
    log = tmp_path / "claude.log"
    env = {
        "TURNSTILE_CLAUDE_BIN": str(claude),
        "TURNSTILE_LOG_LEVEL": "INFO",
        "FAKE_ARTIFACTS": json.dumps(ARTIFACTS),
        "FAKE_COSTS": json.dumps({"research": 0.45}),
        "FAKE_CLAUDE_LOG": str(log),
    }
    # TURNSTILE_RUN_BUDGET by default: the research turn spends $0.45 of $0.5, told; the
    # drive parks at its gate (--no-wait).
    default = {**env, "TURNSTILE_RUN_BUDGET": "0.5"}
    rc, out, err = await _cli(tmp_path, "--tool", "claude", "--no-wait", **default)
    assert rc == 3, out + err
    assert "t: the drive may spend $0.5000; it stops after the turn that reaches that" in out
    assert "💰 This drive has spent $0.4500 of its budget ($0.5000)" in out
    async with open_gates(make_settings(tmp_path)) as gates:
        assert (await gates.approve("t", by=APPROVER)).ok
    # Run again, the budget counts afresh: decomposition's $0.5 spends all of it. Its
    # artifact declares no sub-tasks, yet no revision turn is started past the budget.
    env["FAKE_COSTS"] = json.dumps({"decomposition": 0.5})
    rc, out, err = await _cli(tmp_path, "--tool", "claude", "--budget", "0.5", **env)
    assert rc == 5, out + err
    assert (
        "t: Stopped by its budget: $0.5000 of $0.5000 spent; the drive stopped after the turn "
        "that reached it, and the task stays at decomposition. "
        "`turnstile autopilot --task t --budget MORE` goes on from there."
    ) in out
    assert "INFO" not in out + err  # a person's view: no log records
    assert log.read_text().split() == ["research", "decomposition"]
    async with open_gates(make_settings(tmp_path)) as gates:
        runs = SqliteRunStore(gates.store.db)
        (run,) = await runs.list_runs()
        turns = await runs.turns(run.id)
    assert run.status.value == "stopped"
    assert [t.spend.cost_usd for t in turns] == [0.45, 0.5]


class Told:
    """The executor's :class:`~engine.executors.base.Notices`, kept in a list."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.places: dict[str, object] = {}

    def follow(self, key: str, place: object, *, task: str | None = None, **_: object) -> None:
        if task is not None:
            self.places[task] = place

    def place_of_task(self, task: str) -> object | None:
        return self.places.get(task)

    async def notice(self, key: str, text: str, **_: object) -> None:
        self.texts.append(text)


async def test_a_front_ends_drive_keeps_its_budget_here(tmp_path: Path) -> None:
    from engine.executors.drives import DriveRefused, DriveRequest, LocalDrives
    from engine.runs import RunSupervisor
    from engine.runs.spec import ChatPlace

    log: list[tuple[str, str]] = []

    def agents(agent: str, settings: object, *, cwd: Path, session_id: str, **_: object) -> object:
        assert agent == "command"
        return CostlySession(cwd.name, cwd, session_id, cost=lambda _: 0.6, log=log)

    sink = EventSink()
    place = ChatPlace("-100", None)
    budget = Budget(usd=1.0)
    async with open_gates(make_settings(tmp_path), poll_interval=0.02) as gates:
        told = Told()
        local = LocalDrives(
            gates,
            supervisor=RunSupervisor(SqliteRunStore(gates.store.db)),
            sink=sink,
            notices=told,
            agent_factory=agents,
        )
        await local.start(DriveRequest("f", place, "proj", budget=budget))
        handle = local.drives["f"]
        approver = asyncio.create_task(_approve_all(gates, sink), name="approver")
        try:
            assert await asyncio.wait_for(handle.wait(), 30) is DriveOutcome.STOPPED_BY_BUDGET
        finally:
            approver.cancel()
        # research ($0.60) then decomposition ($1.20): stopped after the turn that spent it.
        assert [e for n, e in log if e.endswith("started")] == [
            "research started",
            "decomposition started",
        ]
        assert "[f] Stopped by its budget: $1.20 of $1.00 spent" in " ".join(sink.texts)
    settings = make_settings(tmp_path / "copilot", default_agent="copilot")
    async with open_gates(settings) as gates:
        local = LocalDrives(
            gates,
            supervisor=RunSupervisor(SqliteRunStore(gates.store.db)),
            sink=sink,
            notices=Told(),
            agent_factory=agents,
        )
        with pytest.raises(DriveRefused, match="copilot reports neither cost nor tokens"):
            await local.start(DriveRequest("g", place, "proj", budget=budget))
        assert await gates.store.find("g") is None


@pytest.mark.timeout(60)
async def test_a_sub_task_waiting_at_its_gate_stops_when_a_sibling_spends_the_budget(
    tmp_path: Path,
) -> None:
    decomposition = "# Split\n\n```subtasks\nwave 1: a\nwave 1: c\n```\n"
    log: list[tuple[str, str]] = []
    sink = EventSink()

    async def until_c_waits() -> None:
        await wait_until(lambda: any(g.task == "p.c" for g in sink.gates), what="p.c's gate")

    def factory(task: TaskRecord, session_id: str, resume: bool) -> CostlySession:
        return CostlySession(
            task.name,
            task.folder,
            session_id,
            cost=lambda _: {"p.a": 1.0, "p.c": 0.1}.get(task.name, 0.0),
            log=log,
            decomposition=decomposition,
            hold={"design": until_c_waits} if task.name == "p.a" else None,
        )

    async def approve_the_parent(gates: Gates) -> None:
        while True:
            request = await sink.queue.get()
            if request.task == "p":
                assert (await gates.approve("p", by=APPROVER)).ok

    # A poll far beyond the test's timeout: only the budget's wake ends p.c's wait.
    async with open_gates(make_settings(tmp_path), poll_interval=3600) as gates:
        await gates.init_task("p")
        handle = gates.start_autopilot("p", sink, agent_factory=factory, budget=Budget(usd=1.0))
        approver = asyncio.create_task(approve_the_parent(gates), name="approver")
        try:
            outcome = await asyncio.wait_for(handle.wait(), 30)
        finally:
            approver.cancel()
        c = await gates.task("p.c")
    assert outcome is DriveOutcome.STOPPED_BY_BUDGET
    assert c.label == "design:awaiting_approval"  # its gate stays open for a later drive
    assert sorted(n for n, e in log if e.endswith("started")) == ["p", "p", "p.a", "p.c"]
    assert any("Stopped by its budget: $1.10 of $1.00 spent" in t for t in sink.texts)

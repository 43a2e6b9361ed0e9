"""Autopilot drives held to a budget on ``turnstile worker`` processes: real PostgreSQL, real
workers, and a stand-in for Claude Code that writes each phase's artifact where the prompt
says and reports what the turn cost. The budget travels with the drive (its sub-tasks'
too); each step counts what the drive has spent after its turn, says so once at 80 %, and
once over it no further step starts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from engine.runs.spec import ChatPlace
from engine.sink import GateRequest, StatusUpdate
from engine.spend import Budget
from tests.automode_support import turnstile
from tests.test_workers_autopilot import (
    THREE,
    WORKFLOW,
    approve,
    entries,
    history,
    label,
    live_jobs,
    parked_at,
    placement,
)
from tests.workers_support import Cluster, wait_for
from tests.workers_support import cluster as cluster  # the fixture

pytestmark = pytest.mark.timeout(240)  # generous: worker suites share a loaded machine

APPROVER = "42"

#: ``claude -p --output-format stream-json`` as far as turnstile reads it: the phase's
#: artifact written, then the one ``result`` record a turn ends with, its cost in it
#: (per task and phase from the configuration, else per phase).
FAKE_CLAUDE = textwrap.dedent(
    """
    import json, os, re, sys, time
    from pathlib import Path

    prompt = sys.stdin.read()
    conf = json.loads(Path(os.environ["FAKE_PILOT_AGENT_CONF"]).read_text())
    phase = re.search(r"^Phase: (\\w+) \\(", prompt, re.M).group(1)
    task = re.search(r"^You are the .* for task (\\S+)\\.$", prompt, re.M).group(1)
    artifact = Path(re.search(r"^Write the artifact to: (.+)$", prompt, re.M).group(1))
    entry = {"task": task, "phase": phase, "started": time.time()}
    with open(conf["started"], "a") as fh:
        fh.write(json.dumps(entry) + "\\n")
    time.sleep(float(conf.get("sleep", {}).get(task, 0)))
    artifact.parent.mkdir(parents=True, exist_ok=True)
    artifact.write_text(conf["decomposition"] if phase == "decomposition" else f"# {phase}\\n")
    entry["finished"] = time.time()
    with open(conf["log"], "a") as fh:
        fh.write(json.dumps(entry) + "\\n")
    costs = conf["costs"]
    cost = costs.get(f"{task}:{phase}", costs.get(phase, 0.01))
    sid = sys.argv[sys.argv.index("--session-id") + 1] if "--session-id" in sys.argv else ""
    print(json.dumps({
        "type": "result", "subtype": "success", "is_error": False,
        "result": f"wrote {artifact}", "session_id": sid, "num_turns": 1,
        "total_cost_usd": cost, "usage": {"input_tokens": 100, "output_tokens": 20},
    }))
    """
)

NO_SPLIT = "# Decomposition\n\n```subtasks\n```\n"


def setup_claude(cluster: Cluster, *, costs: dict[str, float], **conf: Any) -> None:
    """Configure the cluster for drives of the stand-in Claude Code (before the workers)."""
    tmp = cluster.tmp
    (tmp / "workflow.toml").write_text(WORKFLOW)
    claude = tmp / "claude"
    claude.write_text(f"#!{sys.executable}\n{FAKE_CLAUDE}")
    claude.chmod(0o755)
    config = {
        "log": str(tmp / "phases.log"),
        "started": str(tmp / "started.log"),
        "decomposition": NO_SPLIT,
        "costs": costs,
        **conf,
    }
    (tmp / "agent.json").write_text(json.dumps(config))
    cluster.env.update(
        {
            "TURNSTILE_WORKFLOW_FILE": str(tmp / "workflow.toml"),
            "TURNSTILE_APPROVERS": APPROVER,
            "TURNSTILE_TASKS_ROOT": str(tmp / "tasks"),
            "TURNSTILE_CLAUDE_BIN": str(claude),
            "FAKE_PILOT_AGENT_CONF": str(tmp / "agent.json"),
        }
    )


def start_drive(cluster: Cluster, task: str, *budget: str) -> str:
    done = cluster.cli(
        "autopilot",
        "--task",
        task,
        "--init",
        "--checkout-repo",
        "demo",
        "--summary",
        "build the thing",
        "--tool",
        "claude",
        *budget,
        "--detach",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


def notes_of(cluster: Cluster, run_id: str) -> list[str]:
    """What the drive said under its run (the event log its followers read), in order."""
    rows = cluster.query("SELECT data_json FROM events WHERE run_id = %s ORDER BY id", run_id)
    return [str(json.loads(data).get("text", "")) for (data,) in rows]


def test_a_drive_on_the_workers_stops_after_the_step_that_spends_its_budget(
    cluster: Cluster,
) -> None:
    setup_claude(cluster, costs={"research": 0.85, "decomposition": 0.30})
    cluster.start_worker("w1", concurrency=1)
    run_id = start_drive(cluster, "t1", "--budget", "1")
    rows = cluster.query("SELECT spec_json FROM worker_runs WHERE run_id = %s", run_id)
    assert json.loads(rows[0][0])["budget_usd"] == 1.0  # it travels with the drive

    # $0.85 of $1: told once, and the drive goes on to its gate.
    wait_for("the research gate", lambda: parked_at(cluster, run_id, "t1", "research"))
    warned = [t for t in notes_of(cluster, run_id) if "💰" in t]
    assert warned == [
        "[t1] 💰 This drive has spent $0.8500 of its budget ($1.00): it stops after the turn "
        "that reaches it."
    ]

    # A terminal follows it; the approval lets decomposition's turn spend the rest.
    follower = subprocess.Popen(
        turnstile("autopilot", "--task", "t1"),
        cwd=cluster.tmp,
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert follower.stdout is not None
        seen = ""
        while not seen.startswith("t1:"):  # following, before the approval
            seen = follower.stdout.readline()
            assert seen, "the follower ended early"
        approve(cluster, "t1")
        out, err = follower.communicate(timeout=90)
        out = seen + out
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 5, out + err
    assert out.rstrip().endswith(
        "t1: Stopped by its budget: $1.15 of $1.00 spent; the drive stopped after the turn "
        "that reached it, and the task stays at decomposition:awaiting_approval. "
        "`turnstile autopilot --task t1 --budget MORE` goes on from there."
    ), out
    # The turn that spent it kept its work (its gate is open); nothing started after it.
    assert [e["phase"] for e in entries(cluster)] == ["research", "decomposition"]
    assert [e["phase"] for e in entries(cluster, "started.log")] == ["research", "decomposition"]
    assert label(cluster, "t1") == "decomposition:awaiting_approval", history(cluster, "t1")
    status, worker, note = placement(cluster, run_id)
    assert (status, worker) == ("finished", "w1")
    assert note == "Stopped by its budget: $1.15 of $1.00 spent"
    assert cluster.status(run_id) == "stopped"
    assert live_jobs(cluster, run_id) == []
    turns = cluster.query(
        "SELECT phase, state, cost_usd FROM turns WHERE run_id = %s ORDER BY id", run_id
    )
    assert turns == [("research", "finished", 0.85), ("decomposition", "finished", 0.30)]
    said = notes_of(cluster, run_id)
    assert [t for t in said if "💰" in t] == warned  # once
    assert [t for t in said if "Stopped by its budget" in t] == [
        "[t1] Stopped by its budget: $1.15 of $1.00 spent; it stopped after the turn that "
        "reached it, and the task stays at decomposition:awaiting_approval."
    ]
    # An approval now moves nothing: the drive is over.
    approve(cluster, "t1")
    assert placement(cluster, run_id)[0] == "finished"
    assert live_jobs(cluster, run_id) == []


def test_a_waves_sub_tasks_count_and_none_starts_once_the_budget_is_spent(
    cluster: Cluster,
) -> None:
    """Two sub-tasks at once (TURNSTILE_WAVE_CONCURRENCY=2): p.a1's turn spends the
    budget while p.a2's runs; p.a2's ends and counts, p.a3 never starts, and the drive
    stops once p.a2's drive has ended, saying what all of them spent."""
    setup_claude(
        cluster,
        costs={"research": 0.1, "decomposition": 0.1, "p.a1:implement": 1.0, "implement": 0.1},
        decomposition=THREE,
        sleep={"p.a1": 1.0, "p.a2": 4.0},
    )
    cluster.env["TURNSTILE_WAVE_CONCURRENCY"] = "2"
    for name in ("w1", "w2", "w3"):
        cluster.start_worker(name, concurrency=1)
    run_id = start_drive(cluster, "p", "--budget", "1")
    wait_for("the research gate", lambda: parked_at(cluster, run_id, "p", "research"))
    approve(cluster, "p")
    wait_for("the decomposition gate", lambda: parked_at(cluster, run_id, "p", "decomposition"))
    approve(cluster, "p")
    wait_for("the drive's end", lambda: placement(cluster, run_id)[0] == "finished", within=120)

    started = sorted(e["task"] for e in entries(cluster, "started.log"))
    assert started == ["p", "p", "p.a1", "p.a2"]  # p.a3 never started, nor p's implement
    a2 = next(e for e in entries(cluster) if e["task"] == "p.a2")
    a1 = next(e for e in entries(cluster) if e["task"] == "p.a1")
    assert a2["started"] < a1["finished"] < a2["finished"]  # running when it was spent
    assert placement(cluster, run_id)[2] == "Stopped by its budget: $1.30 of $1.00 spent"
    assert cluster.status(run_id) == "stopped"
    subs = cluster.query(
        "SELECT r.task, r.id FROM runs r JOIN worker_runs w ON w.run_id = r.id"
        " WHERE r.parent_id = %s ORDER BY r.task",
        run_id,
    )
    assert [(task, placement(cluster, sub)[0]) for task, sub in subs] == [
        ("p.a1", "finished"),
        ("p.a2", "finished"),
    ]
    specs = cluster.query(
        "SELECT spec_json FROM worker_runs w JOIN runs r ON r.id = w.run_id WHERE r.parent_id = %s",
        run_id,
    )
    assert {json.loads(s)["budget_usd"] for (s,) in specs} == {1.0}
    said = notes_of(cluster, run_id)
    assert [t for t in said if "💰" in t] == []  # from $0.20 straight past $1
    assert [t for t in said if "Stopped by its budget" in t] == [
        "[p] Stopped by its budget: $1.30 of $1.00 spent; it stopped after the turn that "
        "reached it, and the task stays at implement."
    ]
    for (job_run,) in cluster.query("SELECT id FROM runs WHERE parent_id = %s", run_id):
        assert live_jobs(cluster, job_run) == []
    assert live_jobs(cluster, run_id) == []


class Chat:
    """The executor's sink and notices, recorded: what the people following are told."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.notes: dict[str, str] = {}
        self.gates: list[GateRequest] = []

    async def publish_text(self, run_id: str, text: str) -> None:
        self.texts.append(text)

    async def update_status(self, update: StatusUpdate) -> None:
        pass

    async def request_gate(self, request: GateRequest) -> None:
        self.gates.append(request)

    def follow(self, key: str, place: ChatPlace, **_: object) -> None:
        pass

    def place_of_task(self, task: str) -> ChatPlace | None:
        return None

    async def notice(
        self, key: str, text: str, *, live: str | None = None, markdown: bool = False
    ) -> None:
        self.notes[live or f"{key}:{len(self.notes)}"] = text

    async def offer_more_budget(self, run_id: str, budget: Budget, spent: str) -> None:
        raise AssertionError("a drive is not offered a raise")

    async def shown(self, live: str) -> str | None:
        return self.notes.get(live)

    async def told_ended(self, run_id: str) -> bool:
        return False

    async def gate_shown(self, task: str, phase: str) -> bool:
        return False


@asynccontextmanager
async def workers_drives(cluster: Cluster, agent: str) -> AsyncIterator[tuple[Any, Chat]]:
    """The bot's drives executor on the workers (its default agent ``agent``), recorded."""
    import asyncio

    from engine.executors.drives import LocalDrives
    from engine.executors.drives_workers import WorkersDrives
    from engine.gates import Gates
    from engine.runs import RunSupervisor
    from engine.store.backend import open_database
    from engine.store.runs import SqliteRunStore
    from tests.support import make_settings

    settings = make_settings(
        cluster.tmp / f"control-{agent}",
        database=cluster.url,
        execution="workers",
        projects=cluster.env["TURNSTILE_PROJECTS"],
        default_agent=agent,
        workflow_file=cluster.tmp / "workflow.toml",
        approvers=APPROVER,
        worker_heartbeat=0.3,
        worker_timeout=2.0,
    )
    chat = Chat()
    async with open_database(settings) as db:
        gates = Gates(db, settings)

        def no_agent(*_: object, **__: object) -> Any:
            raise AssertionError("a drive on the workers runs no agent here")

        local = LocalDrives(
            gates,
            supervisor=RunSupervisor(SqliteRunStore(db)),
            sink=chat,
            notices=chat,
            agent_factory=no_agent,
        )
        drives = WorkersDrives(settings, db, gates, local=local, sink=chat, notices=chat)
        try:
            yield drives, chat
        finally:
            await drives.shutdown(park=False, preempt=asyncio.Event())


async def test_a_front_ends_drive_on_the_workers_keeps_its_budget_and_says_it_stopped(
    cluster: Cluster,
) -> None:
    """The bot's drives executor on the workers: a DriveRequest's budget goes with the
    drive; its chat is told at 80 % and when the budget stopped it, in the words of a drive
    in the bot's own process; a budget its agent cannot be held to is refused."""
    import asyncio

    from engine.executors.drives import DriveRefused, DriveRequest
    from tests.support import wait_until

    setup_claude(cluster, costs={"research": 0.85, "decomposition": 0.30})
    await asyncio.to_thread(cluster.start_worker, "w1", concurrency=1)
    request = DriveRequest("t2", ChatPlace("-100", None), "demo", budget=Budget(usd=1.0))
    async with workers_drives(cluster, "copilot") as (drives, _):
        with pytest.raises(DriveRefused, match="copilot reports neither cost"):
            await drives.start(request)
    assert cluster.query("SELECT run_id FROM worker_runs") == []  # nothing queued
    async with workers_drives(cluster, "claude") as (drives, chat):
        started = await drives.start(request)
        assert started.queued
        run_id = started.run_id
        await wait_until(lambda: chat.gates, timeout=60, what="the research gate")
        await asyncio.to_thread(approve, cluster, "t2")
        stopped = f"person:{run_id}"
        await wait_until(lambda: stopped in chat.notes, timeout=90, what="the stop")
        await wait_until(lambda: any("💰" in t for t in chat.notes.values()), what="the note")
    assert chat.notes[stopped] == (
        "[t2] Stopped by its budget: $1.15 of $1.00 spent; it stopped after the turn that "
        "reached it, and the task stays at decomposition, waiting for approval."
    )
    assert [t for t in chat.notes.values() if "💰" in t] == [
        "[t2] 💰 This drive has spent $0.8500 of its budget ($1.00): it stops after the turn "
        "that reaches it."
    ]
    assert [g.phase for g in chat.gates][:1] == ["research"]
    assert cluster.status(run_id) == "stopped"

"""The event log: every change of a run written with the change, read and followed by
cursor, and shown by ``turnstile runs RUN --events`` (``--json``, ``--follow``).

Each test runs on a SQLite file and on a fresh PostgreSQL database; the command-line tests
run real ``turnstile auto`` and ``turnstile runs`` processes with the fake agent."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from engine.approvals.policy import Decision, Scope
from engine.approvals.store import SqliteApprovalStore
from engine.errors import ConfigError, TurnSuperseded
from engine.gates import DriveOutcome
from engine.store.events import EventLog, RunEvent
from engine.store.runs import RunStatus, SqliteRunStore, TurnState
from engine.turn import TurnOutput
from tests import db_support, gates_support
from tests.automode_support import (
    AGENT_CMD,
    PLAN,
    cli_env,
    git_workspace,
    happy_rules,
    report_head,
    turnstile,
    write_script,
)
from tests.db_support import Target
from tests.gates_support import APPROVER

pytestmark = pytest.mark.timeout(120)


def kinds(events: list[RunEvent]) -> list[str]:
    return [e.kind for e in events]


async def test_a_run_s_changes_are_its_events_in_order(database: Any) -> None:
    runs = SqliteRunStore(database)
    await runs.create_run("r1", mode="auto", agent="claude", session_id="s", phase="clarify")
    turn = await runs.start_turn("r1", 1, "the prompt", "clarify")
    await runs.finish_turn_and_update_run(
        turn, TurnOutput(text="ok", exit_code=0), "r1", phase="plan", turn=1
    )
    second = await runs.start_turn("r1", 2, "the prompt", "plan")
    assert await runs.fail_turn(second, TurnState.FAILED, "the agent crashed")
    assert not await runs.fail_turn(second, TurnState.FAILED, "again")  # no second end
    await runs.update_run("r1", status=RunStatus.PARKED)
    await runs.update_run("r1", status=RunStatus.RUNNING)
    await runs.update_run("r1", status=RunStatus.ERROR, exit_code=3, abort_reason="boom")
    await runs.update_run("r1", turn=2)  # neither status nor phase: no event
    events = await EventLog(database).read("r1")
    assert kinds(events) == [
        "run_started",
        "turn_started",
        "turn_ended",
        "phase",
        "turn_started",
        "turn_ended",
        "parked",
        "run_resumed",
        "run_ended",
    ]
    assert [e.id for e in events] == sorted({e.id for e in events})
    assert events[0].data["phase"] == "clarify"
    assert events[2].data == {
        "turn_id": turn,
        "seq": 1,
        "attempt": 1,
        "state": "finished",
        "exit_code": 0,
        "size": 2,
        "spilled": False,
    }
    assert events[3].data == {"phase": "plan", "from": "clarify"}
    assert events[5].data["state"] == "failed"
    assert events[5].data["error"] == "the agent crashed"
    assert events[7].data == {"from": "parked"}
    assert events[8].data["status"] == "error"
    assert events[8].data["exit_code"] == 3
    assert events[8].data["reason"] == "boom"
    assert events[8].ends_run
    # Read on from a cursor: only what came after it.
    assert kinds(await EventLog(database).read("r1", after=events[6].id)) == [
        "run_resumed",
        "run_ended",
    ]


async def test_a_place_s_unfinished_runs_and_their_instructions(database: Any) -> None:
    """What a message in a chat steers: the place's auto runs that have not ended, from
    their rows; an instruction for one is an event of it, refused once it has ended."""
    runs = SqliteRunStore(database)
    for run_id, thread in (("a1", None), ("a2", "7"), ("a3", None), ("c1", None)):
        await runs.create_run(
            run_id,
            mode="chat" if run_id == "c1" else "auto",
            agent="claude",
            session_id=run_id,
            chat_id="-100",
            thread_id=thread,
        )
    await runs.update_run("a3", status=RunStatus.COMPLETED)
    assert await runs.unfinished_in("auto", "-100", None) == ["a1"]
    assert await runs.unfinished_in("auto", "-100", "7") == ["a2"]
    assert await runs.unfinished_in("auto", "-100", None, whole_chat=True) == ["a1", "a2"]
    assert await runs.unfinished_in("auto", "-200", None) == []
    await runs.queue_instruction("a1", "use tabs", by="olga")
    [event] = [e for e in await EventLog(database).read("a1") if e.kind == "instruction"]
    assert event.data == {"text": "use tabs", "by": "olga"}
    with pytest.raises(ConfigError, match="has ended"):
        await runs.queue_instruction("a3", "too late")
    with pytest.raises(ConfigError, match="not an auto run"):
        await runs.queue_instruction("c1", "hello")


async def test_a_change_that_does_not_land_leaves_no_event(database: Any) -> None:
    runs = SqliteRunStore(database)
    await runs.create_run("r1", mode="auto", agent="claude", session_id="s")
    turn = await runs.start_turn("r1", 1, "p", "clarify")
    await runs.interrupt_run_turns("r1", "its worker was lost")
    # The turn was recorded cut off meanwhile: its result and the run's end do not land.
    with pytest.raises(TurnSuperseded):
        await runs.finish_turn_and_update_run(
            turn, TurnOutput(text="late", exit_code=0), "r1", status=RunStatus.COMPLETED
        )
    events = await EventLog(database).read("r1")
    assert kinds(events) == ["run_started", "turn_started", "turn_ended"]
    assert events[-1].data["state"] == "interrupted"
    assert (await runs.get_run("r1")).status is RunStatus.RUNNING


async def test_tool_requests_and_their_decisions_are_events(database: Any) -> None:
    runs = SqliteRunStore(database)
    await runs.create_run("r1", mode="chat", agent="claude", session_id="s")
    approvals = SqliteApprovalStore(database)
    asked = await approvals.open_request("r1", "Bash", {"command": "ls -la"})
    await approvals.decide(asked.id, Decision.ALLOWED, scope=Scope.SESSION, by=42)
    again = await approvals.open_request("r1", "Bash", {"command": "ls -la"})  # the grant
    other = await approvals.open_request("r1", "Write", {"file_path": "x"})
    await approvals.cancel_pending("the run stopped", run_ids=["r1"])
    events = await EventLog(database).read("r1")
    assert kinds(events) == [
        "run_started",
        "tool_requested",
        "tool_decided",
        "tool_requested",
        "tool_requested",
        "tool_decided",
    ]
    assert events[1].data["tool"] == "Bash"
    assert "ls -la" in events[1].data["input"]
    assert events[2].data == {
        "request_id": asked.id,
        "decision": "allowed",
        "scope": "session",
        "by": 42,
        "reason": None,
    }
    assert events[3].data["request_id"] == again.id
    assert events[3].data["decision"] == "allowed"  # by the session's grant, at once
    assert events[5].data["request_id"] == other.id
    assert events[5].data["decision"] == "cancelled"


async def test_a_follower_gets_every_event_of_writers_side_by_side(database: Any) -> None:
    """Two writers at once (two runs on PostgreSQL's pool): the follower, reading on from
    its cursor, misses none of its run's events and sees them in the order written."""
    runs = SqliteRunStore(database)
    await runs.create_run("a", mode="auto", agent="claude", session_id="s")
    await runs.create_run("b", mode="auto", agent="claude", session_id="s")
    log = EventLog(database, poll=0.05)
    followed: list[RunEvent] = []

    async def follow() -> None:
        async for event in log.follow("a", linger=0):
            followed.append(event)

    async def write(run_id: str, count: int) -> None:
        for seq in range(1, count + 1):
            turn = await runs.start_turn(run_id, seq, "p", "execute")
            await runs.finish_turn(turn, TurnOutput(text="x", exit_code=0))
        await runs.update_run(run_id, status=RunStatus.COMPLETED, exit_code=0)

    follower = asyncio.create_task(follow())
    await asyncio.gather(write("a", 25), write("b", 25))
    await asyncio.wait_for(follower, 20)
    whole = await log.read("a")
    assert [e.id for e in followed] == [e.id for e in whole]
    assert kinds(followed) == ["run_started"] + ["turn_started", "turn_ended"] * 25 + ["run_ended"]


# -- the command line --------------------------------------------------------------------


def _env(tmp_path: Path, target: Target, rules: list[dict[str, Any]]) -> dict[str, str]:
    script = write_script(tmp_path / "fake", rules=rules)
    return {**cli_env(tmp_path, script), "TURNSTILE_DATABASE": db_support.setting(target)}


def _cli(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        turnstile(*args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )


def _auto(ws: Path) -> list[str]:
    return ["auto", "--tool", "command", "--agent-cmd", AGENT_CMD, "--workdir", str(ws)]


def test_runs_events_shows_an_auto_run_s_life(tmp_path: Path, db_target: Target) -> None:
    ws = git_workspace(tmp_path / "ws")
    env = _env(tmp_path, db_target, happy_rules())
    done = _cli(tmp_path, env, *_auto(ws), "-p", "create result.txt")
    assert done.returncode == 0, done.stderr
    run_id = report_head(done.stdout)[0]
    as_json = _cli(tmp_path, env, "runs", run_id, "--events", "--json")
    assert as_json.returncode == 0, as_json.stderr
    events = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert all({"id", "kind", "run_id", "at"} <= set(e) for e in events)
    assert {e["run_id"] for e in events} == {run_id}
    assert [e["kind"] for e in events if e["kind"] != "note"] == [
        "run_started",
        *["turn_started", "turn_ended", "phase"] * 3,
        "turn_started",
        "turn_ended",
        "run_ended",
    ]
    assert [e["phase"] for e in events if e["kind"] == "turn_started"] == [
        "clarify",
        "plan",
        "execute",
        "evaluate",
    ]
    assert events[0]["objective"] == "create result.txt"
    assert events[-1]["kind"] == "note"
    assert events[-1]["note"] == "final"
    assert events[-1]["text"].startswith(f"Auto run {run_id}: completed")
    ended = next(e for e in events if e["kind"] == "run_ended")
    assert (ended["status"], ended["exit_code"]) == ("completed", 0)
    # For people: a line an event, in their words.
    shown = _cli(tmp_path, env, "runs", run_id, "--events")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert len(lines) == len(events)
    assert lines[0].endswith("auto run started with command: create result.txt")
    assert lines[1].endswith("turn 1 started (clarify)")
    assert lines[2].endswith("turn 1 finished, 54 bytes of output")
    assert lines[3].endswith("now in plan")
    assert any(line.endswith("ended: completed") for line in lines)
    assert lines[-1].endswith(f"result: Auto run {run_id}: completed")


def test_runs_events_bad_input(tmp_path: Path) -> None:
    env = _env(tmp_path, tmp_path / "t.db", [])
    alone = _cli(tmp_path, env, "runs", "--events")
    assert alone.returncode == 2
    assert "--events and --follow need a RUN_ID" in alone.stderr
    follow = _cli(tmp_path, env, "runs", "some-run", "--follow")
    assert follow.returncode == 2
    assert "--follow goes with --events" in follow.stderr
    unknown = _cli(tmp_path, env, "runs", "no-such-run", "--events")
    assert unknown.returncode != 0
    assert "no run 'no-such-run'" in unknown.stderr
    assert "Traceback" not in unknown.stderr


async def test_runs_events_follow_goes_on_until_the_run_ends(
    tmp_path: Path, db_target: Target
) -> None:
    ws = git_workspace(tmp_path / "ws")
    # The plan turn takes a while: the follower starts while the run is under way.
    rules = [{"match": PLAN, "text": "1. write it", "sleep": 2}, *happy_rules()]
    env = _env(tmp_path, db_target, rules)
    auto = await asyncio.create_subprocess_exec(
        *turnstile("--log-level", "INFO", *_auto(ws), "-p", "create result.txt"),
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert auto.stderr is not None
        run_id = None
        while run_id is None:
            line = (await asyncio.wait_for(auto.stderr.readline(), 60)).decode()
            assert line, "the auto run never said its id"
            found = re.search(r"run_id=([\w-]+)", line)
            if "Turn 2, round 2/" in line and found:
                run_id = found[1]
        follower = await asyncio.create_subprocess_exec(
            *turnstile("runs", run_id, "--events", "--follow", "--json"),
            cwd=tmp_path,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(follower.communicate(), 60)
        assert follower.returncode == 0, err.decode()
        followed = [json.loads(line) for line in out.decode().splitlines()]
        # It did not end before the run did: it saw the end, and the final report after it.
        assert await asyncio.wait_for(auto.wait(), 60) == 0
    finally:
        if auto.returncode is None:
            auto.kill()
            await auto.wait()
    kinds_seen = [e["kind"] for e in followed]
    assert kinds_seen[0] == "run_started"
    assert "run_ended" in kinds_seen
    assert followed[-1]["note"] == "final"
    whole = _cli(tmp_path, env, "runs", run_id, "--events", "--json")
    assert [json.loads(line) for line in whole.stdout.splitlines()] == followed


async def test_an_autopilot_drive_s_log_holds_its_gates_turns_and_end(
    tmp_path: Path, db_target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = gates_support.write_script(tmp_path, {"rules": gates_support.phase_rules()})
    for key, value in gates_support.agent_env(tmp_path, script).items():
        monkeypatch.setenv(key, value)
    settings = gates_support.make_settings(tmp_path, database=db_support.setting(db_target))
    sink = gates_support.EventSink()
    async with gates_support.open_gates(settings, poll_interval=0.05) as gates:
        await gates.init_task("t", summary="build the thing")
        handle = gates.start_autopilot("t", sink, tool="command", agent_cmd=AGENT_CMD)
        first = await asyncio.wait_for(sink.queue.get(), 30)
        assert first.phase == "research"
        await gates.reject("t", by=APPROVER, reason="Cite your sources.")
        for phase in ("research", "decomposition", "design", "test_design"):
            request = await asyncio.wait_for(sink.queue.get(), 30)
            assert request.phase == phase
            await gates.approve("t", by=APPROVER)
        assert await asyncio.wait_for(handle.wait(), 60) is DriveOutcome.COMPLETE
        drive = await SqliteRunStore(gates.store.db).latest_task_run("autopilot", "t")
        assert drive is not None
        events = await EventLog(gates.store.db).read(drive.id, task="t", since=drive.created_at)
    seen = kinds(events)
    assert seen[0] == "run_started"
    assert events[0].task == "t"
    opened = [e.data["phase"] for e in events if e.kind == "gate_opened"]
    assert opened == ["research", "research", "decomposition", "design", "test_design"]
    decided = [(e.data["decision"], e.data["by"]) for e in events if e.kind == "gate_decided"]
    assert decided == [("rejected", str(APPROVER))] + [("approved", str(APPROVER))] * 4
    rejection = next(e for e in events if e.kind == "gate_decided")
    assert rejection.data["reason"] == "Cite your sources."
    assert rejection.data["sha256"] == first.sha256
    # One turn a phase, research twice (the rejection's revision), each started and ended.
    turns = [e for e in events if e.kind == "turn_ended"]
    assert len(turns) == 10
    assert all(e.data["state"] == "finished" for e in turns)
    assert seen.count("turn_started") == 10
    moved = [e.data["phase"] for e in events if e.kind == "task_moved"]
    assert moved[-1] == "complete"
    ended = [e for e in events if e.kind == "run_ended"]
    assert [e.data["status"] for e in ended] == ["completed"]
    assert [e.id for e in events] == sorted(e.id for e in events)
    # The same log through the command line, in people's words.
    env = gates_support.cli_env(settings)
    shown = _cli(tmp_path, env, "runs", drive.id, "--events")
    assert shown.returncode == 0, shown.stderr
    assert "task t waits for approval of its research" in shown.stdout
    assert "task t: research rejected by" in shown.stdout
    assert "task t: test design approved by" in shown.stdout
    assert "ended: completed" in shown.stdout

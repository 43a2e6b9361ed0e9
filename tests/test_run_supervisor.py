"""The run supervisor: rows, the one session wrapper, "run one turn of run R", recovery."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.errors import NotFoundError, TurnPreempted
from engine.runs import RUN_ID_PATTERN, ChatPlace, RunMode, RunSupervisor
from engine.runs.owner import owner_token
from engine.store.database import Database
from engine.store.runs import RunStatus, SqliteRunStore, TurnState
from engine.testing import ScriptedSession
from engine.turn import TurnOutput
from tests.support import wait_until

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def runs(tmp_path: Path) -> AsyncIterator[SqliteRunStore]:
    async with Database(tmp_path / "t.db") as db:
        yield SqliteRunStore(db)


async def test_open_run_mints_an_id_and_writes_the_row(runs: SqliteRunStore) -> None:
    supervisor = RunSupervisor(runs)
    run_id = await supervisor.open_run(
        RunMode.CHAT, agent="claude", session_id="s1", chat=ChatPlace("-5", "3"), workdir="/w"
    )
    assert RUN_ID_PATTERN.match(run_id)
    record = await runs.get_run(run_id)
    assert (record.mode, record.agent, record.session_id) == ("chat", "claude", "s1")
    assert (record.chat_id, record.thread_id, record.status) == ("-5", "3", RunStatus.RUNNING)


async def test_a_reserved_id_names_the_worktree_before_the_row_is_written(
    runs: SqliteRunStore,
) -> None:
    supervisor = RunSupervisor(runs)
    run_id = supervisor.reserve(RunMode.AUTO)
    assert RUN_ID_PATTERN.match(run_id)
    assert run_id.startswith("auto-")
    assert supervisor.reserve(RunMode.AUTO) != run_id
    with pytest.raises(NotFoundError):
        await runs.get_run(run_id)  # nothing is recorded until the run opens
    assert await supervisor.open_run(RunMode.AUTO, run_id=run_id, agent="a", session_id="s") == (
        run_id
    )
    assert (await runs.get_run(run_id)).mode == "auto"


async def test_run_turn_is_one_call_with_a_run_id_and_a_prompt(runs: SqliteRunStore) -> None:
    supervisor = RunSupervisor(runs)
    agent = ScriptedSession(["done"], session_id="s")
    session = supervisor.attach("auto-20260101-000000-abcdef", agent)
    assert session.session_id == "s"
    out = await supervisor.run_turn("auto-20260101-000000-abcdef", "do it")
    assert out.text == "done"
    assert agent.prompts == ["do it"]
    supervisor.detach("auto-20260101-000000-abcdef")
    with pytest.raises(NotFoundError, match="no session"):
        await supervisor.run_turn("auto-20260101-000000-abcdef", "again")


async def test_slots_cap_turns_across_runs(runs: SqliteRunStore) -> None:
    supervisor = RunSupervisor(runs, slots=asyncio.Semaphore(1))
    agents = [ScriptedSession() for _ in range(3)]
    gate = asyncio.Event()
    for agent in agents:
        agent.gate = gate
    sessions = [supervisor.attach(f"r{i}", a) for i, a in enumerate(agents)]
    turns = [asyncio.create_task(s.run_turn("p")) for s in sessions]
    await wait_until(lambda: sum(a.in_flight for a in agents) == 1)
    gate.set()
    await asyncio.gather(*turns)
    assert max(a.max_in_flight for a in agents) == 1
    assert sum(len(a.prompts) for a in agents) == 3


async def test_a_stop_latch_preempts_the_turn_even_before_it_starts(
    runs: SqliteRunStore,
) -> None:
    supervisor = RunSupervisor(runs)
    agent = ScriptedSession()
    agent.gate = asyncio.Event()  # never set: the turn would run forever
    stop = asyncio.Event()
    told: list[str] = []
    session = supervisor.attach("r", agent, stop=stop, on_stop=lambda: told.append("r"))
    turn = asyncio.create_task(session.run_turn("p"))
    await wait_until(lambda: agent.in_flight == 1)
    assert supervisor.stop("r")
    assert told == ["r"]  # the run's loop is told too (an auto run ends between turns)
    with pytest.raises(TurnPreempted):
        await turn
    with pytest.raises(TurnPreempted, match="before it started"):
        await session.run_turn("again")
    assert not supervisor.stop("unknown")


async def test_parking_starts_no_new_turn_and_waits_for_running_ones(
    runs: SqliteRunStore,
) -> None:
    supervisor = RunSupervisor(runs)
    parking = ScriptedSession()
    parking.gate = asyncio.Event()
    other = ScriptedSession()
    running = asyncio.create_task(supervisor.attach("d", parking, parks=True).run_turn("p"))
    await wait_until(lambda: parking.in_flight == 1)
    supervisor.park()
    waiter = asyncio.create_task(supervisor.wait_turns(asyncio.Event()))
    await asyncio.sleep(0)
    assert not waiter.done()  # the running turn of a parking run finishes first
    parking.gate.set()
    assert (await running).text == "echo: p"
    await asyncio.wait_for(waiter, 5)
    # A new turn of the parked run waits (until the run is cancelled) ...
    held = asyncio.create_task(supervisor.run_turn("d", "next"))
    await asyncio.sleep(0)
    assert not held.done()
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert parking.prompts == ["p"]
    # ... while a run that does not park (a chat session) still runs.
    supervisor.attach("c", other)
    assert (await supervisor.run_turn("c", "hi")).text == "echo: hi"


async def test_recovery_marks_cut_off_turns_and_says_what_resumes(
    runs: SqliteRunStore,
) -> None:
    supervisor = RunSupervisor(runs)
    place = ChatPlace("-1", None)
    chat_crashed = await supervisor.open_run(RunMode.CHAT, agent="a", session_id="1", chat=place)
    chat_parked = await supervisor.open_run(RunMode.CHAT, agent="a", session_id="2", chat=place)
    auto = await supervisor.open_run(RunMode.AUTO, agent="a", session_id="3", chat=place)
    auto_terminal = await supervisor.open_run(RunMode.AUTO, agent="a", session_id="4")
    drive = await supervisor.open_run(
        RunMode.AUTOPILOT, agent="a", session_id="5", chat=place, task="t1"
    )
    done = await supervisor.open_run(RunMode.AUTO, agent="a", session_id="6", chat=place)
    await runs.update_run(chat_parked, status=RunStatus.PARKED)
    await runs.update_run(drive, status=RunStatus.PARKED)
    await runs.update_run(done, status=RunStatus.COMPLETED)
    turn_id = await runs.start_turn(auto, 1, "the prompt", "clarify")
    finished = await runs.start_turn(chat_crashed, 1, "hello", None)
    await runs.finish_turn(finished, TurnOutput.from_text("hi"))

    report = await RunSupervisor(runs).recover()

    assert [(c.turn.id, c.run.id) for c in report.cut_off] == [(turn_id, auto)]
    assert [t.state for t in await runs.turns(auto)] == [TurnState.INTERRUPTED]
    assert sorted(report.closed_chats) == sorted([chat_crashed, chat_parked])
    assert (await runs.get_run(chat_crashed)).status is RunStatus.CRASHED
    assert (await runs.get_run(chat_parked)).status is RunStatus.COMPLETED
    # Only runs a chat follows are resumed by the bot; a terminal run is resumed by hand.
    assert [r.id for r in report.auto] == [auto]
    assert drive not in {r.id for r in report.auto}
    assert [r.id for r in report.drives] == [drive]
    assert (await runs.get_run(drive)).status is RunStatus.PARKED
    assert (await runs.get_run(auto_terminal)).status is RunStatus.RUNNING
    assert (await runs.get_run(done)).status is RunStatus.COMPLETED


async def test_recovery_lists_each_chat_drive_once_and_none_alive_elsewhere(
    tmp_path: Path,
) -> None:
    ticks = iter(range(1, 1000))
    async with Database(tmp_path / "d.db") as db:
        # A clock that always moves: which run of a task is the newest is never a tie.
        runs = SqliteRunStore(db, clock=lambda: float(next(ticks)))
        supervisor = RunSupervisor(runs)
        place = ChatPlace("-5", "7")

        async def drive(task: str, **kwargs: object) -> str:
            return await supervisor.open_run(
                RunMode.AUTOPILOT, agent="a", session_id=task, task=task, **kwargs
            )

        stale = await drive("a", chat=place)  # an older run of a, superseded by the next
        parked = await drive("a", chat=place)
        terminal = await drive("b")
        sub = await drive("a.s1", chat=place, parent=parked)
        alive = await drive("d", chat=place)
        stopped = await drive("e", chat=place)
        crashed = await drive("f", chat=place)
        await runs.update_run(parked, status=RunStatus.PARKED)
        await runs.update_run(stopped, status=RunStatus.STOPPED)
        asked: list[str] = []

        async def drive_alive(task: str) -> bool:
            asked.append(task)
            return task == "d"

        report = await RunSupervisor(runs).recover(drive_alive=drive_alive)

        # Resumed: the chat's drives, each by its newest run, oldest first.
        assert [(r.id, r.task) for r in report.drives] == [(parked, "a"), (crashed, "f")]
        assert report.drives[0].chat_id == "-5"
        assert report.drives[0].thread_id == "7"
        # Not: a terminal's drive, a wave's sub-task (its parent's drive resumes it), a
        # drive another process still runs, a stopped one, a superseded run.
        listed = {r.id for r in report.drives}
        assert not listed & {stale, terminal, sub, alive, stopped}
        assert (await runs.get_run(sub)).parent_id == parked
        assert sorted(asked) == ["a", "d", "f"]
        # Recovery changes no drive's row: the drive that resumes continues it.
        assert (await runs.get_run(alive)).status is RunStatus.RUNNING
        assert (await runs.get_run(parked)).status is RunStatus.PARKED


async def test_starting_a_turn_is_one_transaction_of_two_inserts_on_sqlite(
    runs: SqliteRunStore,
) -> None:
    # Every auto turn starts one: each round trip to the database thread is on its path
    # (bench/bench_automode.py). BEGIN IMMEDIATE already serialises SQLite's writers, so
    # the next attempt and the unknown-run check fit in the INSERT.
    run_id = await RunSupervisor(runs).open_run(RunMode.AUTO, agent="a", session_id="s")
    statements: list[str] = []
    conn = runs._db.conn  # type: ignore[attr-defined]
    await conn.set_trace_callback(statements.append)
    try:
        first = await runs.start_turn(run_id, 1, "p", "clarify")
        second = await runs.start_turn(run_id, 1, "p", "clarify")
    finally:
        await conn.set_trace_callback(None)
    assert [t.attempt for t in await runs.turns(run_id)] == [1, 2]
    assert first != second
    # (The second INSERT is the turn's event, in the same transaction.)
    assert [s.split()[0] for s in statements] == ["BEGIN", "INSERT", "INSERT", "COMMIT"] * 2
    with pytest.raises(NotFoundError):
        await runs.start_turn("auto-20260101-000000-000000", 1, "p", None)


async def test_recovery_leaves_a_run_whose_process_still_runs(runs: SqliteRunStore) -> None:
    """A terminal's chat (or auto run) on this machine is its own process's: a bot starting
    meanwhile neither cuts its turn off nor ends it; one whose process is gone it ends."""
    other = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(60)"
    )
    try:
        live = await runs.create_run(
            "chat-live",
            mode="chat",
            agent="a",
            session_id="s",
            state={"owner": owner_token(other.pid)},
        )
        gone = await runs.create_run(
            "chat-gone", mode="chat", agent="a", session_id="s", state={"owner": "999999999:1"}
        )
        live_turn = await runs.start_turn(live.id, 1, "p", None)
        gone_turn = await runs.start_turn(gone.id, 1, "p", None)
        report = await RunSupervisor(runs).recover()
        assert [c.turn.id for c in report.cut_off] == [gone_turn]
        assert report.closed_chats == ("chat-gone",)
        assert (await runs.get_run("chat-live")).status is RunStatus.RUNNING
        assert [t.state for t in await runs.turns("chat-live")] == [TurnState.STARTED]
        assert live_turn != gone_turn
    finally:
        other.kill()
        await other.wait()

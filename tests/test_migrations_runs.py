"""The runs' own migrations: one status and one session per run, on both databases.

Each database is made at the engine's schema before the migration (15: ``gate_sessions``
beside the runs, an auto run's cursor with a status of its own), given rows the way that
code wrote them, then opened with today's code: the rows are carried over.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from engine.automode.run import resumable
from engine.automode.state import AutoModeState, AutoStatus, Phase
from engine.gates.store import SqlGateStore
from engine.store import MigrationSet, SqliteRunStore
from engine.store.backend import AnyDatabase, open_database
from engine.store.database import ENGINE, load_migrations
from engine.store.location import PostgresURL

BEFORE = 15  # the engine's schema before 0016_drive_sessions and 0017_one_run_status


def _engine_at(version: int) -> list[MigrationSet]:
    return [MigrationSet(ENGINE, tuple(m for m in load_migrations() if m.version <= version))]


async def _run(
    db: AnyDatabase,
    run_id: str,
    *,
    mode: str,
    session: str,
    status: str = "running",
    task: str | None = None,
    state: str = "{}",
    at: float = 1.0,
    agent: str = "claude",
) -> None:
    await db.execute(
        "INSERT INTO runs (id, mode, agent, session_id, status, task, state_json,"
        " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (run_id, mode, agent, session, status, task, state, at, at),
    )


async def _task(db: AnyDatabase, name: str) -> None:
    await db.execute(
        "INSERT INTO gate_tasks (name, folder, workdir, phase, version, created_at,"
        " updated_at) VALUES (?, '/f', '/w', 'research', 1, 1.0, 1.0)",
        (name,),
    )


async def _session(db: AnyDatabase, task: str, session: str, *, started: bool) -> None:
    await db.execute(
        "INSERT INTO gate_sessions (task, agent, session_id, started, updated_at)"
        " VALUES (?, 'claude', ?, ?, 1.0)",
        (task, session, int(started)),
    )


async def _tables(db: AnyDatabase) -> set[str]:
    if db.dialect == "sqlite":
        rows = await db.fetchall("SELECT name FROM sqlite_master WHERE type = 'table'")
    else:
        rows = await db.fetchall(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        )
    return {str(r[0]) for r in rows}


@pytest.fixture
async def migrated(empty: Path | PostgresURL) -> AsyncIterator[AnyDatabase]:
    """A database with rows written at schema 15, then migrated to today's."""
    async with open_database(empty, migrations=_engine_at(BEFORE)) as db:
        assert "gate_sessions" in await _tables(db)
        # Task k: two drives; its session is the one gate_sessions has, started.
        await _task(db, "k")
        await _run(db, "autopilot-k1", mode="autopilot", session="s-k", status="stopped",
                   task="k", at=1.0)  # fmt: skip
        await _run(db, "autopilot-k2", mode="autopilot", session="s-k-stale", task="k", at=2.0)
        await _session(db, "k", "s-k", started=True)
        # Task m: moved off a lost worker, its new session not started yet.
        await _task(db, "m")
        await _run(db, "autopilot-m1", mode="autopilot", session="s-m-lost", task="m")
        await _session(db, "m", "s-m-new", started=False)
        # Task n: a session, but no drive run to carry it.
        await _task(db, "n")
        await _session(db, "n", "s-n", started=True)
        # A chat session's run is no drive: untouched.
        await _run(db, "chat-1", mode="chat", session="s-chat", task="k", at=3.0)
        # Auto runs as the older code wrote them: a status in the cursor too.
        base = AutoModeState(
            run_id="auto-1",
            session_id="s-a",
            objective="goal",
            workdir="/w",
            log_dir="/l",
            max_turns=5,
            tool="claude",
            turn=3,
            phase=Phase.EXECUTE,
            step=4,
            owner="1:2",
        )
        done = replace(base, status=AutoStatus.COMPLETED, finished_at=9.0)
        await _run(db, "auto-1", mode="auto", session="s-a", status="completed",
                   state=json.dumps(done.to_json()))  # fmt: skip
        # A turn failed: the column says crashed, the cursor still said running.
        cut = replace(base, run_id="auto-2")
        await _run(db, "auto-2", mode="auto", session="s-b", status="crashed",
                   state=json.dumps(cut.to_json()))  # fmt: skip
        # A required turn aborted it: crashed, and the cursor's abort says why.
        aborted = replace(base, run_id="auto-3", status=AutoStatus.ERROR, abort="plan failed")
        await _run(db, "auto-3", mode="auto", session="s-c", status="crashed",
                   state=json.dumps(aborted.to_json()))  # fmt: skip
    async with open_database(empty) as db:
        assert await db.schema_version() == load_migrations()[-1].version
        yield db


async def test_a_drives_session_moves_onto_its_run(migrated: AnyDatabase) -> None:
    db = migrated
    assert "gate_sessions" not in await _tables(db)
    runs = SqliteRunStore(db)
    # The newest drive of k carries the task's session; the older run keeps its own.
    assert (await runs.get_run("autopilot-k2")).session_id == "s-k"
    assert (await runs.get_run("autopilot-k1")).session_id == "s-k"
    # m's session was not started: none (its next turn starts one).
    assert (await runs.get_run("autopilot-m1")).session_id == ""
    assert (await runs.get_run("chat-1")).session_id == "s-chat"
    gates = SqlGateStore(db)
    k = await gates.get_session("k")
    assert k is not None
    assert (k.agent, k.session_id, k.started) == ("claude", "s-k", True)
    assert await gates.get_session("m") is None
    assert await gates.get_session("n") is None  # no drive to carry it: a new session
    # The store keeps writing the session on the task's newest drive.
    await gates.save_session("m", "claude", "s-m-2", True)
    assert (await runs.get_run("autopilot-m1")).session_id == "s-m-2"
    await gates.save_session("k", "claude", "s-k-3", False)
    assert (await runs.get_run("autopilot-k2")).session_id == ""
    assert (await runs.get_run("autopilot-k1")).session_id == "s-k"
    assert await gates.get_session("k") is None


async def test_an_auto_runs_status_is_its_runs_only(migrated: AnyDatabase) -> None:
    runs = SqliteRunStore(migrated)
    records = {r: await runs.get_run(r) for r in ("auto-1", "auto-2", "auto-3")}
    for record in records.values():
        assert "status" not in record.state, record.state
        assert record.state["objective"] == "goal"  # the rest of the cursor is kept
    states = {r: AutoModeState.of_run(record) for r, record in records.items()}
    assert states["auto-1"].status is AutoStatus.COMPLETED
    assert states["auto-1"].finished_at == 9.0
    assert (states["auto-1"].phase, states["auto-1"].step) == (Phase.EXECUTE, 4)
    # A failed turn's run is not over: a resume runs the turn again.
    assert states["auto-2"].status is AutoStatus.RUNNING
    assert resumable(states["auto-2"])
    # A required turn's abort is the end of it.
    assert states["auto-3"].status is AutoStatus.ERROR
    assert not resumable(states["auto-3"])
    # What is written from now on carries no status either.
    await runs.update_run("auto-2", state=states["auto-2"].to_json())
    assert "status" not in (await runs.get_run("auto-2")).state

"""The workers' migration to one status per run: a placement keeps no status of its own.

Each database (the workers' tables exist on both) is made at the workers' schema before
the migration (6: ``worker_runs.status`` beside ``runs.status``), given placements the way
that code wrote them, then opened with today's code: each placement says how it stands from
its job and its run's row, and a run its placement had ended is ended in its row too.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.store import MigrationSet, SqliteRunStore
from engine.store.backend import AnyDatabase, open_database
from engine.store.database import ENGINE, load_migrations
from engine.store.location import PostgresURL
from engine.store.runs import RunStatus
from engine.workers.migrations import OWNER
from engine.workers.migrations import migrations as workers_migrations
from engine.workers.store import Job, PlacementStatus, QueuedRun, WorkerStore

BEFORE = 6  # the workers' schema before 0007_placement_job


def _at_before() -> list[MigrationSet]:
    workers = tuple(m for m in workers_migrations().migrations if m.version <= BEFORE)
    return [MigrationSet(ENGINE, load_migrations()), MigrationSet(OWNER, workers)]


async def _placed(
    db: AnyDatabase,
    run_id: str,
    status: str,
    *,
    worker: str | None = None,
    note: str | None = None,
    mode: str = "auto",
) -> None:
    spec = QueuedRun(run_id=run_id, objective="o", tool="claude", project="demo", mode=mode)
    # As placements of that schema wrote it: with what the run's row holds too.
    repeated = {"run_id": run_id, "objective": "o", "tool": "claude", "mode": mode}
    await db.execute(
        "INSERT INTO worker_runs (run_id, spec_json, worker, last_worker, status, note, moves,"
        " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, 0, 1.0, 7.0)",
        (
            run_id,
            json.dumps({**json.loads(spec.to_json()), **repeated}),
            worker,
            worker,
            status,
            note,
        ),
    )


async def _run(
    db: AnyDatabase, run_id: str, status: str, *, exit_code: int | None = None, mode: str = "auto"
) -> None:
    await db.execute(
        "INSERT INTO runs (id, mode, agent, session_id, status, exit_code, created_at,"
        " updated_at) VALUES (?, ?, 'claude', 's', ?, ?, 1.0, 1.0)",
        (run_id, mode, status, exit_code),
    )


@pytest.fixture
async def migrated(empty: Path | PostgresURL) -> AsyncIterator[AnyDatabase]:
    """Placements written at the workers' schema 6, then migrated to today's."""
    async with open_database(empty, migrations=_at_before()) as db:
        # Queued, no worker took it yet (its run has no row before its first step).
        await _placed(db, "auto-waiting", "waiting")
        # A worker runs its steps.
        await _placed(db, "auto-running", "running", worker="w1")
        await _run(db, "auto-running", "running")
        # A drive at its gate: its worker keeps it, no job queued.
        await _placed(db, "autopilot-parked", "parked", worker="w1", mode="autopilot")
        await _run(db, "autopilot-parked", "parked", mode="autopilot")
        # Ended on its worker as its row says.
        await _placed(db, "auto-done", "finished", worker="w1")
        await _run(db, "auto-done", "completed")
        # Ended because it could not go on: its row was left running.
        await _placed(db, "auto-broken", "finished", worker="w1", note="no such project")
        await _run(db, "auto-broken", "running")
        # Stopped by a person between turns, its row not told.
        await _placed(db, "auto-stopped", "stopped", worker="w1", note="Stopped by a person")
        await _run(db, "auto-stopped", "running")
        # Could not start: no row at all.
        await _placed(db, "auto-never", "finished", note="unknown agent")
        # A drive that needs a person: its row stays parked (its task waits there).
        await _placed(db, "autopilot-human", "finished", worker="w1", mode="autopilot")
        await _run(db, "autopilot-human", "parked", mode="autopilot")
    async with open_database(empty) as db:
        assert (await db.schema_versions())[OWNER] == workers_migrations().latest
        yield db


async def test_a_placement_reads_how_it_stands_from_its_job_and_its_run(
    migrated: AnyDatabase,
) -> None:
    workers = WorkerStore(migrated)
    placed = {p.run_id: p for p in await workers.placements()}
    assert {r: (p.status, p.job, p.worker, p.last_worker) for r, p in placed.items()} == {
        "auto-waiting": (PlacementStatus.WAITING, Job.QUEUED, None, None),
        "auto-running": (PlacementStatus.RUNNING, Job.TAKEN, "w1", "w1"),
        "autopilot-parked": (PlacementStatus.PARKED, None, "w1", "w1"),
        "auto-done": (PlacementStatus.FINISHED, None, None, "w1"),
        "auto-broken": (PlacementStatus.FINISHED, None, None, "w1"),
        "auto-stopped": (PlacementStatus.STOPPED, None, None, "w1"),
        "auto-never": (PlacementStatus.FINISHED, None, None, None),
        "autopilot-human": (PlacementStatus.FINISHED, None, None, "w1"),
    }
    assert {r for r, p in placed.items() if p.ended} == {
        "auto-done",
        "auto-broken",
        "auto-stopped",
        "auto-never",
        "autopilot-human",
    }
    assert placed["auto-broken"].note == "no such project"
    # What the run's row holds is read from it; one with no row has it in its JSON.
    specs = {
        r: (p.spec.run_id, p.spec.tool, p.spec.objective, p.spec.mode) for r, p in placed.items()
    }
    assert specs["autopilot-parked"] == ("autopilot-parked", "claude", "", "autopilot")
    assert specs["auto-never"] == ("auto-never", "claude", "o", "auto")
    # The worker that holds them still does; the ended ones are nobody's.
    assert sorted(p.run_id for p in await workers.runs_of("w1")) == [
        "auto-running",
        "autopilot-parked",
    ]


async def test_a_run_its_placement_ended_is_ended_in_its_row(migrated: AnyDatabase) -> None:
    runs = SqliteRunStore(migrated)
    broken = await runs.get_run("auto-broken")
    assert broken.status is RunStatus.ERROR
    assert broken.finished_at == 7.0
    stopped = await runs.get_run("auto-stopped")
    assert (stopped.status, stopped.exit_code) == (RunStatus.STOPPED, 130)
    # The others keep theirs.
    assert (await runs.get_run("auto-done")).status is RunStatus.COMPLETED
    assert (await runs.get_run("auto-running")).status is RunStatus.RUNNING
    assert (await runs.get_run("autopilot-parked")).status is RunStatus.PARKED
    assert (await runs.get_run("autopilot-human")).status is RunStatus.PARKED


async def test_the_placements_own_status_is_gone(migrated: AnyDatabase) -> None:
    if migrated.dialect == "sqlite":
        rows = await migrated.fetchall("PRAGMA table_info(worker_runs)")
        columns = {str(r["name"]) for r in rows}
    else:
        rows = await migrated.fetchall(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'worker_runs'"
        )
        columns = {str(r[0]) for r in rows}
    assert "status" not in columns
    assert "job" in columns

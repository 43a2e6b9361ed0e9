"""Every placement has its run's row (workers 0008), on both databases.

A database is made at the workers' schema before (7), given placements the way code from
before placing wrote the run's row left them: queued and never taken, stopped while queued,
refused before any step; each with what its row would hold in its JSON. Opened with today's
code, each gets the row placing writes now (running while the workers still have it; ended,
stopped or in error, when they are done with it), and a follower of an ended one is told.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine.runs.follow import RunEnded, RunFollower
from engine.store import MigrationSet, SqliteRunStore
from engine.store.backend import AnyDatabase, open_database
from engine.store.database import discover_migrations
from engine.store.location import PostgresURL
from engine.store.runs import RunStatus
from engine.workers.migrations import OWNER
from engine.workers.store import Job, PlacementStatus, QueuedRun, WorkerStore
from engine.workers.views import look_on_workers

BEFORE = 7  # the workers' schema before 0008_placement_run_rows
GROUP = -1001234567890123


def _before() -> list[MigrationSet]:
    return [
        MigrationSet(
            s.owner,
            tuple(m for m in s.migrations if s.owner != OWNER or m.version <= BEFORE),
            s.adopted,
        )
        for s in discover_migrations()
    ]


async def _placed(
    db: AnyDatabase,
    run_id: str,
    *,
    job: Job | None,
    worker: str | None = None,
    note: str | None = None,
    **spec: Any,
) -> None:
    """A placement as code before wrote it: the run's fields in its JSON."""
    base = QueuedRun(run_id=run_id, objective="", tool="", project="demo")
    raw = {**json.loads(base.to_json()), "objective": "o", "tool": "claude", **spec}
    await db.execute(
        "INSERT INTO worker_runs (run_id, spec_json, worker, last_worker, job, note, moves,"
        " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, 0, 1.0, 7.0)",
        (run_id, json.dumps(raw), worker, worker, job.value if job else None, note),
    )


@pytest.fixture
async def migrated(empty: Path | PostgresURL) -> AsyncIterator[AnyDatabase]:
    async with open_database(empty, migrations=_before()) as db:
        assert (await db.schema_versions())[OWNER] == BEFORE
        # Queued from a chat (its ids numbers then, no topic 0), never taken.
        await _placed(db, "auto-queued", job=Job.QUEUED, mode="auto", chat_id=GROUP, thread_id=0)
        # Stopped by a person while queued; refused before its first step; let go
        # with nothing said.
        await _placed(db, "auto-stopped", job=None, note="Stopped by a person", mode="auto")
        await _placed(db, "auto-refused", job=None, note="unknown agent: nope", tool="nope")
        await _placed(db, "auto-silent", job=None)
        # A drive queued from a forum topic: its task's earlier drive left its session;
        # and its wave's sub-task, queued under it.
        await db.execute(
            "INSERT INTO runs (id, mode, agent, session_id, status, task, state_json,"
            " created_at, updated_at)"
            " VALUES ('autopilot-old', 'autopilot', 'claude', 's-old', 'parked', 'T', '{}',"
            " 0.5, 0.5)"
        )
        await _placed(
            db,
            "autopilot-queued",
            job=Job.QUEUED,
            mode="autopilot",
            task="T",
            objective="the task's summary",
            chat_id="room-a",
            thread_id="007",
        )
        await _placed(
            db,
            "autopilot-sub",
            job=Job.QUEUED,
            mode="autopilot",
            task="T-1",
            parent_run="autopilot-queued",
        )
        # Placed with its row, as placing does now: left as it is.
        await db.execute(
            "INSERT INTO runs (id, mode, agent, session_id, status, objective, state_json,"
            " created_at, updated_at) VALUES ('auto-done', 'auto', 'codex', 's', 'completed',"
            " 'kept', '{}', 1.0, 9.0)"
        )
        await db.execute(
            "INSERT INTO worker_runs (run_id, spec_json, worker, last_worker, job, note, moves,"
            " created_at, updated_at) VALUES ('auto-done', ?, NULL, 'w1', NULL, NULL, 0, 1.0,"
            " 9.0)",
            (QueuedRun(run_id="auto-done", objective="", tool="", project="demo").to_json(),),
        )
    async with open_database(empty) as db:
        assert await db.schema_versions() == db.latest_versions
        yield db


async def test_each_placement_has_its_run_s_row(migrated: AnyDatabase) -> None:
    runs = SqliteRunStore(migrated)
    rows = {r.id: r for r in await runs.list_runs()}
    assert set(rows) == {
        "auto-queued",
        "auto-stopped",
        "auto-refused",
        "auto-silent",
        "autopilot-old",
        "autopilot-queued",
        "autopilot-sub",
        "auto-done",
    }
    queued = rows["auto-queued"]
    assert (queued.status, queued.mode, queued.agent, queued.objective) == (
        RunStatus.RUNNING,
        "auto",
        "claude",
        "o",
    )
    assert (queued.chat_id, queued.thread_id) == (str(GROUP), None)
    assert (queued.workdir, queued.session_id, queued.turn, queued.finished_at) == (
        None,
        "",
        0,
        None,
    )
    assert queued.created_at == 1.0
    stopped = rows["auto-stopped"]
    assert (stopped.status, stopped.exit_code, stopped.finished_at) == (
        RunStatus.STOPPED,
        130,
        7.0,
    )
    refused = rows["auto-refused"]
    assert (refused.status, refused.abort_reason, refused.agent) == (
        RunStatus.ERROR,
        "unknown agent: nope",
        "nope",
    )
    silent = rows["auto-silent"]
    assert (silent.status, silent.exit_code, silent.abort_reason) == (
        RunStatus.STOPPED,
        None,
        None,
    )
    drive = rows["autopilot-queued"]
    assert (drive.status, drive.mode, drive.task, drive.session_id, drive.objective) == (
        RunStatus.RUNNING,
        "autopilot",
        "T",
        "s-old",
        "the task's summary",
    )
    assert (drive.chat_id, drive.thread_id, drive.parent_id) == ("room-a", "007", None)
    sub = rows["autopilot-sub"]
    assert (sub.task, sub.parent_id, sub.session_id) == ("T-1", "autopilot-queued", "")
    done = rows["auto-done"]
    assert (done.status, done.agent, done.objective) == (RunStatus.COMPLETED, "codex", "kept")

    placed = {p.run_id: p for p in await WorkerStore(migrated).placements()}
    assert {r: p.status for r, p in placed.items()} == {
        "auto-queued": PlacementStatus.WAITING,
        "auto-stopped": PlacementStatus.STOPPED,
        "auto-refused": PlacementStatus.FINISHED,
        "auto-silent": PlacementStatus.FINISHED,
        "autopilot-queued": PlacementStatus.WAITING,
        "autopilot-sub": PlacementStatus.WAITING,
        "auto-done": PlacementStatus.FINISHED,
    }
    assert all(p.run_status is not None for p in placed.values())
    spec = placed["autopilot-queued"].spec
    assert (spec.mode, spec.task, spec.chat_id, spec.thread_id, spec.objective) == (
        "autopilot",
        "T",
        "room-a",
        "007",
        "the task's summary",
    )


@pytest.mark.parametrize("run_id", ["auto-stopped", "auto-refused", "auto-silent"])
async def test_a_follower_of_a_placement_that_never_started_is_told_it_ended(
    migrated: AnyDatabase, run_id: str
) -> None:
    look = look_on_workers(migrated, run_id, silent_after=5.0)
    follower = RunFollower(migrated, run_id, look, poll=0.05)

    async def last() -> object:
        events = [event async for event in follower.events()]
        return events[-1]

    ended = await asyncio.wait_for(last(), 10)
    assert isinstance(ended, RunEnded)
    assert ended.record.status is not RunStatus.RUNNING
    assert ended.record.workdir is None  # (it ended before its first step)

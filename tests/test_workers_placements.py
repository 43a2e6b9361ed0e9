"""A placement keeps only what is about where its run goes; how the run stands is its row's.

On both databases (the workers' tables exist on SQLite too): a placement's job (queued,
taken, none) and holder say whether it waits, runs, is parked or was let go, and a run the
workers let go reads stopped only when its row says a person stopped it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from engine.store import SqliteRunStore
from engine.store.events import EventLog
from engine.store.runs import RunStatus
from engine.workers.host import record_stopped
from engine.workers.store import Job, PlacementStatus, QueuedRun, WorkerStore


def _spec(run_id: str) -> QueuedRun:
    return QueuedRun(run_id=run_id, objective="o", tool="claude", project="demo")


async def _standing(workers: WorkerStore, run_id: str) -> tuple[PlacementStatus, bool]:
    placement = await workers.placement(run_id)
    assert placement is not None
    return placement.status, placement.ended


async def test_a_placement_stands_by_its_job_and_holder(database: Any) -> None:
    workers, runs = WorkerStore(database), SqliteRunStore(database)
    await workers.place(_spec("auto-1"))
    assert await _standing(workers, "auto-1") == (PlacementStatus.WAITING, False)
    # Placing wrote the run's row: running, its worktree and session its worker's to give.
    placed = await runs.get_run("auto-1")
    assert (placed.status, placed.mode, placed.agent, placed.objective, placed.workdir) == (
        RunStatus.RUNNING,
        "auto",
        "claude",
        "o",
        None,
    )
    before, holder = await workers.take("auto-1", "w1")
    assert before is not None
    assert before.job is Job.QUEUED
    assert holder is None
    assert await _standing(workers, "auto-1") == (PlacementStatus.RUNNING, False)
    # Another worker does not take it from its holder.
    _, holder = await workers.take("auto-1", "w2")
    assert holder == "w1"
    # Held with no job: parked (a drive at its gate).
    await workers.park("auto-1", "waiting for approval at research")
    assert await _standing(workers, "auto-1") == (PlacementStatus.PARKED, False)
    assert [p.run_id for p in await workers.runs_of("w1")] == ["auto-1"]
    # Its worker gone: it waits again, for any worker.
    assert await workers.release("auto-1", "w1", "worker w1 is gone")
    placement = await workers.placement("auto-1")
    assert placement is not None
    assert (placement.status, placement.worker, placement.last_worker, placement.moves) == (
        PlacementStatus.WAITING,
        None,
        "w1",
        1,
    )
    assert placement.note == "worker w1 is gone"
    await workers.take("auto-1", "w2")
    # Not ended: nothing to resubmit.
    assert not await workers.resubmit(_spec("auto-1"), holder="w2")
    await runs.start_placed("auto-1", session_id="s", workdir="/w")
    await runs.update_run("auto-1", status=RunStatus.COMPLETED)
    await workers.let_go("auto-1", "")
    assert await _standing(workers, "auto-1") == (PlacementStatus.FINISHED, True)
    assert await workers.runs_of("w2") == []
    # A job that comes after the end is not taken.
    before, _ = await workers.take("auto-1", "w2")
    assert before is not None
    assert before.ended
    assert await _standing(workers, "auto-1") == (PlacementStatus.FINISHED, True)


async def test_a_run_let_go_reads_stopped_only_when_a_person_stopped_it(database: Any) -> None:
    workers, runs = WorkerStore(database), SqliteRunStore(database)
    for run_id in ("auto-p", "auto-b"):
        await workers.place(_spec(run_id))
        await workers.take(run_id, "w1")
        await runs.start_placed(run_id, session_id="s", workdir="/w")
    # A person's stop: the row is stopped with the stop's exit status.
    await record_stopped(runs, "auto-p")
    await workers.let_go("auto-p", "Stopped by a person")
    assert (await runs.get_run("auto-p")).exit_code == 130
    assert await _standing(workers, "auto-p") == (PlacementStatus.STOPPED, True)
    # A drive's budget stops its run with no exit status.
    await runs.update_run("auto-b", status=RunStatus.STOPPED)
    await workers.let_go("auto-b", "Stopped by its budget")
    assert await _standing(workers, "auto-b") == (PlacementStatus.FINISHED, True)
    # Put back (a raised budget) on its worker: it waits for that worker's job.
    assert await workers.resubmit(_spec("auto-b"), holder="w1")
    placement = await workers.placement("auto-b")
    assert placement is not None
    assert (placement.status, placement.worker, placement.note) == (
        PlacementStatus.WAITING,
        "w1",
        None,
    )
    # Once only: it has not ended again.
    assert not await workers.resubmit(_spec("auto-b"), holder="w1")


async def test_a_placed_run_starts_once_at_its_first_step(database: Any) -> None:
    workers, runs = WorkerStore(database), SqliteRunStore(database)
    log = EventLog(database)
    # A drive's earlier run holds its task's agent session: the next drive's row has it.
    await runs.create_run(
        "autopilot-0", mode="autopilot", agent="claude", session_id="sess", task="t"
    )
    spec = replace(_spec("autopilot-1"), mode="autopilot", task="t", parent_run="autopilot-p")
    await workers.place(spec)
    placed = await runs.get_run("autopilot-1")
    assert (placed.session_id, placed.task, placed.parent_id, placed.workdir) == (
        "sess",
        "t",
        "autopilot-p",
        None,
    )
    assert await log.read("autopilot-1") == []  # placed: not started yet
    # The placement keeps only what the row has no column for, and reads the rest from it.
    row = await database.fetchone(
        "SELECT spec_json FROM worker_runs WHERE run_id = ?", ("autopilot-1",)
    )
    assert not {"run_id", "objective", "tool", "mode", "task", "parent_run"} & set(
        json.loads(row[0])
    )
    placement = await workers.placement("autopilot-1")
    assert placement is not None
    assert placement.spec == spec
    await runs.start_placed("autopilot-1", workdir="/w", phase="research", objective="the task")
    started = [e for e in await log.read("autopilot-1") if e.kind == "run_started"]
    assert [(e.task, e.data) for e in started] == [
        (
            "t",
            {
                "mode": "autopilot",
                "agent": "claude",
                "objective": "the task",
                "phase": "research",
                "parent": "autopilot-p",
            },
        )
    ]
    # Placing a run whose row exists (a chat session's) keeps that row.
    await runs.create_run("chat-1", mode="chat", agent="claude", session_id="c")
    await workers.place(replace(_spec("chat-1"), mode="chat"))
    assert (await runs.get_run("chat-1")).session_id == "c"

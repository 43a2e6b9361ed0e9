"""The workers' tables: who is alive, where each run's turns go, and stop requests.

Portable SQL behind one small store, like the engine's other stores; the tables come from
this package's own migrations (``engine/workers/migrations``, owner ``workers``).

A placement holds what is about where its run goes (the worker that holds it, whether a
job of it is queued or taken, a note) and no status of the run's own: how the run stands
is its row's in ``runs``, read with it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

from engine.errors import ConfigError
from engine.runs import AgentEnv, ChatPlace, RunSpec
from engine.runs.spec import PlaceId, place_id
from engine.spend import Budget
from engine.store.backend import AnyDatabase
from engine.store.runs import insert_run_in
from engine.workers.migrations import OWNER, migrations

__all__ = [
    "AGENT_QUEUE_PREFIX",
    "OWNER",
    "Job",
    "Placement",
    "PlacementStatus",
    "QueuedRun",
    "WorkerRecord",
    "WorkerStatus",
    "WorkerStore",
    "migrations",
]

# A worker listens on ``turnstile.agent.NAME`` for each agent whose CLI it has: that is
# how it records its agents, and how a run's first turn reaches only such workers.
AGENT_QUEUE_PREFIX: Final = "turnstile.agent."


class WorkerStatus(StrEnum):
    ALIVE = "alive"
    STOPPED = "stopped"
    LOST = "lost"


class PlacementStatus(StrEnum):
    """How a run stands on the workers, as read from its placement and its run's row (no
    column holds it: :attr:`Placement.status`)."""

    WAITING = "waiting"
    """A job of the run is queued and no worker has taken it yet."""
    RUNNING = "running"
    FINISHED = "finished"
    STOPPED = "stopped"
    """Let go after a person stopped it."""
    PARKED = "parked"
    """An autopilot drive waiting at an approval gate or for its sub-tasks (no job queued)."""


class Job(StrEnum):
    """Whether a step job of a placed run is queued (no worker took it yet) or taken."""

    QUEUED = "queued"
    TAKEN = "taken"


# How a person's stop ends a run (its exit status), as the auto mode records it.
_STOPPED_BY_PERSON_EXIT: Final = 130


@dataclass(frozen=True, slots=True)
class QueuedRun:
    """What a worker needs to start an auto run it has never seen: plain data, JSON-safe.
    The placement keeps in its JSON only what the run's row has no column for (the run's
    id, objective, agent, chat place, mode, task and parent are the row's).

    ``project`` is a configured project's name, or a repository URL or absolute path that
    every worker reaches. ``chat_id``/``thread_id``: the chat (and topic) a run started
    from the bot belongs to, where ``/status`` lists it and ``/stop`` reaches it. A worker
    turns it into the run's :class:`~engine.runs.RunSpec` once it has checked the project
    out (:meth:`spec_in`): the worktree is its own.

    ``mode`` is ``auto`` or ``autopilot``. An autopilot drive names its ``task``
    (``objective`` is the task's summary); a wave's sub-task names the run it starts from
    (``base_run``, whose pushed branch its worktree is cut from) and the drive to wake when
    it ends (``parent_run``).

    A chat run whose tool calls ask a person (``TURNSTILE_TOOL_APPROVAL`` on the bot) names
    the policy (``tool_approval``) and who bound the session (``approval_starter``): the
    worker wires its agent to the approval server with them.

    ``budget_usd``/``budget_tokens``: what the run may spend (an admin raising it writes
    them again); ``daily_budget``: the chat's cap per day as the control plane that placed
    the run has it (``TURNSTILE_DAILY_BUDGET``), held on the worker whatever its own setting.
    """

    run_id: str
    objective: str
    tool: str
    project: str
    agent_cmd: str | None = None
    passthrough: tuple[str, ...] = ()
    max_turns: int | None = None
    verify_cmd: str | None = None
    chat_id: PlaceId | None = None
    thread_id: PlaceId | None = None
    mode: str = "auto"
    task: str | None = None
    base_run: str | None = None
    parent_run: str | None = None
    tool_approval: str | None = None
    approval_starter: int | None = None
    budget_usd: float | None = None
    budget_tokens: int | None = None
    daily_budget: float | None = None

    @property
    def budget(self) -> Budget | None:
        if self.budget_usd is None and self.budget_tokens is None:
            return None
        return Budget(self.budget_usd, self.budget_tokens)

    def spec_in(self, workdir: Path, env: AgentEnv) -> RunSpec:
        """The run's spec on a worker that has the project checked out at ``workdir``."""
        return RunSpec(
            objective=self.objective,
            agent=self.tool,
            workdir=workdir,
            run_id=self.run_id,
            project=self.project,
            agent_cmd=self.agent_cmd,
            passthrough=self.passthrough,
            max_turns=self.max_turns,
            verify_cmd=self.verify_cmd,
            env=env,
            budget=self.budget,
            # Recorded with the run: the chat's spend today counts its turns too.
            chat=ChatPlace(self.chat_id, self.thread_id) if self.chat_id is not None else None,
        )

    def to_json(self) -> str:
        """What the placement keeps beside its run's row (:meth:`from_row` reads both)."""
        return json.dumps(
            {
                "project": self.project,
                "agent_cmd": self.agent_cmd,
                "passthrough": list(self.passthrough),
                "max_turns": self.max_turns,
                "verify_cmd": self.verify_cmd,
                "base_run": self.base_run,
                "tool_approval": self.tool_approval,
                "approval_starter": self.approval_starter,
                "budget_usd": self.budget_usd,
                "budget_tokens": self.budget_tokens,
                "daily_budget": self.daily_budget,
            }
        )

    @classmethod
    def from_row(cls, row: Any) -> QueuedRun:
        """The spec of a placement read with its run's row (``run_*`` columns, NULL when it
        has none): the run's id, objective, agent, chat place, mode, task and parent are
        its row's; a placement written before its row held them has them in its JSON."""
        raw: dict[str, Any] = json.loads(row["spec_json"])
        if row["run_mode"] is not None:
            raw.update(
                objective=row["run_objective"] or "",
                tool=row["run_agent"],
                chat_id=place_id(row["run_chat_id"]),
                thread_id=place_id(row["run_thread_id"]),
                mode=row["run_mode"],
                task=row["run_task"],
                parent_run=row["run_parent"],
            )
        return cls(
            run_id=row["run_id"],
            objective=str(raw["objective"]),
            tool=str(raw["tool"]),
            project=str(raw["project"]),
            agent_cmd=raw.get("agent_cmd"),
            passthrough=tuple(raw.get("passthrough") or ()),
            max_turns=raw.get("max_turns"),
            verify_cmd=raw.get("verify_cmd"),
            # (a number in a run queued before place ids were text)
            chat_id=place_id(raw.get("chat_id")),
            thread_id=place_id(raw.get("thread_id")),
            mode=str(raw.get("mode") or "auto"),
            task=raw.get("task"),
            base_run=raw.get("base_run"),
            parent_run=raw.get("parent_run"),
            tool_approval=raw.get("tool_approval"),
            approval_starter=raw.get("approval_starter"),
            budget_usd=raw.get("budget_usd"),
            budget_tokens=raw.get("budget_tokens"),
            daily_budget=raw.get("daily_budget"),
        )


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    name: str
    host: str
    pid: int
    capacity: int
    running: int
    queues: tuple[str, ...]
    status: WorkerStatus
    started_at: float
    heartbeat_at: float

    @property
    def agents(self) -> frozenset[str]:
        """The agents whose CLI this worker has (the agent queues it listens on)."""
        return frozenset(
            q.removeprefix(AGENT_QUEUE_PREFIX)
            for q in self.queues
            if q.startswith(AGENT_QUEUE_PREFIX)
        )

    def alive(self, now: float, timeout: float) -> bool:
        """Alive and heard from within ``timeout`` seconds."""
        return self.status is WorkerStatus.ALIVE and now - self.heartbeat_at <= timeout

    @classmethod
    def from_row(cls, row: Any) -> WorkerRecord:
        return cls(
            name=row["name"],
            host=row["host"],
            pid=row["pid"],
            capacity=row["capacity"],
            running=row["running"],
            queues=tuple(json.loads(row["queues"])),
            status=WorkerStatus(row["status"]),
            started_at=row["started_at"],
            heartbeat_at=row["heartbeat_at"],
        )


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a run's turns go: its spec, the worker holding its worktree, its job.

    The run's own status is its row's in ``runs``, written when it was placed
    (``run_status``; None only for a placement from before placing wrote the row, until
    its first step does); :attr:`status` reads how it stands on the workers from both.
    """

    run_id: str
    spec: QueuedRun
    worker: str | None
    last_worker: str | None
    job: Job | None
    note: str | None
    moves: int
    created_at: float
    updated_at: float
    # The run's final report as its worker wrote it (None: not ended, or nothing written).
    report: str | None = None
    run_status: str | None = None
    run_exit_code: int | None = None

    @classmethod
    def from_row(cls, row: Any) -> Placement:
        return cls(
            run_id=row["run_id"],
            spec=QueuedRun.from_row(row),
            worker=row["worker"],
            last_worker=row["last_worker"],
            job=Job(row["job"]) if row["job"] is not None else None,
            note=row["note"],
            moves=row["moves"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            report=row["report"],
            run_status=row["run_status"],
            run_exit_code=row["run_exit_code"],
        )

    @property
    def ended(self) -> bool:
        """The workers are done with it: no worker holds it and no job of it is queued."""
        return self.worker is None and self.job is None

    @property
    def status(self) -> PlacementStatus:
        if self.job is Job.QUEUED:
            return PlacementStatus.WAITING
        if self.job is Job.TAKEN:
            return PlacementStatus.RUNNING
        if not self.ended:
            return PlacementStatus.PARKED  # held, and no job: it waits for its next one
        if self.run_status == "stopped" and self.run_exit_code == _STOPPED_BY_PERSON_EXIT:
            return PlacementStatus.STOPPED
        return PlacementStatus.FINISHED


# A placement with its run's row (every placement has one: placing writes it, and the
# workers' migration 0008 wrote those of placements from before).
_PLACEMENTS: Final = (
    "SELECT w.*, r.status AS run_status, r.exit_code AS run_exit_code, r.mode AS run_mode,"
    " r.agent AS run_agent, r.objective AS run_objective, r.chat_id AS run_chat_id,"
    " r.thread_id AS run_thread_id, r.task AS run_task, r.parent_id AS run_parent"
    " FROM worker_runs w LEFT JOIN runs r ON r.id = w.run_id"
)


async def _add_run_row(conn: Any, spec: QueuedRun, at: float) -> None:
    """Insert the run's row for ``spec`` unless it has one. A drive's carries the agent
    session of its task's newest drive (the gates store reads it from there)."""
    cursor = await conn.execute("SELECT 1 FROM runs WHERE id = ?", (spec.run_id,))
    if await cursor.fetchone() is not None:
        return
    session = ""
    if spec.task is not None:
        cursor = await conn.execute(
            "SELECT session_id FROM runs WHERE mode = ? AND task = ?"
            " ORDER BY created_at DESC, id DESC LIMIT 1",
            (spec.mode, spec.task),
        )
        row = await cursor.fetchone()
        session = row[0] if row is not None else ""
    await insert_run_in(
        conn,
        spec.run_id,
        mode=spec.mode,
        agent=spec.tool,
        session_id=session,
        at=at,
        objective=spec.objective,
        chat_id=spec.chat_id,
        thread_id=spec.thread_id,
        task=spec.task,
        parent_id=spec.parent_run,
    )


class WorkerStore:
    """The workers' tables, on SQLite or PostgreSQL (a placement read with its run's
    status from ``runs``)."""

    def __init__(self, db: AnyDatabase, *, clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self._clock = clock

    # -- workers ---------------------------------------------------------------------
    async def register(
        self, name: str, *, host: str, pid: int, capacity: int, queues: Sequence[str]
    ) -> None:
        """Record this worker as alive (a restart under the same name takes the row over).

        Raises:
            ConfigError: a live worker already has this name.
        """
        now = self._clock()
        async with self._db.transaction() as conn:
            cursor = await conn.execute(
                f"SELECT status, heartbeat_at, host, pid FROM workers WHERE name = ?"  # noqa: S608
                f"{self._db.for_update}",
                (name,),
            )
            row = await cursor.fetchone()
            if row is not None and row["status"] == WorkerStatus.ALIVE.value:
                raise ConfigError(
                    f"a worker named {name!r} is already running (on {row['host']}, "
                    f"pid {row['pid']}); choose another --name"
                )
            if row is not None:
                await conn.execute("DELETE FROM workers WHERE name = ?", (name,))
            await conn.execute(
                "INSERT INTO workers (name, host, pid, capacity, running, queues, status,"
                " started_at, heartbeat_at) VALUES (?, ?, ?, ?, 0, ?, ?, ?, ?)",
                (
                    name,
                    host,
                    pid,
                    capacity,
                    json.dumps(list(queues)),
                    WorkerStatus.ALIVE.value,
                    now,
                    now,
                ),
            )

    async def heartbeat(self, name: str, *, running: int) -> bool:
        """Say this worker is alive; False if it was declared lost meanwhile."""
        count = await self._db.execute(
            "UPDATE workers SET heartbeat_at = ?, running = ? WHERE name = ? AND status = ?",
            (self._clock(), running, name, WorkerStatus.ALIVE.value),
        )
        return count > 0

    async def set_worker_status(self, name: str, status: WorkerStatus) -> None:
        await self._db.execute(
            "UPDATE workers SET status = ?, running = 0 WHERE name = ?", (status.value, name)
        )

    async def revive(self, name: str) -> None:
        """A worker declared lost is answering again (its runs have moved on meanwhile)."""
        await self._db.execute(
            "UPDATE workers SET status = ?, heartbeat_at = ? WHERE name = ?",
            (WorkerStatus.ALIVE.value, self._clock(), name),
        )

    async def workers(self) -> list[WorkerRecord]:
        rows = await self._db.fetchall("SELECT * FROM workers ORDER BY name")
        return [WorkerRecord.from_row(r) for r in rows]

    async def declare_lost(self, silent_after: float) -> list[str]:
        """Mark workers not heard from within ``silent_after`` seconds lost; the names marked.

        One step per worker, so of two workers sweeping at once exactly one marks each.
        """
        cutoff = self._clock() - silent_after
        rows = await self._db.fetchall(
            "SELECT name FROM workers WHERE status = ? AND heartbeat_at < ?",
            (WorkerStatus.ALIVE.value, cutoff),
        )
        lost: list[str] = []
        for row in rows:
            count = await self._db.execute(
                "UPDATE workers SET status = ?, running = 0"
                " WHERE name = ? AND status = ? AND heartbeat_at < ?",
                (WorkerStatus.LOST.value, row["name"], WorkerStatus.ALIVE.value, cutoff),
            )
            if count:
                lost.append(row["name"])
        return lost

    # -- placements ------------------------------------------------------------------
    async def place(self, spec: QueuedRun) -> None:
        """Record the run as placed, its first job queued, and its row in ``runs`` (status
        running, no workdir until its first step on a worker), in one transaction. A run
        whose row exists (a chat session's) keeps it."""
        now = self._clock()
        async with self._db.transaction() as conn:
            await _add_run_row(conn, spec, now)
            await conn.execute(
                "INSERT INTO worker_runs (run_id, spec_json, worker, job, note, moves,"
                " created_at, updated_at) VALUES (?, ?, NULL, ?, NULL, 0, ?, ?)",
                (spec.run_id, spec.to_json(), Job.QUEUED.value, now, now),
            )

    async def placement(self, run_id: str) -> Placement | None:
        row = await self._db.fetchone(f"{_PLACEMENTS} WHERE w.run_id = ?", (run_id,))
        return Placement.from_row(row) if row is not None else None

    async def placements(self) -> list[Placement]:
        rows = await self._db.fetchall(f"{_PLACEMENTS} ORDER BY w.created_at DESC")
        return [Placement.from_row(r) for r in rows]

    async def take(self, run_id: str, worker: str) -> tuple[Placement | None, str | None]:
        """Make ``worker`` the run's holder unless another worker holds it.

        Returns the placement as it stood before, and the holder it had (None: free).
        The holder changes only in this compare-and-set, under the row's lock.
        """
        before, holder, _ = await self.take_and_check(run_id, worker)
        return before, holder

    async def take_and_check(
        self, run_id: str, worker: str
    ) -> tuple[Placement | None, str | None, bool]:
        """:meth:`take`, and whether a stop was asked for the run, in one transaction."""
        async with self._db.transaction() as conn:
            cursor = await conn.execute("SELECT 1 FROM run_stops WHERE run_id = ?", (run_id,))
            stop_asked = await cursor.fetchone() is not None
            cursor = await conn.execute(
                f"SELECT * FROM worker_runs WHERE run_id = ?{self._db.for_update}",  # noqa: S608
                (run_id,),
            )
            if await cursor.fetchone() is None:
                return None, None, stop_asked
            cursor = await conn.execute(f"{_PLACEMENTS} WHERE w.run_id = ?", (run_id,))
            before = Placement.from_row(await cursor.fetchone())
            if before.worker not in (None, worker) or before.ended:
                return before, before.worker, stop_asked
            await conn.execute(
                "UPDATE worker_runs SET worker = ?, last_worker = ?, job = ?, updated_at = ?"
                " WHERE run_id = ?",
                (worker, worker, Job.TAKEN.value, self._clock(), run_id),
            )
            return before, before.worker, stop_asked

    async def set_note(self, run_id: str, note: str) -> None:
        """What the run's placement says beside its run's status (empty: nothing)."""
        await self._db.execute(
            "UPDATE worker_runs SET note = ?, updated_at = ? WHERE run_id = ?",
            (note, self._clock(), run_id),
        )

    async def park(self, run_id: str, note: str) -> None:
        """Its holder keeps it with no job queued: it waits (a gate, its sub-tasks)."""
        await self._db.execute(
            "UPDATE worker_runs SET job = NULL, note = ?, updated_at = ? WHERE run_id = ?",
            (note, self._clock(), run_id),
        )

    async def let_go(self, run_id: str, note: str | None = None) -> None:
        """The workers are done with the run (its row says how it ended): no holder, no job.
        ``note``: why, beside its status (None: left as it was)."""
        sets = "worker = NULL, job = NULL, updated_at = ?"
        params: list[Any] = [self._clock()]
        if note is not None:
            sets += ", note = ?"
            params.append(note)
        params.append(run_id)
        await self._db.execute(
            f"UPDATE worker_runs SET {sets} WHERE run_id = ?",  # noqa: S608
            params,
        )

    async def resubmit(self, spec: QueuedRun, *, holder: str | None) -> bool:
        """Put an ended run back under ``spec`` (a raised budget), a job queued for
        ``holder`` (None: any worker, as a moved run: it is taken from its pushed branch);
        its report is cleared. Compare-and-set on its having ended: False when it had not."""
        released = ", moves = moves + 1" if holder is None else ""
        count = await self._db.execute(
            "UPDATE worker_runs SET spec_json = ?, job = ?, note = NULL, report = NULL,"  # noqa: S608
            f" worker = ?{released}, updated_at = ?"
            " WHERE run_id = ? AND worker IS NULL AND job IS NULL",
            (spec.to_json(), Job.QUEUED.value, holder, self._clock(), spec.run_id),
        )
        return count > 0

    async def set_report(self, run_id: str, report: str) -> None:
        """Keep the run's final report (written before the run is set ended)."""
        await self._db.execute(
            "UPDATE worker_runs SET report = ? WHERE run_id = ?", (report, run_id)
        )

    async def release(self, run_id: str, worker: str, note: str | None = None) -> bool:
        """Free the run ``worker`` held for any worker, a job of it queued (a move;
        compare-and-set: one caller wins)."""
        count = await self._db.execute(
            "UPDATE worker_runs SET worker = NULL, moves = moves + 1, job = ?,"
            " note = COALESCE(?, note), updated_at = ? WHERE run_id = ? AND worker = ?",
            (Job.QUEUED.value, note, self._clock(), run_id, worker),
        )
        return count > 0

    async def runs_of(self, worker: str) -> list[Placement]:
        """The runs ``worker`` holds."""
        rows = await self._db.fetchall(f"{_PLACEMENTS} WHERE w.worker = ?", (worker,))
        return [Placement.from_row(r) for r in rows]

    # -- warm sessions ---------------------------------------------------------------
    async def mark_warm(self, worker: str, run_ids: Iterable[str]) -> None:
        """Record that exactly ``run_ids`` have a resident agent process on ``worker``."""
        warm = sorted(set(run_ids))
        now = self._clock()
        async with self._db.transaction() as conn:
            if warm:
                marks = ", ".join("?" for _ in warm)
                await conn.execute(
                    f"DELETE FROM warm_runs WHERE worker = ? AND run_id NOT IN ({marks})",  # noqa: S608
                    (worker, *warm),
                )
            else:
                await conn.execute("DELETE FROM warm_runs WHERE worker = ?", (worker,))
            for run_id in warm:
                await conn.execute(
                    "INSERT INTO warm_runs (run_id, worker, since) VALUES (?, ?, ?)"
                    " ON CONFLICT (run_id) DO UPDATE SET worker = excluded.worker,"
                    " since = CASE WHEN warm_runs.worker = excluded.worker"
                    " THEN warm_runs.since ELSE excluded.since END",
                    (run_id, worker, now),
                )

    async def warm_runs(self) -> dict[str, str]:
        """run id → the worker its resident agent process is on (as that worker said)."""
        rows = await self._db.fetchall("SELECT run_id, worker FROM warm_runs")
        return {r["run_id"]: r["worker"] for r in rows}

    # -- stop requests ---------------------------------------------------------------
    async def request_stop(self, run_id: str, by: str | None = None) -> None:
        await self._db.execute(
            "INSERT INTO run_stops (run_id, requested_at, requested_by) VALUES (?, ?, ?)"
            " ON CONFLICT (run_id) DO NOTHING",
            (run_id, self._clock(), by),
        )

    async def stop_requested(self, run_id: str) -> bool:
        row = await self._db.fetchone("SELECT 1 FROM run_stops WHERE run_id = ?", (run_id,))
        return row is not None

    async def clear_stop(self, run_id: str) -> None:
        await self._db.execute("DELETE FROM run_stops WHERE run_id = ?", (run_id,))

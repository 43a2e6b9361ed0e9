"""Runs and turns: what ran, what it produced, and what a crash cut off.

Long: every change of a run or a turn is written here with its event (engine.store.events)
in the same transaction, on either database; the records, the store's protocol and the
one implementation stay together.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final

from engine.errors import ConfigError, NotFoundError, TurnSuperseded
from engine.gates.artifacts import SqlArtifactStore
from engine.reaper import TurnProcess, kill_remains
from engine.runs.spec import PlaceId, place_id
from engine.spend import Spend
from engine.store.events import (
    EventKind,
    NewEvent,
    add_event,
    add_events,
    events_written,
    turn_ended,
    turn_started,
)
from engine.turn import TurnOutput

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = [
    "FINISH_TURN",
    "InstructionFile",
    "QueuedInstruction",
    "RunRecord",
    "RunStatus",
    "RunStore",
    "SqliteRunStore",
    "TurnRecord",
    "TurnState",
    "finish_turn_in",
    "finished_values",
    "insert_run_in",
    "stored_state",
]


#: A turn that ran to its end, with its output: then ``WHERE id = ?`` and what follows;
#: its values come from :func:`finished_values`.
FINISH_TURN: Final = (
    "UPDATE turns SET output = ?, output_spill = ?, output_size = ?, exit_code = ?,"
    " stderr_tail = ?, state = ?, finished_at = ?, cost_usd = ?, tokens_input = ?,"
    " tokens_output = ?, tokens_cache_read = ?, tokens_cache_write = ? WHERE id = ?"
)


def finished_values(out: TurnOutput, at: float) -> tuple[Any, ...]:
    """The values of :data:`FINISH_TURN` but the turn's id."""
    return (
        out.text,
        str(out.spill_path) if out.spill_path else None,
        out.size if out.size is not None else len(out.text.encode()),
        out.exit_code,
        out.stderr_tail or None,
        TurnState.FINISHED.value,
        at,
        *Spend.of_turn(out.metadata).columns(),
    )


def stored_state(state: Mapping[str, Any]) -> str:
    """A run's state as ``runs.state_json`` keeps it: without a status of its own, since
    ``runs.status`` is the run's one status (an auto run's cursor has one in memory)."""
    return json.dumps({k: v for k, v in state.items() if k != "status"})


#: The spend of each run's finished turns, summed (``{in}``: the run ids' placeholders).
_SPEND_SUMS: Final = (
    "COUNT(*) AS turns, SUM(cost_usd) AS cost_usd,"
    " SUM(tokens_input) AS tokens_input, SUM(tokens_output) AS tokens_output,"
    " SUM(tokens_cache_read) AS tokens_cache_read,"
    " SUM(tokens_cache_write) AS tokens_cache_write,"
    " SUM(CASE WHEN cost_usd IS NULL AND tokens_input IS NULL AND tokens_output IS NULL"
    " AND tokens_cache_read IS NULL AND tokens_cache_write IS NULL THEN 1 ELSE 0 END)"
    " AS unknown"
)
_SPEND_OF_RUNS: Final = (
    f"SELECT run_id, {_SPEND_SUMS} FROM turns"  # noqa: S608
    " WHERE state = 'finished' AND run_id IN ({in}) GROUP BY run_id"
)


def _summed(row: Any) -> Spend:
    if row is None or not row["turns"]:
        return Spend()
    return Spend.from_columns(row, turns=int(row["turns"]), unknown=int(row["unknown"] or 0))


async def finish_turn_in(
    conn: Any, db: AnyDatabase, turn_id: int, out: TurnOutput, at: float
) -> bool:
    """Record, in the transaction ``conn``, the turn ``turn_id`` ended with ``out``, and its
    event; False when there is no such turn. (The caller wakes the log's followers once
    the transaction is committed: :func:`engine.store.events.events_written`.)"""
    cursor = await conn.execute(
        f"{FINISH_TURN} RETURNING run_id, seq, attempt", (*finished_values(out, at), turn_id)
    )
    row = await cursor.fetchone()
    if row is None:
        return False
    ended = turn_ended(turn_id, int(row[1]), int(row[2]), out)
    await add_event(conn, db, EventKind.TURN_ENDED, run_id=row[0], data=ended, at=at)
    return True


async def insert_run_in(
    conn: Any,
    run_id: str,
    *,
    mode: str,
    agent: str,
    session_id: str,
    at: float,
    objective: str | None = None,
    workdir: str | None = None,
    log_dir: str | None = None,
    chat_id: PlaceId | None = None,
    thread_id: PlaceId | None = None,
    task: str | None = None,
    phase: str | None = None,
    state: Mapping[str, Any] | None = None,
    parent_id: str | None = None,
) -> None:
    """Insert a run's row (status running) in the transaction ``conn``, no event: its
    ``run_started`` is written when it starts (:meth:`SqliteRunStore.create_run`, or the
    first step of a run placed on the workers, :meth:`SqliteRunStore.start_placed`)."""
    await conn.execute(
        "INSERT INTO runs (id, mode, agent, session_id, status, phase, turn, objective,"
        " workdir, log_dir, chat_id, thread_id, task, state_json, created_at,"
        " updated_at, parent_id)"
        " VALUES (?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            run_id,
            mode,
            agent,
            session_id,
            RunStatus.RUNNING.value,
            phase,
            objective,
            workdir,
            log_dir,
            chat_id,
            thread_id,
            task,
            stored_state(state or {}),
            at,
            at,
            parent_id,
        ),
    )


async def _run_started(conn: Any, db: AnyDatabase, run_id: str, at: float) -> None:
    """The run's ``run_started`` event, from its row as it stands in ``conn``."""
    cursor = await conn.execute(
        "SELECT mode, agent, objective, phase, parent_id, task FROM runs WHERE id = ?",
        (run_id,),
    )
    row = await cursor.fetchone()
    started: dict[str, Any] = {"mode": row[0], "agent": row[1], "objective": row[2]}
    if row[3] is not None:
        started["phase"] = row[3]
    if row[4] is not None:
        started["parent"] = row[4]
    await add_event(
        conn, db, EventKind.RUN_STARTED, run_id=run_id, task=row[5], data=started, at=at
    )


class RunStatus(StrEnum):
    RUNNING = "running"
    PARKED = "parked"
    COMPLETED = "completed"
    STOPPED = "stopped"
    ERROR = "error"
    CRASHED = "crashed"


@dataclass(frozen=True, slots=True)
class InstructionFile:
    """A file sent with an instruction: its bytes are stored (``gate_artifacts``, under
    their SHA-256) until the run's next Execute turn writes them into its folder."""

    name: str
    mime: str
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "mime": self.mime, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> InstructionFile:
        return cls(str(raw["name"]), str(raw["mime"]), int(raw["size"]), str(raw["sha256"]))


@dataclass(frozen=True, slots=True)
class QueuedInstruction:
    """An instruction queued for an auto run's next Execute turn (its event), and the
    files sent with it (the text is then their caption, maybe empty)."""

    id: int
    at: float
    text: str
    files: tuple[InstructionFile, ...] = ()

    @property
    def name(self) -> str:
        """Its file's name in the run's inbox: in time order among files dropped there,
        and the same every time it is delivered."""
        return f"{round(self.at * 1e9):020d}-e{self.id}.md"


class TurnState(StrEnum):
    STARTED = "started"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class RunRecord:
    id: str
    mode: str
    agent: str
    session_id: str
    status: RunStatus
    phase: str | None
    turn: int
    objective: str | None
    workdir: str | None
    log_dir: str | None
    chat_id: PlaceId | None
    thread_id: PlaceId | None
    task: str | None
    state: Mapping[str, Any]
    exit_code: int | None
    abort_reason: str | None
    created_at: float
    updated_at: float
    finished_at: float | None
    # The run that drives this one (a wave's sub-task under its parent's drive).
    parent_id: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> RunRecord:
        return cls(
            id=row["id"],
            mode=row["mode"],
            agent=row["agent"],
            session_id=row["session_id"],
            status=RunStatus(row["status"]),
            phase=row["phase"],
            turn=row["turn"],
            objective=row["objective"],
            workdir=row["workdir"],
            log_dir=row["log_dir"],
            # (place_id: a no-topic mark of rows stored before reads as none)
            chat_id=place_id(row["chat_id"]),
            thread_id=place_id(row["thread_id"]),
            task=row["task"],
            state=json.loads(row["state_json"]),
            exit_code=row["exit_code"],
            abort_reason=row["abort_reason"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            finished_at=row["finished_at"],
            parent_id=row["parent_id"],
        )


@dataclass(frozen=True, slots=True)
class TurnRecord:
    id: int
    run_id: str
    seq: int
    attempt: int
    phase: str | None
    prompt: str
    output: str | None
    output_spill: str | None
    output_size: int | None
    exit_code: int | None
    state: TurnState
    error: str | None
    started_at: float
    finished_at: float | None
    # The turn's processes, once it ran (see engine.process.TurnProcess).
    proc_pgid: int | None = None
    proc_start: str | None = None
    proc_marker: str | None = None
    # The redacted end of the agent's stderr (why a turn failed).
    stderr_tail: str | None = None
    # What it cost, as its agent reported it (engine.spend).
    spend: Spend = field(default_factory=Spend)

    @classmethod
    def from_row(cls, row: Any) -> TurnRecord:
        return cls(
            id=row["id"],
            run_id=row["run_id"],
            seq=row["seq"],
            attempt=row["attempt"],
            phase=row["phase"],
            prompt=row["prompt"],
            output=row["output"],
            output_spill=row["output_spill"],
            output_size=row["output_size"],
            exit_code=row["exit_code"],
            state=TurnState(row["state"]),
            error=row["error"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
            proc_pgid=row["proc_pgid"],
            proc_start=row["proc_start"],
            proc_marker=row["proc_marker"],
            stderr_tail=row["stderr_tail"],
            spend=Spend.from_columns(row),
        )

    def kill_remains(self) -> list[int]:
        """Kill what is left of this (cut-off) turn's processes; the pids signalled.

        The group only if its leader's start time still matches the record, so a pid
        reused since is never hit; then every process that carries the turn's marker.
        """
        if self.proc_pgid is None and self.proc_marker is None:
            return []
        return kill_remains(self.proc_pgid, self.proc_start, self.proc_marker)


_RUN_FIELDS = frozenset(
    {
        "status",
        "phase",
        "turn",
        "objective",
        "workdir",
        "log_dir",
        "chat_id",
        "thread_id",
        "task",
        "state",
        "exit_code",
        "abort_reason",
        "finished_at",
        "session_id",
        "parent_id",
    }
)


class SqliteRunStore:
    """Runs and their turns, on either database (SQLite or PostgreSQL: the SQL is portable)."""

    def __init__(self, db: AnyDatabase, *, clock: Any = time.time) -> None:
        self._db = db
        self._clock = clock

    @property
    def db(self) -> AnyDatabase:
        return self._db

    async def create_run(
        self,
        run_id: str,
        *,
        mode: str,
        agent: str,
        session_id: str,
        objective: str | None = None,
        workdir: str | None = None,
        log_dir: str | None = None,
        chat_id: PlaceId | None = None,
        thread_id: PlaceId | None = None,
        task: str | None = None,
        phase: str | None = None,
        state: Mapping[str, Any] | None = None,
        parent_id: str | None = None,
    ) -> RunRecord:
        now = self._clock()
        async with self._db.transaction() as conn:
            await insert_run_in(
                conn,
                run_id,
                mode=mode,
                agent=agent,
                session_id=session_id,
                objective=objective,
                workdir=workdir,
                log_dir=log_dir,
                chat_id=chat_id,
                thread_id=thread_id,
                task=task,
                phase=phase,
                state=state,
                parent_id=parent_id,
                at=now,
            )
            await _run_started(conn, self._db, run_id, now)
        events_written(self._db)
        return await self.get_run(run_id)

    async def start_placed(
        self,
        run_id: str,
        *,
        session_id: str | None = None,
        workdir: str,
        log_dir: str | None = None,
        phase: str | None = None,
        objective: str | None = None,
        state: Mapping[str, Any] | None = None,
    ) -> RunRecord:
        """The first step of a run whose row was written when it was placed on the workers
        (:func:`insert_run_in`, no workdir yet): what only its worker knows (its worktree,
        its agent session), and its ``run_started`` event, as :meth:`create_run` writes it.
        None leaves a column as placed.

        Raises:
            NotFoundError: no such run.
        """
        fields: dict[str, Any] = {"workdir": workdir}
        for name, value in (
            ("session_id", session_id),
            ("log_dir", log_dir),
            ("phase", phase),
            ("objective", objective),
            ("state", state),
        ):
            if value is not None:
                fields[name] = value
        sql, params = self._run_update(run_id, fields)
        async with self._db.transaction() as conn:
            cursor = await conn.execute(sql, params)
            if cursor.rowcount == 0:
                raise NotFoundError(f"no run {run_id!r}")
            await _run_started(conn, self._db, run_id, self._clock())
        events_written(self._db)
        return await self.get_run(run_id)

    async def get_run(self, run_id: str) -> RunRecord:
        row = await self._db.fetchone("SELECT * FROM runs WHERE id = ?", (run_id,))
        if row is None:
            raise NotFoundError(f"no run {run_id!r}")
        return RunRecord.from_row(row)

    async def list_runs(self, *, status: RunStatus | None = None) -> list[RunRecord]:
        if status is None:
            rows = await self._db.fetchall("SELECT * FROM runs ORDER BY created_at DESC")
        else:
            rows = await self._db.fetchall(
                "SELECT * FROM runs WHERE status = ? ORDER BY created_at DESC", (status.value,)
            )
        return [RunRecord.from_row(r) for r in rows]

    async def latest_task_run(self, mode: str, task: str) -> RunRecord | None:
        """The newest run of ``mode`` on ``task`` (an autopilot drive of it), if any."""
        row = await self._db.fetchone(
            "SELECT * FROM runs WHERE mode = ? AND task = ? ORDER BY created_at DESC, id DESC"
            " LIMIT 1",
            (mode, task),
        )
        return RunRecord.from_row(row) if row is not None else None

    def _run_update(self, run_id: str, fields: Mapping[str, Any]) -> tuple[str, tuple[Any, ...]]:
        unknown = set(fields) - _RUN_FIELDS
        if unknown:
            raise ValueError(f"unknown run fields: {sorted(unknown)}")
        columns: list[str] = []
        values: list[Any] = []
        for name, value in fields.items():
            if name == "state":
                columns.append("state_json = ?")
                values.append(stored_state(value))
            else:
                columns.append(f"{name} = ?")
                values.append(value.value if isinstance(value, StrEnum) else value)
        columns.append("updated_at = ?")
        values.append(self._clock())
        sql = f"UPDATE runs SET {', '.join(columns)} WHERE id = ?"  # noqa: S608 - names are vetted
        return sql, (*values, run_id)

    async def update_run(self, run_id: str, **fields: Any) -> RunRecord:
        sql, params = self._run_update(run_id, fields)
        async with self._db.transaction() as conn:
            before = None
            if "status" in fields or "phase" in fields:
                cursor = await conn.execute(
                    f"SELECT status, phase FROM runs WHERE id = ?{self._db.for_update}",  # noqa: S608
                    (run_id,),
                )
                before = await cursor.fetchone()
            cursor = await conn.execute(sql, params)
            if cursor.rowcount == 0:
                raise NotFoundError(f"no run {run_id!r}")
            moved = self._moved(run_id, before, fields)
            await add_events(conn, self._db, moved)
        if moved:
            events_written(self._db)
        return await self.get_run(run_id)

    def _moved(self, run_id: str, before: Any, fields: Mapping[str, Any]) -> list[NewEvent]:
        """The events of a change of the run's status or phase (``before``: the two as they
        were, or None when neither changes)."""
        if before is None or ("status" not in fields and "phase" not in fields):
            return []
        now = self._clock()
        events: list[NewEvent] = []
        was_phase = before[1]
        phase = fields.get("phase", was_phase)
        if "phase" in fields and phase is not None and phase != was_phase:
            moved = {"phase": phase, "from": was_phase}
            events.append(NewEvent(EventKind.PHASE, moved, run_id, at=now))
        status = fields.get("status")
        if status is None or RunStatus(status) is RunStatus(before[0]):
            return events
        status, was = RunStatus(status), RunStatus(before[0])
        data: dict[str, Any]
        if status is RunStatus.PARKED:
            kind, data = EventKind.PARKED, {"phase": phase}
        elif status is RunStatus.RUNNING:
            kind, data = EventKind.RUN_RESUMED, {"from": was.value}
        else:
            kind = EventKind.RUN_ENDED
            data = {
                "status": status.value,
                "exit_code": fields.get("exit_code"),
                "reason": fields.get("abort_reason"),
                "phase": phase,
            }
        events.append(NewEvent(kind, data, run_id, at=now))
        return events

    async def finish_turn_and_update_run(
        self, turn_id: int, out: TurnOutput, run_id: str, **fields: Any
    ) -> None:
        """Record a finished turn and the run's new state in one transaction.

        A crash can then never leave a turn counted without the decision it led to.
        (The run's status and phase as they were come back with the turn's update, read
        before the run's: no statement of their own on every auto turn's path.)
        """
        sql, params = self._run_update(run_id, fields)
        async with self._db.transaction() as conn:
            finished = await conn.execute(
                f"{FINISH_TURN} AND state = ? RETURNING seq, attempt,"  # noqa: S608
                " (SELECT r.status FROM runs r WHERE r.id = ?),"
                " (SELECT r.phase FROM runs r WHERE r.id = ?)",
                (
                    *finished_values(out, self._clock()),
                    turn_id,
                    TurnState.STARTED.value,
                    run_id,
                    run_id,
                ),
            )
            turn = await finished.fetchone()
            if turn is None:
                # Recorded cut off meanwhile (its worker declared lost, the run moved on):
                # neither the turn's result nor the run's new state may land.
                raise TurnSuperseded(f"turn {turn_id} was recorded ended while it ran")
            cursor = await conn.execute(sql, params)
            if cursor.rowcount == 0:
                raise NotFoundError(f"no run {run_id!r}")
            ended = turn_ended(turn_id, int(turn[0]), int(turn[1]), out)
            events = [NewEvent(EventKind.TURN_ENDED, ended, run_id)]
            events += self._moved(run_id, (turn[2], turn[3]), fields)
            await add_events(conn, self._db, events)
        events_written(self._db)

    async def interrupt_run_turns(self, run_id: str, error: str) -> int:
        """Mark one run's turns still recorded as started as interrupted; return how many.

        Unlike :meth:`mark_interrupted` this leaves other runs (maybe live in another
        process sharing the database) alone.
        """
        async with self._db.transaction() as conn:
            cursor = await conn.execute(
                "UPDATE turns SET state = ?, error = ?, finished_at = ? WHERE run_id = ?"
                " AND state = ? RETURNING id, run_id, seq, attempt",
                (
                    TurnState.INTERRUPTED.value,
                    error,
                    self._clock(),
                    run_id,
                    TurnState.STARTED.value,
                ),
            )
            ended = list(await cursor.fetchall())
            await self._cut_off(conn, ended, TurnState.INTERRUPTED, error)
        if ended:
            events_written(self._db)
        return len(ended)

    async def _cut_off(self, conn: Any, turns: list[Any], state: TurnState, error: str) -> None:
        ended = [
            NewEvent(
                EventKind.TURN_ENDED,
                {
                    "turn_id": turn[0],
                    "seq": turn[2],
                    "attempt": turn[3],
                    "state": state.value,
                    "error": error,
                },
                turn[1],
            )
            for turn in turns
        ]
        await add_events(conn, self._db, ended)

    async def start_turn(
        self, run_id: str, seq: int, prompt: str, phase: str | None, *, kind: str | None = None
    ) -> int:
        """Record a turn as started (``kind``: an autopilot turn's, for its event).

        A turn re-run after a crash keeps its sequence number and gets the next attempt;
        the interrupted attempt stays on record.
        """
        async with self._db.transaction() as conn:
            if self._db.for_update:
                # The run's row is the lock that gives the next attempt to one writer at a
                # time: PostgreSQL's transactions run side by side and would both read the
                # same MAX(attempt). (SQLite's BEGIN IMMEDIATE already serialises writers.)
                await conn.execute(
                    f"SELECT id FROM runs WHERE id = ?{self._db.for_update}",  # noqa: S608
                    (run_id,),
                )
            # One statement: the next attempt, and no row at all when the run is unknown.
            # (A turn is on every auto run's hot path: each round trip to the database
            # thread counts, see bench/bench_automode.py.)
            now = self._clock()
            cursor = await conn.execute(
                "INSERT INTO turns (run_id, seq, attempt, phase, prompt, state, started_at)"
                " SELECT r.id, ?, (SELECT COALESCE(MAX(t.attempt), 0) + 1 FROM turns t"
                " WHERE t.run_id = r.id AND t.seq = ?), ?, ?, ?, ? FROM runs r WHERE r.id = ?"
                " RETURNING id, attempt",
                (seq, seq, phase, prompt, TurnState.STARTED.value, now, run_id),
            )
            inserted = await cursor.fetchone()
            if inserted is None:
                raise NotFoundError(f"no run {run_id!r}")
            await add_event(
                conn,
                self._db,
                EventKind.TURN_STARTED,
                run_id=run_id,
                data=turn_started(int(inserted[0]), seq, int(inserted[1]), phase, prompt, kind),
                at=now,
            )
        events_written(self._db)
        return int(inserted[0])

    async def record_turn_process(self, turn_id: int, process: TurnProcess) -> None:
        """Record the running turn's processes (what a start-up after a crash kills)."""
        await self._db.execute(
            "UPDATE turns SET proc_pgid = ?, proc_start = ?, proc_marker = ? WHERE id = ?",
            (process.pgid, process.start, process.marker, turn_id),
        )

    async def finish_turn(self, turn_id: int, out: TurnOutput) -> None:
        async with self._db.transaction() as conn:
            await finish_turn_in(conn, self._db, turn_id, out, self._clock())
        events_written(self._db)

    async def fail_turn(self, turn_id: int, state: TurnState, error: str) -> bool:
        """Record the started turn ended in ``state``; False when its end was recorded
        already (the first end recorded stands)."""
        async with self._db.transaction() as conn:
            cursor = await conn.execute(
                "UPDATE turns SET state = ?, error = ?, finished_at = ? WHERE id = ? AND state = ?"
                " RETURNING id, run_id, seq, attempt",
                (state.value, error, self._clock(), turn_id, TurnState.STARTED.value),
            )
            ended = list(await cursor.fetchall())
            await self._cut_off(conn, ended, state, error)
        if ended:
            events_written(self._db)
        return bool(ended)

    async def queue_instruction(
        self,
        run_id: str,
        text: str,
        *,
        by: str | None = None,
        files: Sequence[InstructionFile] = (),
    ) -> None:
        """Queue ``text`` for the next Execute turn of the auto run ``run_id``, wherever
        it runs: an event of the run's log, which that turn delivers into the run's inbox
        (:meth:`engine.automode.append.InstructionInbox.deliver`). ``by``: who sent it;
        ``files``: stored files sent with it, which that turn writes into the run's folder
        first.

        Raises:
            NotFoundError: no such run.
            ConfigError: not an auto run, or it has ended.
        """
        async with self._db.transaction() as conn:
            cursor = await conn.execute("SELECT mode, status FROM runs WHERE id = ?", (run_id,))
            row = await cursor.fetchone()
            if row is None:
                raise NotFoundError(f"no run {run_id!r}")
            if row[0] != "auto":
                raise ConfigError(f"run {run_id} is not an auto run: only those take instructions")
            if row[1] not in (RunStatus.RUNNING, RunStatus.PARKED):
                raise ConfigError(f"run {run_id} has ended ({row[1]})")
            data: dict[str, Any] = {"text": text, "by": by}
            if files:
                data["files"] = [f.to_json() for f in files]
            await add_event(conn, self._db, EventKind.INSTRUCTION, run_id=run_id, data=data)
        events_written(self._db)

    async def unfinished_in(
        self, mode: str, chat_id: PlaceId, thread_id: PlaceId | None, *, whole_chat: bool = False
    ) -> list[str]:
        """The ids of the chat's (``whole_chat``: any topic's; else ``thread_id``'s) runs
        of ``mode`` that have not ended (running, or parked to go on), oldest first."""
        sql = "SELECT id FROM runs WHERE chat_id = ? AND mode = ? AND status IN (?, ?)"
        params: list[object] = [chat_id, mode, RunStatus.RUNNING.value, RunStatus.PARKED.value]
        if whole_chat:
            pass
        elif thread_id is None:
            sql += " AND thread_id IS NULL"
        else:
            sql += " AND thread_id = ?"
            params.append(thread_id)
        rows = await self._db.fetchall(f"{sql} ORDER BY created_at, id", params)
        return [str(r["id"]) for r in rows]

    async def queued_instructions(
        self, run_id: str, *, before: int | None = None
    ) -> list[QueuedInstruction]:
        """The instructions queued for the run, oldest first; with ``before`` (an Execute
        turn's number), only those queued after the last Execute turn ahead of it started:
        the earlier ones went into that turn's prompt (a run that moved to another machine,
        with a fresh inbox there, must not be given them again)."""
        rows = await self._db.fetchall(
            "SELECT id, at, data_json FROM events WHERE run_id = ? AND kind = ? ORDER BY id",
            (run_id, EventKind.INSTRUCTION.value),
        )
        if not rows:
            return []  # (most runs, at every Execute turn: one short look)
        queued = []
        for row in rows:
            data = json.loads(row["data_json"])
            files = tuple(InstructionFile.from_json(f) for f in data.get("files") or ())
            queued.append(QueuedInstruction(int(row["id"]), float(row["at"]), data["text"], files))
        if before is None:
            return queued
        started = await self._db.fetchall(
            "SELECT id, data_json FROM events WHERE run_id = ? AND kind = ? AND id > ? ORDER BY id",
            (run_id, EventKind.TURN_STARTED.value, queued[0].id),
        )
        taken = 0  # what was queued before the last earlier Execute turn started
        for row in started:
            data = json.loads(row["data_json"])
            if data.get("phase") == "execute" and int(data.get("seq", before)) < before:
                taken = int(row["id"])
        return [q for q in queued if q.id > taken]

    async def instruction_file(self, file: InstructionFile) -> bytes | None:
        """The stored bytes of a file sent with an instruction (None: no longer stored)."""
        found = await SqlArtifactStore(self._db).get(file.sha256)
        return found.content if found is not None else None

    async def turns(self, run_id: str) -> list[TurnRecord]:
        rows = await self._db.fetchall(
            "SELECT * FROM turns WHERE run_id = ? ORDER BY seq, attempt", (run_id,)
        )
        return [TurnRecord.from_row(r) for r in rows]

    async def spend_of(self, run_ids: Collection[str]) -> dict[str, Spend]:
        """What each run's finished turns cost, summed (a run without one: no entry)."""
        ids = list(dict.fromkeys(run_ids))
        out: dict[str, Spend] = {}
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            rows = await self._db.fetchall(
                _SPEND_OF_RUNS.format(**{"in": ", ".join("?" * len(chunk))}), chunk
            )
            for r in rows:
                out[r["run_id"]] = _summed(r)
        return out

    async def spend_in_chat(self, chat_id: PlaceId, *, since: float) -> Spend:
        """What the turns of a chat's runs that finished since ``since`` cost."""
        row = await self._db.fetchone(
            f"SELECT {_SPEND_SUMS} FROM turns t JOIN runs r ON r.id = t.run_id"  # noqa: S608
            " WHERE r.chat_id = ? AND t.state = 'finished' AND t.finished_at >= ?",
            (chat_id, since),
        )
        return _summed(row)

    async def spend_of_tasks(self, names: Collection[str]) -> dict[str, Spend]:
        """What each task's runs (its drives, a sub-task's own) cost so far."""
        names = list(dict.fromkeys(names))
        if not names:
            return {}
        marks = ", ".join("?" * len(names))
        rows = await self._db.fetchall(
            f"SELECT r.task AS task, {_SPEND_SUMS} FROM turns t"  # noqa: S608
            f" JOIN runs r ON r.id = t.run_id WHERE r.task IN ({marks})"
            " AND t.state = 'finished' GROUP BY r.task",
            names,
        )
        return {r["task"]: _summed(r) for r in rows}

    async def mark_interrupted(self, *, leave: Collection[str] = ()) -> list[TurnRecord]:
        """On start-up: every turn still marked started was cut off by a crash, but those of
        the runs ``leave`` (held by another process sharing the database: a worker's)."""
        rows = await self._db.fetchall(
            "SELECT * FROM turns WHERE state = ?", (TurnState.STARTED.value,)
        )
        ids = [r["id"] for r in rows if r["run_id"] not in leave]
        if not ids:
            return []  # (and no empty "IN ()", which PostgreSQL refuses)
        marks = ",".join("?" * len(ids))
        error = "the process stopped while this turn ran"
        async with self._db.transaction() as conn:
            cursor = await conn.execute(
                f"UPDATE turns SET state = ?, error = ?, finished_at = ?"  # noqa: S608 - marks
                f" WHERE state = ? AND id IN ({marks}) RETURNING id, run_id, seq, attempt",
                (
                    TurnState.INTERRUPTED.value,
                    error,
                    self._clock(),
                    TurnState.STARTED.value,
                    *ids,
                ),
            )
            ended = sorted(await cursor.fetchall(), key=lambda r: int(r[0]))
            await self._cut_off(conn, ended, TurnState.INTERRUPTED, error)
        events_written(self._db)
        refreshed = await self._db.fetchall(
            f"SELECT * FROM turns WHERE id IN ({marks}) ORDER BY id",  # noqa: S608 - only marks
            ids,
        )
        return [TurnRecord.from_row(r) for r in refreshed]


#: The store of runs and turns (one implementation serves both databases).
RunStore = SqliteRunStore

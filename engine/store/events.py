"""One event log for every run: each change of a run is a typed event in one table.

A store that changes a run, a turn, a task's gate or a tool request writes the event in
the same transaction (:func:`add_event`), so the log never says what did not happen nor
misses what did. Every event has a cursor (its ``id``); a front end reads on from the last
one it rendered (:meth:`EventLog.read`) or follows a run as it goes (:meth:`EventLog.follow`):
woken by PostgreSQL's ``LISTEN``/``NOTIFY`` there, by the writer itself in one process on
SQLite, and by a short poll for a SQLite file another process writes.

Ids are handed out in commit order: SQLite has one writer at a time, and on PostgreSQL an
event is written under a transaction-level advisory lock taken at the end of the
transaction, so a follower reading ``id > cursor`` never skips an event committed late.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final

from engine.spend import Spend
from engine.store.backend import execute_later
from engine.store.dialect import advisory_key

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase
    from engine.turn import TurnOutput

__all__ = [
    "CHANNEL",
    "EventKind",
    "EventLog",
    "NewEvent",
    "RunEvent",
    "add_event",
    "add_events",
    "events_written",
    "turn_ended",
    "turn_started",
]

#: The PostgreSQL channel an event's writer notifies (the payload is the run id or task).
CHANNEL: Final = "turnstile_events"
#: The advisory lock that hands event ids out in commit order on PostgreSQL.
_ORDER_KEY: Final = advisory_key("turnstile events")


class EventKind(StrEnum):
    """What changed."""

    RUN_STARTED = "run_started"  # mode, agent, objective, task, parent
    RUN_RESUMED = "run_resumed"  # status it was resumed from
    PHASE = "phase"  # the run moved to a phase
    PARKED = "parked"  # the run waits (for a person, a sub-task)
    TURN_STARTED = "turn_started"  # turn_id, seq, attempt, phase, prompt (its head)
    TURN_ENDED = "turn_ended"  # turn_id, state, exit_code, size, error
    NOTE = "note"  # a text for the people following the run, and what it is
    TASK_MOVED = "task_moved"  # a task's phase changed (from, to, why)
    GATE_OPENED = "gate_opened"  # phase, sha256, round
    GATE_DECIDED = "gate_decided"  # approved / rejected / an approval counted
    TOOL_REQUESTED = "tool_requested"  # request_id, tool, summary
    TOOL_DECIDED = "tool_decided"  # request_id, decision, by
    QUESTION_ASKED = "question_asked"  # question_id, question, options
    QUESTION_ANSWERED = "question_answered"  # question_id, answer, by (or withdrawn: reason)
    PAUSED = "paused"  # by: the run waits after its current tool call
    PAUSE_ENDED = "pause_ended"  # by: the run goes on
    FILE_OUT = "file_out"  # a file handed to the people following the run
    INSTRUCTION = "instruction"  # text, by: for the auto run's next Execute turn
    RUN_ENDED = "run_ended"  # status, exit_code, reason


@dataclass(frozen=True, slots=True)
class RunEvent:
    """One row of the log."""

    id: int
    kind: str
    at: float
    run_id: str | None
    task: str | None
    data: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: Any) -> RunEvent:
        return cls(
            id=int(row["id"]),
            kind=row["kind"],
            at=float(row["at"]),
            run_id=row["run_id"],
            task=row["task"],
            data=json.loads(row["data_json"]),
        )

    def to_json(self) -> dict[str, Any]:
        """The event as one flat JSON object: ``id``, ``kind``, ``run_id``, ``task``,
        ``at``, then what the kind carries."""
        fixed = {"id": self.id, "kind": self.kind, "run_id": self.run_id, "task": self.task}
        return {**fixed, "at": self.at, **{k: v for k, v in self.data.items() if k not in fixed}}

    @property
    def ends_run(self) -> bool:
        return self.kind == EventKind.RUN_ENDED


#: How much of a prompt the log keeps (the whole prompt is the turn's).
_PROMPT_HEAD = 300


def turn_started(
    turn_id: int, seq: int, attempt: int, phase: str | None, prompt: str, kind: str | None = None
) -> dict[str, Any]:
    """What a turn-started event carries: a chat turn's prompt is what a person wrote (its
    head); a phase's prompt is the mode's own text, known by the phase. ``kind``: which of
    its phase's turns an autopilot turn is (``phase``, ``revision``), as its drive says it."""
    started: dict[str, Any] = {"turn_id": turn_id, "seq": seq, "attempt": attempt, "phase": phase}
    if phase is None:
        started["prompt"] = prompt[:_PROMPT_HEAD]
    if kind is not None:
        started["turn_kind"] = kind
    return started


def turn_ended(turn_id: int, seq: int, attempt: int, out: TurnOutput) -> dict[str, Any]:
    """What the event of a turn that ran to its end carries."""
    spend = Spend.of_turn(out.metadata)
    ended: dict[str, Any] = {
        "turn_id": turn_id,
        "seq": seq,
        "attempt": attempt,
        "state": "finished",
        "exit_code": out.exit_code,
        "size": out.size if out.size is not None else len(out.text.encode()),
        "spilled": out.spill_path is not None,
    }
    if spend.known:
        ended.update(spend.to_json())
    return ended


_INSERT: Final = "INSERT INTO events (run_id, task, kind, at, data_json) VALUES (?, ?, ?, ?, ?)"


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event to write (:func:`add_events`)."""

    kind: EventKind
    data: Mapping[str, Any]
    run_id: str | None = None
    task: str | None = None
    at: float | None = None

    def values(self) -> tuple[Any, ...]:
        if self.run_id is None and self.task is None:
            raise ValueError("an event belongs to a run or a task")
        return (
            self.run_id,
            self.task,
            self.kind.value,
            time.time() if self.at is None else self.at,
            json.dumps(dict(self.data), separators=(",", ":"), default=str),
        )


async def add_events(conn: Any, db: AnyDatabase, events: Sequence[NewEvent]) -> None:
    """Write ``events`` in the transaction ``conn`` of ``db``, in order: like
    :func:`add_event`, several in one go (one statement on SQLite, one round trip with
    the COMMIT on PostgreSQL)."""
    if not events:
        return
    rows = [event.values() for event in events]
    if db.dialect == "postgresql":
        await execute_later(conn, "SELECT pg_advisory_xact_lock(?)", (_ORDER_KEY,))
        for row in rows:
            await execute_later(conn, _INSERT, row)
        for subject in dict.fromkeys(e.run_id or e.task for e in events):
            await execute_later(conn, "SELECT pg_notify(?, ?)", (CHANNEL, subject))
    else:
        await conn.executemany(_INSERT, rows)


async def add_event(
    conn: Any,
    db: AnyDatabase,
    kind: EventKind,
    *,
    run_id: str | None = None,
    task: str | None = None,
    data: Mapping[str, Any] | None = None,
    at: float | None = None,
) -> None:
    """Write one event in the transaction ``conn`` of ``db`` (the store's own change).

    Call it last in the transaction: on PostgreSQL it takes the lock that orders the log
    until the commit (all of it goes with the COMMIT, in one round trip). After the
    transaction, :func:`events_written` wakes the followers in this process.
    """
    await add_events(conn, db, [NewEvent(kind, data or {}, run_id, task, at)])


# Followers in this process, per database: woken once a transaction with events committed.
_followers: weakref.WeakKeyDictionary[Any, set[asyncio.Event]] = weakref.WeakKeyDictionary()


def events_written(db: AnyDatabase) -> None:
    """Wake this process's followers of ``db`` (after a commit that wrote events)."""
    for waiter in _followers.get(db, ()):
        waiter.set()


class EventLog:
    """Reads and follows the log of one database."""

    def __init__(self, db: AnyDatabase, *, poll: float = 0.25) -> None:
        self._db = db
        self._poll = poll

    async def read(
        self,
        run_id: str,
        *,
        task: str | None = None,
        after: int = 0,
        limit: int = 1000,
        since: float | None = None,
        children: bool = False,
    ) -> list[RunEvent]:
        """The run's events after the cursor ``after``, oldest first; with ``task``, the
        task's own events too (its gates: an autopilot drive's), from ``since`` on; with
        ``children``, the events of the runs it started (a drive's wave sub-tasks)."""
        where = ["run_id = ?"]
        params: list[object] = [run_id]
        if children:
            where.append("run_id IN (SELECT id FROM runs WHERE parent_id = ?)")
            params.append(run_id)
        if task is not None:
            where.append("(task = ? AND run_id IS NULL AND at >= ?)")
            params += [task, since or 0.0]
        rows = await self._db.fetchall(
            f"SELECT * FROM events WHERE id > ? AND ({' OR '.join(where)}) ORDER BY id LIMIT ?",  # noqa: S608 (fixed clauses)
            (after, *params, limit),
        )
        return [RunEvent.from_row(r) for r in rows]

    async def follow(
        self,
        run_id: str,
        *,
        task: str | None = None,
        after: int = 0,
        since: float | None = None,
        until: Callable[[RunEvent], bool] = lambda event: event.ends_run,
        linger: float = 0.5,
    ) -> AsyncIterator[RunEvent]:
        """The run's events from the cursor on, as they are written, up to and including
        the first one ``until`` accepts (by default: the run's end), then those written
        within ``linger`` seconds of it (a run's final report follows its end)."""
        cursor = after
        deadline: float | None = None
        async with self.wakeups() as wait:
            while True:
                for event in await self.read(run_id, task=task, after=cursor, since=since):
                    cursor = event.id
                    yield event
                    if deadline is None and until(event):
                        deadline = time.monotonic() + linger
                if deadline is not None and time.monotonic() >= deadline:
                    return
                await wait()

    async def last_id(self) -> int:
        """The cursor of the newest event (0: none yet)."""
        row = await self._db.fetchone("SELECT MAX(id) AS last FROM events")
        return int(row["last"] or 0) if row is not None else 0

    async def tail(
        self, kinds: Collection[EventKind], *, after: int = 0, limit: int = 200
    ) -> AsyncGenerator[RunEvent, None]:
        """Every run's and task's events of these ``kinds`` from the cursor on, as they are
        written, without end (a front end announcing what any process did)."""
        marks = ", ".join("?" * len(kinds))
        query = f"SELECT * FROM events WHERE id > ? AND kind IN ({marks}) ORDER BY id LIMIT ?"  # noqa: S608
        cursor = after
        async with self.wakeups() as wait:
            while True:
                rows = await self._db.fetchall(query, (cursor, *kinds, limit))
                for row in rows:
                    event = RunEvent.from_row(row)
                    cursor = event.id
                    yield event
                if len(rows) < limit:
                    await wait()

    @contextlib.asynccontextmanager
    async def wakeups(self) -> AsyncIterator[Callable[[], Any]]:
        """A ``wait()`` that returns once events may have been written, or after a poll."""
        listen = getattr(self._db, "listen", None)
        if listen is not None:
            async with listen(CHANNEL) as notified:
                yield lambda: notified(self._poll * 4)
            return
        waiter = asyncio.Event()
        _followers.setdefault(self._db, set()).add(waiter)

        async def wait() -> None:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that
            # lands as its timeout fires, and a follower that is stopped never ends.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll):
                    await waiter.wait()
            waiter.clear()

        try:
            yield wait
        finally:
            _followers.get(self._db, set()).discard(waiter)

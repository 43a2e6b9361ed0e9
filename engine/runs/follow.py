"""Follow one run through the event log: its turns as they start and end, its notes, its end.

The one follower a front end renders a run from (the bot's auto runs and drives on the
workers, ``turnstile auto`` and ``turnstile autopilot`` following a run on them): it reads
the log from a cursor (:meth:`~engine.store.events.EventLog.read`), woken by PostgreSQL's
``NOTIFY`` or this process's writers, and gives each event once. Where the run executes is
not in the log, only in a look its caller passes in (on the workers: its placement, and
whether it waits for a worker, which depends on heartbeats that age without any write):
the look is taken with each batch and at each wake-up (about once a second when nothing is
written). The run has ended once its row says so and the look says it is done there.

A follower that stops (the database away a moment) or a new one given the cursor its user
kept (``after``: the last event it showed) goes on without giving an event twice.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from engine.automode.state import AutoModeState, rounds_of
from engine.errors import NotFoundError
from engine.runs.ids import RunMode
from engine.sink import RunText, TextKind
from engine.store.backend import AnyDatabase
from engine.store.events import EventKind, EventLog, RunEvent
from engine.store.runs import RunRecord, RunStatus, SqliteRunStore, TurnRecord

__all__ = [
    "Followed",
    "Looked",
    "Note",
    "RunEnded",
    "RunFollower",
    "TurnEnded",
    "TurnStarted",
    "Where",
    "run_or_none",
]


class Where(Protocol):
    """Where a run executes, as its caller's look sees it now."""

    @property
    def ended(self) -> bool:
        """Whether it is done there (its last words written: a final report, say)."""
        ...


W = TypeVar("W", bound=Where)


@dataclass(frozen=True, slots=True)
class Looked(Generic[W]):
    """The look's answer changed (the first look included)."""

    where: W


@dataclass(frozen=True, slots=True)
class TurnStarted(Generic[W]):
    """A turn began (``attempt`` > 1: a cut-off turn run again); ``state`` None: a turn
    of a run that keeps no auto-mode state (an autopilot drive's)."""

    cursor: int
    run_id: str
    seq: int
    attempt: int
    phase: str | None
    started_at: float
    where: W
    state: AutoModeState | None
    round: int = 0  # an auto run's round this turn ran in (the state has moved on since)


@dataclass(frozen=True, slots=True)
class TurnEnded(Generic[W]):
    """A turn ended: finished (its row has its output and exit code), failed or
    interrupted; ``state`` as :class:`TurnStarted`'s."""

    cursor: int
    run_id: str
    turn: TurnRecord
    where: W
    state: AutoModeState | None
    round: int = 0


@dataclass(frozen=True, slots=True)
class Note:
    """A text the run said to the people following it (its note event), as it said it."""

    cursor: int
    said: RunText


@dataclass(frozen=True, slots=True)
class RunEnded(Generic[W]):
    """The run ended (its row says how; before its first step it has no workdir)."""

    run_id: str
    record: RunRecord
    where: W

    @property
    def state(self) -> AutoModeState | None:
        return _auto_state(self.record)


#: What a follower gives: these, and the log's other events (its task's moves, gates) as
#: they are.
Followed = Looked[W] | TurnStarted[W] | TurnEnded[W] | Note | RunEvent | RunEnded[W]

_TURNS = (EventKind.TURN_STARTED, EventKind.TURN_ENDED)
_PAGE = 1000


@dataclass
class RunFollower(Generic[W]):
    """The events of one run, in order, until it ends.

    ``task``: its task's own events too (an autopilot drive's gates), from ``since`` on.
    ``after``: the cursor, moved on as events are given (a follower started again with it
    gives none twice). ``children``: the events of the runs it started too (a drive's
    wave sub-tasks: their turns and notes carry their own run ids), in the log's order.
    """

    db: AnyDatabase
    run_id: str
    look: Callable[[], Awaitable[W]]
    task: str | None = None
    since: float | None = None
    after: int = 0
    poll: float = 0.25
    children: bool = False

    async def events(self) -> AsyncGenerator[Followed[W], None]:
        """Yield the run's events; the last one is :class:`RunEnded`."""
        log = EventLog(self.db, poll=self.poll)
        runs = SqliteRunStore(self.db)
        seen: W | None = None
        async with log.wakeups() as wait:
            while True:
                # The events before the look: a worker takes a run before it starts a turn,
                # so the look names the worker of every turn read.
                batch = await self._read(log, self.after)
                where = await self.look()
                if where.ended:  # what it wrote before it was done there is read too
                    batch += await self._read(log, batch[-1].id if batch else self.after)
                if where != seen:
                    seen = where
                    yield Looked(where)
                turns: dict[int, TurnRecord] = {}
                record: RunRecord | None = None
                if any(e.kind in _TURNS for e in batch):
                    record = await run_or_none(runs, self.run_id)
                    for run_id in {e.run_id or self.run_id for e in batch if e.kind in _TURNS}:
                        turns.update({t.id: t for t in await runs.turns(run_id)})
                state = _auto_state(record) if record is not None else None
                rounds = (
                    rounds_of((t.seq, t.phase) for t in turns.values()) if state is not None else {}
                )
                for event in batch:
                    given = self._typed(event, where, turns, state, rounds)
                    self.after = event.id
                    if given is not None:
                        yield given
                if where.ended:
                    record = await run_or_none(runs, self.run_id)
                    if record is not None and record.status is not RunStatus.RUNNING:
                        yield RunEnded(self.run_id, record, where)
                        return
                await wait()

    async def _read(self, log: EventLog, after: int) -> list[RunEvent]:
        """All the events after ``after`` (a long run followed from its start: in pages)."""
        found: list[RunEvent] = []
        while True:
            page = await log.read(
                self.run_id,
                task=self.task,
                after=after,
                since=self.since,
                limit=_PAGE,
                children=self.children,
            )
            found += page
            if len(page) < _PAGE:
                return found
            after = page[-1].id

    def _typed(
        self,
        event: RunEvent,
        where: W,
        turns: dict[int, TurnRecord],
        state: AutoModeState | None,
        rounds: dict[int, int],
    ) -> Followed[W] | None:
        data = event.data
        if event.kind == EventKind.TURN_STARTED:
            seq = int(data["seq"])
            return TurnStarted(
                event.id,
                event.run_id or self.run_id,
                seq,
                int(data["attempt"]),
                data.get("phase"),
                event.at,
                where,
                state,
                rounds.get(seq, 0),
            )
        if event.kind == EventKind.TURN_ENDED:
            turn = turns.get(int(data["turn_id"]))
            if turn is None:
                return None  # (not a turn of this run)
            run_id = event.run_id or self.run_id
            return TurnEnded(event.id, run_id, turn, where, state, rounds.get(turn.seq, 0))
        if event.kind == EventKind.NOTE:
            said = RunText(
                event.run_id or self.run_id,
                str(data.get("text", "")),
                TextKind(data.get("note", TextKind.NOTE)),
                task=event.task,
                body=data.get("body"),
            )
            return Note(event.id, said)
        return event


def _auto_state(record: RunRecord) -> AutoModeState | None:
    """An auto run's state; None for an autopilot drive's run (its task holds its state),
    or before its first step (its row as placing wrote it)."""
    if record.mode != RunMode.AUTO or record.workdir is None:
        return None
    return AutoModeState.of_run(record)


async def run_or_none(runs: SqliteRunStore, run_id: str) -> RunRecord | None:
    """The run's row, or None when there is no such run."""
    try:
        return await runs.get_run(run_id)
    except NotFoundError:
        return None

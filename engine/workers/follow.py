"""Follow a run on the workers from the store: its turns as they start and end, its end.

The one follower of the control plane (``turnstile auto`` without ``--detach``, the bot's
auto runs): nothing here reads a worker's disk. Each interval costs one indexed read (a
fingerprint of the run's placement, row and turns); only when it changes are the rows
themselves read. Whether the run waits for a worker depends on heartbeats, which age
without any write, so that is looked at every few intervals as well.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from engine.automode.state import AutoModeState, rounds_of
from engine.errors import ConfigError, NotFoundError
from engine.runs import RunMode
from engine.store.backend import AnyDatabase
from engine.store.runs import RunRecord, RunStatus, SqliteRunStore, TurnRecord, TurnState
from engine.workers.store import Placement, WorkerStore
from engine.workers.views import waiting_note

__all__ = [
    "RunEnded",
    "RunEvent",
    "RunFollower",
    "TurnEnded",
    "TurnStarted",
    "Waiting",
    "run_or_none",
]

_POLL: Final = 0.25
# Heartbeats age without a write: the waiting note is re-checked every this many polls.
_NOTE_EVERY: Final = 4

_FINGERPRINT: Final = (
    "SELECT w.job, w.worker, w.note, w.moves, w.updated_at, r.status AS run_status,"
    " r.updated_at AS run_updated,"
    " (SELECT COUNT(*) FROM turns t WHERE t.run_id = w.run_id) AS turns,"
    " (SELECT MAX(t.finished_at) FROM turns t WHERE t.run_id = w.run_id) AS turn_end"
    " FROM worker_runs w LEFT JOIN runs r ON r.id = w.run_id WHERE w.run_id = ?"
)


@dataclass(frozen=True, slots=True)
class TurnStarted:
    """A turn began on ``worker`` (``attempt`` > 1: a cut-off turn run again); ``state``
    None: a turn of an autopilot drive (which keeps no auto-mode state)."""

    run_id: str
    seq: int
    attempt: int
    phase: str | None
    worker: str | None
    started_at: float
    state: AutoModeState | None
    round: int = 0  # an auto run's round this turn ran in (the state has moved on since)


@dataclass(frozen=True, slots=True)
class TurnEnded:
    """A turn ended: finished (with its output and exit code), failed or interrupted;
    ``state`` None: a turn of an autopilot drive."""

    run_id: str
    turn: TurnRecord
    worker: str | None
    state: AutoModeState | None
    round: int = 0  # as TurnStarted's


@dataclass(frozen=True, slots=True)
class Waiting:
    """Why the run waits for a worker now; ``note`` None: it no longer waits."""

    run_id: str
    note: str | None


@dataclass(frozen=True, slots=True)
class RunEnded:
    """The run ended (before its first step, when its row has no workdir: a stop, or a
    bad project, say)."""

    run_id: str
    record: RunRecord
    placement: Placement

    @property
    def state(self) -> AutoModeState | None:
        return _auto_state(self.record)


RunEvent = TurnStarted | TurnEnded | Waiting | RunEnded


@dataclass
class RunFollower:
    """The events of one run on the workers, in order, until it ends.

    ``started``/``ended``: the turns (``(seq, attempt)``) already seen, for a follower
    that resumes after a restart: their events are not given again.
    """

    db: AnyDatabase
    run_id: str
    silent_after: float
    poll: float = _POLL
    started: set[tuple[int, int]] = field(default_factory=set)
    ended: set[tuple[int, int]] = field(default_factory=set)
    reads: int = 0

    async def _fingerprint(self) -> tuple[Any, ...] | None:
        self.reads += 1
        row = await self.db.fetchone(_FINGERPRINT, (self.run_id,))
        return tuple(row) if row is not None else None

    async def events(self) -> AsyncIterator[RunEvent]:
        """Yield the run's events; the last one is :class:`RunEnded`.

        Raises:
            ConfigError: the run is not on the workers.
        """
        workers = WorkerStore(self.db)
        runs = SqliteRunStore(self.db)
        seen: tuple[Any, ...] | None = None
        note: str | None = None
        polls = 0
        while True:
            mark = await self._fingerprint()
            if mark is None:
                raise ConfigError(f"run {self.run_id} is not on the workers")
            changed = mark != seen
            seen = mark
            if changed or polls % _NOTE_EVERY == 0:
                # The turns before the placement: a worker takes the run before it starts a
                # turn, so the placement read next names the worker of every turn read.
                record = await run_or_none(runs, self.run_id) if changed else None
                turns = await runs.turns(self.run_id) if record is not None else []
                placement = await workers.placement(self.run_id)
                if placement is None:
                    raise ConfigError(f"run {self.run_id} is not on the workers")
                now = time.time()
                alive = [w for w in await workers.workers() if w.alive(now, self.silent_after)]
                now_note = waiting_note(placement, alive) or placement.note or None
                if now_note != note:
                    note = now_note
                    yield Waiting(self.run_id, note)
                if record is not None:
                    for event in self._turn_events(turns, record, placement):
                        yield event
                # (A row read before a write that ended the run changes the next fingerprint,
                # so the end is seen at the next interval.)
                if (
                    changed
                    and placement.ended
                    and record is not None
                    and record.status is not RunStatus.RUNNING
                ):
                    yield RunEnded(self.run_id, record, placement)
                    return
            polls += 1
            await asyncio.sleep(self.poll)

    def _turn_events(
        self, turns: Iterable[TurnRecord], record: RunRecord, placement: Placement
    ) -> list[RunEvent]:
        state = _auto_state(record)
        turns = list(turns)
        rounds = rounds_of((t.seq, t.phase) for t in turns) if state is not None else {}
        found: list[RunEvent] = []
        for turn in turns:
            key = (turn.seq, turn.attempt)
            if key not in self.started and key not in self.ended:
                self.started.add(key)
                found.append(
                    TurnStarted(
                        self.run_id,
                        turn.seq,
                        turn.attempt,
                        turn.phase,
                        placement.worker or placement.last_worker,
                        turn.started_at,
                        state,
                        rounds.get(turn.seq, 0),
                    )
                )
            if turn.state is not TurnState.STARTED and key not in self.ended:
                self.ended.add(key)
                found.append(
                    TurnEnded(
                        self.run_id,
                        turn,
                        placement.last_worker or placement.worker,
                        state,
                        rounds.get(turn.seq, 0),
                    )
                )
        return found


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

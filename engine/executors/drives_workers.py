"""Autopilot drives on the workers, for a front end: queued, followed, stopped and woken.

A drive on the workers reports nothing to this process: its worker records the run's turns,
and what the drive says (its steps, its problems, a wave queued or merged, its completion,
why it needs a person) is written to the event log as it says it. One follower
(:class:`engine.runs.follow.RunFollower`) reads the log and hands the front end's sink what
an in-process drive hands it: a phase's status as its turn starts, the turn's output (from
its turn row), each of the drive's texts as it said it. The gates the workers open are
announced through the sink as they open.

The messages' names are made from the drive's run and the log's events, so after a restart
the follower starts again without saying anything twice: it goes on from its last ended turn
(a running turn writes its phase's message again) and what was said since is said once.
Drives this process drove before are still resumed and stopped here
(:class:`~engine.executors.drives.LocalDrives`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Final

from engine.aio import raise_if_cancelled
from engine.errors import ConfigError, TurnstileError
from engine.executors.base import Notices, wait_all
from engine.executors.drives import (
    DriveRefused,
    DriveRequest,
    DriveStarted,
    LocalDrives,
)
from engine.gates import GateRefused, Gates
from engine.gates.autopilot import turn_finished
from engine.gates.workflow import AWAITING_APPROVAL, COMPLETE, HUMAN_INTERVENTION
from engine.humane import humane
from engine.runs import Recovery
from engine.runs.follow import (
    Note,
    RunEnded,
    RunFollower,
    TurnEnded,
    TurnStarted,
    run_or_none,
)
from engine.runs.spec import ChatPlace, PlaceId
from engine.settings import Settings
from engine.sink import RunSink, RunText, StatusUpdate, TextKind, publish, publish_said, summary_ref
from engine.store.backend import AnyDatabase
from engine.store.events import EventKind, EventLog, RunEvent
from engine.store.runs import SqliteRunStore, TurnState
from engine.workers.autopilot import budget_stopped
from engine.workers.control import chat_placements, stop_placed
from engine.workers.drives import gate_requests, queue_drive, wake_drive
from engine.workers.store import Placement, PlacementStatus, WorkerStore
from engine.workers.views import OnWorkers, look_on_workers

__all__ = ["WorkersDrives"]

_LOGGER = logging.getLogger(__name__)
_RETRY: Final = 1.0


def _person_ref(run_id: str) -> str:
    return f"person:{run_id}"


def _stopped_ref(run_id: str) -> str:
    return f"stopped:{run_id}"


@dataclass
class _Drive:
    run_id: str
    task: str
    place: ChatPlace
    job: asyncio.Task[None] | None = None
    #: Which of its phase's turns each turn is (by its number), as its start said.
    kinds: dict[int, str] = field(default_factory=dict)
    #: Its wave sub-tasks' runs: each one's task and wave.
    subs: dict[str, tuple[str, int]] = field(default_factory=dict)
    sub_kinds: dict[tuple[str, int], str] = field(default_factory=dict)


class WorkersDrives:
    """Drives on the workers (TURNSTILE_EXECUTION=workers), one follower per drive."""

    def __init__(
        self,
        settings: Settings,
        db: AnyDatabase,
        gates: Gates,
        *,
        local: LocalDrives,
        sink: RunSink,
        notices: Notices,
    ) -> None:
        self.settings = settings
        self.db = db
        self.gates = gates
        self.local = local
        self.sink = sink
        self.notices = notices
        self.followed: dict[str, _Drive] = {}
        self._gate_watch: asyncio.Task[None] | None = None
        self.closing = False

    # -- starting, waking --------------------------------------------------------------

    async def start(self, request: DriveRequest) -> DriveStarted:
        """Queue the drive as ``turnstile autopilot --init --checkout-repo PROJECT`` does
        (the chat's project), or find the one there; its gates are announced as they open."""
        name, place = request.task, request.place
        if request.budget is not None:
            # It travels with the drive: each step counts what the drive spent so far.
            refused = request.budget.refusal_for(self.settings.default_agent)
            if refused is not None:
                raise DriveRefused(f"Cannot keep to this budget: {refused}.")
        try:
            queued = await queue_drive(
                self.settings,
                self.db,
                name,
                init=True,
                summary=request.summary,
                project=request.project,
                chat=(place.chat_id, place.thread_id),
                budget=request.budget,
            )
        except (ConfigError, GateRefused) as exc:
            raise DriveRefused(f"Cannot start: {exc}") from exc
        if queued is None:
            raise DriveRefused(f"Task {name} is already complete.")
        run_id = queued.spec.run_id
        self._watch_gates()
        self.follow(run_id, name, place)
        return DriveStarted(name, run_id=run_id, queued=True, new=queued.new)

    async def wake(self, task: str) -> None:
        """A decided gate of a drive on the workers: its next step is queued now."""
        try:
            await wake_drive(self.settings, self.db, task)
        except Exception as exc:  # its worker's heartbeat queues it a beat later
            _LOGGER.warning("could not wake the drive of %s: %s", task, exc)

    def _watch_gates(self) -> None:
        """Announce the gates of the chats' drives on the workers as they open (once
        running, until shutdown)."""
        if self._gate_watch is None or self._gate_watch.done():
            self._gate_watch = asyncio.create_task(self._gates(), name="autopilot-worker-gates")

    async def _gates(self) -> None:
        interval = max(0.2, min(2.0, self.settings.worker_heartbeat))
        while not self.closing:
            try:
                for request, drive in await gate_requests(self.settings, self.db):
                    assert drive.chat_id is not None  # (only the chats' drives are listed)
                    assert request.run_id is not None  # (a gate of a drive on the workers)
                    if self.notices.place_of_task(request.task) is None:
                        place = ChatPlace(drive.chat_id, drive.thread_id)
                        self.notices.follow(request.run_id, place, task=request.task)
                    await self.sink.request_gate(request)
            except TurnstileError as exc:  # the database may be away a moment
                raise_if_cancelled()
                _LOGGER.warning("cannot read the workers' gates: %s", exc)
            await asyncio.sleep(interval)

    # -- what is driven, stopping --------------------------------------------------------

    def state_of(self, task: str) -> str | None:
        here = self.local.state_of(task)
        if here is not None:
            return here
        for drive in self.followed.values():
            if drive.task == task:
                return "driving on the workers"
        return None

    async def _placed(self, chat_id: PlaceId, place: ChatPlace | None = None) -> list[Placement]:
        return await chat_placements(self.db, chat_id, drives=True, place=place)

    async def stop(self, key: str, *, chat_id: PlaceId, by: str) -> bool:
        if await self.local.stop(key, chat_id=chat_id, by=by):
            return True
        for placement in await self._placed(chat_id):
            if key in (placement.run_id, placement.spec.task):
                return await self._stop(placement)
        return False

    async def stop_in(self, place: ChatPlace, *, by: str) -> list[str]:
        stopped = await self.local.stop_in(place, by=by)
        for placement in await self._placed(place.chat_id, place):
            if await self._stop(placement):
                stopped.append(placement.run_id)
        return stopped

    async def _stop(self, placement: Placement) -> bool:
        """Its follower says the drive stopped once its worker has stopped it."""
        return await stop_placed(self.settings, self.db, placement.run_id)

    # -- start-up and shutdown -----------------------------------------------------------

    async def recover(self, report: Recovery) -> None:
        """Follow again the chats' drives still on the workers, and those that ended while
        nobody followed them and whose end was not said; resume this process's drives."""
        self._watch_gates()
        placed = set()
        for placement in await WorkerStore(self.db).placements():
            placed.add(placement.run_id)
            spec = placement.spec
            if spec.mode == "auto" or spec.chat_id is None or spec.task is None:
                continue
            if spec.parent_run is not None:
                continue  # a wave's sub-task: its parent's drive speaks for it
            if placement.ended and await self._end_said(placement):
                continue
            self.follow(
                placement.run_id,
                spec.task,
                ChatPlace(spec.chat_id, spec.thread_id),
                resumed=True,
            )
        await self.local.recover(report, elsewhere=frozenset(placed))

    async def shutdown(self, *, park: bool, preempt: asyncio.Event) -> None:
        """Stop following (the drives go on on their workers; followed again at start),
        then shut this process's drives down."""
        self.closing = True
        if self._gate_watch is not None:
            self._gate_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._gate_watch
        jobs = [d.job for d in self.followed.values() if d.job is not None]
        for job in jobs:
            job.cancel()
        await wait_all(jobs)
        await self.local.shutdown(park=park, preempt=preempt)

    async def park_all(self) -> None:
        await self.local.park_all()

    # -- following -----------------------------------------------------------------------

    def follow(self, run_id: str, task: str, place: ChatPlace, *, resumed: bool = False) -> None:
        """Show drive ``run_id`` of ``task`` in ``place`` until it ends (``resumed``: after
        a restart, what had ended before it is not shown again)."""
        if run_id in self.followed:
            return
        self.notices.follow(run_id, place, task=task, run_id=run_id)
        drive = _Drive(run_id, task, place)
        self.followed[run_id] = drive
        drive.job = asyncio.create_task(self._follow(drive, resumed), name=f"drive-{run_id}")

    async def _end_said(self, placement: Placement) -> bool:
        task = placement.spec.task
        assert task is not None
        for name in (
            summary_ref(task, placement.run_id),
            _person_ref(placement.run_id),
            _stopped_ref(placement.run_id),
        ):
            if await self.notices.shown(name) is not None:
                return True
        return False

    async def _follow(self, drive: _Drive, resumed: bool) -> None:
        follower: RunFollower[OnWorkers] | None = None
        try:
            while True:
                try:
                    follower = follower or await self._follower(drive, resumed)
                    async for event in follower.events():
                        if await self._of_subtask(drive, event):
                            continue
                        match event:
                            case TurnStarted():
                                kind = await self._kind(drive, event)
                                await self._status(
                                    drive, "running", event.phase, event.seq, f"{kind} turn"
                                )
                            case TurnEnded():
                                await self._turn_ended(drive, event)
                            case Note(said=said):
                                await self._said(drive, said, event.cursor)
                            case RunEnded():
                                await self._ended(drive, event)
                    return
                except TurnstileError as exc:  # the database may be away a moment
                    raise_if_cancelled()
                    _LOGGER.warning("following paused: %s", exc, extra={"run_id": drive.run_id})
                    await asyncio.sleep(_RETRY)
        except asyncio.CancelledError:
            raise
        except Exception:
            _LOGGER.exception("could not follow the drive", extra={"run_id": drive.run_id})
        finally:
            self.followed.pop(drive.run_id, None)

    async def _follower(self, drive: _Drive, resumed: bool) -> RunFollower[OnWorkers]:
        look = look_on_workers(self.db, drive.run_id, silent_after=self.settings.worker_timeout)
        placed = await look()
        return RunFollower(
            self.db,
            drive.run_id,
            look,
            task=drive.task,
            since=placed.placement.created_at,  # (its task's events from the drive's start)
            after=await self._resume_at(drive.run_id) if resumed else 0,
            children=True,  # its wave's sub-tasks: their rows in the wave's message
        )

    async def _resume_at(self, run_id: str) -> int:
        """After a restart, the cursor to follow on from: the turns that had ended were
        shown, a running one is shown again (its phase's message is the same one, edited),
        and what the drive said since its last turn is read again (each said once)."""
        cursor = 0
        for event in await EventLog(self.db).read(run_id, limit=100_000):
            if event.kind == EventKind.TURN_ENDED:
                cursor = event.id
            elif event.kind == EventKind.TURN_STARTED:
                cursor = max(cursor, event.id - 1)
        return cursor

    async def _said(self, drive: _Drive, said: RunText, cursor: int) -> None:
        """What the drive said, as a drive in this process says it: a note and why it waits
        for a person posted once each (named after the drive and its event), its steps and
        its completion summary through the sink."""
        if said.kind is TextKind.NOTE:
            live = f"note:{cursor}"
        elif said.kind is TextKind.PERSON:
            live = _person_ref(said.run_id)  # (a sub-task's: its own)
        else:
            await publish_said(self.sink, said)
            return
        await self.notices.notice(drive.run_id, humane(said.text), live=live, markdown=True)

    async def _status(
        self, drive: _Drive, status: str, phase: str | None, turn: int, event: str | None = None
    ) -> None:
        if phase is not None and await self.notices.gate_shown(drive.task, phase):
            # Its gate is posted already (the gate watcher read it before this follower
            # read the phase's turns): the gate message is the phase's message now, and a
            # status would post a second one.
            return
        await self.sink.update_status(
            StatusUpdate(
                run_id=drive.run_id,
                mode="autopilot",
                status=status,
                phase=phase,
                turn=turn,
                task=drive.task,
                last_event=event or "phase turn",
            )
        )

    async def _kind(self, drive: _Drive, event: TurnStarted[OnWorkers]) -> str:
        """Which of its phase's turns the turn starting is, as its event says."""
        started = await EventLog(self.db).read(event.run_id, after=event.cursor - 1, limit=1)
        kind = str(started[0].data.get("turn_kind") or "phase") if started else "phase"
        if event.run_id == drive.run_id:
            drive.kinds[event.seq] = kind
        return kind

    # -- a wave's sub-tasks ----------------------------------------------------------------

    async def _of_subtask(self, drive: _Drive, event: object) -> bool:
        """Say an event of one of the drive's wave sub-tasks as a drive in this process
        says its sub-tasks' (their rows in the wave's message); False: not one of theirs."""
        match event:
            case TurnStarted() | TurnEnded() if event.run_id != drive.run_id:
                sub = await self._sub(drive, event.run_id)
            case Note(said=said) if said.run_id != drive.run_id:
                sub = await self._sub(drive, said.run_id)
            case RunEvent(run_id=run_id) if run_id is not None and run_id != drive.run_id:
                sub = await self._sub(drive, run_id)
            case _:
                return False
        if sub is None:
            return True  # (not a sub-task's run any more: nothing to say of it)
        task, wave = sub
        match event:
            case TurnStarted():
                kind = await self._kind(drive, event)
                drive.sub_kinds[(event.run_id, event.seq)] = kind
                await self._sub_status(drive, event.run_id, task, wave, "running", event.phase)
            case TurnEnded(turn=turn) if turn.state is TurnState.FINISHED:
                kind = drive.sub_kinds.get((event.run_id, turn.seq), "phase")
                head, text = turn_finished(
                    task,
                    turn.phase or "turn",
                    kind,
                    turn.output or "",
                    turn.exit_code,
                    turn.stderr_tail or "",
                )
                await publish(self.sink, event.run_id, head, TextKind.TURN, task=task, body=text)
            case Note(said=said):
                await self._said(drive, said, event.cursor)
            case RunEvent(kind=EventKind.PARKED, run_id=run_id) if run_id is not None:
                # At its gate (the gate is a message of its own): its row says it waits.
                record = await self.gates.store.find(task)
                if record is not None and record.awaiting_approval:
                    status = AWAITING_APPROVAL
                    await self._sub_status(drive, run_id, task, wave, status, record.label)
            case RunEvent(kind=EventKind.RUN_ENDED, run_id=run_id) if run_id is not None:
                record = await self.gates.store.find(task)
                phase = record.phase if record is not None else None
                if phase in (COMPLETE, HUMAN_INTERVENTION):
                    await self._sub_status(drive, run_id, task, wave, phase, phase)
                else:
                    await self._sub_status(drive, run_id, task, wave, "stopped", phase)
        return True

    async def _sub(self, drive: _Drive, run_id: str) -> tuple[str, int] | None:
        """The task and wave of the drive's sub-task run ``run_id``."""
        found = drive.subs.get(run_id)
        if found is not None:
            return found
        run = await run_or_none(SqliteRunStore(self.db), run_id)
        if run is None or run.task is None:
            return None
        record = await self.gates.store.find(run.task)
        if record is None:
            return None
        drive.subs[run_id] = (run.task, record.wave or 1)
        return drive.subs[run_id]

    async def _sub_status(
        self, drive: _Drive, run_id: str, task: str, wave: int, status: str, phase: str | None
    ) -> None:
        await self.sink.update_status(
            StatusUpdate(
                run_id=run_id,
                mode="autopilot",
                status=status,
                phase=phase,
                task=task,
                parent=drive.task,
                wave=wave,
                parent_run=drive.run_id,
            )
        )

    async def _turn_ended(self, drive: _Drive, event: TurnEnded[OnWorkers]) -> None:
        # (Its output is the turn's, not in the log: said as the drive says it.)
        turn = event.turn
        phase = turn.phase or "turn"
        if turn.state is TurnState.FINISHED:
            kind = drive.kinds.get(turn.seq, "phase")
            said, text = turn_finished(
                drive.task, phase, kind, turn.output or "", turn.exit_code, turn.stderr_tail or ""
            )
            await publish(self.sink, drive.run_id, said, TextKind.TURN, task=drive.task, body=text)
            return
        worker = event.where.worker
        where = f" on worker {worker}" if worker else ""
        why = f": {turn.error}" if turn.error else ""
        verb = "cut off" if turn.state is TurnState.INTERRUPTED else "failed"
        # A cut-off turn runs again (on this worker or another): its phase's message says so.
        await self._status(drive, "running", phase, turn.seq, f"{phase} {verb}{where}{why}")

    async def _ended(self, drive: _Drive, event: RunEnded[OnWorkers]) -> None:
        """Its phase's message says how it ended; the drive said why itself (complete,
        sent to a person, its budget spent), but not that a person stopped it here."""
        placement = event.where.placement
        task = await self.gates.store.find(drive.task)
        run_id = drive.run_id
        if placement.status is PlacementStatus.STOPPED:
            # Its running phase's message says so (and loses its Stop button), as here.
            await self._status(drive, "stopped", None, 0)
            await self.notices.notice(
                run_id,
                f"⏹ Autopilot for {drive.task} stopped on the workers (run {run_id}); the "
                f"task keeps its phase. /autopilot {drive.task} resumes it.",
                live=_stopped_ref(run_id),
            )
        elif budget_stopped(placement, event.record):
            label = task.label if task is not None else "its phase"
            await self._status(drive, "stopped", label, 0, "budget spent")
        elif task is not None and task.phase in (COMPLETE, HUMAN_INTERVENTION):
            await self._status(drive, task.phase, task.label, 0)
        else:
            await self.notices.notice(
                run_id,
                f"⚠️ Autopilot for {drive.task} ended on the workers (run {run_id}): "
                f"{placement.note or placement.status.value}\n/autopilot {drive.task} resumes it.",
                live=_person_ref(run_id),
            )

"""The chat's view of an autopilot drive on the workers, followed from the database.

A drive on the workers reports nothing to the bot: its worker records the run's turns and
the task's phase changes. A follower reads them (:class:`engine.workers.follow.RunFollower`
for the turns, the gate store for the phase) and hands the bot's sink what an in-process
drive hands it: a phase's status as its turn starts, the turn's output, the step done, the
completion summary, a drive sent to a person. The chat shows them with the same messages
(one per phase, edited; its gate is posted by the gate watcher of bot.autopilot).

The messages' refs are made from the drive's run and turn, so after a restart the follower
starts again without posting anything twice: the turns that had ended are not given again,
a running turn edits its phase's message, and a drive's end is said once (its message is
looked up first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Final

from bot.context import BotContext
from bot.sink import BotSink, ChatPlace, humane, summary_ref
from engine.aio import raise_if_cancelled
from engine.errors import TurnstileError
from engine.gates.records import TaskRecord
from engine.gates.workflow import COMPLETE, HUMAN_INTERVENTION
from engine.sink import StatusUpdate, TextKind
from engine.store.events import EventKind, EventLog
from engine.store.runs import TurnState
from engine.workers.follow import RunEnded, RunFollower, TurnEnded, TurnStarted
from engine.workers.store import Placement, PlacementStatus, WorkerStore

__all__ = ["WorkerDrives"]

_LOGGER = logging.getLogger(__name__)
_POLL: Final = 0.25
_RETRY: Final = 1.0
_RUN_PREFIX: Final = "autopilot:"


def _phase_of(event: TurnStarted | TurnEnded) -> str | None:
    return event.phase if isinstance(event, TurnStarted) else event.turn.phase


def _person_ref(run_id: str) -> str:
    return f"person:{run_id}"


def _stopped_ref(run_id: str) -> str:
    return f"stopped:{run_id}"


@dataclass
class _Drive:
    run_id: str
    task: str
    place: ChatPlace
    label: str | None = None
    job: asyncio.Task[None] | None = None


class WorkerDrives:
    """Follows the chats' drives on the workers (one follower per drive)."""

    def __init__(self, ctx: BotContext, sink: BotSink) -> None:
        self.ctx = ctx
        self.sink = sink
        self.followed: dict[str, _Drive] = {}

    def follow(self, run_id: str, task: str, place: ChatPlace, *, resumed: bool = False) -> None:
        """Show drive ``run_id`` of ``task`` in ``place`` until it ends (``resumed``: after
        a restart, what had ended before it is not shown again)."""
        if run_id in self.followed:
            return
        self.sink.register(_RUN_PREFIX + task, place, task=task, steered=False, key=run_id)
        drive = _Drive(run_id, task, place)
        self.followed[run_id] = drive
        drive.job = asyncio.create_task(self._follow(drive, resumed), name=f"drive-{run_id}")

    async def resume(self) -> None:
        """After a restart: follow again the chats' drives still on the workers, and those
        that ended while no bot followed them and whose end the chat was not told."""
        for placement in await WorkerStore(self.ctx.db).placements():
            spec = placement.spec
            if spec.mode != "autopilot" or spec.chat_id is None or spec.task is None:
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

    async def close(self) -> None:
        """Stop following (the drives go on on their workers; followed again at start)."""
        jobs = [d.job for d in self.followed.values() if d.job is not None]
        for job in jobs:
            job.cancel()
        if jobs:
            await asyncio.wait(jobs)

    async def _end_said(self, placement: Placement) -> bool:
        task = placement.spec.task
        assert task is not None
        store = self.ctx.store
        for ref in (
            summary_ref(task, placement.run_id),
            _person_ref(placement.run_id),
            _stopped_ref(placement.run_id),
        ):
            if await store.get_live(ref) is not None:
                return True
        return False

    async def _task(self, name: str) -> TaskRecord | None:
        return await self.ctx.gates.store.find(name)

    async def _follow(self, drive: _Drive, resumed: bool) -> None:
        follower = RunFollower(
            self.ctx.db, drive.run_id, silent_after=self.ctx.settings.worker_timeout, poll=_POLL
        )
        ended = asyncio.Event()
        notes = asyncio.create_task(self._notes(drive, ended), name=f"notes-{drive.run_id}")
        try:
            if resumed:
                await self._seed(drive, follower)
            while True:
                try:
                    async for event in follower.events():
                        match event:
                            case TurnStarted() | TurnEnded():
                                await self._steps(drive, _phase_of(event))
                            case _:
                                await self._steps(drive, None)
                        match event:
                            case TurnStarted():
                                await self._status(drive, "running", event.phase, event.seq)
                            case TurnEnded():
                                await self._turn_ended(drive, event)
                            case RunEnded():
                                await self._ended(drive, event)
                    return
                except TurnstileError as exc:  # the database may be away a moment
                    raise_if_cancelled()
                    _LOGGER.warning("following paused: %s", exc, extra={"run_id": drive.run_id})
                    await asyncio.sleep(_RETRY)
        except asyncio.CancelledError:
            notes.cancel()
            raise
        except Exception:
            _LOGGER.exception("could not follow the drive", extra={"run_id": drive.run_id})
        finally:
            ended.set()
            await asyncio.gather(notes, return_exceptions=True)
            self.followed.pop(drive.run_id, None)

    async def _notes(self, drive: _Drive, ended: asyncio.Event) -> None:
        """What the drive tells the people following it (a phase's problems before its
        revision turn, a wave queued or merged, a conflict), read from the event log and
        posted once each: a note's message is named after its event, so reading the log
        again after a restart posts nothing twice. Its steps, turns, gates and end the
        follower says itself."""
        placement = await WorkerStore(self.ctx.db).placement(drive.run_id)
        since = placement.created_at if placement is not None else 0.0
        log = EventLog(self.ctx.db)
        key = _RUN_PREFIX + drive.task
        cursor = 0
        while True:
            last = ended.is_set()
            try:
                batch = await log.read(drive.run_id, task=drive.task, after=cursor, since=since)
                for event in batch:
                    if event.kind == EventKind.NOTE and event.data.get("note") == TextKind.NOTE:
                        await self.ctx.publisher.live(
                            f"note:{event.id}",
                            "",
                            markdown=humane(str(event.data.get("text", ""))),
                            chat_id=drive.place.chat_id,
                            thread_id=drive.place.thread_id,
                            run_id=key,
                        )
                    cursor = event.id
            except TurnstileError as exc:  # the database may be away a moment
                raise_if_cancelled()
                _LOGGER.warning("notes paused: %s", exc, extra={"run_id": drive.run_id})
                await asyncio.sleep(_RETRY)
                continue
            if last and not batch:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), _POLL)

    async def _seed(self, drive: _Drive, follower: RunFollower) -> None:
        """After a restart: the turns that had ended were shown; a running one is shown
        again (its phase's message is the same one, edited)."""
        from engine.store.runs import SqliteRunStore

        for turn in await SqliteRunStore(self.ctx.db).turns(drive.run_id):
            if turn.state is not TurnState.STARTED:
                key = (turn.seq, turn.attempt)
                follower.started.add(key)
                follower.ended.add(key)
        task = await self._task(drive.task)
        drive.label = task.label if task is not None else None

    async def _steps(self, drive: _Drive, busy: str | None) -> None:
        """A phase the drive left since the last look: its message says it is done (once
        the turns of that phase read with it are shown: ``busy``, the phase of the turn
        about to be shown)."""
        task = await self._task(drive.task)
        if task is None:
            return
        before = drive.label
        if before is not None and busy is not None and before.split(":", 1)[0] == busy:
            return  # said after this turn of the phase
        drive.label = task.label
        if before is None or before == task.label or ":" in before:
            return  # the first look, no change, or a gate passed (its message says it)
        if before in (COMPLETE, HUMAN_INTERVENTION) or task.phase == HUMAN_INTERVENTION:
            return  # (sent to a person: said when the drive ends)
        await self.sink.publish_kind(
            _RUN_PREFIX + drive.task, f"[{drive.task}] {before} done → {task.label}", TextKind.STEP
        )

    async def _status(
        self, drive: _Drive, status: str, phase: str | None, turn: int, event: str | None = None
    ) -> None:
        if phase is not None and any(
            g.phase == phase for g in await self.ctx.store.open_gates_of(drive.task)
        ):
            # Its gate is posted already (the gate watcher read it before this follower
            # read the phase's turns): the gate message is the phase's message now, and a
            # status would post a second one.
            return
        await self.sink.update_status(
            StatusUpdate(
                run_id=_RUN_PREFIX + drive.task,
                mode="autopilot",
                status=status,
                phase=phase,
                turn=turn,
                task=drive.task,
                last_event=event or "phase turn",
            )
        )

    async def _turn_ended(self, drive: _Drive, event: TurnEnded) -> None:
        turn = event.turn
        phase = turn.phase or "turn"
        if turn.state is TurnState.FINISHED:
            code = "" if turn.exit_code in (0, None) else f" (exit code {turn.exit_code})"
            text = (turn.output or "").strip() or "(no output)"
            await self.sink.publish_kind(
                _RUN_PREFIX + drive.task,
                f"[{drive.task} · {phase}] phase turn finished{code}:\n{text}",
                TextKind.TURN,
            )
            return
        where = f" on worker {event.worker}" if event.worker else ""
        why = f": {turn.error}" if turn.error else ""
        verb = "cut off" if turn.state is TurnState.INTERRUPTED else "failed"
        # A cut-off turn runs again (on this worker or another): its phase's message says so.
        await self._status(drive, "running", phase, turn.seq, f"{phase} {verb}{where}{why}")

    async def _ended(self, drive: _Drive, event: RunEnded) -> None:
        if await self._end_said(event.placement):
            return
        task = await self._task(drive.task)
        place, run_id = drive.place, drive.run_id
        key = _RUN_PREFIX + drive.task
        if event.placement.status is PlacementStatus.STOPPED:
            await self.ctx.publisher.live(
                _stopped_ref(run_id),
                f"⏹ Autopilot for {drive.task} stopped on the workers (run {run_id}); the "
                f"task keeps its phase. /autopilot {drive.task} resumes it.",
                chat_id=place.chat_id,
                thread_id=place.thread_id,
                run_id=key,
            )
            return
        if task is not None and task.phase == COMPLETE:
            await self._status(drive, "complete", task.label, 0)
            await self.sink.publish_kind(key, f"[{drive.task}] complete", TextKind.FINAL)
            return
        if task is not None and task.phase == HUMAN_INTERVENTION:
            await self._status(drive, "human_intervention", task.label, 0)
            reason = await self._why_human(task) or event.placement.note or "see its status"
            said = f"✋ Autopilot for {drive.task} needs a person: {reason}"
        else:
            said = (
                f"⚠️ Autopilot for {drive.task} ended on the workers (run {run_id}): "
                f"{event.placement.note or event.placement.status.value}"
            )
        await self.ctx.publisher.live(
            _person_ref(run_id),
            f"{said}\n/autopilot {drive.task} resumes it.",
            chat_id=place.chat_id,
            thread_id=place.thread_id,
            run_id=key,
        )

    async def _why_human(self, task: TaskRecord) -> str | None:
        history = await self.ctx.gates.store.history(task.name)
        for change in reversed(history):
            if change.to_phase == HUMAN_INTERVENTION:
                return change.reason
        return None

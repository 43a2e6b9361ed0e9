"""Auto runs on the workers: queued, followed from the event log, stopped through the store.

A run shows where it is followed as a run of this process does: one live status message
(its last line names the worker running the turn), the turns, the files its turns hand
over (read and stored on the worker: the ``file_out`` event lists them), the final report.
A stop asked from here is said at once ("Stopping run … on worker w1") and that message is
written again once the run has actually stopped. A run its budget stopped is offered to an
admin, whose raise puts it back on the workers (its holder's queue), followed on from its
next turn. Runs this process drove before (recorded here, parked or cut off) are resumed
and stopped here (:class:`~engine.executors.local.LocalAuto`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Final

from engine.aio import raise_if_cancelled
from engine.automode import AutoRun
from engine.automode.budget import STOPPED_BY_BUDGET
from engine.automode.channel import final_report, live_status, turn_said
from engine.automode.state import AutoModeState, Phase
from engine.errors import ConfigError, TurnstileError
from engine.executors.base import AutoRequest, Notices, Started, wait_all
from engine.executors.local import LocalAuto
from engine.humane import format_elapsed, words
from engine.runs import Recovery
from engine.runs.follow import RunEnded, RunFollower, TurnEnded, TurnStarted
from engine.runs.spec import ChatPlace, PlaceId
from engine.settings import Settings
from engine.sink import (
    RunSink,
    StatusUpdate,
    StoredFileSink,
    TextKind,
    publish,
    publish_said,
    sent_files,
)
from engine.spend import Budget, Spend
from engine.store.backend import AnyDatabase
from engine.store.events import EventKind, EventLog, RunEvent
from engine.store.runs import RunStatus, SqliteRunStore, TurnState
from engine.workers.control import (
    chat_placements,
    new_spec,
    project_reference,
    raise_budget_on_workers,
    start_on_workers,
    stop_placed,
    worker_status,
    workers_project_problem,
)
from engine.workers.store import Placement, WorkerStore
from engine.workers.views import OnWorkers, is_warm, look_on_workers

__all__ = ["WorkersAuto"]

_LOGGER = logging.getLogger(__name__)

# How long a follower waits when the database is away.
_RETRY: Final = 2.0


def _stopping(run_id: str) -> str:
    """The message answering a stop, written again once the run has stopped."""
    return f"stopping:{run_id}"


@dataclass
class _Followed:
    """A run on the workers followed from here."""

    run_id: str
    task: asyncio.Task[None] | None = None
    end: RunEnded[OnWorkers] | None = None
    # The cursor: the events up to it were shown (before a raised budget let it go on).
    after: int = 0


class WorkersAuto:
    """Auto runs queued on the workers (TURNSTILE_EXECUTION=workers)."""

    def __init__(
        self,
        settings: Settings,
        db: AnyDatabase,
        *,
        local: LocalAuto,
        sink: RunSink,
        notices: Notices,
    ) -> None:
        self.settings = settings
        self.db = db
        self.local = local
        self.sink = sink
        self.notices = notices
        self.followed: dict[str, _Followed] = {}

    async def start(self, request: AutoRequest) -> Started:
        """Queue the run as ``turnstile auto --checkout-repo PROJECT`` does."""
        settings = self.settings
        tool = settings.default_agent
        if request.permissions not in (None, "off"):
            raise ConfigError(
                f"permissions {request.permissions} need the run's tool calls to ask a person, "
                "and auto runs on the workers do not ask; /permissions default here, or run "
                "it where the bot runs (TURNSTILE_EXECUTION=local)"
            )
        problem = workers_project_problem(settings, request.project)
        if problem is not None:
            raise ConfigError(problem)
        spec = new_spec(
            objective=request.objective,
            tool=tool,
            project=project_reference(settings, request.project),
            agent_cmd=settings.agent_command if tool == "command" else None,
            passthrough=(),
            max_turns=None,
            verify_cmd=None,
            budget=request.budget
            or (Budget(usd=settings.run_budget) if settings.run_budget is not None else None),
            daily_budget=settings.daily_budget,
        )
        spec = replace(spec, chat_id=request.place.chat_id, thread_id=request.place.thread_id)
        await start_on_workers(settings, spec)
        self._follow(spec.run_id, request.place)
        return Started(spec.run_id, tool, queued=True)

    # -- what runs here (none of these: their folders are the workers') ---------------

    def running_in(self, place: ChatPlace) -> list[AutoRun]:
        return self.local.running_in(place)

    async def steerable(self, place: ChatPlace, *, whole_chat: bool = False) -> list[str]:
        # Its own row says whether a run goes on, wherever it runs (or waits to run).
        stored = await SqliteRunStore(self.db).unfinished_in(
            "auto", place.chat_id, place.thread_id, whole_chat=whole_chat
        )
        here = await self.local.steerable(place, whole_chat=whole_chat)
        return [*here, *(r for r in stored if r not in here)]

    async def _placed(self, chat_id: PlaceId, place: ChatPlace | None = None) -> list[Placement]:
        # (A drive's is the drives' executor's: engine.executors.drives.)
        return await chat_placements(self.db, chat_id, drives=False, place=place)

    # -- stopping ----------------------------------------------------------------------

    async def stop(self, run_id: str, *, chat_id: PlaceId) -> bool:
        if await self.local.stop(run_id, chat_id=chat_id):
            return True
        for placement in await self._placed(chat_id):
            if placement.run_id == run_id:
                return await self._stop(placement)
        return False

    async def raise_budget(self, run_id: str, budget: Budget, *, chat_id: PlaceId) -> str:
        placement = await WorkerStore(self.db).placement(run_id)
        if placement is None:
            return await self.local.raise_budget(run_id, budget, chat_id=chat_id)
        if placement.spec.chat_id != chat_id:
            raise ConfigError(f"run {run_id} is not this chat's")
        after = await EventLog(self.db).last_id()  # (what it did so far was shown)
        resumed = await raise_budget_on_workers(self.settings, self.db, run_id, budget)
        # A follower that saw the end tells it first; one that had not yet follows on.
        last = self.followed.get(run_id)
        if last is not None and last.end is not None and last.task is not None:
            await wait_all([last.task])
        state = resumed.state
        where = f"worker {resumed.worker}" if resumed.worker else "another worker"
        # The live message is the running run's again, until the follower sees it end.
        await self._status(
            run_id, state, state.phase.value, state.turn, f"Going on, waiting for {where}"
        )
        self._follow(
            run_id,
            ChatPlace(chat_id, placement.spec.thread_id),
            after=after,
        )
        return (
            f"▶️ Auto run {run_id} goes on under a budget of {budget.text()}, at round "
            f"{state.turn}, phase {state.phase.value}, on {where}."
        )

    async def stop_in(self, place: ChatPlace) -> list[str]:
        stopped = await self.local.stop_in(place)
        for placement in await self._placed(place.chat_id, place):
            if await self._stop(placement):
                stopped.append(placement.run_id)
        return stopped

    async def _stop(self, placement: Placement) -> bool:
        run_id = placement.run_id
        if not await stop_placed(self.settings, self.db, run_id):
            return False
        where = f" on worker {placement.worker}" if placement.worker else ""
        # Said at once; written again when the follower sees the run end (the same message).
        await self.notices.notice(
            run_id, f"⏹ Stopping run {run_id}{where}…", live=_stopping(run_id)
        )
        followed = self.followed.get(run_id)
        if followed is not None and followed.end is not None:
            await self._confirm_stop(followed.run_id, followed.end)
        return True

    async def _confirm_stop(self, run_id: str, event: RunEnded[OnWorkers]) -> None:
        known = await self.notices.shown(_stopping(run_id))
        if known is None or not known.startswith("⏹ Stopping"):
            return  # no stop was asked from here, or it was confirmed already
        record, worker = event.record, event.where.worker
        where = f" on worker {worker}" if worker else ""
        if record.status is RunStatus.STOPPED:
            text = f"⏹ Run {run_id} stopped{where}."
        else:
            text = (
                f"Run {run_id} ended{where} before the stop reached it: "
                f"{words(record.status.value)}."
            )
        await self.notices.notice(run_id, text, live=_stopping(run_id))

    # -- status ------------------------------------------------------------------------

    async def status_lines(self, chat_id: PlaceId) -> list[str]:
        lines = await self.local.status_lines(chat_id)
        placements = await self._placed(chat_id)
        if not placements:
            return lines
        store = WorkerStore(self.db)
        # Recorded by the worker: its agent process stays between the run's turns there.
        warm = await store.warm_runs()
        for p in placements:
            waiting = await worker_status(store, p, silent_after=self.settings.worker_timeout)
            where = waiting or f"running on worker {p.worker}"
            elapsed = int(time.time() - p.created_at)
            lines.append(
                f"🤖 auto {p.run_id} · {where} · {format_elapsed(elapsed)}"
                + (" · warm" if is_warm(p, waiting, warm) else "")
            )
        return lines

    # -- following from the store ------------------------------------------------------

    def _follow(self, run_id: str, place: ChatPlace, *, after: int = 0) -> None:
        if run_id in self.followed:
            return
        self.notices.follow(run_id, place)
        followed = _Followed(run_id, after=after)
        self.followed[run_id] = followed
        followed.task = asyncio.create_task(self._follow_run(followed), name=f"follow-{run_id}")

    async def _follow_run(self, followed: _Followed) -> None:
        """The run's turns and end as a run of this process shows them, through the sink."""
        run_id = followed.run_id
        look = look_on_workers(self.db, run_id, silent_after=self.settings.worker_timeout)
        follower = RunFollower(self.db, run_id, look, after=followed.after)
        try:
            while True:
                try:
                    # The follower keeps its cursor: a retry gives no event twice.
                    async for event in follower.events():
                        match event:
                            case TurnStarted():
                                await self._turn_started(event)
                            case TurnEnded():
                                await self._turn_ended(event)
                            case RunEnded():
                                await self._run_ended(followed, event)
                            case RunEvent(kind=EventKind.FILE_OUT):
                                await self._files_out(event)
                        followed.after = follower.after
                    return
                except TurnstileError as exc:
                    # The database may be away a moment; the run goes on on its worker.
                    raise_if_cancelled()
                    _LOGGER.warning("following paused: %s", exc, extra={"run_id": run_id})
                    await asyncio.sleep(_RETRY)
        except asyncio.CancelledError:
            raise
        except Exception:
            _LOGGER.exception("could not follow the run", extra={"run_id": run_id})
        finally:
            if self.followed.get(run_id) is followed:
                self.followed.pop(run_id)

    async def _status(
        self,
        run_id: str,
        state: AutoModeState,
        phase: str | None,
        turn: int,
        event: str,
        round_: int = 0,
    ) -> None:
        await self.sink.update_status(
            StatusUpdate(
                run_id=run_id,
                mode="auto",
                status=RunStatus.RUNNING.value,
                phase=phase,
                turn=turn,
                round=round_ or state.turn,
                max_turns=state.max_turns,
                started_at=state.started_at,
                last_event=event,
            )
        )

    async def _turn_started(self, event: TurnStarted[OnWorkers]) -> None:
        label = Phase(event.phase).label if event.phase else "Turn"
        worker = event.where.worker
        where = f" on worker {worker}" if worker else ""
        assert event.state is not None  # (an auto run's)
        await self._status(
            event.run_id,
            event.state,
            event.phase,
            event.seq,
            f"{label} running{where}",
            event.round,
        )

    async def _turn_ended(self, event: TurnEnded[OnWorkers]) -> None:
        turn, state = event.turn, event.state
        assert state is not None  # (an auto run's)
        phase = Phase(turn.phase) if turn.phase else state.phase
        if turn.state is TurnState.FINISHED and turn.exit_code is not None:
            ended = turn_said(
                event.run_id,
                turn=turn.seq,
                round_=event.round or state.turn,
                max_turns=state.max_turns,
                phase=phase,
                code=turn.exit_code,
                text=turn.output or "",
                size=turn.output_size,
                stderr_tail=turn.stderr_tail,
                log_dir=state.log_dir,
            )
            await publish_said(self.sink, ended)
            return
        worker = event.where.worker
        where = f" on worker {worker}" if worker else ""
        why = f": {turn.error}" if turn.error else ""
        if turn.state is TurnState.INTERRUPTED:
            said = f"⏹ {phase.label} cut off{where}{why}"
        else:
            said = f"⚠️ {phase.label} failed{where}{why}"
        # In the live status's last line until the next turn starts or the run ends.
        await self._status(event.run_id, state, phase.value, turn.seq, said, event.round)

    async def _files_out(self, event: RunEvent) -> None:
        """Files a turn handed over: read and stored on its worker, sent as a local run's."""
        files = sent_files(event.data)
        if files and isinstance(self.sink, StoredFileSink):
            await self.sink.send_stored(event.run_id or "", files)

    async def _run_ended(self, followed: _Followed, event: RunEnded[OnWorkers]) -> None:
        followed.end = event
        run_id = followed.run_id
        if await self.notices.told_ended(run_id):
            await self._confirm_stop(run_id, event)  # (its answer, if a restart cut it)
            return  # told before a restart
        state = event.state
        if state is None:
            note = event.where.placement.note or "stopped"
            await self.notices.notice(
                run_id, f"🤖 Auto run {run_id} did not start: {note}", live=f"status:{run_id}"
            )
            await self._confirm_stop(run_id, event)
            return
        await self.sink.update_status(
            StatusUpdate(
                run_id=run_id,
                mode="auto",
                status=live_status(state, event.record.status.value),
                phase=state.phase.value,
                turn=state.step - 1,
                round=state.turn,
                max_turns=state.max_turns,
                started_at=state.started_at,
                last_event=state.message or event.record.status.value,
            )
        )
        await self._confirm_stop(run_id, event)
        # The worker's report (with the evidence and work summary it measured), else what
        # the store says of the run.
        report = event.where.placement.report or final_report(state)
        await publish(self.sink, run_id, report, TextKind.FINAL)
        budget = Budget.from_config(state.config)
        if state.config.get("stopped_by") == STOPPED_BY_BUDGET and budget is not None:
            spent = (await SqliteRunStore(self.db).spend_of([run_id])).get(run_id, Spend())
            await self.notices.offer_more_budget(run_id, budget, budget.spent_text(spent))

    # -- start-up and shutdown ---------------------------------------------------------

    async def recover(self, report: Recovery) -> None:
        """Resume this process's runs; follow the chats' runs on the workers again (and
        once more those that ended while nobody followed them, if their end was not told)."""
        placements = await WorkerStore(self.db).placements()
        # A run on the workers records its chat too (its spend counts in the chat's day),
        # but it goes on on its worker, not here.
        placed = {p.run_id for p in placements}
        await self.local.recover(
            replace(report, auto=tuple(r for r in report.auto if r.id not in placed))
        )
        for placement in placements:
            spec = placement.spec
            if spec.chat_id is None or spec.mode != "auto":
                continue  # (a drive's are followed by the drives' front end)
            if placement.ended and (
                await self.notices.shown(f"status:{placement.run_id}") is None
                or await self.notices.told_ended(placement.run_id)
            ):
                continue
            self._follow(placement.run_id, ChatPlace(spec.chat_id, spec.thread_id))

    async def shutdown(self, *, park: bool) -> None:
        """Stop following (followers only read: the runs go on on their workers, and are
        followed again at the next start), then shut this process's runs down."""
        following = [f.task for f in self.followed.values() if f.task is not None]
        for task in following:
            task.cancel()
        await wait_all(following)
        await self.local.shutdown(park=park)

    async def park_all(self) -> None:
        await self.local.park_all()

"""Auto mode from a chat: ``/auto OBJECTIVE``, steering by message or ``/steer``, ``/stop``.

Runs are driven by :mod:`engine.automode` in their own tasks; the handlers only start,
steer and stop them. Reports come back through the bot's :class:`~bot.sink.BotSink`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Final

from telegram import Update
from telegram.error import TelegramError

from bot.auth import Action
from bot.chatting import configured_project
from bot.context import BotContext
from bot.feature import Feature
from bot.handlers import Dispatch
from bot.progress import TurnProgress
from bot.publish import format_elapsed
from bot.sink import ChatPlace, words
from bot.tool_approvals import ToolApprovalExtension
from engine.automode import (
    STOPPED_BY_PERSON,
    AutoRun,
    AutoStatus,
    resume_auto_run,
    start_auto_run,
)
from engine.automode.channel import final_report, turn_text
from engine.automode.run import ApprovalFor
from engine.automode.state import Phase
from engine.automode.verifier import evidence_gap
from engine.errors import ConfigError, TurnstileError
from engine.runs import Recovery, RunMode, RunSpec
from engine.sink import StatusUpdate, TextKind
from engine.store.runs import RunStatus, TurnState
from engine.workers.follow import RunEnded, RunFollower, TurnEnded, TurnStarted
from engine.workers.store import Placement, WorkerStore
from engine.workspace.runs import worktree_summaries

__all__ = ["AutoExtension"]

_LOGGER = logging.getLogger(__name__)

# A run on the workers: its turns' progress messages (not the chat's ``progress:``, which a
# restart settles: these runs go on meanwhile) and their Stop button's data.
WORKER_TURN: Final = "wturn:"
WORKER_STOP: Final = "sw:"
# How often a follower reads the store, and a running turn's message shows its time.
_FOLLOW_POLL: Final = 1.0
_TICK: Final = 5.0
_RETRY: Final = 2.0


@dataclass
class _Active:
    run: AutoRun
    place: ChatPlace
    watcher: asyncio.Task[None] | None = None
    parking: bool = False


@dataclass
class _Followed:
    """A run on the workers this bot follows for its chat."""

    run_id: str
    place: ChatPlace
    task: asyncio.Task[None] | None = None
    progress: TurnProgress | None = None
    stopped_by: int | None = None
    ticker: asyncio.Task[None] | None = None


def _thread_key(place: ChatPlace) -> int:
    return place.thread_id or 0


class AutoExtension(Feature):
    """Starts, steers, stops, parks and resumes auto-mode runs for chats."""

    def __init__(self, ctx: BotContext, approvals: ToolApprovalExtension) -> None:
        self.ctx = ctx
        self.sink = ctx.sink
        self.approvals = approvals
        self.active: dict[str, _Active] = {}
        self.followed: dict[str, _Followed] = {}
        self._closing = False

    def register(self, dispatch: Dispatch) -> None:
        dispatch.command("auto", Action.START_RUN, self.cmd_auto, usage="Usage: /auto OBJECTIVE")
        dispatch.command("steer", Action.STEER, self.cmd_steer, usage="Usage: /steer TEXT")
        dispatch.text(self.on_text)
        dispatch.buttons(rf"^{WORKER_STOP}", Action.STOP, self.on_worker_stop_button)

    def _approvals(self, update: Update | None, tool: str | None = None) -> ApprovalFor | None:
        """Where the run's tool calls ask (bot.tool_approvals); None when nothing asks."""
        user = update.effective_user if update is not None else None
        return self.approvals.routes_for(
            tool or self.ctx.settings.default_agent, user.id if user is not None else None
        )

    def running_in(self, chat_id: int, thread: int) -> list[AutoRun]:
        """The auto runs of this chat and topic, oldest first."""
        return [a.run for a in self._runs_in(chat_id, thread)]

    def running(self, run_id: str) -> AutoRun | None:
        active = self.active.get(run_id)
        return active.run if active is not None else None

    # -- commands ----------------------------------------------------------------------

    async def cmd_auto(self, update: Update, args: list[str]) -> None:
        message = update.effective_message
        chat = update.effective_chat
        assert message is not None
        assert chat is not None
        if self._closing:
            await self.ctx.replies.reply(update, "The bot is shutting down; try again in a minute.")
            return
        text = message.text or ""
        objective = text.split(maxsplit=1)[1].strip() if len(text.split(maxsplit=1)) > 1 else ""
        if not objective:
            await self.ctx.replies.reply(update, "Usage: /auto OBJECTIVE")
            return
        thread = message.message_thread_id if message.is_topic_message else None
        if thread is None and chat.is_forum:
            thread = await self._topic(chat.id, f"auto: {objective[:60]}")
        binding = await self.ctx.store.binding(chat.id, thread or 0)
        project = binding.project if binding is not None else "default"
        place = ChatPlace(chat.id, thread)
        cannot = await self._unverifiable(project)
        if cannot is not None:
            await self.ctx.replies.reply(update, f"Cannot start: {cannot}")
            return
        if self.ctx.settings.execution == "workers":
            await self._auto_on_workers(update, objective, project, place)
            return
        try:
            # The run's id keys its worktree: its branch is turnstile/<run id>.
            run_id = self.ctx.supervisor.reserve(RunMode.AUTO)
            workdir = await self.ctx.chats.workdir_for(project, run_id)
            spec = RunSpec(
                objective=objective,
                agent=self.ctx.settings.default_agent,
                workdir=workdir,
                run_id=run_id,
                project=project,
                chat=place,
            )
            run = await start_auto_run(
                self.ctx.settings,
                self.ctx.db,
                spec,
                sink=self.sink,
                supervisor=self.ctx.supervisor,
                approval_for=self._approvals(update),
            )
        except ConfigError as exc:
            await self.ctx.replies.reply(update, f"Cannot start: {exc}")
            return
        self._track(run, place)
        user = update.effective_user
        await self.ctx.store.audit(
            action="auto",
            outcome="allowed",
            user_id=user.id if user else None,
            chat_id=chat.id,
            update_id=update.update_id,
            reason=run.run_id,
        )
        # The run's one live message (its status, edited in place), under the /auto asking.
        await self.ctx.publisher.live(
            f"status:{run.run_id}",
            f"🤖 Auto run {run.run_id} started ({self.ctx.settings.default_agent}, project "
            f"{project}).\nMessages here, or /steer TEXT, become instructions for the next "
            f"Execute turn. /stop {run.run_id} stops it.",
            chat_id=chat.id,
            thread_id=thread,
            run_id=run.run_id,
            reply_to=message.message_id,
        )

    async def _auto_on_workers(
        self, update: Update, objective: str, project: str, place: ChatPlace
    ) -> None:
        """``/auto`` with TURNSTILE_EXECUTION=workers: queue the run as ``turnstile auto
        --checkout-repo PROJECT`` does; /status and /stop reach it from this chat."""
        from engine.workers.control import new_spec, project_reference, start_on_workers

        settings = self.ctx.settings
        tool = settings.default_agent
        try:
            spec = new_spec(
                objective=objective,
                tool=tool,
                project=project_reference(settings, project),
                agent_cmd=settings.agent_command if tool == "command" else None,
                passthrough=(),
                max_turns=None,
                verify_cmd=None,
            )
            spec = replace(spec, chat_id=place.chat_id, thread_id=place.thread_id)
            await start_on_workers(settings, spec)
        except ConfigError as exc:
            await self.ctx.replies.reply(update, f"Cannot start: {exc}")
            return
        user = update.effective_user
        await self.ctx.store.audit(
            action="auto",
            outcome="allowed",
            user_id=user.id if user else None,
            chat_id=place.chat_id,
            update_id=update.update_id,
            reason=spec.run_id,
        )
        message = update.effective_message
        # The run's one live message, under the /auto, as for a run in this process.
        await self.ctx.publisher.live(
            f"status:{spec.run_id}",
            f"🤖 Auto run {spec.run_id} is queued on the workers ({tool}, project {project})."
            f"\n/status shows it; /stop {spec.run_id} stops it.",
            chat_id=place.chat_id,
            thread_id=place.thread_id,
            run_id=spec.run_id,
            reply_to=message.message_id if message is not None else None,
        )
        self._follow(spec.run_id, place)

    async def _on_workers(self, chat_id: int, thread: int | None = None) -> list[Placement]:
        """The unfinished runs on the workers started from this chat (and topic)."""
        if self.ctx.settings.execution != "workers":
            return []
        found = []
        for placement in await WorkerStore(self.ctx.db).placements():
            spec = placement.spec
            if placement.ended or spec.chat_id != chat_id:
                continue
            if thread is not None and (spec.thread_id or 0) != thread:
                continue
            found.append(placement)
        return found

    async def _stop_on_workers(self, run_id: str, by: int | None = None) -> bool:
        from engine.workers.control import stop_run_in

        followed = self.followed.get(run_id)
        if followed is not None and by is not None:
            followed.stopped_by = by

        try:
            done = await stop_run_in(self.ctx.settings, self.ctx.db, run_id)
        except ConfigError as exc:  # it ended meanwhile
            _LOGGER.info("nothing to stop: %s", exc, extra={"run_id": run_id})
            return False
        _LOGGER.info("%s", done, extra={"run_id": run_id})
        return True

    async def _unverifiable(self, project: str) -> str | None:
        """Why no completion could ever be accepted in the project's folder (None: it can).

        The bot has no verify command: in a folder that is no git repository nothing
        could confirm completion, and the run would use all its turns.
        """
        if configured_project(self.ctx.settings, project):
            return None  # a git worktree of its own
        try:
            folder = await self.ctx.chats.workdir_for(project, "")
        except ConfigError:
            return None  # said when the run is started
        gap = await evidence_gap(folder)
        if gap is None:
            return None
        return (
            f"{gap}, so no claim of completion could be accepted and the run would use all "
            "its turns. Make that folder a git repository (git init and a first commit), or "
            "use another project (/project NAME)."
        )

    async def cmd_steer(self, update: Update, args: list[str]) -> None:
        message = update.effective_message
        assert message is not None
        text = message.text or ""
        parts = text.split(maxsplit=1)
        await self._steer(update, parts[1] if len(parts) > 1 else "", explicit=True)

    async def _topic(self, chat_id: int, name: str) -> int | None:
        bot = self.ctx.bot
        try:
            topic = await bot.create_forum_topic(chat_id=chat_id, name=name[:128])
        except TelegramError as exc:
            _LOGGER.warning("could not create a forum topic: %s", exc)
            return None
        return int(topic.message_thread_id)

    # -- steering ----------------------------------------------------------------------

    def _runs_in(self, chat_id: int, thread: int) -> list[_Active]:
        return [
            a
            for a in self.active.values()
            if a.place.chat_id == chat_id and _thread_key(a.place) == thread
        ]

    async def on_text(self, update: Update, text: str, thread: int) -> bool:
        chat = update.effective_chat
        assert chat is not None
        if not self._runs_in(chat.id, thread):
            return False
        await self._steer(update, text, explicit=False)
        return True

    async def _steer(self, update: Update, text: str, *, explicit: bool) -> None:
        chat = update.effective_chat
        message = update.effective_message
        assert chat is not None
        assert message is not None
        thread = message.message_thread_id if message.is_topic_message else 0
        runs = self._runs_in(chat.id, thread or 0) or [
            a for a in self.active.values() if a.place.chat_id == chat.id
        ]
        if not runs:
            if explicit:
                await self.ctx.replies.reply(update, "No auto-mode run is running here to steer.")
            return
        if not await self.ctx.replies.authorize(update, Action.STEER):
            return
        if not text.strip():
            await self.ctx.replies.reply(update, "Usage: /steer TEXT")
            return
        target = runs[-1]
        try:
            path = target.run.append_instruction(text)
        except ConfigError as exc:
            await self.ctx.replies.reply(update, f"Instruction refused: {exc}")
            return
        _LOGGER.info("instruction %s queued", path.name, extra={"run_id": target.run.run_id})
        await self.ctx.replies.reply(
            update,
            f"📝 Noted for run {target.run.run_id}: it goes into the next Execute turn.",
        )

    # -- running -----------------------------------------------------------------------

    def _track(self, run: AutoRun, place: ChatPlace) -> None:
        self.sink.register(run.run_id, place)
        active = _Active(run, place)
        self.active[run.run_id] = active
        active.watcher = asyncio.create_task(self._watch(active), name=f"auto-watch-{run.run_id}")

    async def _watch(self, active: _Active) -> None:
        run = active.run
        finished = False
        try:
            result = await run.task
            # Only a run our shutdown stopped is parked; one that ended on its own is not.
            finished = not (
                result.status is AutoStatus.STOPPED and result.message == STOPPED_BY_PERSON
            )
            _LOGGER.info("auto run ended %s", result.status.value, extra={"run_id": run.run_id})
        except TurnstileError as exc:
            await self.ctx.publisher.say(
                active.place.chat_id,
                f"⚠️ Auto run {run.run_id} failed: {exc}",
                thread_id=active.place.thread_id,
                run_id=run.run_id,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _LOGGER.exception("auto run crashed", extra={"run_id": run.run_id})
            await self.ctx.publisher.say(
                active.place.chat_id,
                f"⚠️ Auto run {run.run_id} crashed: {type(exc).__name__}",
                thread_id=active.place.thread_id,
                run_id=run.run_id,
            )
        finally:
            self.active.pop(run.run_id, None)
            if active.parking and not finished:
                with contextlib.suppress(TurnstileError):
                    await self.ctx.runs.update_run(run.run_id, status=RunStatus.PARKED)

    async def stop(self, run_id: str, *, chat_id: int, by: int) -> bool:
        active = self.active.get(run_id)
        if active is None or active.place.chat_id != chat_id:
            if any(p.run_id == run_id for p in await self._on_workers(chat_id)):
                return await self._stop_on_workers(run_id, by)
            return False
        # Through the supervisor, like every run's stop (the running turn is pre-empted).
        if not self.ctx.supervisor.stop(run_id):
            await active.run.stop()  # (not attached yet: the run's latch waits for it)
        return True

    async def stop_chat(self, chat_id: int, thread: int, *, by: int) -> list[str]:
        stopped = []
        for active in self._runs_in(chat_id, thread):
            if not self.ctx.supervisor.stop(active.run.run_id):
                await active.run.stop()
            stopped.append(active.run.run_id)
        for placement in await self._on_workers(chat_id, thread):
            if await self._stop_on_workers(placement.run_id, by):
                stopped.append(placement.run_id)
        return stopped

    async def status_lines(self, chat_id: int, thread: int) -> list[str]:
        runs = [a.run for a in self.active.values() if a.place.chat_id == chat_id]
        here = [run.state for run in runs]
        # A warm session: its agent process stays between the run's turns.
        warm = {
            run.run_id
            for run in runs
            if getattr(getattr(run.runner, "agent", None), "resident", False)
        }
        # The worktree of a run on a configured project: its branch and disk usage.
        worktrees = await worktree_summaries(
            self.ctx.settings, self.ctx.db, {s.run_id: s.workdir for s in here}
        )
        lines = []
        for s in here:
            elapsed = int(time.time() - s.started_at)
            lines.append(
                f"🤖 auto {s.run_id} · {s.status.value} · {s.phase.label} · "
                f"turn {s.turn} of {s.max_turns} · {format_elapsed(elapsed)}"
                + (" · warm" if s.run_id in warm else "")
            )
            if s.run_id in worktrees:
                lines.append(f"   🌿 {worktrees[s.run_id]}")
        lines.extend(await self._worker_status_lines(chat_id))
        return lines

    async def _worker_status_lines(self, chat_id: int) -> list[str]:
        placements = await self._on_workers(chat_id)
        if not placements:
            return []
        from engine.workers.control import worker_status
        from engine.workers.views import is_warm

        store = WorkerStore(self.ctx.db)
        # Recorded by the worker: its agent process stays between the run's turns there.
        warm = await store.warm_runs()
        lines = []
        for p in placements:
            waiting = await worker_status(store, p, silent_after=self.ctx.settings.worker_timeout)
            where = waiting or f"running on worker {p.worker}"
            elapsed = int(time.time() - p.created_at)
            lines.append(
                f"🤖 auto {p.run_id} · {where} · {format_elapsed(elapsed)}"
                + (" · warm" if is_warm(p, waiting, warm) else "")
            )
        return lines

    # -- runs on the workers: followed from the store --------------------------------------

    def _follow(self, run_id: str, place: ChatPlace) -> None:
        if run_id in self.followed:
            return
        self.sink.register(run_id, place)
        followed = _Followed(run_id, place)
        self.followed[run_id] = followed
        followed.task = asyncio.create_task(self._follow_run(followed), name=f"follow-{run_id}")

    async def _follow_run(self, followed: _Followed) -> None:
        """The run's turns and end as the chat shows a run of this process: the live status
        message and final report through the sink, and a progress message per turn."""
        run_id = followed.run_id
        follower = RunFollower(
            self.ctx.db,
            run_id,
            silent_after=self.ctx.settings.worker_timeout,
            poll=_FOLLOW_POLL,
        )
        ticker = asyncio.create_task(self._tick(followed), name=f"tick-{run_id}")
        try:
            while True:
                try:
                    # The follower keeps the turns it has given: a retry gives no turn twice.
                    async for event in follower.events():
                        match event:
                            case TurnStarted():
                                await self._turn_started(followed, event)
                            case TurnEnded():
                                await self._turn_ended(followed, event)
                            case RunEnded():
                                await self._run_ended(followed, event)
                    return
                except TurnstileError as exc:
                    # The database may be away a moment; the run goes on on its worker.
                    _LOGGER.warning("following paused: %s", exc, extra={"run_id": run_id})
                    await asyncio.sleep(_RETRY)
        except asyncio.CancelledError:
            raise
        except Exception:
            _LOGGER.exception("could not follow the run", extra={"run_id": run_id})
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            self.followed.pop(run_id, None)

    async def _tick(self, followed: _Followed) -> None:
        while True:
            await asyncio.sleep(_TICK)  # a refresh of the elapsed time, not a hand-off
            progress = followed.progress
            if progress is not None and not progress.finished:
                try:
                    await progress.show()
                except TurnstileError as exc:
                    _LOGGER.warning("progress not refreshed: %s", exc)

    def _progress(
        self,
        followed: _Followed,
        seq: int,
        attempt: int,
        started_at: float,
        clock: Callable[[], float] = time.time,
    ) -> TurnProgress:
        progress = TurnProgress(
            self.ctx.publisher,
            chat_id=followed.place.chat_id,
            thread_id=followed.place.thread_id,
            run_id=followed.run_id,
            turn=seq,
            reply_to=None,
            clock=clock,
            prefix=WORKER_TURN,
            stop_data=WORKER_STOP,
        )
        # A turn run again (its worker was lost) gets a message of its own.
        if attempt > 1:
            progress.ref += f".{attempt}"
        progress.started = started_at
        return progress

    async def _turn_started(self, followed: _Followed, event: TurnStarted) -> None:
        state = event.state
        label = Phase(event.phase).label if event.phase else "Turn"
        where = f"{label} on worker {event.worker}" if event.worker else label
        await self.sink.update_status(
            StatusUpdate(
                run_id=followed.run_id,
                mode="auto",
                status=RunStatus.RUNNING.value,
                phase=event.phase,
                turn=event.seq,
                max_turns=state.max_turns,
                started_at=state.started_at,
                last_event=f"{label} running"
                + (f" on worker {event.worker}" if event.worker else ""),
            )
        )
        progress = self._progress(followed, event.seq, event.attempt, event.started_at)
        progress.where = where
        followed.progress = progress
        known = await self.ctx.store.get_live(progress.ref)
        if known is not None and known.markup is None:
            progress.finished = True  # finalized before a restart
            return
        await progress.show()

    async def _turn_ended(self, followed: _Followed, event: TurnEnded) -> None:
        turn, state = event.turn, event.state
        phase = Phase(turn.phase) if turn.phase else state.phase
        if turn.state is TurnState.FINISHED and turn.exit_code is not None:
            # Folded by the sink into the live message and the final turns document.
            await self.sink.publish_kind(
                followed.run_id,
                turn_text(
                    turn=turn.seq,
                    max_turns=state.max_turns,
                    phase=phase,
                    code=turn.exit_code,
                    text=turn.output or "",
                    size=turn.output_size,
                    stderr_tail=turn.stderr_tail,
                    log_dir=state.log_dir,
                ),
                TextKind.TURN,
            )
            final = f"✅ {phase.label} done" + (
                f", exit {turn.exit_code}" if turn.exit_code else ""
            )
        elif turn.state is TurnState.INTERRUPTED and followed.stopped_by is not None:
            final = (
                f"⏹ {phase.label} stopped by {self.ctx.publisher.people.name(followed.stopped_by)}"
            )
        elif turn.state is TurnState.INTERRUPTED:
            final = f"⏹ {phase.label} cut off" + (f": {turn.error}" if turn.error else "")
        else:
            final = f"⚠️ {phase.label} failed" + (f": {turn.error}" if turn.error else "")
        if event.worker:
            final += f" on worker {event.worker}"
        finished_at = turn.finished_at or turn.started_at
        # Finalized with the turn's own duration (also when replayed after a restart).
        done = self._progress(
            followed, turn.seq, turn.attempt, turn.started_at, clock=lambda: finished_at
        )
        progress = followed.progress
        if progress is not None and progress.ref == done.ref:
            progress.finished = True
            followed.progress = None
        known = await self.ctx.store.get_live(done.ref)
        if known is None or known.markup is not None:
            await done.finish(final)

    async def _run_ended(self, followed: _Followed, event: RunEnded) -> None:
        place, run_id = followed.place, followed.run_id
        state = event.state
        status = f"status:{run_id}"
        known = await self.ctx.store.get_live(status)
        if known is not None and _ended_text(known.body):
            return  # said before a restart
        if state is None or event.record is None:
            note = event.placement.note or "stopped"
            await self.ctx.publisher.live(
                status,
                f"🤖 Auto run {run_id} did not start: {note}",
                chat_id=place.chat_id,
                thread_id=place.thread_id,
                run_id=run_id,
            )
            return
        await self.sink.update_status(
            StatusUpdate(
                run_id=run_id,
                mode="auto",
                status=event.record.status.value,
                phase=state.phase.value,
                turn=state.turn,
                max_turns=state.max_turns,
                started_at=state.started_at,
                last_event=state.message or event.record.status.value,
            )
        )
        # The worker's report (with the evidence and work summary it measured), else what
        # the store says of the run.
        report = event.placement.report or final_report(state)
        await self.sink.publish_kind(run_id, report, TextKind.FINAL)

    async def on_worker_stop_button(self, update: Update, data: str) -> None:
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        run_id = data.removeprefix(WORKER_STOP)
        if not any(p.run_id == run_id for p in await self._on_workers(chat.id)):
            await self.ctx.replies.answer(update, "Nothing is running there any more.")
            return
        await self.ctx.replies.answer(update, "Stopping…")
        await self.ctx.store.audit(
            action="stop",
            outcome="allowed",
            user_id=user.id,
            chat_id=chat.id,
            update_id=update.update_id,
            reason=run_id,
        )
        await self._stop_on_workers(run_id, user.id)

    async def _resume_following(self) -> None:
        """After a restart: follow the chats' runs still going on the workers again."""
        for placement in await self._placements_followed():
            spec = placement.spec
            assert spec.chat_id is not None
            self._follow(placement.run_id, ChatPlace(spec.chat_id, spec.thread_id))

    async def _placements_followed(self) -> list[Placement]:
        if self.ctx.settings.execution != "workers":
            return []
        found = []
        for placement in await WorkerStore(self.ctx.db).placements():
            if placement.spec.chat_id is None:
                continue
            if placement.ended:
                # Ended while no bot followed it: followed once more if its chat was not
                # told yet (its live message still shows it running).
                live = await self.ctx.store.get_live(f"status:{placement.run_id}")
                if live is None or _ended_text(live.body):
                    continue
            found.append(placement)
        return found

    # -- start-up and shutdown ---------------------------------------------------------

    async def recover(self, report: Recovery) -> None:
        """Resume the auto runs the supervisor's recovery found parked or cut off."""
        for record in report.auto:
            assert record.chat_id is not None  # (the report holds the runs a chat follows)
            place = ChatPlace(record.chat_id, record.thread_id)
            self.sink.register(record.id, place)
            try:
                run = await resume_auto_run(
                    self.ctx.settings,
                    self.ctx.db,
                    record.id,
                    sink=self.sink,
                    supervisor=self.ctx.supervisor,
                    approval_for=self._approvals(None, record.agent),
                )
            except TurnstileError as exc:
                _LOGGER.warning("auto run not resumed: %s", exc, extra={"run_id": record.id})
                await self.ctx.publisher.say(
                    record.chat_id,
                    f"⚠️ Auto run {record.id} could not be resumed: {exc}",
                    thread_id=record.thread_id,
                    run_id=record.id,
                )
                continue
            self._track(run, place)
            await self.ctx.publisher.say(
                record.chat_id,
                f"▶️ Auto run {record.id} resumed at turn {run.state.turn}, phase "
                f"{run.state.phase.value}.",
                thread_id=record.thread_id,
                run_id=record.id,
            )
        await self._resume_following()

    async def shutdown(self, *, park: bool, preempt: asyncio.Event) -> None:
        self._closing = True
        # Followers only read: the runs go on on their workers, followed again at start.
        following = [f.task for f in self.followed.values() if f.task is not None]
        for task in following:
            task.cancel()
        if following:
            await asyncio.wait(following)
        actives = list(self.active.values())
        for active in actives:
            active.parking = True
            if park:
                await active.run.stop()
            else:
                # The running turn finishes; the run closes at its next poll.
                active.run.channel.request_stop()
        watchers = [a.watcher for a in actives if a.watcher is not None]
        if watchers:
            await asyncio.wait(watchers)

    async def park_all(self) -> None:
        for active in list(self.active.values()):
            active.parking = True
            await active.run.stop()


def _ended_text(body: str) -> bool:
    """Whether a run's live status message says it ended (its second line, the state)."""
    lines = body.splitlines()
    if len(lines) < 2:
        return False
    ended = [words(s) for s in ("completed", "stopped", "error", "crashed")]
    return any(lines[1].startswith(w) for w in ended)

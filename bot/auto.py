"""Auto mode from a chat: ``/auto OBJECTIVE``, steering by message or ``/steer``, ``/stop``.

Runs are driven by :mod:`engine.automode` in their own tasks; the handlers only start,
steer and stop them. Reports come back through the bot's :class:`~bot.sink.BotSink`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from telegram import Update
from telegram.error import TelegramError

from bot.auth import Action
from bot.auto_workers import WORKER_STOP, WorkerRuns
from bot.chatting import configured_project
from bot.context import BotContext
from bot.feature import Feature
from bot.handlers import Dispatch
from bot.publish import format_elapsed
from bot.sink import ChatPlace
from bot.tool_approvals import ToolApprovalExtension
from engine.automode import (
    STOPPED_BY_PERSON,
    AutoRun,
    AutoStatus,
    resume_auto_run,
    start_auto_run,
)
from engine.automode.run import ApprovalFor
from engine.automode.verifier import evidence_gap
from engine.errors import ConfigError, StoreUnreachableError, TurnstileError
from engine.runs import Recovery, RunMode, RunSpec
from engine.store.backend import wait_reachable
from engine.store.runs import RunStatus
from engine.workspace.runs import worktree_summaries

__all__ = ["AutoExtension"]

_LOGGER = logging.getLogger(__name__)


@dataclass
class _Active:
    run: AutoRun
    place: ChatPlace
    watcher: asyncio.Task[None] | None = None
    parking: bool = False


def _thread_key(place: ChatPlace) -> int:
    return place.thread_id or 0


class AutoExtension(Feature):
    """Starts, steers, stops, parks and resumes auto-mode runs for chats."""

    def __init__(self, ctx: BotContext, approvals: ToolApprovalExtension) -> None:
        self.ctx = ctx
        self.sink = ctx.sink
        self.approvals = approvals
        self.active: dict[str, _Active] = {}
        self.workers = WorkerRuns(ctx)
        self._closing = False
        # Runs the database cut off, each resumed once it is back (bot/auto.py _revive).
        self._revivals: set[asyncio.Task[None]] = set()

    def register(self, dispatch: Dispatch) -> None:
        dispatch.command("auto", Action.START_RUN, self.cmd_auto, usage="Usage: /auto OBJECTIVE")
        dispatch.command("steer", Action.STEER, self.cmd_steer, usage="Usage: /steer TEXT")
        dispatch.text(self.on_text)
        dispatch.buttons(rf"^{WORKER_STOP}", Action.STOP, self.workers.on_stop_button)

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
            await self.workers.start(update, objective, project, place)
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
            initial=True,
        )

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
        except StoreUnreachableError as exc:
            if not exc.retryable or self._closing:
                # Recorded running: the next start's recovery resumes it.
                _LOGGER.warning("auto run cut off: %s", exc, extra={"run_id": run.run_id})
                return
            # The database went away under the run (an outage, a restart): what its turn did
            # was not all recorded. Once the database is back the run resumes from what the
            # store holds, its cut-off turn run again; nothing to say meanwhile.
            _LOGGER.warning(
                "auto run cut off by the database (%s); resumed once it is back",
                exc,
                extra={"run_id": run.run_id},
            )
            revival = asyncio.create_task(self._revive(active), name=f"revive-{run.run_id}")
            self._revivals.add(revival)
            revival.add_done_callback(self._revivals.discard)
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

    async def _revive(self, active: _Active) -> None:
        await wait_reachable(self.ctx.db)
        if self._closing:
            return  # resumed by the next start's recovery (it is still recorded running)
        await self._resume(
            active.run.run_id,
            active.place,
            active.run.state.tool,
            why=": the database was away for a while",
            failed="was cut off when the database went away and could not be resumed",
        )

    async def _resume(
        self, run_id: str, place: ChatPlace, tool: str | None, *, why: str = "", failed: str
    ) -> None:
        """Resume ``run_id`` from its recorded phase and turn here, and say so (or why not)."""
        try:
            run = await resume_auto_run(
                self.ctx.settings,
                self.ctx.db,
                run_id,
                sink=self.sink,
                supervisor=self.ctx.supervisor,
                approval_for=self._approvals(None, tool),
            )
        except TurnstileError as exc:
            _LOGGER.warning("auto run not resumed: %s", exc, extra={"run_id": run_id})
            await self.ctx.publisher.say(
                place.chat_id,
                f"⚠️ Auto run {run_id} {failed}: {exc}",
                thread_id=place.thread_id,
                run_id=run_id,
            )
            return
        self._track(run, place)
        await self.ctx.publisher.say(
            place.chat_id,
            f"▶️ Auto run {run_id} resumed at turn {run.state.turn}, phase "
            f"{run.state.phase.value}{why}.",
            thread_id=place.thread_id,
            run_id=run_id,
        )

    async def stop(self, run_id: str, *, chat_id: int, by: int) -> bool:
        active = self.active.get(run_id)
        if active is None or active.place.chat_id != chat_id:
            return await self.workers.stop(run_id, chat_id=chat_id)
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
        stopped.extend(await self.workers.stop_chat(chat_id, thread))
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
        lines.extend(await self.workers.status_lines(chat_id))
        return lines

    # -- start-up and shutdown ---------------------------------------------------------

    async def recover(self, report: Recovery) -> None:
        """Resume the auto runs the supervisor's recovery found parked or cut off."""
        for record in report.auto:
            assert record.chat_id is not None  # (the report holds the runs a chat follows)
            place = ChatPlace(record.chat_id, record.thread_id)
            self.sink.register(record.id, place)
            await self._resume(record.id, place, record.agent, failed="could not be resumed")
        await self.workers.resume()

    async def shutdown(self, *, park: bool, preempt: asyncio.Event) -> None:
        self._closing = True
        for revival in list(self._revivals):
            revival.cancel()
        await self.workers.close()
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

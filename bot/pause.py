"""Pause and go on: ``/pause [RUN]``, ``/resume [RUN]`` and the buttons on a run's message.

A paused run finishes the tool call it is in (an agent that asks turnstile before its
tool calls: Claude Code with tool approvals or a preset) or else the turn it is in, then
waits, keeping its turn slot, until someone lets it go on (``engine.runs.pause``). Its
live message says so and offers ▶ Go on; ``/status`` lists it. Stopping a paused run
stops it (the pause goes with it).
"""

from __future__ import annotations

import logging
import time
from typing import Final

from telegram import Update

from bot.context import BotContext
from bot.feature import Feature
from bot.handlers import Dispatch
from bot.places import chat_of
from bot.replies import thread_of
from bot.tool_approvals import ToolApprovalExtension
from chatfront.auth import Action
from chatfront.progress import GO_ON_DATA, PAUSE_DATA, PREFIX, stop_button
from engine.approvals import ApprovalPolicy
from engine.errors import NotFoundError
from engine.humane import format_elapsed
from engine.runs import Recovery, named_runs
from engine.runs.pause import Pauses
from engine.runs.spec import PlaceId
from engine.store.runs import RunRecord, RunStatus

__all__ = ["PauseFeature"]

_LOGGER = logging.getLogger(__name__)

_ID_CHARS: Final = r"[A-Za-z0-9_:.-]{1,60}"


class PauseFeature(Feature):
    """Pauses the bot's runs and lets them go on."""

    def __init__(self, ctx: BotContext, approvals: ToolApprovalExtension) -> None:
        self.ctx = ctx
        self.approvals = approvals
        self.pauses = Pauses(ctx.db)
        #: The runs paused now, and the line their live message shows.
        self.lines: dict[str, str] = {}
        ctx.chat_front.paused = self.lines
        ctx.sink.paused = self.lines

    def register(self, dispatch: Dispatch) -> None:
        dispatch.command("pause", Action.PAUSE, self.cmd_pause)
        dispatch.command("resume", Action.PAUSE, self.cmd_resume)
        dispatch.buttons(rf"^{PAUSE_DATA}{_ID_CHARS}\Z", Action.PAUSE, self.on_pause_button)
        dispatch.buttons(rf"^{GO_ON_DATA}{_ID_CHARS}\Z", Action.PAUSE, self.on_go_on_button)

    # -- finding the run ---------------------------------------------------------------

    async def _running_here(self, chat_id: PlaceId, thread: PlaceId | None) -> list[RunRecord]:
        runs = await self.ctx.runs.list_runs(status=RunStatus.RUNNING)
        return [r for r in runs if r.chat_id == chat_id and r.thread_id == thread]

    async def _named(self, update: Update, args: list[str], verb: str) -> RunRecord | None:
        """The run ``args`` name (or the one run here); None once the person was told why."""
        chat = update.effective_chat
        assert chat is not None
        here = await self._running_here(chat_of(chat), thread_of(update.effective_message))
        if args:
            wanted = args[0]
            names = named_runs((r.id for r in here), wanted)
            found = [r for r in here if r.id in names]
            if len(found) == 1:
                return found[0]
            listed = ", ".join(r.id for r in here) or "none"
            what = "Several runs here end so" if found else f"No running run {wanted} here"
            await self.ctx.replies.reply(update, f"{what}. Running here: {listed}.")
            return None
        if len(here) == 1:
            return here[0]
        if not here:
            await self.ctx.replies.reply(update, "Nothing is running here.")
            return None
        listed = "\n".join(f"/{verb} {r.id}" for r in here)
        await self.ctx.replies.reply(update, f"Several runs here; which one?\n{listed}")
        return None

    async def _waits_after(self, run: RunRecord) -> str:
        """What a paused run finishes before it waits, in plain words: a Claude Code run
        whose tool calls reach the permission server waits before its next one."""
        if run.agent == "claude":
            own = run.state.get("config", {}).get("permissions") if run.state else None
            if own is not None:
                policy = ApprovalPolicy(own)
            elif run.chat_id is not None:
                policy = await self.approvals.policy_in(run.chat_id, run.thread_id)
            else:
                policy = self.approvals.policy
            if policy is not ApprovalPolicy.OFF:
                return "the tool call it is in"
        return "the turn it is in"

    # -- pausing -----------------------------------------------------------------------

    async def cmd_pause(self, update: Update, args: list[str]) -> None:
        run = await self._named(update, args, "pause")
        if run is not None:
            await self._pause(update, run)

    async def cmd_resume(self, update: Update, args: list[str]) -> None:
        if args:
            run = await self._named(update, args, "resume")
        else:  # a bare /resume: the one paused run here
            chat = update.effective_chat
            assert chat is not None
            here = await self._running_here(chat_of(chat), thread_of(update.effective_message))
            paused = await self.pauses.of([r.id for r in here])
            waiting = [r for r in here if r.id in paused]
            if len(waiting) == 1:
                run = waiting[0]
            elif not waiting:
                await self.ctx.replies.reply(update, "No run is paused here.")
                return
            else:
                listed = "\n".join(f"/resume {r.id}" for r in waiting)
                await self.ctx.replies.reply(update, f"Several runs are paused here:\n{listed}")
                return
        if run is not None:
            await self._go_on(update, run)

    async def on_pause_button(self, update: Update, data: str) -> None:
        run = await self._pressed(update, data.removeprefix(PAUSE_DATA))
        if run is not None:
            await self._pause(update, run)

    async def on_go_on_button(self, update: Update, data: str) -> None:
        run = await self._pressed(update, data.removeprefix(GO_ON_DATA))
        if run is not None:
            await self._go_on(update, run)

    async def _pressed(self, update: Update, run_id: str) -> RunRecord | None:
        chat = update.effective_chat
        assert chat is not None
        try:
            run = await self.ctx.runs.get_run(run_id)
        except NotFoundError:
            run = None
        if run is None or run.chat_id != chat_of(chat) or run.status is not RunStatus.RUNNING:
            await self.ctx.replies.answer(update, "That run is not running any more.")
            return None
        return run

    async def _pause(self, update: Update, run: RunRecord) -> None:
        user = update.effective_user
        chat = update.effective_chat
        assert user is not None
        assert chat is not None
        name = self.ctx.publisher.people.name(user.id)
        after = await self._waits_after(run)
        if not await self.pauses.pause(run.id, by=user.id):
            said = f"Run {run.id} is paused already. /resume {run.id} lets it go on."
            await self._tell(update, said)
            return
        await self.ctx.replies.audited(update, "pause", run.id)
        self.lines[run.id] = (
            f"⏸ Paused by {name}: it finishes {after}, then waits. ▶ Go on, or /resume, "
            "lets it go on."
        )
        _LOGGER.info("run %s paused by %s", run.id, user.id)
        await self._refresh(run.id)
        await self._tell(
            update,
            f"⏸ Run {run.id} pauses: it finishes {after}, then waits, keeping its turn "
            f"slot. /resume {run.id} lets it go on.",
        )

    async def _go_on(self, update: Update, run: RunRecord) -> None:
        user = update.effective_user
        assert user is not None
        if not await self.pauses.resume(run.id, by=user.id):
            self.lines.pop(run.id, None)
            await self._tell(update, f"Run {run.id} is not paused.")
            return
        await self.ctx.replies.audited(update, "resume", run.id)
        self.lines.pop(run.id, None)
        _LOGGER.info("run %s goes on (%s)", run.id, user.id)
        await self._refresh(run.id)
        name = self.ctx.publisher.people.name(user.id)
        await self._tell(update, f"▶ Run {run.id} goes on ({name}).")

    async def _tell(self, update: Update, text: str) -> None:
        """A button press is answered on the button; a command, in the chat."""
        if update.callback_query is not None:
            await self.ctx.replies.answer(update, text[:200])
        else:
            await self.ctx.replies.reply(update, text)

    async def _refresh(self, run_id: str) -> None:
        """The run's live message shows the pause (or no longer): a chat turn's progress
        message, or an auto run's status message."""
        if await self.ctx.sink.refresh_auto(run_id):
            return
        shown = [
            live
            for live in await self.ctx.store.live_with_prefix(f"{PREFIX}{run_id}:")
            if live.markup is not None
        ]
        if not shown:
            return
        live = shown[-1]
        paused = run_id in self.lines
        body = "\n".join(line for line in live.body.splitlines() if not line.startswith("⏸"))
        if paused:
            head, _, rest = body.partition("\n")
            body = "\n".join(part for part in (head, self.lines[run_id], rest) if part)
        await self.ctx.publisher.live(
            live.ref,
            body,
            chat_id=live.chat_id,
            thread_id=live.thread_id,
            markup=stop_button(run_id, paused=paused),
            run_id=run_id,
        )

    # -- stop, status, start-up --------------------------------------------------------

    async def stop(self, run_id: str, *, chat_id: PlaceId, by: int) -> bool:
        # Asked after the run's owner stopped it: the pause goes with the stop.
        if run_id in self.lines or await self.pauses.get(run_id) is not None:
            await self.pauses.resume(run_id, by=by)
            self.lines.pop(run_id, None)
        return False

    async def stop_chat(self, chat_id: PlaceId, thread: PlaceId | None, *, by: int) -> list[str]:
        here = await self._running_here(chat_id, thread)
        for run_id in await self.pauses.of([r.id for r in here]):
            await self.pauses.resume(run_id, by=by)
            self.lines.pop(run_id, None)
        return []

    async def status_lines(self, chat_id: PlaceId, thread: PlaceId | None) -> list[str]:
        here = await self._running_here(chat_id, thread)
        paused = await self.pauses.of([r.id for r in here])
        lines = []
        for run_id, pause in paused.items():
            name = self.ctx.publisher.people.name(pause.paused_by)
            since = format_elapsed(time.time() - pause.paused_at)
            lines.append(
                f"⏸ run {run_id} is paused (by {name}, {since} ago); it keeps its turn slot. "
                f"/resume {run_id} lets it go on."
            )
        return lines

    async def recover(self, report: Recovery) -> None:
        """Pauses outlive a restart: the runs that resume wait as they did."""
        for run_id, pause in (await self.pauses.of()).items():
            name = self.ctx.publisher.people.name(pause.paused_by)
            self.lines[run_id] = (
                f"⏸ Paused by {name}: it waits. ▶ Go on, or /resume, lets it go on."
            )

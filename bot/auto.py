"""Auto mode from a chat: ``/auto OBJECTIVE``, steering by message or ``/steer``, ``/stop``.

The chat's commands go to the engine's auto executor (:mod:`engine.executors`), which
drives a run in this process or queues it on the workers, as the settings say; the run's
reports come back through the bot's :class:`~chatfront.sink.BotSink`, and what the executor says
beside them through :class:`~chatfront.notices.ChatNotices`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Final

from telegram import Update
from telegram.error import TelegramError

from bot.chatting import configured_project, project_words
from bot.context import BotContext
from bot.controls import RAISE_BUDGET, InlineControls
from bot.feature import Feature
from bot.handlers import Dispatch
from bot.places import chat_of, telegram_chat
from bot.replies import thread_of
from bot.tool_approvals import ToolApprovalExtension
from chatfront.auth import Action
from chatfront.notices import ChatNotices
from chatfront.progress import AUTO_STOP_DATA
from chatfront.sink import ChatPlace
from engine.approvals import ApprovalPolicy
from engine.automode import AutoRun
from engine.automode.append import steer_run
from engine.automode.verifier import evidence_gap
from engine.errors import ConfigError, NotFoundError
from engine.executors import AutoRequest, auto_executor
from engine.runs import Recovery
from engine.runs.ids import short_id
from engine.runs.spec import PlaceId
from engine.spend import Budget
from engine.store.runs import InstructionFile
from engine.workspace.manager import DEFAULT_PROJECT

__all__ = ["AutoExtension"]

_LOGGER = logging.getLogger(__name__)

# The Stop button's data on the turn messages an earlier version of the bot posted for runs
# on the workers.
USAGE: Final = "Usage: /auto [--budget USD] [--permissions guarded|trusted|free] OBJECTIVE"


class AutoExtension(Feature):
    """Starts, steers, stops, parks and resumes auto-mode runs for chats."""

    def __init__(self, ctx: BotContext, approvals: ToolApprovalExtension) -> None:
        self.ctx = ctx
        self._closing = False
        self.executor = auto_executor(
            ctx.settings,
            ctx.db,
            runs=ctx.runs,
            supervisor=ctx.supervisor,
            sink=ctx.sink,
            notices=ChatNotices(
                sink=ctx.sink, publisher=ctx.publisher, store=ctx.store, controls=InlineControls()
            ),
            workdirs=ctx.chats.workdir_for,
            approvals=approvals.routes_for,
        )

    def register(self, dispatch: Dispatch) -> None:
        dispatch.command(
            "auto",
            Action.START_RUN,
            self.cmd_auto,
            usage=USAGE,
        )
        dispatch.command("steer", Action.STEER, self.cmd_steer, usage="Usage: /steer TEXT")
        dispatch.text(self.on_text)
        dispatch.buttons(rf"^{AUTO_STOP_DATA}", Action.STOP, self.on_stop_button)
        dispatch.buttons(rf"^{RAISE_BUDGET}", Action.BUDGET, self.on_raise_budget)

    def running_in(self, chat_id: PlaceId, thread: PlaceId | None) -> list[AutoRun]:
        """The auto runs of this chat and topic driven here, oldest first."""
        return self.executor.running_in(ChatPlace(chat_id, thread))

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
        try:
            budget, permissions, objective = _options_and_objective(objective)
        except ConfigError as exc:
            await self.ctx.replies.reply(update, f"Cannot start: {exc}")
            return
        if not objective:
            await self.ctx.replies.reply(update, USAGE)
            return
        asked = thread_of(message)
        # The project (and the own workspace) of where it was asked, as /autopilot does.
        binding = await self.ctx.store.binding(chat_of(chat), asked)
        project = binding.project if binding is not None else DEFAULT_PROJECT
        asked_in = ChatPlace(chat_of(chat), asked)
        cannot = await self._unverifiable(project, asked_in)
        if cannot is not None:
            await self.ctx.replies.reply(update, f"Cannot start: {cannot}")
            return
        thread = asked
        if thread is None and chat.is_forum:
            thread = await self._topic(chat_of(chat), f"auto: {objective[:60]}")
        place = ChatPlace(chat_of(chat), thread)
        user = update.effective_user
        request = AutoRequest(
            objective=objective,
            project=project,
            place=place,
            user_id=user.id if user is not None else None,
            budget=budget,
            # Its own, else the chat's (/permissions); kept with the run for resumes.
            permissions=permissions
            or await self.ctx.store.place_permissions(chat_of(chat), thread),
            asked_in=asked_in,
        )
        try:
            started = await self.executor.start(request)
        except ConfigError as exc:
            await self.ctx.replies.reply(update, f"Cannot start: {exc}")
            return
        run_id = started.run_id
        await self.ctx.replies.audited(update, "auto", run_id)
        where = project_words(self.ctx.settings, project, asked)
        if started.queued:
            text = (
                f"🤖 Auto run {run_id} is queued on the workers ({started.agent}, {where}).\n"
                "Messages here, or /steer TEXT, become instructions for the next Execute "
                f"turn. /status shows it; /stop {short_id(run_id)} stops it."
            )
        else:
            text = (
                f"🤖 Auto run {run_id} started ({started.agent}, {where}).\n"
                "Messages here, or /steer TEXT, become instructions for the next Execute "
                f"turn. /stop {short_id(run_id)} stops it."
            )
        # The run's one live message (its status, edited in place), under the /auto asking;
        # dropped if the run's own status was written first.
        await self.ctx.publisher.live(
            f"status:{run_id}",
            text,
            chat_id=chat_of(chat),
            thread_id=thread,
            run_id=run_id,
            reply_to=message.message_id,
            initial=True,
        )

    async def _unverifiable(self, project: str, place: ChatPlace) -> str | None:
        """Why no completion could ever be accepted in the project's folder (None: it can).

        The bot has no verify command: in a folder that is no git repository nothing
        could confirm completion, and the run would use all its turns.
        """
        if configured_project(self.ctx.settings, project) or self.ctx.chats.agents.remote:
            return None  # a git worktree of its own (on the workers: the workers')
        try:
            # The chat's own workspace itself, not a worktree (none is made for the check).
            folder = await self.ctx.chats.workdir_for(project, "", place, worktree=False)
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

    async def _topic(self, chat_id: PlaceId, name: str) -> PlaceId | None:
        bot = self.ctx.bot
        try:
            topic = await bot.create_forum_topic(chat_id=telegram_chat(chat_id), name=name[:128])
        except TelegramError as exc:
            _LOGGER.warning("could not create a forum topic: %s", exc)
            return None
        return str(topic.message_thread_id)

    # -- steering ----------------------------------------------------------------------

    async def on_text(self, update: Update, text: str, thread: PlaceId | None) -> bool:
        chat = update.effective_chat
        assert chat is not None
        if not await self.executor.steerable(ChatPlace(chat_of(chat), thread)):
            return False
        await self._steer(update, text, explicit=False)
        return True

    async def _steer(self, update: Update, text: str, *, explicit: bool) -> None:
        chat = update.effective_chat
        message = update.effective_message
        assert chat is not None
        assert message is not None
        place = ChatPlace(chat_of(chat), thread_of(message))
        runs = await self.executor.steerable(place) or await self.executor.steerable(
            place, whole_chat=True
        )
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
        user = update.effective_user
        refused = await self.steer(target, text, by=user.id if user is not None else None)
        if refused is not None:
            await self.ctx.replies.reply(update, refused)
            return
        await self.ctx.replies.reply(
            update, f"📝 Noted for run {target}: it goes into the next Execute turn."
        )

    async def steer(
        self,
        run_id: str,
        text: str,
        *,
        by: int | None,
        files: Sequence[InstructionFile] = (),
    ) -> str | None:
        """Queue ``text`` (and the stored ``files`` it is the caption of) for the run's
        next Execute turn from the person ``by``; None once it is, else why not."""
        try:
            # The same wherever the run executes: through the store.
            await steer_run(
                self.ctx.runs, run_id, text, by=self.ctx.publisher.people.name(by), files=files
            )
        except (ConfigError, NotFoundError) as exc:
            return f"Instruction refused: {exc}"
        _LOGGER.info("instruction queued", extra={"run_id": run_id})
        return None

    # -- stopping, status, start-up and shutdown: the executor's --------------------------

    async def stop(self, run_id: str, *, chat_id: PlaceId, by: int) -> bool:
        return await self.executor.stop(run_id, chat_id=chat_id)

    async def stop_chat(self, chat_id: PlaceId, thread: PlaceId | None, *, by: int) -> list[str]:
        return await self.executor.stop_in(ChatPlace(chat_id, thread))

    async def on_stop_button(self, update: Update, data: str) -> None:
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        run_id = data.removeprefix(AUTO_STOP_DATA)
        if not await self.executor.stop(run_id, chat_id=chat_of(chat)):
            await self.ctx.replies.answer(update, "Nothing is running there any more.")
            return
        await self.ctx.replies.answer(update, "Stopping…")
        await self.ctx.replies.audited(update, "stop", run_id)

    async def on_raise_budget(self, update: Update, data: str) -> None:
        """An admin lets a run its budget stopped go on under twice the budget."""
        chat = update.effective_chat
        user = update.effective_user
        message = update.effective_message
        assert chat is not None
        assert user is not None
        run_id = data.removeprefix(RAISE_BUDGET)
        try:
            record = await self.ctx.runs.get_run(run_id)
            budget = Budget.from_config(record.state.get("config", {}))
            if budget is None:
                raise ConfigError(f"run {run_id} has no budget to raise")
            said = await self.executor.raise_budget(run_id, budget.raised(), chat_id=chat_of(chat))
        except (ConfigError, NotFoundError) as exc:
            await self.ctx.replies.answer(update, f"⛔ {exc}"[:190])
            return
        await self.ctx.replies.answer(update, "Going on.")
        name = self.ctx.publisher.people.name(user.id)
        await self.ctx.publisher.say(
            chat_of(chat),
            f"{said} (raised by {name})",
            thread_id=thread_of(message),
            run_id=run_id,
        )
        await self.ctx.store.audit(
            action="budget",
            outcome="raised",
            user_id=user.id,
            chat_id=chat_of(chat),
            update_id=update.update_id,
            reason=f"{run_id}: {budget.raised().text()}",
        )

    async def status_lines(self, chat_id: PlaceId, thread: PlaceId | None) -> list[str]:
        return await self.executor.status_lines(chat_id)

    async def recover(self, report: Recovery) -> None:
        await self.executor.recover(report)

    async def shutdown(self, *, park: bool, preempt: asyncio.Event) -> None:
        self._closing = True
        await self.executor.shutdown(park=park)

    async def park_all(self) -> None:
        await self.executor.park_all()


def _options_and_objective(text: str) -> tuple[Budget | None, str | None, str]:
    """``--budget USD`` and ``--permissions P`` (or ``--flag=value``) at the start of
    ``/auto``'s text, in any order, and the rest (the objective).

    Raises:
        ConfigError: the budget is not a positive amount, or no such permissions.
    """
    budget: Budget | None = None
    permissions: str | None = None
    rest = text.strip()
    while rest.startswith("--"):
        head, _, rest = rest.partition(" ")
        name, equals, value = head.partition("=")
        if not equals:
            value, _, rest = rest.strip().partition(" ")
        rest = rest.strip()
        if name == "--budget":
            try:
                usd = float(value.removeprefix("$"))
            except ValueError:
                raise ConfigError(
                    f"--budget takes an amount in USD, like 2 or 0.50, not {value!r}"
                ) from None
            budget = Budget.given(usd, None)
        elif name == "--permissions":
            if value not in {p.value for p in ApprovalPolicy if p.is_preset}:
                raise ConfigError(f"--permissions takes guarded, trusted or free, not {value!r}")
            permissions = value
        else:
            raise ConfigError(f"/auto knows --budget and --permissions, not {name}")
    return budget, permissions, rest

"""Questions the agent asks in the chat: one message each, its options as buttons.

A Claude Code run whose permission server runs (tool approvals or a preset) may call its
``ask`` tool; the question lands in the store, the approvals' watcher hands it here, and
it is posted to the run's chat. An operator answers with a button, or in their own words
by replying to the question's message; the first answer goes back to the agent as the
tool's result, and the turn goes on. ``/stop`` (or the turn ending any other way)
withdraws it. The bot shutting down withdraws it too: a chat turn is parked and asks
again after the restart; another run's agent reads that nobody could answer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

from telegram import Update

from bot.context import BotContext
from bot.feature import Feature
from bot.handlers import Dispatch
from bot.places import chat_of
from bot.render import message_link
from bot.replies import MISPLACED, NOT_DELIVERED, misplaced_press
from bot.tool_approvals import NOT_YET, ToolApprovalExtension, turn_progress
from chatfront.auth import Action
from engine.approvals import AgentQuestion, QuestionState, QuestionStore
from engine.errors import NotFoundError
from engine.runs import Recovery
from engine.runs.spec import PlaceId
from engine.store.runs import RunRecord

__all__ = ["AgentQuestionFeature", "question_text"]

_LOGGER = logging.getLogger(__name__)

PREFIX: Final = "aq"
REF: Final = "question:"
RESTARTED: Final = "the bot restarted while it waited; the turn was cut off"
STOPPED: Final = "the turn was stopped"
SHUTTING_DOWN: Final = "the bot is shutting down, so nobody could answer"
PARKED: Final = "the bot restarted while it waited; the turn runs again and asks again"


def _ref(question_id: int) -> str:
    return f"{REF}{question_id}"


def _buttons(question: AgentQuestion) -> dict[str, Any] | None:
    if not question.options:
        return None
    rows = [
        [{"text": option, "callback_data": f"{PREFIX}:{question.id}:{n}"}]
        for n, option in enumerate(question.options)
    ]
    return {"inline_keyboard": rows}


def question_text(question: AgentQuestion, outcome: str | None = None) -> str:
    """The question as people read it; ``outcome`` replaces the footer once settled."""
    lines = [f"❓ Run {question.run_id} asks:", question.question, ""]
    if outcome is not None:
        lines.append(outcome)
    elif question.options:
        lines.append("Press an answer, or reply to this message in your own words. The run waits.")
    else:
        lines.append("Reply to this message with your answer. The run waits.")
    return "\n".join(lines)


class AgentQuestionFeature(Feature):
    """Posts the questions of the bot's runs and takes the answers."""

    def __init__(self, ctx: BotContext, approvals: ToolApprovalExtension) -> None:
        self.ctx = ctx
        self.approvals = approvals
        self.store = QuestionStore(ctx.db)
        # The approvals' watcher is woken by the permission server, which serves both.
        approvals.watcher.questions = (self.store, self._show)
        self._closing = False

    def register(self, dispatch: Dispatch) -> None:
        dispatch.buttons(rf"^{PREFIX}:[0-9]{{1,18}}:[0-3]\Z", None, self.on_button)
        dispatch.text(self.on_text)

    # -- showing -----------------------------------------------------------------------

    async def _run_of(self, run_id: str) -> RunRecord | None:
        try:
            run = await self.ctx.runs.get_run(run_id)
        except NotFoundError:
            return None
        return run if run.chat_id is not None else None

    async def _show(self, question: AgentQuestion) -> bool:
        run = await self._run_of(question.run_id)
        if run is None or run.chat_id is None:
            return False  # not a bot run: a terminal front end shares the database
        if self._closing:
            await self._withdraw([run.id], SHUTTING_DOWN)
            return True
        progress = turn_progress(self.ctx, run.id)
        await self.ctx.publisher.live(
            _ref(question.id),
            self.ctx.redactor(question_text(question)),
            chat_id=run.chat_id,
            thread_id=run.thread_id,
            markup=_buttons(question),
            run_id=run.id,
            reply_to=progress.reply_to if progress is not None else None,
        )
        if progress is not None:
            await progress.wait_for_person("❓ to answer the agent's question (below)")
        _LOGGER.info("question %s of run %s posted", question.id, run.id)
        return True

    def _outcome(self, question: AgentQuestion) -> str:
        if question.state is QuestionState.ANSWERED:
            who = self.ctx.publisher.people.name(question.answered_by)
            return f"✅ {who} answered: {question.answer}"
        return f"⏹ Not answered: {question.answer or 'withdrawn'}."

    async def _refresh(self, question: AgentQuestion) -> None:
        progress = turn_progress(self.ctx, question.run_id)
        if progress is not None and not await self.store.pending(run_id=question.run_id):
            await progress.wait_for_person(None)
        live = await self.ctx.store.get_live(_ref(question.id))
        if live is None:
            return
        await self.ctx.publisher.live(
            _ref(question.id),
            self.ctx.redactor(question_text(question, self._outcome(question))),
            chat_id=live.chat_id,
            thread_id=live.thread_id,
            markup=None,
            run_id=question.run_id,
        )

    # -- answering ---------------------------------------------------------------------

    async def on_button(self, update: Update, data: str) -> None:
        _, raw_id, raw_choice = data.split(":")
        try:
            question = await self.store.get(int(raw_id))
        except NotFoundError:
            await self.ctx.replies.answer(update, "This question is unknown.")
            return
        misplaced = await misplaced_press(self.ctx.store, update, _ref(question.id))
        if misplaced is not None:
            await self.ctx.replies.answer(
                update, NOT_YET if misplaced == NOT_DELIVERED else MISPLACED
            )
            return
        choice = int(raw_choice)
        if choice >= len(question.options):
            await self.ctx.replies.answer(update, MISPLACED)
            return
        await self._answer(update, question, question.options[choice])

    async def on_text(self, update: Update, text: str, thread: PlaceId | None) -> bool:
        """A reply to a question's message answers it; any other text is not ours."""
        message = update.effective_message
        chat = update.effective_chat
        assert chat is not None
        if message is None or message.reply_to_message is None:
            return False
        live = await self.ctx.store.live_by_message(
            chat_of(chat), message.reply_to_message.message_id
        )
        if live is None or not live.ref.startswith(REF):
            return False
        try:
            question = await self.store.get(int(live.ref.removeprefix(REF)))
        except (NotFoundError, ValueError):
            return False
        if not text.strip():
            return True
        await self._answer(update, question, text.strip())
        return True

    async def _answer(self, update: Update, question: AgentQuestion, answer: str) -> None:
        user = update.effective_user
        chat = update.effective_chat
        assert user is not None
        assert chat is not None
        if not await self.ctx.replies.authorize(update, Action.ANSWER):
            return
        changed, settled = await self.store.answer(question.id, answer, by=user.id)
        if not changed:
            said = f"This question was settled already: {self._outcome(settled)}"
            if update.callback_query is not None:
                await self.ctx.replies.answer(update, said[:200])
            else:
                await self.ctx.replies.reply(update, said)
            return
        await self.ctx.replies.audited(
            update, "answer", f"question {settled.id} of run {settled.run_id}: {answer}"[:300]
        )
        _LOGGER.info("question %s answered by %s", settled.id, user.id)
        if update.callback_query is not None:
            await self.ctx.replies.answer(update, "✅ The agent has your answer.")
        await self._refresh(settled)

    # -- withdrawing -------------------------------------------------------------------

    async def _withdraw(self, run_ids: list[str], reason: str) -> None:
        for question in await self.store.withdraw_pending(reason, run_ids=run_ids):
            _LOGGER.info("question %s withdrawn: %s", question.id, reason)
            await self._refresh(question)

    async def _runs_waiting(self, chat_id: PlaceId, thread: PlaceId | None) -> list[str]:
        found: dict[str, None] = {}
        for question in await self.store.pending():
            run = await self._run_of(question.run_id)
            if run is None or run.chat_id != chat_id:
                continue
            if thread is None or run.thread_id == thread:
                found.setdefault(run.id, None)
        return list(found)

    async def stop(self, run_id: str, *, chat_id: PlaceId, by: int) -> bool:
        if run_id in await self._runs_waiting(chat_id, None):
            await self._withdraw([run_id], STOPPED)
        return False  # the run itself belongs to another feature

    async def stop_chat(self, chat_id: PlaceId, thread: PlaceId | None, *, by: int) -> list[str]:
        waiting = await self._runs_waiting(chat_id, thread)
        if waiting:
            await self._withdraw(waiting, STOPPED)
        return []

    async def pending_for(self, user_id: int, chat_id: PlaceId) -> list[str]:
        """The agents' questions ``user_id`` may answer."""
        items = []
        for question in await self.store.pending():
            run = await self._run_of(question.run_id)
            if run is None or run.chat_id is None:
                continue
            if not self.ctx.authorizer.check(user_id, run.chat_id, Action.ANSWER).allowed:
                continue
            live = await self.ctx.store.get_live(_ref(question.id))
            link = message_link(run.chat_id, live.message_id if live is not None else None)
            where = f": {link}" if link else (" here" if run.chat_id == chat_id else "")
            asked = self.ctx.redactor(" ".join(question.question.split())[:80])
            items.append(f"❓ run {run.id} asks: {asked}\n   answer on its message{where}")
        return items

    async def status_lines(self, chat_id: PlaceId, thread: PlaceId | None) -> list[str]:
        lines = []
        for question in await self.store.pending():
            run = await self._run_of(question.run_id)
            if run is not None and run.chat_id == chat_id and run.thread_id == thread:
                first = question.question.splitlines()[0][:80]
                lines.append(f"❓ run {run.id} waits for an answer: {first}")
        return lines

    # -- start-up and shutdown ---------------------------------------------------------

    async def recover(self, report: Recovery) -> None:
        """Questions of bot runs left from before the restart: their turn is gone."""
        leftover = {q.run_id for q in await self.store.pending() if await self._run_of(q.run_id)}
        if leftover:
            await self._withdraw(sorted(leftover), RESTARTED)

    async def shutdown(self, *, park: bool, preempt: asyncio.Event) -> None:
        """A turn waiting for an answer cannot get one while the bot is down."""
        self._closing = True
        waiting = sorted(
            {q.run_id for q in await self.store.pending() if await self._run_of(q.run_id)}
        )
        for run_id in waiting:
            # Withdrawn first (saying why), then the chat turn parked: parked first, its
            # turn's end would withdraw the question without a word to the chat.
            chat_run = self.ctx.chats.find(run_id)
            parks = chat_run is not None and chat_run.task is not None and not chat_run.task.done()
            await self._withdraw([run_id], PARKED if parks else SHUTTING_DOWN)
            if parks:
                await self.approvals.park_run(run_id)

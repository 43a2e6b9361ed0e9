"""Chat sessions from a chat: ``/chat [agent] [project]``, then every plain message a turn.

The sessions themselves (queue, runs, parking) are :class:`bot.chat.ChatSessions`; this
feature binds chats, queues their messages, and stops and reports their runs.
"""

from __future__ import annotations

import logging
import re

from telegram import Update

from bot.auth import Action
from bot.context import BotContext
from bot.feature import Feature
from bot.handlers import Dispatch
from bot.progress import STOP_DATA
from bot.replies import thread_of
from engine.agents.factory import AGENT_NAMES
from engine.errors import ConfigError
from engine.workspace.runs import worktree_summaries

__all__ = ["ChatFeature"]

_LOGGER = logging.getLogger(__name__)


class ChatFeature(Feature):
    """Binds chats to agent sessions and turns their plain messages into turns."""

    def __init__(self, ctx: BotContext) -> None:
        self.ctx = ctx

    def register(self, dispatch: Dispatch) -> None:
        dispatch.command("chat", Action.CHAT, self.cmd_chat)
        # The ⏹ Stop button of a turn's progress message (bot.progress).
        dispatch.buttons(rf"^{STOP_DATA}", Action.STOP, self.on_stop_button)
        # Registered after the other features: a text none of them took is a turn.
        dispatch.text(self.on_text)

    async def cmd_chat(self, update: Update, args: list[str]) -> None:
        ctx = self.ctx
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        agent = ctx.settings.default_agent
        if args and args[0] in AGENT_NAMES:
            agent = args.pop(0)  # type: ignore[assignment]
        project = args.pop(0) if args else "default"
        if args or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", project):
            await ctx.replies.reply(
                update,
                f"Usage: /chat [agent] [project]. Agents: {', '.join(AGENT_NAMES)}; a project "
                "name is letters, digits, '.', '_' or '-'.",
            )
            return
        thread = thread_of(update.effective_message)
        try:
            binding = await ctx.chats.bind(
                chat.id, thread, agent=agent, project=project, user_id=user.id
            )
        except ConfigError as exc:
            await ctx.replies.reply(update, f"Cannot bind: {exc}")
            return
        await ctx.store.audit(
            action="chat",
            outcome="allowed",
            user_id=user.id,
            chat_id=chat.id,
            update_id=update.update_id,
            reason=f"{agent} {project}",
        )
        await ctx.replies.reply(
            update,
            f"🔗 This {'topic' if thread else 'chat'} is bound to a new {agent} session "
            f"(project {project}). Every message is now one turn; replies come back here.",
        )
        _LOGGER.info("chat bound", extra={"chat_id": chat.id, "session_id": binding.session_id})

    async def on_text(self, update: Update, text: str, thread: int) -> bool:
        ctx = self.ctx
        message = update.message
        chat = update.effective_chat
        user = update.effective_user
        assert message is not None
        assert chat is not None
        assert user is not None
        active = ctx.chats.active.get((chat.id, thread))
        binding = active.binding if active is not None else None
        if binding is None:
            binding = await ctx.store.binding(chat.id, thread)
        if binding is None:
            # In a group with privacy mode off, not every message is for us: hint only in
            # a private chat or in answer to one of our messages.
            to_us = chat.type == "private" or (
                message.reply_to_message is not None
                and message.reply_to_message.from_user is not None
                and message.reply_to_message.from_user.id == ctx.bot.id
            )
            if to_us and ctx.replies.allowed(user.id, chat.id, Action.PROMPT):
                await ctx.replies.reply(
                    update, "This chat is not bound to an agent session yet: send /chat first."
                )
            return True
        if not await ctx.replies.authorize(update, Action.PROMPT):
            return True
        result = await ctx.chats.submit(
            chat.id, thread, update_id=update.update_id, user_id=user.id, text=text
        )
        ctx.handled_in_transaction(update.update_id)
        if result.steered:
            await ctx.replies.reply(update, "↪️ Sent to the running turn: the agent has it now.")
        elif not result.queued:
            await ctx.replies.reply(
                update,
                f"⚠️ Not queued: {result.waiting} message(s) are already waiting for this "
                f"session (limit {ctx.settings.queue_depth}). Send it again once the "
                "queue has room.",
            )
        elif result.busy or result.waiting:
            await ctx.replies.reply(
                update, f"⏳ Queued: {result.waiting + 1} message(s) wait for the running turn."
            )
        return True

    # -- stop and status ---------------------------------------------------------------

    async def on_stop_button(self, update: Update, data: str) -> None:
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        run = self.ctx.chats.find(data.removeprefix(STOP_DATA))
        if run is None or run.binding.chat_id != chat.id or not run.busy:
            await self.ctx.replies.answer(update, "Nothing is running there any more.")
            return
        await self.ctx.replies.answer(update, "Stopping…")
        await self.ctx.store.audit(
            action="stop",
            outcome="allowed",
            user_id=user.id,
            chat_id=chat.id,
            update_id=update.update_id,
            reason=run.run_id,
        )
        await self.ctx.chats.stop(run, user.id)

    async def stop(self, run_id: str, *, chat_id: int, by: int) -> bool:
        run = self.ctx.chats.find(run_id)
        if run is None or run.binding.chat_id != chat_id:
            return False
        await self.ctx.chats.stop(run, by)
        return True

    async def stop_chat(self, chat_id: int, thread: int, *, by: int) -> list[str]:
        run = self.ctx.chats.active.get((chat_id, thread))
        if run is None:
            return []
        await self.ctx.chats.stop(run, by)
        return [run.run_id]

    async def status_lines(self, chat_id: int, thread: int) -> list[str]:
        ctx = self.ctx
        binding = await ctx.store.binding(chat_id, thread)
        if binding is None:
            return []
        queued = await ctx.store.queued_count(chat_id, thread)
        run = ctx.chats.active.get((chat_id, thread))
        # The lines under the head: the running turn and its elapsed time (and the last
        # tool event), or idle.
        state = " · ".join(run.status_text().splitlines()[1:]) if run is not None else "idle"
        lines = [
            f"💬 chat session · {binding.agent} · {binding.project} · {binding.turns} turn(s)"
            f" · {state} · queue {queued}"
        ]
        # The session's worktree (a configured project): its branch and disk usage.
        worktree = await worktree_summaries(
            ctx.settings, ctx.db, {binding.session_id: binding.workdir}
        )
        if binding.session_id in worktree:
            lines.append(f"   🌿 {worktree[binding.session_id]}")
        return lines

"""Command, message and button handlers: authorize, record, act, answer — never await a run.

Every handler is short: it checks the user's right for the action (refusals are audited
and answered once with the user's numeric id), queues work for a run task, and replies
through the outbox.
"""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Any, Final

from telegram import BotCommand, Message, Update
from telegram.ext import (
    Application,
    ApplicationHandlerStop,
    CallbackQueryHandler,
    CommandHandler,
    ContextTypes,
    MessageHandler,
    TypeHandler,
    filters,
)

from bot.auth import Action
from engine.agents.factory import AGENT_NAMES
from engine.errors import ConfigError
from engine.workspace.runs import worktree_summaries

if TYPE_CHECKING:
    from bot.app import BotRuntime

__all__ = ["COMMANDS", "Handlers"]

_LOGGER = logging.getLogger(__name__)

Context = ContextTypes.DEFAULT_TYPE

COMMANDS: Final = [
    BotCommand("help", "what this bot does and who may do what"),
    BotCommand("chat", "[agent] [project] — bind this chat or topic to an agent session"),
    BotCommand("auto", "OBJECTIVE — start an auto-mode run"),
    BotCommand("steer", "TEXT — an instruction for the running auto-mode run"),
    BotCommand("autopilot", "TASK — start or resume the gated workflow of a task"),
    BotCommand("approve", "[TASK] — approve the open gate"),
    BotCommand("reject", "TASK REASON — reject the open gate with a reason"),
    BotCommand("cancel", "drop the Reject that waits for your reason"),
    BotCommand("stop", "[RUN] — stop the running turn at once"),
    BotCommand("status", "this chat's runs"),
    BotCommand("get", "PATH — a file (a folder as a zip) of this chat's run"),
    BotCommand("tasks", "every task's state (admin)"),
    BotCommand("audit", "the audit's findings (admin)"),
]

HELP: Final = "\n".join(
    [
        "turnstile drives coding agents turn by turn, with approval gates.",
        "",
        "Chat sessions",
        "/chat [agent] [project] — bind this chat (or topic) to a new agent session; then"
        " every message is one turn. Agents: {agents}.",
        "",
        "Runs",
        "/auto OBJECTIVE — auto mode: clarify, plan, execute until verified done. Messages"
        " (or /steer TEXT) become instructions for the next execute turn.",
        "/autopilot TASK — the gated workflow; each approval gate posts the artifact with"
        " Approve / Reject buttons.",
        "/approve [TASK] · reply APPROVED to a gate message · /reject TASK REASON",
        "/cancel — drop a Reject button press whose reason you have not sent yet.",
        "/stop [RUN] — stop the running turn now; the run ends stopped.",
        "/status — this chat's runs. /tasks, /audit — admins.",
        "",
        "Files",
        "Send a file or photo (an album is one turn): it is saved in the run's folder under"
        " uploads/ and the caption is the prompt. Voice notes are transcribed into the"
        " prompt. /get PATH sends a file of the run's folder (a folder as a zip).",
        "",
        "Tool approvals — {tool_approval}. When on, a Claude Code session asks here"
        " before a tool call: Allow once, Allow for this session, or Deny; the turn"
        " waits. Copilot CLI and Codex cannot ask per tool call: their allowed tools alone"
        " decide.",
        "",
        "Rights: operators chat, start, steer and stop; approvers approve and reject; admins"
        " everything. Your id: {user_id}.",
    ]
)

# Button data is "<verb>:<id>"; the verb says which right the presser needs.
# rc: cancel a pending reason; ry: reject with a reason that read like an approval.
BUTTON_ACTIONS: Final = {
    "ap": Action.APPROVE,
    "rj": Action.REJECT,
    "rc": Action.REJECT,
    "ry": Action.REJECT,
    "tk": Action.TASKS,
}
_APPROVED = re.compile(r"^\s*approved[.!]?\s*$", re.IGNORECASE)
_APPROVAL_HELP: Final = {
    "off": "off here: only the allowed tools run",
    "unlisted": "on here for tools outside the allowed list",
    "all": "on here for every tool call",
}


def _thread(message: Message | None) -> int:
    if message is None:
        return 0
    if message.is_topic_message and message.message_thread_id is not None:
        return int(message.message_thread_id)
    return 0


class Handlers:
    """The bot's handlers, bound to the runtime's components."""

    def __init__(self, runtime: BotRuntime) -> None:
        self.rt = runtime
        self.extensions: list[Any] = []

    # -- registration ------------------------------------------------------------------

    def register(self, app: Application[Any, Any, Any, Any, Any, Any]) -> None:
        app.add_handler(TypeHandler(Update, self.gatekeeper), group=-1)
        commands = {
            "help": self.cmd_help,
            "start": self.cmd_help,
            "chat": self.cmd_chat,
            "stop": self.cmd_stop,
            "status": self.cmd_status,
            "auto": self.cmd_auto,
            "steer": self.cmd_steer,
            "autopilot": self.cmd_autopilot,
            "approve": self.cmd_approve,
            "reject": self.cmd_reject,
            "cancel": self.cmd_cancel,
            "tasks": self.cmd_tasks,
            "audit": self.cmd_audit,
            "get": self.cmd_get,
        }
        for name, callback in commands.items():
            app.add_handler(CommandHandler(name, callback, filters=filters.UpdateType.MESSAGE))
        app.add_handler(
            MessageHandler(filters.UpdateType.MESSAGE & filters.COMMAND, self.unknown_command)
        )
        app.add_handler(
            MessageHandler(
                filters.UpdateType.MESSAGE & filters.TEXT & ~filters.COMMAND, self.on_text
            )
        )
        media = (
            filters.Document.ALL
            | filters.PHOTO
            | filters.VIDEO
            | filters.VIDEO_NOTE
            | filters.VOICE
            | filters.AUDIO
        )
        app.add_handler(MessageHandler(filters.UpdateType.MESSAGE & media, self.on_media))
        app.add_handler(CallbackQueryHandler(self.on_button))
        app.add_error_handler(self.on_error)

    # -- helpers -----------------------------------------------------------------------

    async def reply(self, update: Update, text: str, **kw: Any) -> None:
        await self.rt.replies.reply(update, text, **kw)

    async def authorize(self, update: Update, action: Action) -> bool:
        return await self.rt.replies.authorize(update, action)

    # -- the gate in front of everything -----------------------------------------------

    async def gatekeeper(self, update: Update, context: Context) -> None:
        """Ignore what is not for us; refuse chats not allowed; follow chat migrations."""
        message = update.message
        chat = update.effective_chat
        user = update.effective_user
        if update.callback_query is None and message is None:
            raise ApplicationHandlerStop  # edits, channel posts, member updates...
        if chat is None or user is None or user.is_bot:
            await self.rt.replies.answer(update)  # a button on an inline message: not ours
            raise ApplicationHandlerStop
        if message is not None and (message.migrate_to_chat_id or message.migrate_from_chat_id):
            await self.rt.follow_migration(update)
            raise ApplicationHandlerStop
        if not self.rt.authorizer.chat_allowed(chat.id):
            # The log is where an admin finds a group's id to allow it.
            _LOGGER.info(
                "ignored update %s from chat %s (%s) not in TURNSTILE_ALLOWED_CHATS, user %s",
                update.update_id,
                chat.id,
                chat.type,
                user.id,
            )
            reason = "chat not allowed"
            # A private chat is how a new user learns their id; groups are ignored.
            if (
                chat.type == "private"
                and self.rt.replies.may_tell(user.id)
                and not self.rt.replies.refuse(
                    update,
                    f"⛔ This chat is not allowed. Your Telegram user id is {user.id} "
                    f"(chat id {chat.id}); an admin can add it to the bot's settings.",
                )
            ):
                reason = self.rt.replies.unanswered(reason)
            await self.rt.store.audit(
                action="any",
                outcome="refused",
                user_id=user.id,
                chat_id=chat.id,
                update_id=update.update_id,
                reason=reason,
            )
            if update.callback_query is not None:
                await self.rt.replies.answer(update)
            raise ApplicationHandlerStop
        if message is not None and message.text is not None:
            if len(message.text) > self.rt.settings.max_inbound_chars:
                await self.reply(
                    update,
                    f"That message is {len(message.text):,} characters; the limit is "
                    f"{self.rt.settings.max_inbound_chars:,}. Send a shorter one, or put the "
                    "text in a file in the project.",
                )
                raise ApplicationHandlerStop
            if not message.text.strip():
                raise ApplicationHandlerStop

    async def on_error(self, update: object, context: Context) -> None:
        _LOGGER.error("handler failed: %s", context.error, exc_info=context.error)
        if isinstance(update, Update) and update.effective_chat is not None:
            await self.reply(update, "⚠️ Something went wrong handling that; it is in the log.")

    # -- commands ----------------------------------------------------------------------

    async def cmd_help(self, update: Update, context: Context) -> None:
        if not await self.authorize(update, Action.HELP):
            return
        user = update.effective_user
        await self.reply(
            update,
            HELP.format(
                agents=", ".join(AGENT_NAMES),
                user_id=user.id if user else "?",
                tool_approval=_APPROVAL_HELP[self.rt.settings.tool_approval],
            ),
        )

    async def unknown_command(self, update: Update, context: Context) -> None:
        if not await self.authorize(update, Action.HELP):
            return
        await self.reply(update, "Unknown command. /help lists what I understand.")

    async def cmd_chat(self, update: Update, context: Context) -> None:
        if not await self.authorize(update, Action.CHAT):
            return
        assert self.rt.chats is not None
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        args = list(context.args or [])
        agent = self.rt.settings.default_agent
        if args and args[0] in AGENT_NAMES:
            agent = args.pop(0)  # type: ignore[assignment]
        project = args.pop(0) if args else "default"
        if args or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", project):
            await self.reply(
                update,
                f"Usage: /chat [agent] [project]. Agents: {', '.join(AGENT_NAMES)}; a project "
                "name is letters, digits, '.', '_' or '-'.",
            )
            return
        thread = _thread(update.effective_message)
        try:
            binding = await self.rt.chats.bind(
                chat.id, thread, agent=agent, project=project, user_id=user.id
            )
        except ConfigError as exc:
            await self.reply(update, f"Cannot bind: {exc}")
            return
        await self.rt.store.audit(
            action="chat",
            outcome="allowed",
            user_id=user.id,
            chat_id=chat.id,
            update_id=update.update_id,
            reason=f"{agent} {project}",
        )
        await self.reply(
            update,
            f"🔗 This {'topic' if thread else 'chat'} is bound to a new {agent} session "
            f"(project {project}). Every message is now one turn; replies come back here.",
        )
        _LOGGER.info("chat bound", extra={"chat_id": chat.id, "session_id": binding.session_id})

    async def cmd_stop(self, update: Update, context: Context) -> None:
        if not await self.authorize(update, Action.STOP):
            return
        assert self.rt.chats is not None
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        args = list(context.args or [])
        thread = _thread(update.effective_message)
        stopped: list[str] = []
        if args:
            target = args[0]
            run = self.rt.chats.find(target)
            if run is not None and run.binding.chat_id == chat.id:
                await self.rt.chats.stop(run, user.id)
                stopped.append(run.run_id)
            for ext in self.extensions:
                if await ext.stop(target, chat_id=chat.id, by=user.id):
                    stopped.append(target)
        else:
            run = self.rt.chats.active.get((chat.id, thread))
            if run is not None:
                await self.rt.chats.stop(run, user.id)
                stopped.append(run.run_id)
            for ext in self.extensions:
                stopped.extend(await ext.stop_chat(chat.id, thread, by=user.id))
        if not stopped:
            await self.reply(
                update, "Nothing is running here." if not args else f"No run {args[0]} here."
            )

    async def cmd_status(self, update: Update, context: Context) -> None:
        if not await self.authorize(update, Action.STATUS):
            return
        assert self.rt.chats is not None
        chat = update.effective_chat
        assert chat is not None
        thread = _thread(update.effective_message)
        lines: list[str] = []
        binding = await self.rt.store.binding(chat.id, thread)
        if binding is not None:
            queued = await self.rt.store.queued_count(chat.id, thread)
            run = self.rt.chats.active.get((chat.id, thread))
            # The lines under the head: the running turn and its elapsed time (and the
            # last tool event), or idle.
            state = " · ".join(run.status_text().splitlines()[1:]) if run is not None else "idle"
            lines.append(
                f"💬 chat session · {binding.agent} · {binding.project} · {binding.turns} turn(s)"
                f" · {state} · queue {queued}"
            )
            # The session's worktree (a configured project): its branch and disk usage.
            worktree = await worktree_summaries(
                self.rt.settings, self.rt.db, {binding.session_id: binding.workdir}
            )
            if binding.session_id in worktree:
                lines.append(f"   🌿 {worktree[binding.session_id]}")
        for ext in self.extensions:
            lines.extend(await ext.status_lines(chat.id))
        await self.reply(update, "\n".join(lines) if lines else "No runs in this chat. /help")

    async def cmd_auto(self, update: Update, context: Context) -> None:
        await self._delegate(update, context, "auto", Action.START_RUN, "Usage: /auto OBJECTIVE")

    async def cmd_steer(self, update: Update, context: Context) -> None:
        await self._delegate(update, context, "steer", Action.STEER, "Usage: /steer TEXT")

    async def cmd_autopilot(self, update: Update, context: Context) -> None:
        await self._delegate(
            update, context, "autopilot", Action.START_RUN, "Usage: /autopilot TASK"
        )

    async def cmd_approve(self, update: Update, context: Context) -> None:
        await self._delegate(update, context, "approve", Action.APPROVE, None)

    async def cmd_reject(self, update: Update, context: Context) -> None:
        await self._delegate(update, context, "reject", Action.REJECT, "Usage: /reject TASK REASON")

    async def cmd_cancel(self, update: Update, context: Context) -> None:
        # Anyone with a role may ask; only a pending Reject of theirs is cancelled.
        await self._delegate(update, context, "cancel", Action.HELP, None)

    async def cmd_tasks(self, update: Update, context: Context) -> None:
        await self._delegate(update, context, "tasks", Action.TASKS, None)

    async def cmd_audit(self, update: Update, context: Context) -> None:
        await self._delegate(update, context, "audit", Action.AUDIT, None)

    async def cmd_get(self, update: Update, context: Context) -> None:
        await self._delegate(update, context, "get", Action.STATUS, None)

    async def on_media(self, update: Update, context: Context) -> None:
        """Files, photos and voice notes (bot/files.py)."""
        for ext in self.extensions:
            if await ext.on_media(update, context):
                return

    async def _delegate(
        self, update: Update, context: Context, verb: str, action: Action, usage: str | None
    ) -> None:
        if not await self.authorize(update, action):
            return
        args = list(context.args or [])
        if usage is not None and not args:
            await self.reply(update, usage)
            return
        for ext in self.extensions:
            method = getattr(ext, f"cmd_{verb}", None)
            if method is not None:
                await method(update, args)
                return
        if verb == "audit":
            await self._bot_audit(update)
            return
        await self.reply(update, f"/{verb} is not available in this build yet.")

    async def _bot_audit(self, update: Update) -> None:
        entries = await self.rt.store.audit_entries(limit=20)
        if not entries:
            await self.reply(update, "No audit entries.")
            return
        lines = ["Recent bot audit entries (newest first):"]
        for e in entries:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.at))
            lines.append(
                f"{stamp} user {e.user_id} chat {e.chat_id}: {e.action} {e.outcome}"
                + (f" ({e.reason})" if e.reason else "")
            )
        await self.reply(update, "\n".join(lines))

    # -- plain messages ----------------------------------------------------------------

    async def on_text(self, update: Update, context: Context) -> None:
        message = update.message
        chat = update.effective_chat
        user = update.effective_user
        assert message is not None
        assert chat is not None
        assert user is not None
        text = message.text or ""
        thread = _thread(message)
        for ext in self.extensions:
            if await ext.on_text(update, text, thread):
                return
        assert self.rt.chats is not None
        active = self.rt.chats.active.get((chat.id, thread))
        binding = active.binding if active is not None else None
        if binding is None:
            binding = await self.rt.store.binding(chat.id, thread)
        if binding is None:
            # In a group with privacy mode off, not every message is for us: hint only in
            # a private chat or in answer to one of our messages.
            to_us = chat.type == "private" or (
                message.reply_to_message is not None
                and message.reply_to_message.from_user is not None
                and message.reply_to_message.from_user.id == context.bot.id
            )
            if to_us and self.rt.authorizer.check(user.id, chat.id, Action.PROMPT).allowed:
                await self.reply(
                    update, "This chat is not bound to an agent session yet: send /chat first."
                )
            return
        if not await self.authorize(update, Action.PROMPT):
            return
        assert self.rt.chats is not None
        result = await self.rt.chats.submit(
            chat.id, thread, update_id=update.update_id, user_id=user.id, text=text
        )
        self.rt.handled_in_transaction(update.update_id)
        if not result.queued:
            await self.reply(
                update,
                f"⚠️ Not queued: {result.waiting} message(s) are already waiting for this "
                f"session (limit {self.rt.settings.queue_depth}). Send it again once the "
                "queue has room.",
            )
        elif result.busy or result.waiting:
            await self.reply(
                update, f"⏳ Queued: {result.waiting + 1} message(s) wait for the running turn."
            )

    # -- buttons -----------------------------------------------------------------------

    async def on_button(self, update: Update, context: Context) -> None:
        query = update.callback_query
        assert query is not None
        data = query.data or ""
        action = BUTTON_ACTIONS.get(data.split(":", 1)[0])
        if action is not None and not await self.authorize(update, action):
            return
        for ext in self.extensions:
            if await ext.on_button(update, data):
                return
        # Not ours (an old keyboard, another bot's data): answered, ignored.
        await self.rt.replies.answer(update)

    # -- start-up and shutdown hooks for extensions ------------------------------------

    async def recover(self) -> None:
        for ext in self.extensions:
            await ext.recover()

    async def shutdown(self, *, park: bool, preempt: Any) -> None:
        for ext in self.extensions:
            await ext.shutdown(park=park, preempt=preempt)

    async def park_all(self) -> None:
        for ext in self.extensions:
            await ext.park_all()

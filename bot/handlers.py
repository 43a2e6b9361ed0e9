"""How every feature's handlers are wrapped: the gate in front, the right check, the errors.

Each feature (bot/chatting.py, auto.py, autopilot.py, files.py, tool_approvals.py,
admin.py) registers its own python-telegram-bot handlers through :class:`Dispatch`:
command handlers, a ``CallbackQueryHandler`` with a pattern for its buttons, message
filters for text and media. Dispatch adds what every handler shares, in one place:

- the gatekeeper (group -1): what is not for us is ignored, chats not allowed are refused,
  chat migrations are followed, over-long and empty texts are answered or dropped (an
  over-long one from someone without a role is audited, not answered);
- the right check before a command or a button (refusals are audited and answered once
  with the user's numeric id, see :mod:`bot.replies`), and a command's usage line;
- plain texts go to the features in the order they registered, each in a handler group of
  its own: a feature that consumed the text stops the others;
- a handler that fails is logged and answered once, and nothing else handles the update.

Recording updates before handling and marking them handled after (the inbox) and the
order per chat are the runtime's (bot/app.py: ``_accept`` and ``ChatOrderedProcessor``).
Every handler is short: it queues work for a run task and replies through the outbox.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final

from telegram import Update
from telegram.ext import (
    Application,
    ApplicationHandlerStop,
    BaseHandler,
    CallbackQueryHandler,
    CommandHandler,
    ContextTypes,
    MessageHandler,
    TypeHandler,
    filters,
)

from bot.places import chat_of
from bot.replies import Replies, thread_of
from chatfront.auth import Action, Authorizer
from chatfront.store import BotStore
from engine.runs.spec import PlaceId
from engine.settings import Settings

__all__ = [
    "ButtonCallback",
    "CommandCallback",
    "Dispatch",
    "MediaCallback",
    "TextCallback",
]

_LOGGER = logging.getLogger(__name__)

Context = ContextTypes.DEFAULT_TYPE
PtbApp = Application[Any, Any, Any, Any, Any, Any]

# A command gets its arguments; a text its body and topic (True: consumed); a button its data.
CommandCallback = Callable[[Update, list[str]], Awaitable[None]]
TextCallback = Callable[[Update, str, PlaceId | None], Awaitable[bool]]
MediaCallback = Callable[[Update], Awaitable[None]]
ButtonCallback = Callable[[Update, str], Awaitable[None]]
FollowMigration = Callable[[Update], Awaitable[None]]
PtbCallback = Callable[[Update, Context], Coroutine[Any, Any, None]]

_FAILED: Final = "⚠️ Something went wrong handling that; it is in the log."
_NO_LONGER_VALID: Final = "That button is no longer valid."
_MEDIA: Final = (
    filters.Document.ALL
    | filters.PHOTO
    | filters.VIDEO
    | filters.VIDEO_NOTE
    | filters.VOICE
    | filters.AUDIO
)
# Commands, media and buttons go to the first matching handler of this group; texts go
# to one group per feature after it.
_MAIN_GROUP: Final = 0


class Dispatch:
    """Builds the wrapped python-telegram-bot handlers the features register."""

    def __init__(
        self,
        app: PtbApp,
        *,
        settings: Settings,
        authorizer: Authorizer,
        store: BotStore,
        replies: Replies,
        follow_migration: FollowMigration,
    ) -> None:
        self._app = app
        self._settings = settings
        self._authorizer = authorizer
        self._store = store
        self._replies = replies
        self._follow_migration = follow_migration
        self._text_group = _MAIN_GROUP
        self._finished = False
        app.add_handler(TypeHandler(Update, self._gatekeeper), group=-1)
        app.add_error_handler(self._on_error)

    # -- what features register --------------------------------------------------------

    def command(
        self,
        names: str | tuple[str, ...],
        action: Action,
        callback: CommandCallback,
        *,
        usage: str | None = None,
    ) -> None:
        """``/name ARGS``: the right for ``action`` is checked; no ARGS answers ``usage``."""

        async def handle(update: Update, context: Context) -> None:
            if not await self._replies.authorize(update, action):
                return
            args = list(context.args or [])
            if usage is not None and not args:
                await self._replies.reply(update, usage)
                return
            await callback(update, args)

        for name in (names,) if isinstance(names, str) else names:
            self._add(
                CommandHandler(name, self._guarded(handle), filters=filters.UpdateType.MESSAGE)
            )

    def text(self, callback: TextCallback) -> None:
        """Plain texts; asked after the features that registered before (True: consumed)."""

        async def handle(update: Update, context: Context) -> None:
            message = update.message
            assert message is not None
            if await callback(update, message.text or "", thread_of(message)):
                raise ApplicationHandlerStop

        self._text_group += 1
        self._add(
            MessageHandler(
                filters.UpdateType.MESSAGE & filters.TEXT & ~filters.COMMAND,
                self._guarded(handle),
            ),
            group=self._text_group,
        )

    def media(self, callback: MediaCallback) -> None:
        """Documents, photos, videos, voice notes and audio."""

        async def handle(update: Update, context: Context) -> None:
            await callback(update)

        self._add(MessageHandler(filters.UpdateType.MESSAGE & _MEDIA, self._guarded(handle)))

    def buttons(self, pattern: str, action: Action | None, callback: ButtonCallback) -> None:
        """Button presses whose data matches ``pattern``; ``action`` is the right needed
        (None: the feature decides who may press)."""

        async def handle(update: Update, context: Context) -> None:
            query = update.callback_query
            assert query is not None
            if action is not None and not await self._replies.authorize(update, action):
                return
            await callback(update, query.data or "")

        self._add(CallbackQueryHandler(self._guarded(handle), pattern=pattern))

    def finish(self) -> None:
        """After every feature: unknown commands are answered, unknown buttons answered."""
        self._finished = True

        async def unknown_command(update: Update, context: Context) -> None:
            if not await self._replies.authorize(update, Action.HELP):
                return
            await self._replies.reply(update, "Unknown command. /help lists what I understand.")

        async def unknown_button(update: Update, context: Context) -> None:
            # Not ours (an old keyboard, data no button of ours carries): answered, ignored.
            await self._replies.answer(update, _NO_LONGER_VALID)

        self._app.add_handler(
            MessageHandler(
                filters.UpdateType.MESSAGE & filters.COMMAND, self._guarded(unknown_command)
            ),
            group=_MAIN_GROUP,
        )
        self._app.add_handler(
            CallbackQueryHandler(self._guarded(unknown_button)), group=_MAIN_GROUP
        )

    # -- wrapping ----------------------------------------------------------------------

    def _add(self, handler: BaseHandler[Update, Any, Any], group: int = _MAIN_GROUP) -> None:
        if self._finished:
            raise RuntimeError("handlers are registered before Dispatch.finish()")
        self._app.add_handler(handler, group=group)

    def _guarded(self, handle: PtbCallback) -> PtbCallback:
        """A failure is logged and answered once; no later handler group sees the update."""

        async def guarded(update: Update, context: Context) -> None:
            try:
                await handle(update, context)
            except ApplicationHandlerStop:
                raise
            except Exception as exc:
                _LOGGER.error("handler failed: %s", exc, exc_info=exc)
                if update.effective_chat is not None:
                    await self._replies.reply(update, _FAILED)
                raise ApplicationHandlerStop from exc

        return guarded

    async def _on_error(self, update: object, context: Context) -> None:
        # What fails outside the features' handlers (the gatekeeper).
        _LOGGER.error("handler failed: %s", context.error, exc_info=context.error)
        if isinstance(update, Update) and update.effective_chat is not None:
            await self._replies.reply(update, _FAILED)

    # -- the gate in front of everything -----------------------------------------------

    async def _refused(self, update: Update, reason: str) -> None:
        """Audit a refusal of ``update`` by the gatekeeper (before any feature saw it)."""
        user, chat = update.effective_user, update.effective_chat
        await self._store.audit(
            action="any",
            outcome="refused",
            user_id=user.id if user is not None else None,
            chat_id=chat_of(chat) if chat is not None else None,
            update_id=update.update_id,
            reason=reason,
        )

    async def _gatekeeper(self, update: Update, context: Context) -> None:
        """Ignore what is not for us; refuse chats not allowed; follow chat migrations."""
        message = update.message
        chat = update.effective_chat
        user = update.effective_user
        if update.callback_query is None and message is None:
            raise ApplicationHandlerStop  # edits, channel posts, member updates...
        if chat is None or user is None or user.is_bot:
            await self._replies.answer(update)  # a button on an inline message: not ours
            raise ApplicationHandlerStop
        # Remembered for what the bot says about them ("approved by Ann").
        await self._replies.people.seen(user)
        if message is not None and (message.migrate_to_chat_id or message.migrate_from_chat_id):
            await self._follow_migration(update)
            raise ApplicationHandlerStop
        if not self._authorizer.chat_allowed(chat_of(chat)):
            # The log is where an admin finds a group's id to allow it.
            _LOGGER.info(
                "ignored update %s from chat %s (%s) not in TURNSTILE_ALLOWED_CHATS, user %s",
                update.update_id,
                chat_of(chat),
                chat.type,
                user.id,
            )
            reason = "chat not allowed"
            # A private chat is how a new user learns their id; groups are ignored.
            if (
                chat.type == "private"
                and self._replies.may_tell(user.id)
                and not self._replies.refuse(
                    update,
                    f"⛔ This chat is not allowed. Your Telegram user id is {user.id} "
                    f"(chat id {chat_of(chat)}); an admin can add it to the bot's settings.",
                )
            ):
                reason = self._replies.unanswered(reason)
            await self._refused(update, reason)
            if update.callback_query is not None:
                await self._replies.answer(update)
            raise ApplicationHandlerStop
        if message is not None and message.text is not None:
            limit = self._settings.max_inbound_chars
            if len(message.text) > limit and not self._authorizer.roles(user.id):
                # Someone without a role may do nothing with it: audited, and not answered
                # (an answer would spend the chat's message budget on a stranger).
                await self._refused(
                    update,
                    f"a message over {limit:,} characters from someone without a role; "
                    "not answered",
                )
                raise ApplicationHandlerStop
            if len(message.text) > limit:
                await self._replies.reply(
                    update,
                    f"That message is {len(message.text):,} characters; the limit is "
                    f"{limit:,}. Send a shorter one, or put the text in a file in the project.",
                )
                raise ApplicationHandlerStop
            if not message.text.strip():
                raise ApplicationHandlerStop

"""Reply, answer and authorize: how every feature of the bot talks back to a person.

One instance serves every feature, so the once-a-minute limit on refusal answers holds
across them all.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Final

from telegram import Message, Update

from bot.auth import Action, Authorizer
from bot.publish import Publisher
from bot.store import BotStore

__all__ = ["Replies", "thread_of"]

_LOGGER = logging.getLogger(__name__)

_REFUSAL_EVERY: Final = 60.0
_UNANSWERED: Final = "; not answered: too many refusals waiting (TURNSTILE_REFUSAL_BACKLOG)"


def thread_of(message: Message | None) -> int:
    """The forum topic a message is in (0: none)."""
    if message is None:
        return 0
    if message.is_topic_message and message.message_thread_id is not None:
        return int(message.message_thread_id)
    return 0


class Replies:
    """Answers through the outbox, button answers, and the right check with its refusal."""

    def __init__(self, publisher: Publisher, authorizer: Authorizer, store: BotStore) -> None:
        self._publisher = publisher
        self.people = publisher.people
        self._authorizer = authorizer
        self._store = store
        self._last_refusal: dict[int, float] = {}

    async def reply(self, update: Update, text: str, **kw: Any) -> None:
        """Say ``text`` in the update's chat and topic, as a reply to its message."""
        message = update.effective_message
        chat = update.effective_chat
        if chat is None:
            return
        await self._publisher.say(
            chat.id,
            text,
            thread_id=thread_of(message) or None,
            reply_to=message.message_id if message is not None else None,
            **kw,
        )

    async def answer(self, update: Update, text: str | None = None) -> None:
        """Answer the update's button press (a no-op for anything else)."""
        query = update.callback_query
        if query is None:
            return
        try:
            await query.answer(text=text)
        except Exception as exc:
            _LOGGER.warning("answering a button press failed: %s", exc)

    async def authorize(self, update: Update, action: Action) -> bool:
        """Check the right; a refusal is audited and answered (once a minute per user)."""
        user = update.effective_user
        chat = update.effective_chat
        assert chat is not None
        user_id = user.id if user is not None else None
        decision = self._authorizer.check(user_id, chat.id, action)
        if decision.allowed:
            return True
        _LOGGER.info("refused %s for user %s: %s", action.value, user_id, decision.reason)
        reason = decision.reason
        if update.callback_query is None and user_id is not None and self.may_tell(user_id):
            text = (
                f"⛔ Not allowed. Your Telegram user id is {user_id}; an admin can grant you "
                f"a role in the bot's settings."
            )
            if not self.refuse(update, text):
                reason += _UNANSWERED
        await self._store.audit(
            action=action.value,
            outcome="refused",
            user_id=user_id,
            chat_id=chat.id,
            update_id=update.update_id,
            reason=reason,
        )
        if update.callback_query is not None:
            await self.answer(update, f"Not allowed. Your id: {user_id}")
        return False

    def allowed(self, user_id: int | None, chat_id: int, action: Action) -> bool:
        """The right alone: nothing audited, nothing said."""
        return self._authorizer.check(user_id, chat_id, action).allowed

    def refuse(self, update: Update, text: str) -> bool:
        """Answer a refusal through the low-priority lane; False when it was full."""
        message = update.effective_message
        chat = update.effective_chat
        assert chat is not None
        return self._publisher.refusal(
            chat.id,
            text,
            thread_id=thread_of(message) or None,
            reply_to=message.message_id if message is not None else None,
        )

    def may_tell(self, user_id: int) -> bool:
        """Whether a refusal may be answered now (at most once a minute per user)."""
        now = time.monotonic()
        last = self._last_refusal.get(user_id)
        if last is not None and now - last < _REFUSAL_EVERY:
            return False
        self._last_refusal[user_id] = now
        return True

    @staticmethod
    def unanswered(reason: str) -> str:
        return reason + _UNANSWERED

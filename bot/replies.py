"""Reply, answer and authorize: how every feature of the bot talks back to a person.

One instance serves every feature, so the once-a-minute limits on refusal answers hold
across them all: per person, and per group for people without any role (a group's 20
messages a minute are the team's, not a crowd of strangers').
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from telegram import Update

from bot.places import chat_of, thread_of
from chatfront.auth import Action, Authorizer, needed_roles
from chatfront.publish import Publisher
from chatfront.store import BotStore
from engine.runs.spec import PlaceId

__all__ = ["Replies", "thread_of"]

_LOGGER = logging.getLogger(__name__)

_REFUSAL_EVERY: Final = 60.0
_UNANSWERED: Final = "; not answered: too many refusals waiting (TURNSTILE_REFUSAL_BACKLOG)"
# Past this many remembered refusals, the ones older than a minute are forgotten.
_REMEMBERED: Final = 1024


MISPLACED: Final = "⛔ This button does not belong to this message."
NOT_DELIVERED: Final = "its message is not delivered yet"
# A press can come in before the bot has heard back from Telegram that the message was
# sent (and so knows its id): wait that long for it before refusing.
_DELIVERY_WAIT: Final = 3.0


async def misplaced_press(
    store: BotStore, update: Update, ref: str, *, wait: float = _DELIVERY_WAIT
) -> str | None:
    """Why this button press is not one on the message ``ref`` was posted as (None: it is).

    A button's data is the client's to send: Approve, Reject, Allow and Deny count only on
    their own message. A message id is unique within its chat, so the chat and the message
    pin the forum topic too. :data:`NOT_DELIVERED` when its message id is still unknown.
    """
    deadline = time.monotonic() + wait
    live = await store.get_live(ref)
    while (live is None or live.message_id is None) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        live = await store.get_live(ref)
    if live is None or live.message_id is None:
        return NOT_DELIVERED
    query = update.callback_query
    chat = update.effective_chat
    pressed = query.message if query is not None else None
    if pressed is None or chat is None:
        return "pressed on no message"
    if (chat_of(chat), pressed.message_id) != (live.chat_id, live.message_id):
        return (
            f"pressed on message {pressed.message_id} in chat {chat_of(chat)}, not on its own "
            f"(message {live.message_id} in chat {live.chat_id})"
        )
    return None


_DOING: Final = {
    Action.PROMPT: "Prompting the agent",
    Action.STEER: "Steering the run",
    Action.APPROVE: "Approving",
    Action.REJECT: "Rejecting",
}


def _refused_what(update: Update, action: Action) -> str:
    """What was refused, in the person's words: the command, or what their message did."""
    message = update.effective_message
    first = (message.text or message.caption or "").split(maxsplit=1) if message else []
    if first and first[0].startswith("/"):
        return first[0].split("@")[0]
    return _DOING.get(action, "That")


class Replies:
    """Answers through the outbox, button answers, and the right check with its refusal."""

    def __init__(self, publisher: Publisher, authorizer: Authorizer, store: BotStore) -> None:
        self._publisher = publisher
        self.people = publisher.people
        self._authorizer = authorizer
        self._store = store
        # Per person ("user", id) and per group ("group", id): when the last refusal was
        # answered, and whether it said "muted".
        self._last_refusal: dict[tuple[str, int], tuple[float, bool]] = {}
        #: Puts a 👎 on a message (chat id, message id); set by the runtime once the bot
        #: is up. A refusal repeated within a minute is answered so, not by a message.
        self.react: Callable[[PlaceId, int], Awaitable[object]] | None = None

    async def reply(self, update: Update, text: str, **kw: Any) -> None:
        """Say ``text`` in the update's chat and topic, as a reply to its message."""
        message = update.effective_message
        chat = update.effective_chat
        if chat is None:
            return
        await self._publisher.say(
            chat_of(chat),
            text,
            thread_id=thread_of(message),
            reply_to=message.message_id if message is not None else None,
            **kw,
        )

    async def audited(self, update: Update, action: str, reason: str) -> None:
        """Record in the audit log that the update's sender was allowed ``action``."""
        chat = update.effective_chat
        user = update.effective_user
        await self._store.audit(
            action=action,
            outcome="allowed",
            user_id=user.id if user is not None else None,
            chat_id=chat_of(chat) if chat is not None else None,
            update_id=update.update_id,
            reason=reason,
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
        """Check the right; a refusal is audited and answered with the role it needs.

        A person refused again within a minute gets a 👎 on their message instead of
        another answer (every refusal is audited). In a group, people without any role get
        one answer a minute between them all.
        """
        user = update.effective_user
        chat = update.effective_chat
        assert chat is not None
        user_id = user.id if user is not None else None
        decision = self._authorizer.check(user_id, chat_of(chat), action)
        if decision.allowed:
            return True
        _LOGGER.info("refused %s for user %s: %s", action.value, user_id, decision.reason)
        reason = decision.reason
        roles = needed_roles(action)
        if update.callback_query is None and user_id is not None:
            what = _refused_what(update, action)
            crowd = chat.type != "private" and not self._authorizer.roles(user_id)
            if crowd:
                answer = self._refusal_answer(("group", chat.id), mute_note=False)
            else:
                answer = self._refusal_answer(("user", user_id))
            text = None
            if answer == "tell":
                text = (
                    f"⛔ {what} needs the {roles} role. Your Telegram user id is {user_id}; "
                    "an admin can grant the role in the bot's settings."
                )
                if crowd:
                    text += " In this group, refusals are answered at most once a minute."
            elif crowd:
                reason += "; not answered: a group gets one refusal a minute"
            else:
                # Told in full a moment ago: a 👎 on the message says "refused" again,
                # without a message of its own.
                reason += "; answered with a reaction: refused again within a minute"
                await self._react(update)
            if text is not None and not self.refuse(update, text):
                reason += _UNANSWERED
        await self._store.audit(
            action=action.value,
            outcome="refused",
            user_id=user_id,
            chat_id=chat_of(chat),
            update_id=update.update_id,
            reason=reason,
        )
        if update.callback_query is not None:
            await self.answer(update, f"⛔ Needs the {roles} role. Your id: {user_id}")
        return False

    async def _react(self, update: Update) -> None:
        message = update.effective_message
        chat = update.effective_chat
        if self.react is None or message is None or chat is None:
            return
        try:
            await self.react(chat_of(chat), message.message_id)
        except Exception as exc:  # a reaction is a courtesy: never fail the update for it
            _LOGGER.info("could not react to a refused message: %s", exc)

    def allowed(self, user_id: int | None, chat_id: PlaceId, action: Action) -> bool:
        """The right alone: nothing audited, nothing said."""
        return self._authorizer.check(user_id, chat_id, action).allowed

    def refuse(self, update: Update, text: str) -> bool:
        """Answer a refusal through the low-priority lane; False when it was full."""
        message = update.effective_message
        chat = update.effective_chat
        assert chat is not None
        return self._publisher.refusal(
            chat_of(chat),
            text,
            thread_id=thread_of(message),
            reply_to=message.message_id if message is not None else None,
        )

    def may_tell(self, user_id: int) -> bool:
        """Whether a refusal may be answered in full now (once a minute per user)."""
        return self._refusal_answer(("user", user_id)) == "tell"

    def _refusal_answer(self, key: tuple[str, int], *, mute_note: bool = True) -> str:
        """Answer in full (``tell``), say once that it is muted (``mute``, unless not
        ``mute_note``), or stay ``silent``; once a minute per ``key``."""
        now = time.monotonic()
        if len(self._last_refusal) > _REMEMBERED:
            self._last_refusal = {
                k: v for k, v in self._last_refusal.items() if now - v[0] < _REFUSAL_EVERY
            }
        last = self._last_refusal.get(key)
        if last is None or now - last[0] >= _REFUSAL_EVERY:
            self._last_refusal[key] = (now, False)
            return "tell"
        if mute_note and not last[1]:
            self._last_refusal[key] = (now, True)
            return "mute"
        return "silent"

    @staticmethod
    def unanswered(reason: str) -> str:
        return reason + _UNANSWERED

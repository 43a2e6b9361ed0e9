"""Telegram's chat and topic ids as place ids, and back: the one crossing.

Past the bot, a place's ids are opaque text (:data:`engine.runs.spec.PlaceId`): Telegram's
chat id and forum topic id as their decimal text, "no topic" as None. Telegram's numbers
come back only where the Bot API is called and for Telegram's own rules (a negative chat
id is a group; a supergroup's message links drop its ``-100``).
"""

from __future__ import annotations

from telegram import Chat, Message

from engine.errors import ConfigError
from engine.runs.spec import PlaceId

__all__ = ["chat_of", "telegram_chat", "telegram_topic", "thread_of"]


def chat_of(chat: Chat) -> PlaceId:
    """A Telegram chat's place id."""
    return str(chat.id)


def thread_of(message: Message | None) -> PlaceId | None:
    """The forum topic a message is in (None: none)."""
    if message is None:
        return None
    if message.is_topic_message and message.message_thread_id is not None:
        return str(message.message_thread_id)
    return None


def telegram_chat(chat_id: PlaceId) -> int:
    """The Telegram chat id of a place.

    Raises:
        ConfigError: the place is not a Telegram chat (its id is not a number).
    """
    try:
        return int(chat_id)
    except ValueError:
        raise ConfigError(f"{chat_id!r} is not a Telegram chat") from None


def telegram_topic(thread_id: PlaceId | None) -> int | None:
    """The Telegram forum topic id of a place's topic (None: no topic).

    Raises:
        ConfigError: the topic is not a Telegram topic (its id is not a number).
    """
    if thread_id is None:
        return None
    try:
        return int(thread_id)
    except ValueError:
        raise ConfigError(f"{thread_id!r} is not a Telegram forum topic") from None

"""What every feature of the bot receives: the bot's parts, built once after ``initialize()``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from telegram import Bot

from bot.replies import Replies
from chatfront.auth import Authorizer
from chatfront.chat import OutboxChatFront
from chatfront.publish import Publisher
from chatfront.sink import BotSink
from chatfront.store import BotStore
from engine.chats.sessions import ChatSessions
from engine.gates import Gates
from engine.redact import Redactor
from engine.runs import RunSupervisor
from engine.settings import Settings
from engine.store.backend import AnyDatabase
from engine.store.runs import SqliteRunStore

__all__ = ["BotContext"]


@dataclass(frozen=True, slots=True)
class BotContext:
    """The bot's parts a feature uses; nothing in it is optional.

    ``spawn`` starts a background task the runtime awaits on exit;
    ``handled_in_transaction`` says an update was marked handled in the same transaction
    as its effect (so the inbox does not mark it again).
    """

    settings: Settings
    db: AnyDatabase
    store: BotStore
    runs: SqliteRunStore
    publisher: Publisher
    authorizer: Authorizer
    redactor: Redactor
    replies: Replies
    supervisor: RunSupervisor
    gates: Gates
    chats: ChatSessions
    chat_front: OutboxChatFront
    sink: BotSink
    bot: Bot
    spawn: Callable[[Awaitable[None], str], asyncio.Task[None]]
    handled_in_transaction: Callable[[int], None]

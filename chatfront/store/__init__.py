"""The bot's persistence: inbound updates, the outbox, live messages, bindings, audit.

Everything the bot must not lose lives here, in the one database (a SQLite file or a
PostgreSQL server). Each concern is a :class:`~typing.Protocol` (:class:`Inbox`,
:class:`Outbox`, :class:`PromptQueue`, ...); :class:`BotStore` is all of them, the one the
bot's parts receive, and :class:`SqlBotStore` implements it on either database. Nothing
outside this package builds SQL on the bot's tables.

SQL stays portable (plain ``?`` parameters, no SQLite-only functions in queries).
"""

from __future__ import annotations

from typing import Protocol

from chatfront.store.chats import (
    BotAudit,
    BotAuditTables,
    ChatMoves,
    ChatMoveTables,
    PlacePermissions,
    PlacePermissionTables,
)
from chatfront.store.gates import (
    GateMessages,
    GateMessageTables,
    ReasonRequests,
    ReasonRequestTables,
    TaskPlaces,
    TaskPlaceTables,
)
from chatfront.store.inbox import Inbox, InboxTables
from chatfront.store.outbox import LiveMessages, LiveTables, Outbox, OutboxTables
from chatfront.store.people import People, PeopleTables
from chatfront.store.prompts import ChatBindings, ChatBindingTables, PromptQueue, PromptTables
from chatfront.store.records import (
    AuditEntry,
    Binding,
    GateRecord,
    InboundState,
    LiveMessage,
    OutboxItem,
    OutboxRow,
    PromptRow,
    ReasonRequest,
)

__all__ = [
    "AuditEntry",
    "Binding",
    "BotAudit",
    "BotStore",
    "ChatBindings",
    "ChatMoves",
    "GateMessages",
    "GateRecord",
    "InboundState",
    "Inbox",
    "LiveMessage",
    "LiveMessages",
    "Outbox",
    "OutboxItem",
    "OutboxRow",
    "People",
    "PlacePermissions",
    "PromptQueue",
    "PromptRow",
    "ReasonRequest",
    "ReasonRequests",
    "SqlBotStore",
    "TaskPlaces",
]


class BotStore(
    Inbox,
    Outbox,
    LiveMessages,
    ChatBindings,
    PromptQueue,
    GateMessages,
    ReasonRequests,
    TaskPlaces,
    ChatMoves,
    PlacePermissions,
    BotAudit,
    People,
    Protocol,
):
    """Every table of the bot: what the bot's parts receive."""


class SqlBotStore(
    InboxTables,
    OutboxTables,
    LiveTables,
    ChatBindingTables,
    PromptTables,
    GateMessageTables,
    ReasonRequestTables,
    TaskPlaceTables,
    ChatMoveTables,
    PlacePermissionTables,
    BotAuditTables,
    PeopleTables,
):
    """:class:`BotStore` on either database (SQLite or PostgreSQL)."""

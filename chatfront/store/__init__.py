"""The bot's persistence: inbound updates, the outbox, live messages, bindings, audit.

Everything the bot must not lose lives here, in the one database (a SQLite file or a
PostgreSQL server). Each concern is a :class:`~typing.Protocol` (:class:`Inbox`,
:class:`Outbox`, :class:`PromptQueue`, ...); :class:`BotStore` is all of them, the one the
bot's parts receive, and :class:`SqlBotStore` implements it on either database. Nothing
outside this package builds SQL on the bot's tables.

SQL stays portable (plain ``?`` parameters, no SQLite-only functions in queries).
"""

from __future__ import annotations

from chatfront.store.chats import (
    BotAuditTables,
    ChatMoveTables,
    PlacePermissionTables,
)
from chatfront.store.gates import (
    GateMessageTables,
    ReasonRequestTables,
    TaskPlaceTables,
)
from chatfront.store.inbox import InboxTables
from chatfront.store.outbox import LiveTables, OutboxTables
from chatfront.store.people import PeopleTables
from chatfront.store.prompts import ChatBindingTables, PromptTables
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
    "BotStore",
    "GateRecord",
    "InboundState",
    "LiveMessage",
    "OutboxItem",
    "OutboxRow",
    "PromptRow",
    "ReasonRequest",
    "SqlBotStore",
]


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
    """Every table of the bot, on either database (SQLite or PostgreSQL): what the bot's
    parts receive."""


BotStore = SqlBotStore

"""What every part of the bot store shares: the database, the clock, the outbox insert."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Final

from chatfront.store.records import OutboxItem
from engine.runs.spec import PlaceId
from engine.store.audit import SqliteAuditLog
from engine.store.backend import AnyDatabase, execute_later
from engine.store.dialect import advisory_key

__all__ = ["AUDIT_ORIGIN", "Tables"]

#: The bot's entries in the system's one audit log.
AUDIT_ORIGIN: Final = "bot"


class Tables:
    """The base of each part of :class:`~chatfront.store.SqlBotStore`: one database, one clock."""

    def __init__(
        self,
        db: AnyDatabase,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = db
        self._clock = clock
        # The system's one audit log; the bot's entries are those of origin "bot".
        self._audit = SqliteAuditLog(db, clock=clock)
        # (chat, user) pairs the bot asked for a rejection reason (loaded on first use).
        self._asked: set[tuple[PlaceId, int]] | None = None

    async def _serialize(self, conn: Any, name: str) -> None:
        """Hold ``name`` until the transaction ends: its writers take turns.

        A read-then-write transaction is safe on SQLite as it is (``BEGIN IMMEDIATE`` holds
        the whole database); PostgreSQL's READ COMMITTED transactions run side by side, so
        there ``name`` becomes an advisory transaction lock (released at commit or rollback).
        """
        if self.db.dialect == "postgresql":
            # Sent with the transaction's next statement: the server takes the lock first.
            await execute_later(conn, "SELECT pg_advisory_xact_lock(?)", (advisory_key(name),))

    @staticmethod
    async def _insert_outbox(conn: Any, item: OutboxItem, now: float) -> None:
        await execute_later(
            conn,
            "INSERT INTO bot_outbox (chat_id, thread_id, kind, body, entities_json, filename,"
            " caption, markup_json, reply_to, run_id, ref, state, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?)",
            (
                item.chat_id,
                item.thread_id,
                item.kind,
                item.body,
                json.dumps(list(item.entities)) if item.entities else None,
                item.filename,
                item.caption,
                json.dumps(item.markup) if item.markup else None,
                item.reply_to,
                item.run_id,
                item.ref,
                now,
            ),
        )

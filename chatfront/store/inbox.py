"""Inbound updates: recorded (deduplicated) before they are confirmed or handled."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path

from chatfront.store.records import InboundState
from chatfront.store.tables import Tables
from engine.store.database import Database

__all__ = ["InboxTables"]


def _fsync_wal(db_path: Path) -> None:
    for candidate in (Path(f"{db_path}-wal"), db_path):
        try:
            fd = os.open(candidate, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return


class InboxTables(Tables):
    """Telegram's updates, recorded before anything acts on them."""

    async def record_inbound(self, updates: Sequence[tuple[int, str]]) -> set[int]:
        """Record raw updates (id, JSON) in one transaction; returns the ids not seen before.

        Call :meth:`sync` before confirming them to Telegram (the next ``getUpdates``,
        or the webhook's 200): Telegram forgets confirmed updates.
        """
        fresh: set[int] = set()
        now = self._clock()
        async with self.db.transaction() as conn:
            for update_id, payload in updates:
                cursor = await conn.execute(
                    "INSERT INTO bot_inbound (update_id, payload, state, received_at)"
                    " VALUES (?, ?, ?, ?) ON CONFLICT (update_id) DO NOTHING",
                    (update_id, payload, InboundState.RECEIVED.value, now),
                )
                if cursor.rowcount:
                    fresh.add(update_id)
        return fresh

    async def sync(self) -> None:
        """Make every commit so far durable on disk.

        SQLite: the bot's connection runs with ``synchronous=NORMAL`` (a commit survives
        the process being killed); this fsync of the WAL makes it survive a power loss
        too. PostgreSQL: a commit is already durable when it returns (the server's
        ``synchronous_commit``), so there is nothing to do.
        """
        if isinstance(self.db, Database):
            await asyncio.to_thread(_fsync_wal, self.db.path)

    async def prune(self, before: float) -> int:
        """Forget handled updates and delivered messages older than ``before``.

        The newest update is always kept: it gives the next polling offset.
        """
        async with self.db.transaction() as conn:
            cursor = await conn.execute(
                "DELETE FROM bot_inbound WHERE state != ? AND received_at < ?"
                " AND update_id < (SELECT MAX(update_id) FROM bot_inbound)",
                (InboundState.RECEIVED.value, before),
            )
            removed = cursor.rowcount
            cursor = await conn.execute(
                "DELETE FROM bot_outbox WHERE state != 'pending' AND created_at < ?", (before,)
            )
            removed += cursor.rowcount
        return removed

    async def mark_inbound(self, update_id: int, state: InboundState) -> None:
        await self.db.execute(
            "UPDATE bot_inbound SET state = ?, handled_at = ? WHERE update_id = ?",
            (state.value, self._clock(), update_id),
        )

    async def unhandled_inbound(self) -> list[tuple[int, str]]:
        rows = await self.db.fetchall(
            "SELECT update_id, payload FROM bot_inbound WHERE state = ? ORDER BY update_id",
            (InboundState.RECEIVED.value,),
        )
        return [(r["update_id"], r["payload"]) for r in rows]

    async def next_offset(self) -> int:
        row = await self.db.fetchone("SELECT MAX(update_id) FROM bot_inbound")
        return int(row[0]) + 1 if row is not None and row[0] is not None else 0

    async def message_of_update(self, update_id: int) -> int | None:
        """The message id an inbound update carried (what an answer replies to)."""
        row = await self.db.fetchone(
            "SELECT payload FROM bot_inbound WHERE update_id = ?", (update_id,)
        )
        if row is None:
            return None
        try:
            message = json.loads(row["payload"]).get("message") or {}
            return int(message["message_id"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

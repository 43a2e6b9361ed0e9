"""The outbox and the live messages: what the bot sends, and what it edits in place."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Final

from chatfront.store.records import LiveMessage, OutboxItem, OutboxRow
from chatfront.store.tables import AUDIT_ORIGIN, Tables
from engine.runs.spec import PlaceId

__all__ = ["URGENT", "LiveTables", "OutboxTables"]


#: ``bot_live.dirty`` of an edit that takes buttons away: sent before queued new messages
#: (1: an ordinary edit, paced; 0: shown as it is). Kept in the row, so a restart keeps it.
URGENT: Final = 2


def _due(sent: OutboxItem, current: Any) -> int:
    """The ``dirty`` of a live message just delivered as ``sent``, its row now ``current``
    (changed while the send was in flight: an edit is due, urgent when buttons went)."""
    if current is None or current["body"] == sent.body:
        return 0
    return URGENT if sent.markup and current["markup_json"] is None else 1


def _live_key(ref: str) -> str:
    return f"bot_live:{ref}"


class OutboxTables(Tables):
    """Messages to deliver, delivered once each, in order."""

    async def enqueue(self, items: Iterable[OutboxItem]) -> None:
        """Queue messages for delivery (one transaction)."""
        now = self._clock()
        async with self.db.transaction() as conn:
            for item in items:
                await self._insert_outbox(conn, item, now)

    async def next_outbox(self) -> OutboxRow | None:
        row = await self.db.fetchone(
            "SELECT * FROM bot_outbox WHERE state = 'pending' ORDER BY id LIMIT 1"
        )
        return OutboxRow.from_row(row) if row is not None else None

    async def outbox_sending(self, row_id: int) -> None:
        """Note that a row's send begins (see :meth:`outbox_uncertain`)."""
        await self.db.execute(
            "UPDATE bot_outbox SET sending_since = ? WHERE id = ?", (self._clock(), row_id)
        )

    async def outbox_not_sent(self, row_id: int) -> None:
        """The send failed in a way that will be retried: it did not reach Telegram."""
        await self.db.execute("UPDATE bot_outbox SET sending_since = NULL WHERE id = ?", (row_id,))

    async def outbox_uncertain(self) -> list[OutboxRow]:
        """On start-up: rows whose send began but was never recorded as done (a crash).

        They may or may not have reached the chat; they are marked ``uncertain`` and not
        sent again, so nothing is delivered twice.
        """
        async with self.db.transaction() as conn:
            cursor = await conn.execute(
                "SELECT * FROM bot_outbox WHERE state = 'pending'"  # noqa: S608
                f" AND sending_since IS NOT NULL ORDER BY id{self.db.for_update}"
            )
            rows = [OutboxRow.from_row(r) for r in await cursor.fetchall()]
            for row in rows:
                await conn.execute(
                    "UPDATE bot_outbox SET state = 'uncertain' WHERE id = ?", (row.id,)
                )
        return rows

    async def pending_outbox(self) -> int:
        row = await self.db.fetchone("SELECT COUNT(*) FROM bot_outbox WHERE state = 'pending'")
        return int(row[0]) if row is not None else 0

    async def outbox_sent(self, row: OutboxRow, message_id: int | None) -> None:
        """Mark a row delivered; a row with a ``ref`` becomes that live message."""
        now = self._clock()
        item = row.item
        async with self.db.transaction() as conn:
            if item.ref is not None:
                # Against a set_live of the same ref in between (it reads, then writes).
                await self._serialize(conn, _live_key(item.ref))
            await conn.execute(
                "UPDATE bot_outbox SET state = 'sent', message_id = ?, sent_at = ?,"
                " attempts = attempts + 1 WHERE id = ?",
                (message_id, now, row.id),
            )
            # The row as it is now: renamed (a phase message that became a gate) or
            # updated (set_live) while its send was in flight.
            cursor = await conn.execute(
                "SELECT ref, body, entities_json, markup_json FROM bot_outbox WHERE id = ?",
                (row.id,),
            )
            current = await cursor.fetchone()
            ref = current["ref"] if current is not None else item.ref
            if ref is not None and message_id is None:
                await self._continue_unaddressable(conn, row.id, item.body, now)
            elif ref is not None:
                body = current["body"] if current is not None else item.body
                cursor = await conn.execute("SELECT body FROM bot_live WHERE ref = ?", (ref,))
                live = await cursor.fetchone()
                if live is None:
                    await conn.execute(
                        "INSERT INTO bot_live (ref, chat_id, thread_id, message_id, body,"
                        " entities_json, markup_json, dirty, updated_at, edited_at)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            ref,
                            item.chat_id,
                            item.thread_id,
                            message_id,
                            body,
                            current["entities_json"] if current is not None else None,
                            current["markup_json"] if current is not None else None,
                            _due(item, current),
                            now,
                            now,
                        ),
                    )
                else:
                    # Updated while the first send was in flight: keep the newer text dirty.
                    await conn.execute(
                        "UPDATE bot_live SET message_id = ?, edited_at = ?,"
                        " dirty = CASE WHEN body = ? THEN 0 ELSE 1 END WHERE ref = ?",
                        (message_id, now, item.body, ref),
                    )

    async def _continue_unaddressable(
        self, conn: Any, row_id: int, sent_body: str, now: float
    ) -> None:
        """A live message Telegram took without the bot learning its id: nothing can edit
        it or count a press of its buttons. It stays an ordinary delivered message, and the
        live message goes on as a new one: at once when it has buttons or changed while its
        send was in flight, else with its next change."""
        cursor = await conn.execute("SELECT * FROM bot_outbox WHERE id = ?", (row_id,))
        current = await cursor.fetchone()
        await conn.execute("UPDATE bot_outbox SET ref = NULL WHERE id = ?", (row_id,))
        if current is None:
            return
        item = OutboxRow.from_row(current).item
        buttons = bool(item.markup and item.markup.get("inline_keyboard"))
        if buttons or item.body != sent_body:
            await self._insert_outbox(conn, item, now)

    async def run_of_message(self, chat_id: PlaceId, message_id: int) -> str | None:
        """The run a delivered message belongs to (a reply to it addresses that run)."""
        row = await self.db.fetchone(
            "SELECT run_id FROM bot_outbox WHERE chat_id = ? AND message_id = ?"
            " AND run_id IS NOT NULL ORDER BY id DESC LIMIT 1",
            (chat_id, message_id),
        )
        return str(row[0]) if row is not None else None

    async def outbox_failed(self, row: OutboxRow, error: str) -> None:
        """Mark a row failed for good and audit it (``/audit`` shows it), atomically."""
        item = row.item
        async with self.db.transaction() as conn:
            await conn.execute(
                "UPDATE bot_outbox SET state = 'failed', error = ?, attempts = attempts + 1"
                " WHERE id = ?",
                (error[:500], row.id),
            )
            await conn.execute(
                *self._audit.insert(
                    "deliver",
                    "failed",
                    origin=AUDIT_ORIGIN,
                    chat_id=item.chat_id,
                    detail=f"{'a file' if item.kind != 'text' else 'a message'}"
                    f"{' of run ' + item.run_id if item.run_id else ''} was not delivered:"
                    f" Telegram answered {error[:300]}",
                )
            )


class LiveTables(Tables):
    """Messages edited in place (a run's status, a gate)."""

    async def set_live(
        self,
        ref: str,
        *,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        body: str,
        entities: tuple[dict[str, Any], ...] = (),
        markup: dict[str, Any] | None = None,
        run_id: str | None = None,
        reply_to: int | None = None,
        initial: bool = False,
    ) -> None:
        """Set a live message's content: the first time it is queued (as a reply to
        ``reply_to`` when given), then edited in place.

        ``initial`` content is only for a message not set yet: one that a newer update
        already set keeps its content (a run's first status can be set before the words
        that announce it) and only gains the ``reply_to`` it was queued without.
        """
        now = self._clock()
        ents = json.dumps(list(entities)) if entities else None
        mk = json.dumps(markup) if markup else None
        async with self.db.transaction() as conn:
            # Read, then write on what was read: one writer of a ref at a time, or two
            # could both find nothing and queue the message twice.
            await self._serialize(conn, _live_key(ref))
            cursor = await conn.execute(
                "SELECT body, entities_json, markup_json FROM bot_live WHERE ref = ?", (ref,)
            )
            live = await cursor.fetchone()
            if initial and live is None:
                cursor = await conn.execute(
                    "UPDATE bot_outbox SET reply_to = COALESCE(reply_to, ?)"
                    " WHERE ref = ? AND state = 'pending'",
                    (reply_to, ref),
                )
                if cursor.rowcount:
                    return
                cursor = await conn.execute("SELECT 1 FROM bot_outbox WHERE ref = ?", (ref,))
                if await cursor.fetchone() is not None:
                    return  # on its way with newer content
            if initial and live is not None:
                return
            if live is not None:
                if (live["body"], live["entities_json"], live["markup_json"]) != (body, ents, mk):
                    # Buttons taken away (a gate decided, a phase ended): urgent, so the
                    # edit goes out ahead of the messages queued to send.
                    dirty = URGENT if live["markup_json"] is not None and mk is None else 1
                    await conn.execute(
                        "UPDATE bot_live SET body = ?, entities_json = ?, markup_json = ?,"
                        " dirty = CASE WHEN dirty = ? THEN dirty ELSE ? END, updated_at = ?"
                        " WHERE ref = ?",
                        (body, ents, mk, URGENT, dirty, now, ref),
                    )
                return
            cursor = await conn.execute(
                "UPDATE bot_outbox SET body = ?, entities_json = ?, markup_json = ?"
                " WHERE ref = ? AND state = 'pending'",
                (body, ents, mk, ref),
            )
            if cursor.rowcount:
                return
            cursor = await conn.execute(
                "SELECT 1 FROM bot_outbox WHERE ref = ? AND state = 'sent'", (ref,)
            )
            if await cursor.fetchone() is not None:
                return
            item = OutboxItem(
                chat_id=chat_id,
                thread_id=thread_id,
                body=body,
                entities=entities,
                markup=markup,
                run_id=run_id,
                ref=ref,
                reply_to=reply_to,
            )
            await self._insert_outbox(conn, item, now)

    async def retire_live(self, ref: str, note: str) -> bool:
        """The message ``ref`` loses its buttons and gets ``note`` as its last line, once
        (a message without buttons is left as it is); False when there was nothing to do.

        Delivered or not yet: a message whose send is still queued or in flight (Telegram
        may already show it, but the bot has not recorded it delivered) carries the change
        in its outbox row, and recording the delivery turns it into an edit.
        """
        now = self._clock()
        async with self.db.transaction() as conn:
            # Against the delivery being recorded, or another retirement, in between.
            await self._serialize(conn, _live_key(ref))
            cursor = await conn.execute(
                "SELECT body, markup_json FROM bot_live WHERE ref = ?", (ref,)
            )
            live = await cursor.fetchone()
            if live is not None:
                if live["markup_json"] is None:
                    return False
                await conn.execute(
                    "UPDATE bot_live SET body = ?, markup_json = NULL, dirty = ?,"
                    " updated_at = ? WHERE ref = ?",
                    (f"{live['body']}\n{note}", URGENT, now, ref),
                )
                return True
            cursor = await conn.execute(
                "SELECT id, body, markup_json FROM bot_outbox WHERE ref = ? AND state = 'pending'"
                " ORDER BY id DESC LIMIT 1",
                (ref,),
            )
            queued = await cursor.fetchone()
            if queued is None or queued["markup_json"] is None:
                return False
            await conn.execute(
                "UPDATE bot_outbox SET body = ?, markup_json = NULL WHERE id = ?",
                (f"{queued['body']}\n{note}", queued["id"]),
            )
            return True

    async def rename_live(self, old: str, new: str) -> bool:
        """Give the live message ``old`` the ref ``new`` (queued or sent); False when there
        is none, or ``new`` is taken."""
        async with self.db.transaction() as conn:
            await self._serialize(conn, _live_key(new))
            cursor = await conn.execute("SELECT 1 FROM bot_live WHERE ref = ?", (new,))
            if await cursor.fetchone() is not None:
                return False
            cursor = await conn.execute("UPDATE bot_live SET ref = ? WHERE ref = ?", (new, old))
            moved = cursor.rowcount
            cursor = await conn.execute(
                "UPDATE bot_outbox SET ref = ? WHERE ref = ? AND state = 'pending'", (new, old)
            )
            return bool(moved or cursor.rowcount)

    async def live_with_prefix(self, prefix: str) -> list[LiveMessage]:
        """The delivered live messages whose ref starts with ``prefix``."""
        # Not LIKE: it is case-insensitive on SQLite only, and ``_``/``%`` are wildcards.
        rows = await self.db.fetchall(
            "SELECT * FROM bot_live WHERE substr(ref, 1, ?) = ? AND message_id IS NOT NULL",
            (len(prefix), prefix),
        )
        return [LiveMessage.from_row(r) for r in rows]

    async def get_live(self, ref: str) -> LiveMessage | None:
        row = await self.db.fetchone("SELECT * FROM bot_live WHERE ref = ?", (ref,))
        return LiveMessage.from_row(row) if row is not None else None

    async def dirty_live(self) -> list[LiveMessage]:
        """The delivered live messages with an edit due, the urgent ones first."""
        rows = await self.db.fetchall(
            "SELECT * FROM bot_live WHERE dirty <> 0 AND message_id IS NOT NULL"
            " ORDER BY dirty DESC, updated_at"
        )
        return [LiveMessage.from_row(r) for r in rows]

    async def live_edited(self, ref: str, body: str, at: float, *, urgent: bool = False) -> None:
        """The edit to ``body`` went through; ``urgent``: it was the urgent one (whatever
        changed since is not). An urgent change made meanwhile stays urgent."""
        await self.db.execute(
            "UPDATE bot_live SET edited_at = ?, dirty = CASE WHEN body = ? THEN 0"
            " WHEN dirty = ? AND ? = 0 THEN dirty ELSE 1 END WHERE ref = ?",
            (at, body, URGENT, int(urgent), ref),
        )

    async def live_by_message(self, chat_id: PlaceId, message_id: int) -> LiveMessage | None:
        row = await self.db.fetchone(
            "SELECT * FROM bot_live WHERE chat_id = ? AND message_id = ?", (chat_id, message_id)
        )
        return LiveMessage.from_row(row) if row is not None else None

    async def touch_live(self, prefix: str) -> int:
        """Mark every live message whose ref starts with ``prefix`` for a refresh."""
        # Not LIKE: it is case-insensitive on SQLite only, and ``_``/``%`` are wildcards.
        return await self.db.execute(
            "UPDATE bot_live SET dirty = CASE WHEN dirty = ? THEN dirty ELSE 1 END"
            " WHERE substr(ref, 1, ?) = ?",
            (URGENT, len(prefix), prefix),
        )

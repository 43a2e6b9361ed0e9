"""The bot's persistence: inbound updates, the outbox, live messages, bindings, audit.

Everything the bot must not lose lives here, in the one database. SQL stays portable
(plain ``?`` parameters, no SQLite-only functions in queries).

Long: the one SQL surface of the bot's tables (inbound, outbox, live messages, bindings,
prompts, gate messages, reason requests), kept together so that the transactions
spanning several of them stay in one place.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import aiosqlite

from engine.store.audit import SqliteAuditLog
from engine.store.database import Database
from engine.store.runs import TurnState
from engine.turn import TurnOutput

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
]


class InboundState(StrEnum):
    RECEIVED = "received"
    HANDLED = "handled"
    IGNORED = "ignored"
    FAILED = "failed"


_AUDIT_ORIGIN = "bot"


def _user_id(actor: str | None) -> int | None:
    try:
        return int(actor) if actor is not None else None
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class OutboxItem:
    """One message to deliver (before it is queued)."""

    chat_id: int
    body: str
    thread_id: int | None = None
    kind: str = "text"
    entities: tuple[dict[str, Any], ...] = ()
    filename: str | None = None
    caption: str | None = None
    markup: dict[str, Any] | None = None
    reply_to: int | None = None
    run_id: str | None = None
    ref: str | None = None


@dataclass(frozen=True, slots=True)
class OutboxRow:
    id: int
    item: OutboxItem
    attempts: int

    @classmethod
    def from_row(cls, row: aiosqlite.Row) -> OutboxRow:
        return cls(
            id=row["id"],
            attempts=row["attempts"],
            item=OutboxItem(
                chat_id=row["chat_id"],
                thread_id=row["thread_id"],
                kind=row["kind"],
                body=row["body"],
                entities=tuple(json.loads(row["entities_json"] or "[]")),
                filename=row["filename"],
                caption=row["caption"],
                markup=json.loads(row["markup_json"]) if row["markup_json"] else None,
                reply_to=row["reply_to"],
                run_id=row["run_id"],
                ref=row["ref"],
            ),
        )


@dataclass(frozen=True, slots=True)
class LiveMessage:
    """A message edited in place (a run's status, a gate)."""

    ref: str
    chat_id: int
    thread_id: int | None
    message_id: int | None
    body: str
    entities: tuple[dict[str, Any], ...]
    markup: dict[str, Any] | None
    dirty: bool
    edited_at: float | None

    @classmethod
    def from_row(cls, row: aiosqlite.Row) -> LiveMessage:
        return cls(
            ref=row["ref"],
            chat_id=row["chat_id"],
            thread_id=row["thread_id"],
            message_id=row["message_id"],
            body=row["body"],
            entities=tuple(json.loads(row["entities_json"] or "[]")),
            markup=json.loads(row["markup_json"]) if row["markup_json"] else None,
            dirty=bool(row["dirty"]),
            edited_at=row["edited_at"],
        )


@dataclass(frozen=True, slots=True)
class Binding:
    """A chat (or forum topic) bound to one agent session."""

    chat_id: int
    thread_id: int
    agent: str
    project: str
    workdir: str
    session_id: str
    turns: int
    run_id: str | None

    @classmethod
    def from_row(cls, row: aiosqlite.Row) -> Binding:
        return cls(
            chat_id=row["chat_id"],
            thread_id=row["thread_id"],
            agent=row["agent"],
            project=row["project"],
            workdir=row["workdir"],
            session_id=row["session_id"],
            turns=row["turns"],
            run_id=row["run_id"],
        )


@dataclass(frozen=True, slots=True)
class PromptRow:
    id: int
    chat_id: int
    thread_id: int
    update_id: int | None
    user_id: int | None
    body: str
    state: str
    run_id: str | None
    turn_id: int | None


@dataclass(frozen=True, slots=True)
class ReasonRequest:
    """The bot asked a person for a rejection reason (after a Reject button press)."""

    gate_id: str
    prompt_ref: str | None
    created_at: float
    expired: bool = False


@dataclass(frozen=True, slots=True)
class GateRecord:
    gate_id: str
    task: str
    phase: str
    sha256: str
    artifact_name: str
    chat_id: int
    thread_id: int | None
    run_id: str | None
    state: str

    @classmethod
    def from_row(cls, row: aiosqlite.Row) -> GateRecord:
        return cls(
            gate_id=row["gate_id"],
            task=row["task"],
            phase=row["phase"],
            sha256=row["sha256"],
            artifact_name=row["artifact_name"],
            chat_id=row["chat_id"],
            thread_id=row["thread_id"],
            run_id=row["run_id"],
            state=row["state"],
        )


@dataclass(frozen=True, slots=True)
class AuditEntry:
    at: float
    user_id: int | None
    chat_id: int | None
    update_id: int | None
    action: str
    outcome: str
    reason: str | None


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


def _prompt(row: aiosqlite.Row) -> PromptRow:
    return PromptRow(
        id=row["id"],
        chat_id=row["chat_id"],
        thread_id=row["thread_id"],
        update_id=row["update_id"],
        user_id=row["user_id"],
        body=row["body"],
        state=row["state"],
        run_id=row["run_id"],
        turn_id=row["turn_id"],
    )


class BotStore:
    """The bot's tables on a :class:`Database`."""

    def __init__(
        self,
        db: Database,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = db
        self._clock = clock
        # The system's one audit log; the bot's entries are those of origin "bot".
        self._audit = SqliteAuditLog(db, clock=clock)
        # (chat, user) pairs the bot asked for a rejection reason (loaded on first use).
        self._asked: set[tuple[int, int]] | None = None

    # -- inbound -----------------------------------------------------------------------

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
                    "INSERT OR IGNORE INTO bot_inbound (update_id, payload, state, received_at)"
                    " VALUES (?, ?, ?, ?)",
                    (update_id, payload, InboundState.RECEIVED.value, now),
                )
                if cursor.rowcount:
                    fresh.add(update_id)
        return fresh

    async def sync(self) -> None:
        """Make every commit so far durable on disk (fsync of the WAL).

        The bot's connection runs with ``synchronous=NORMAL``: a commit survives the
        process being killed, and this call makes it survive a power loss too.
        """
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

    # -- outbox ------------------------------------------------------------------------

    @staticmethod
    async def _insert_outbox(conn: aiosqlite.Connection, item: OutboxItem, now: float) -> None:
        await conn.execute(
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
                "SELECT * FROM bot_outbox WHERE state = 'pending' AND sending_since IS NOT NULL"
                " ORDER BY id"
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
            if ref is not None and message_id is not None:
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
                            int(body != item.body),
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

    async def run_of_message(self, chat_id: int, message_id: int) -> str | None:
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
                    origin=_AUDIT_ORIGIN,
                    chat_id=item.chat_id,
                    detail=f"{'a file' if item.kind != 'text' else 'a message'}"
                    f"{' of run ' + item.run_id if item.run_id else ''} was not delivered:"
                    f" Telegram answered {error[:300]}",
                )
            )

    async def outbox_retarget(self, old_chat: int, new_chat: int) -> None:
        """A group became a supergroup: pending messages follow it."""
        async with self.db.transaction() as conn:
            await conn.execute(
                "UPDATE bot_outbox SET chat_id = ? WHERE chat_id = ? AND state = 'pending'",
                (new_chat, old_chat),
            )
            await conn.execute(
                "UPDATE bot_live SET chat_id = ? WHERE chat_id = ?", (new_chat, old_chat)
            )

    # -- live messages -----------------------------------------------------------------

    async def set_live(
        self,
        ref: str,
        *,
        chat_id: int,
        thread_id: int | None,
        body: str,
        entities: tuple[dict[str, Any], ...] = (),
        markup: dict[str, Any] | None = None,
        run_id: str | None = None,
        reply_to: int | None = None,
    ) -> None:
        """Set a live message's content: the first time it is queued (as a reply to
        ``reply_to`` when given), then edited in place."""
        now = self._clock()
        ents = json.dumps(list(entities)) if entities else None
        mk = json.dumps(markup) if markup else None
        async with self.db.transaction() as conn:
            cursor = await conn.execute(
                "SELECT body, entities_json, markup_json FROM bot_live WHERE ref = ?", (ref,)
            )
            live = await cursor.fetchone()
            if live is not None:
                if (live["body"], live["entities_json"], live["markup_json"]) != (body, ents, mk):
                    await conn.execute(
                        "UPDATE bot_live SET body = ?, entities_json = ?, markup_json = ?,"
                        " dirty = 1, updated_at = ? WHERE ref = ?",
                        (body, ents, mk, now, ref),
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

    async def get_live(self, ref: str) -> LiveMessage | None:
        row = await self.db.fetchone("SELECT * FROM bot_live WHERE ref = ?", (ref,))
        return LiveMessage.from_row(row) if row is not None else None

    async def dirty_live(self) -> list[LiveMessage]:
        rows = await self.db.fetchall(
            "SELECT * FROM bot_live WHERE dirty = 1 AND message_id IS NOT NULL ORDER BY updated_at"
        )
        return [LiveMessage.from_row(r) for r in rows]

    async def live_edited(self, ref: str, body: str, at: float) -> None:
        await self.db.execute(
            "UPDATE bot_live SET edited_at = ?, dirty = CASE WHEN body = ? THEN 0 ELSE 1 END"
            " WHERE ref = ?",
            (at, body, ref),
        )

    async def live_by_message(self, chat_id: int, message_id: int) -> LiveMessage | None:
        row = await self.db.fetchone(
            "SELECT * FROM bot_live WHERE chat_id = ? AND message_id = ?", (chat_id, message_id)
        )
        return LiveMessage.from_row(row) if row is not None else None

    async def rename_live(self, old: str, new: str) -> bool:
        """Give the live message ``old`` the ref ``new`` (queued or sent); False when there
        is none, or ``new`` is taken."""
        async with self.db.transaction() as conn:
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
        rows = await self.db.fetchall(
            "SELECT * FROM bot_live WHERE ref LIKE ? AND message_id IS NOT NULL",
            (prefix.replace("%", "") + "%",),
        )
        return [LiveMessage.from_row(r) for r in rows]

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

    # -- people ------------------------------------------------------------------------

    async def remember_person(self, user_id: int, name: str) -> None:
        """Remember how a person is called (first name or @username, from their updates)."""
        await self.db.execute(
            "INSERT INTO bot_people (user_id, name, seen_at) VALUES (?, ?, ?)"
            " ON CONFLICT (user_id) DO UPDATE SET name = excluded.name, seen_at = excluded.seen_at"
            " WHERE bot_people.name != excluded.name",
            (user_id, name, self._clock()),
        )

    async def people(self) -> dict[int, str]:
        rows = await self.db.fetchall("SELECT user_id, name FROM bot_people")
        return {int(r["user_id"]): str(r["name"]) for r in rows}

    async def touch_live(self, prefix: str) -> int:
        """Mark every live message whose ref starts with ``prefix`` for a refresh."""
        return await self.db.execute(
            "UPDATE bot_live SET dirty = 1 WHERE ref LIKE ?", (prefix.replace("%", "") + "%",)
        )

    # -- bindings and the prompt queue -------------------------------------------------

    async def bind(
        self,
        chat_id: int,
        thread_id: int,
        *,
        agent: str,
        project: str,
        workdir: str,
        session_id: str,
        user_id: int | None,
    ) -> Binding:
        async with self.db.transaction() as conn:
            await conn.execute(
                "DELETE FROM bot_bindings WHERE chat_id = ? AND thread_id = ?",
                (chat_id, thread_id),
            )
            await conn.execute(
                "INSERT INTO bot_bindings (chat_id, thread_id, agent, project, workdir,"
                " session_id, turns, bound_by, created_at) VALUES (?, ?, ?, ?, ?, ?, 0, ?, ?)",
                (chat_id, thread_id, agent, project, workdir, session_id, user_id, self._clock()),
            )
        binding = await self.binding(chat_id, thread_id)
        assert binding is not None
        return binding

    async def binding(self, chat_id: int, thread_id: int) -> Binding | None:
        row = await self.db.fetchone(
            "SELECT * FROM bot_bindings WHERE chat_id = ? AND thread_id = ?", (chat_id, thread_id)
        )
        return Binding.from_row(row) if row is not None else None

    async def bindings(self) -> list[Binding]:
        rows = await self.db.fetchall("SELECT * FROM bot_bindings ORDER BY created_at")
        return [Binding.from_row(r) for r in rows]

    async def set_binding_run(self, chat_id: int, thread_id: int, run_id: str | None) -> None:
        await self.db.execute(
            "UPDATE bot_bindings SET run_id = ? WHERE chat_id = ? AND thread_id = ?",
            (run_id, chat_id, thread_id),
        )

    async def queue_prompt(
        self,
        chat_id: int,
        thread_id: int,
        *,
        update_id: int | None,
        user_id: int | None,
        body: str,
        depth: int,
    ) -> tuple[bool, int]:
        """Queue a prompt unless ``depth`` are already waiting.

        Returns:
            (queued, number waiting before it). A duplicate update id counts as queued.
        """
        async with self.db.transaction() as conn:
            cursor = await conn.execute(
                "SELECT COUNT(*) FROM bot_prompts WHERE chat_id = ? AND thread_id = ?"
                " AND state = 'queued'",
                (chat_id, thread_id),
            )
            row = await cursor.fetchone()
            waiting = int(row[0]) if row else 0
            if update_id is not None:
                cursor = await conn.execute(
                    "SELECT 1 FROM bot_prompts WHERE update_id = ?", (update_id,)
                )
                if await cursor.fetchone() is not None:
                    return True, waiting
            if waiting >= depth:
                return False, waiting
            await conn.execute(
                "INSERT INTO bot_prompts (chat_id, thread_id, update_id, user_id, body, state,"
                " created_at) VALUES (?, ?, ?, ?, ?, 'queued', ?)",
                (chat_id, thread_id, update_id, user_id, body, self._clock()),
            )
            if update_id is not None:
                await conn.execute(
                    "UPDATE bot_inbound SET state = ?, handled_at = ? WHERE update_id = ?",
                    (InboundState.HANDLED.value, self._clock(), update_id),
                )
        return True, waiting

    async def hold_for_steering(
        self, chat_id: int, thread_id: int, *, update_id: int | None, user_id: int | None, body: str
    ) -> int | None:
        """Record a message meant for the running turn (not queued for the next one).

        Returns:
            The prompt's id, or None when the update was recorded before (a replay).
        """
        async with self.db.transaction() as conn:
            if update_id is not None:
                cursor = await conn.execute(
                    "SELECT 1 FROM bot_prompts WHERE update_id = ?", (update_id,)
                )
                if await cursor.fetchone() is not None:
                    return None
            cursor = await conn.execute(
                "INSERT INTO bot_prompts (chat_id, thread_id, update_id, user_id, body, state,"
                " created_at) VALUES (?, ?, ?, ?, ?, 'steering', ?)",
                (chat_id, thread_id, update_id, user_id, body, self._clock()),
            )
            prompt_id = cursor.lastrowid
            assert prompt_id is not None
            if update_id is not None:
                await conn.execute(
                    "UPDATE bot_inbound SET state = ?, handled_at = ? WHERE update_id = ?",
                    (InboundState.HANDLED.value, self._clock(), update_id),
                )
        return prompt_id

    async def steering_done(self, prompt_id: int, *, delivered: bool) -> None:
        """The running turn took the message (``steered``), or it waits for the next turn."""
        if delivered:
            await self.end_prompt(prompt_id, "steered")
        else:
            await self.db.execute(
                "UPDATE bot_prompts SET state = 'queued' WHERE id = ?", (prompt_id,)
            )

    async def queued_count(self, chat_id: int, thread_id: int) -> int:
        row = await self.db.fetchone(
            "SELECT COUNT(*) FROM bot_prompts WHERE chat_id = ? AND thread_id = ?"
            " AND state = 'queued'",
            (chat_id, thread_id),
        )
        return int(row[0]) if row is not None else 0

    async def take_prompt(
        self, chat_id: int, thread_id: int, run_id: str, seq: int
    ) -> tuple[PromptRow, int] | None:
        """Take the oldest queued prompt and record its turn as started, atomically.

        Returns:
            (the prompt, the turn's row id), or None when the queue is empty.
        """
        now = self._clock()
        async with self.db.transaction() as conn:
            cursor = await conn.execute(
                "SELECT * FROM bot_prompts WHERE chat_id = ? AND thread_id = ? AND state = 'queued'"
                " ORDER BY id LIMIT 1",
                (chat_id, thread_id),
            )
            row = await cursor.fetchone()
            if row is None:
                return None
            cursor = await conn.execute(
                "SELECT COALESCE(MAX(attempt), 0) FROM turns WHERE run_id = ? AND seq = ?",
                (run_id, seq),
            )
            arow = await cursor.fetchone()
            attempt = (int(arow[0]) if arow else 0) + 1
            cursor = await conn.execute(
                "INSERT INTO turns (run_id, seq, attempt, phase, prompt, state, started_at)"
                " VALUES (?, ?, ?, NULL, ?, ?, ?)",
                (run_id, seq, attempt, row["body"], TurnState.STARTED.value, now),
            )
            turn_id = cursor.lastrowid
            assert turn_id is not None
            await conn.execute(
                "UPDATE bot_prompts SET state = 'running', run_id = ?, turn_id = ? WHERE id = ?",
                (run_id, turn_id, row["id"]),
            )
            await conn.execute(
                "UPDATE runs SET turn = ?, updated_at = ? WHERE id = ?", (seq, now, run_id)
            )
        return _prompt(row), turn_id

    async def commit_turn(
        self,
        prompt_id: int,
        turn_id: int,
        out: TurnOutput,
        items: Iterable[OutboxItem],
        *,
        chat_id: int,
        thread_id: int,
    ) -> None:
        """One transaction: the turn's output recorded, its messages queued, the prompt done."""
        now = self._clock()
        async with self.db.transaction() as conn:
            await conn.execute(
                "UPDATE turns SET output = ?, output_spill = ?, output_size = ?, exit_code = ?,"
                " state = ?, finished_at = ? WHERE id = ?",
                (
                    out.text,
                    str(out.spill_path) if out.spill_path else None,
                    out.size if out.size is not None else len(out.text.encode()),
                    out.exit_code,
                    TurnState.FINISHED.value,
                    now,
                    turn_id,
                ),
            )
            for item in items:
                await self._insert_outbox(conn, item, now)
            await conn.execute(
                "UPDATE bot_prompts SET state = 'done', finished_at = ? WHERE id = ?",
                (now, prompt_id),
            )
            await conn.execute(
                "UPDATE bot_bindings SET turns = turns + 1 WHERE chat_id = ? AND thread_id = ?",
                (chat_id, thread_id),
            )

    async def end_prompt(self, prompt_id: int, state: str, *, requeue: bool = False) -> None:
        """Close a prompt whose turn did not finish; ``requeue`` puts it back in front."""
        await self.db.execute(
            "UPDATE bot_prompts SET state = ?, finished_at = ? WHERE id = ?",
            ("queued" if requeue else state, self._clock(), prompt_id),
        )

    async def running_prompts(self) -> list[PromptRow]:
        rows = await self.db.fetchall(
            "SELECT * FROM bot_prompts WHERE state = 'running' ORDER BY id"
        )
        return [_prompt(r) for r in rows]

    async def drop_queued(self, chat_id: int, thread_id: int) -> int:
        return await self.db.execute(
            "UPDATE bot_prompts SET state = 'dropped', finished_at = ? WHERE chat_id = ?"
            " AND thread_id = ? AND state = 'queued'",
            (self._clock(), chat_id, thread_id),
        )

    async def chats_with_queued(self) -> list[tuple[int, int]]:
        rows = await self.db.fetchall(
            "SELECT DISTINCT chat_id, thread_id FROM bot_prompts WHERE state = 'queued'"
        )
        return [(r["chat_id"], r["thread_id"]) for r in rows]

    # -- gates -------------------------------------------------------------------------

    async def add_gate(
        self,
        gate_id: str,
        *,
        task: str,
        phase: str,
        sha256: str,
        artifact_name: str,
        chat_id: int,
        thread_id: int | None,
        run_id: str | None,
    ) -> None:
        async with self.db.transaction() as conn:
            await conn.execute(
                "UPDATE bot_gates SET state = 'superseded' WHERE task = ? AND phase = ?"
                " AND state = 'open'",
                (task, phase),
            )
            await conn.execute(
                "INSERT OR REPLACE INTO bot_gates (gate_id, task, phase, sha256, artifact_name,"
                " chat_id, thread_id, run_id, state, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'open', ?)",
                (
                    gate_id,
                    task,
                    phase,
                    sha256,
                    artifact_name,
                    chat_id,
                    thread_id,
                    run_id,
                    self._clock(),
                ),
            )

    async def gate(self, gate_id: str) -> GateRecord | None:
        row = await self.db.fetchone("SELECT * FROM bot_gates WHERE gate_id = ?", (gate_id,))
        return GateRecord.from_row(row) if row is not None else None

    async def open_gates(self, *, chat_id: int | None = None) -> list[GateRecord]:
        if chat_id is None:
            rows = await self.db.fetchall(
                "SELECT * FROM bot_gates WHERE state = 'open' ORDER BY created_at"
            )
        else:
            rows = await self.db.fetchall(
                "SELECT * FROM bot_gates WHERE state = 'open' AND chat_id = ? ORDER BY created_at",
                (chat_id,),
            )
        return [GateRecord.from_row(r) for r in rows]

    async def decisions_of(self, task: str) -> list[tuple[str, str, int | None]]:
        """(phase, state, decided by) of the task's decided gates, oldest first."""
        rows = await self.db.fetchall(
            "SELECT phase, state, decided_by FROM bot_gates WHERE task = ? AND state != 'open'"
            " ORDER BY decided_at",
            (task,),
        )
        return [(r["phase"], r["state"], r["decided_by"]) for r in rows]

    async def close_gate(self, gate_id: str, state: str, user_id: int | None) -> bool:
        """Close an open gate; False when it was not open (already decided)."""
        changed = await self.db.execute(
            "UPDATE bot_gates SET state = ?, decided_by = ?, decided_at = ?"
            " WHERE gate_id = ? AND state = 'open'",
            (state, user_id, self._clock(), gate_id),
        )
        return changed > 0

    async def ask_reason(
        self, chat_id: int, user_id: int, gate_id: str, *, prompt_ref: str | None = None
    ) -> None:
        """Wait for ``user_id``'s rejection reason in ``chat_id`` (one request per pair:
        a new one replaces the old); ``prompt_ref`` is the live message that asked."""
        if self._asked is not None:
            self._asked.add((chat_id, user_id))
        await self.db.execute(
            "INSERT OR REPLACE INTO bot_reason_requests"
            " (chat_id, user_id, gate_id, prompt_message_ref, created_at) VALUES (?, ?, ?, ?, ?)",
            (chat_id, user_id, gate_id, prompt_ref, self._clock()),
        )

    async def reason_request(
        self, chat_id: int, user_id: int, *, max_age: float | None = None
    ) -> ReasonRequest | None:
        """The pending reason request of ``user_id`` in ``chat_id``, left in place.

        A request older than ``max_age`` seconds is expired: it is dropped, and returned
        once with ``expired`` set (so the question can say so).
        """
        if self._asked is None:
            rows = await self.db.fetchall("SELECT chat_id, user_id FROM bot_reason_requests")
            self._asked = {(int(r["chat_id"]), int(r["user_id"])) for r in rows}
        # Most messages are not reasons: answered from memory, off the database.
        if (chat_id, user_id) not in self._asked:
            return None
        row = await self.db.fetchone(
            "SELECT gate_id, prompt_message_ref, created_at FROM bot_reason_requests"
            " WHERE chat_id = ? AND user_id = ?",
            (chat_id, user_id),
        )
        if row is None:
            self._asked.discard((chat_id, user_id))
            return None
        request = ReasonRequest(
            gate_id=str(row["gate_id"]),
            prompt_ref=row["prompt_message_ref"],
            created_at=float(row["created_at"]),
        )
        if max_age is not None and self._clock() - request.created_at > max_age:
            await self.drop_reason_request(chat_id, user_id, gate_id=request.gate_id)
            return replace(request, expired=True)
        return request

    async def drop_reason_request(
        self, chat_id: int, user_id: int, *, gate_id: str | None = None
    ) -> bool:
        """Forget the pending request (only if it is for ``gate_id``, when given)."""
        sql = "DELETE FROM bot_reason_requests WHERE chat_id = ? AND user_id = ?"
        params: tuple[object, ...] = (chat_id, user_id)
        if gate_id is not None:
            sql += " AND gate_id = ?"
            params = (*params, gate_id)
        changed = await self.db.execute(sql, params)
        if self._asked is not None and (changed or gate_id is None):
            self._asked.discard((chat_id, user_id))
        return changed > 0

    async def take_reason_request(
        self, chat_id: int, user_id: int, *, max_age: float | None = None
    ) -> str | None:
        """The gate a pending, unexpired request is for; the request is used up."""
        request = await self.reason_request(chat_id, user_id, max_age=max_age)
        if request is None or request.expired:
            return None
        if not await self.drop_reason_request(chat_id, user_id, gate_id=request.gate_id):
            return None
        return request.gate_id

    async def open_gate_for(self, task: str, phase: str, sha256: str) -> GateRecord | None:
        row = await self.db.fetchone(
            "SELECT * FROM bot_gates WHERE task = ? AND phase = ? AND sha256 = ?"
            " AND state = 'open' ORDER BY created_at DESC LIMIT 1",
            (task, phase, sha256),
        )
        return GateRecord.from_row(row) if row is not None else None

    async def open_gates_of(self, task: str) -> list[GateRecord]:
        rows = await self.db.fetchall(
            "SELECT * FROM bot_gates WHERE task = ? AND state = 'open' ORDER BY created_at",
            (task,),
        )
        return [GateRecord.from_row(r) for r in rows]

    async def latest_open_gate(self, task: str) -> GateRecord | None:
        row = await self.db.fetchone(
            "SELECT * FROM bot_gates WHERE task = ? AND state = 'open'"
            " ORDER BY created_at DESC LIMIT 1",
            (task,),
        )
        return GateRecord.from_row(row) if row is not None else None

    async def close_gates_of(self, task: str, state: str, user_id: int | None) -> list[str]:
        """Close every open gate of ``task``; returns their ids."""
        rows = await self.db.fetchall(
            "SELECT gate_id FROM bot_gates WHERE task = ? AND state = 'open'", (task,)
        )
        for row in rows:
            await self.close_gate(row["gate_id"], state, user_id)
        return [str(r["gate_id"]) for r in rows]

    # -- autopilot tasks driven from a chat --------------------------------------------

    async def save_task_place(
        self, task: str, chat_id: int, thread_id: int | None, started_by: int | None
    ) -> None:
        await self.db.execute(
            "INSERT INTO bot_tasks (task, chat_id, thread_id, started_by, active, created_at)"
            " VALUES (?, ?, ?, ?, 1, ?) ON CONFLICT (task) DO UPDATE SET"
            " chat_id = excluded.chat_id, thread_id = excluded.thread_id, active = 1",
            (task, chat_id, thread_id, started_by, self._clock()),
        )

    async def set_task_active(self, task: str, active: bool) -> None:
        await self.db.execute(
            "UPDATE bot_tasks SET active = ? WHERE task = ?", (1 if active else 0, task)
        )

    async def task_places(self, *, active_only: bool = False) -> list[tuple[str, int, int | None]]:
        sql = "SELECT task, chat_id, thread_id FROM bot_tasks"
        if active_only:
            sql += " WHERE active = 1"
        rows = await self.db.fetchall(sql + " ORDER BY created_at")
        return [(r["task"], r["chat_id"], r["thread_id"]) for r in rows]

    # -- chat migration ----------------------------------------------------------------

    async def migrate_chat(self, old_chat: int, new_chat: int) -> None:
        """Follow a group that became a supergroup: bindings, queues and outbox move."""
        now = self._clock()
        async with self.db.transaction() as conn:
            await conn.execute(
                "INSERT OR REPLACE INTO bot_chat_migrations (old_chat_id, new_chat_id,"
                " migrated_at) VALUES (?, ?, ?)",
                (old_chat, new_chat, now),
            )
            for table in ("bot_bindings", "bot_prompts", "bot_gates", "bot_tasks"):
                await conn.execute(
                    f"UPDATE {table} SET chat_id = ? WHERE chat_id = ?",  # noqa: S608
                    (new_chat, old_chat),
                )
            await conn.execute(
                "UPDATE runs SET chat_id = ? WHERE chat_id = ?", (new_chat, old_chat)
            )
            await conn.execute(
                "UPDATE bot_outbox SET chat_id = ? WHERE chat_id = ? AND state = 'pending'",
                (new_chat, old_chat),
            )
            await conn.execute(
                "UPDATE bot_live SET chat_id = ? WHERE chat_id = ?", (new_chat, old_chat)
            )

    async def migrated_from(self) -> dict[int, int]:
        """new chat id → old chat id, for every followed migration."""
        rows = await self.db.fetchall("SELECT old_chat_id, new_chat_id FROM bot_chat_migrations")
        return {int(r["new_chat_id"]): int(r["old_chat_id"]) for r in rows}

    # -- audit -------------------------------------------------------------------------

    async def audit(
        self,
        *,
        action: str,
        outcome: str,
        user_id: int | None,
        chat_id: int | None,
        update_id: int | None,
        reason: str | None = None,
    ) -> None:
        await self._audit.record(
            action,
            outcome,
            origin=_AUDIT_ORIGIN,
            actor=str(user_id) if user_id is not None else None,
            chat_id=chat_id,
            update_id=update_id,
            detail=reason,
        )

    async def audit_entries(self, *, limit: int = 50) -> list[AuditEntry]:
        """The bot's latest audit entries, newest first."""
        found = await self._audit.entries(origin=_AUDIT_ORIGIN, limit=limit)
        return [
            AuditEntry(
                at=e.at,
                user_id=int(e.actor)
                if e.actor is not None and e.actor.lstrip("-").isdigit()
                else None,
                chat_id=e.chat_id,
                update_id=e.update_id,
                action=e.event,
                outcome=e.outcome,
                reason=e.detail,
            )
            for e in reversed(found)
        ]

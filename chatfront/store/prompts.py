"""Chat bindings and each chat's prompt queue."""

from __future__ import annotations

from collections.abc import Iterable

from chatfront.store.records import (
    Binding,
    InboundState,
    OutboxItem,
    PromptRow,
    binding_from_row,
    prompt_from_row,
    topic_key,
)
from chatfront.store.tables import Tables
from engine.runs.spec import PlaceId, place_id
from engine.store.backend import execute_later
from engine.store.events import EventKind, add_event, events_written, turn_started
from engine.store.runs import TurnState, finish_turn_in
from engine.turn import TurnOutput

__all__ = ["ChatBindingTables", "PromptTables"]


def _queue_key(chat_id: PlaceId, thread_id: PlaceId | None) -> str:
    return f"bot_prompts:{chat_id}:{topic_key(thread_id)}"


class ChatBindingTables(Tables):
    """Which chat (or forum topic) talks to which agent session, beyond what the chat mode
    asks (:class:`~engine.chats.records.ChatQueue`)."""

    async def bind(
        self,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        *,
        agent: str,
        project: str,
        workdir: str,
        session_id: str,
        user_id: int | None,
        model: str | None = None,
    ) -> Binding:
        # One statement, so two binds of one chat cannot both insert (a new binding
        # replaces the old one whole: a fresh session, no turns, no run yet).
        await self.db.execute(
            "INSERT INTO bot_bindings (chat_id, thread_id, agent, project, workdir,"
            " session_id, turns, run_id, bound_by, created_at, model)"
            " VALUES (?, ?, ?, ?, ?, ?, 0, NULL, ?, ?, ?) ON CONFLICT (chat_id, thread_id)"
            " DO UPDATE SET agent = excluded.agent, project = excluded.project,"
            " workdir = excluded.workdir, session_id = excluded.session_id, turns = 0,"
            " run_id = NULL, bound_by = excluded.bound_by, created_at = excluded.created_at,"
            " model = excluded.model",
            (
                chat_id,
                topic_key(thread_id),
                agent,
                project,
                workdir,
                session_id,
                user_id,
                self._clock(),
                model,
            ),
        )
        binding = await self.binding(chat_id, thread_id)
        assert binding is not None
        return binding

    async def binding(self, chat_id: PlaceId, thread_id: PlaceId | None) -> Binding | None:
        row = await self.db.fetchone(
            "SELECT * FROM bot_bindings WHERE chat_id = ? AND thread_id = ?",
            (chat_id, topic_key(thread_id)),
        )
        return binding_from_row(row) if row is not None else None

    async def bindings(self) -> list[Binding]:
        rows = await self.db.fetchall("SELECT * FROM bot_bindings ORDER BY created_at")
        return [binding_from_row(r) for r in rows]

    async def set_binding_run(
        self, chat_id: PlaceId, thread_id: PlaceId | None, run_id: str | None
    ) -> None:
        await self.db.execute(
            "UPDATE bot_bindings SET run_id = ? WHERE chat_id = ? AND thread_id = ?",
            (run_id, chat_id, topic_key(thread_id)),
        )

    async def set_binding_model(
        self, chat_id: PlaceId, thread_id: PlaceId | None, model: str | None
    ) -> None:
        await self.db.execute(
            "UPDATE bot_bindings SET model = ? WHERE chat_id = ? AND thread_id = ?",
            (model, chat_id, topic_key(thread_id)),
        )


class PromptTables(Tables):
    """Each chat's prompts, queued, taken one turn at a time, and settled: the chat mode's
    queue, and what the bot does with it besides."""

    async def queue_prompt(
        self,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
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
            # Counted, then inserted: one writer of a chat's queue at a time, or two could
            # both see room for one more.
            await self._serialize(conn, _queue_key(chat_id, thread_id))
            # The queue's length and whether this update is queued already, in one read.
            cursor = await conn.execute(
                "SELECT COUNT(*), (SELECT 1 FROM bot_prompts WHERE update_id = ?)"
                " FROM bot_prompts WHERE chat_id = ? AND thread_id = ? AND state = 'queued'",
                (update_id, chat_id, topic_key(thread_id)),
            )
            row = await cursor.fetchone()
            waiting = int(row[0]) if row else 0
            if update_id is not None and row is not None and row[1] is not None:
                return True, waiting
            if waiting >= depth:
                return False, waiting
            cursor = await conn.execute(
                "INSERT INTO bot_prompts (chat_id, thread_id, update_id, user_id, body, state,"
                " created_at) VALUES (?, ?, ?, ?, ?, 'queued', ?)"
                " ON CONFLICT (update_id) DO NOTHING RETURNING id",
                (chat_id, topic_key(thread_id), update_id, user_id, body, self._clock()),
            )
            if await cursor.fetchone() is None:  # the same update, queued from another chat
                return True, waiting
            if update_id is not None:
                await execute_later(
                    conn,
                    "UPDATE bot_inbound SET state = ?, handled_at = ? WHERE update_id = ?",
                    (InboundState.HANDLED.value, self._clock(), update_id),
                )
        return True, waiting

    async def hold_for_steering(
        self,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        *,
        update_id: int | None,
        user_id: int | None,
        body: str,
    ) -> int | None:
        """Record a message meant for the running turn (not queued for the next one).

        Returns:
            The prompt's id, or None when the update was recorded before (a replay).
        """
        async with self.db.transaction() as conn:
            cursor = await conn.execute(
                "INSERT INTO bot_prompts (chat_id, thread_id, update_id, user_id, body, state,"
                " created_at) VALUES (?, ?, ?, ?, ?, 'steering', ?)"
                " ON CONFLICT (update_id) DO NOTHING RETURNING id",
                (chat_id, topic_key(thread_id), update_id, user_id, body, self._clock()),
            )
            inserted = await cursor.fetchone()
            if inserted is None:  # recorded before: a replay
                return None
            prompt_id = int(inserted[0])
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

    async def queued_count(self, chat_id: PlaceId, thread_id: PlaceId | None) -> int:
        row = await self.db.fetchone(
            "SELECT COUNT(*) FROM bot_prompts WHERE chat_id = ? AND thread_id = ?"
            " AND state = 'queued'",
            (chat_id, topic_key(thread_id)),
        )
        return int(row[0]) if row is not None else 0

    async def take_prompt(
        self, chat_id: PlaceId, thread_id: PlaceId | None, run_id: str, seq: int
    ) -> tuple[PromptRow, int] | None:
        """Take the oldest queued prompt and record its turn as started, atomically.

        Returns:
            (the prompt, the turn's row id), or None when the queue is empty.
        """
        now = self._clock()
        async with self.db.transaction() as conn:
            # Read the oldest, then mark it taken: one taker of a chat's queue at a time,
            # or two could both take the same prompt.
            await self._serialize(conn, _queue_key(chat_id, thread_id))
            cursor = await conn.execute(
                "SELECT * FROM bot_prompts WHERE chat_id = ? AND thread_id = ? AND state = 'queued'"
                " ORDER BY id LIMIT 1",
                (chat_id, topic_key(thread_id)),
            )
            row = await cursor.fetchone()
            if row is None:
                return None
            # Updating the run's row first locks it: the next attempt goes to one writer at
            # a time (as the runs store's start_turn does), counted in the insert itself.
            # (On PostgreSQL the update goes in one round trip with the insert.)
            await execute_later(
                conn, "UPDATE runs SET turn = ?, updated_at = ? WHERE id = ?", (seq, now, run_id)
            )
            cursor = await conn.execute(
                "INSERT INTO turns (run_id, seq, attempt, phase, prompt, state, started_at)"
                " SELECT ?, ?, COALESCE(MAX(attempt), 0) + 1, NULL, ?, ?, ?"
                " FROM turns WHERE run_id = ? AND seq = ? RETURNING id, attempt",
                (run_id, seq, row["body"], TurnState.STARTED.value, now, run_id, seq),
            )
            inserted = await cursor.fetchone()
            assert inserted is not None
            turn_id = int(inserted[0])
            await execute_later(
                conn,
                "UPDATE bot_prompts SET state = 'running', run_id = ?, turn_id = ? WHERE id = ?",
                (run_id, turn_id, row["id"]),
            )
            started = turn_started(turn_id, seq, int(inserted[1]), None, row["body"])
            await add_event(conn, self.db, EventKind.TURN_STARTED, run_id=run_id, data=started)
        events_written(self.db)
        return prompt_from_row(row), turn_id

    async def commit_turn(
        self,
        prompt_id: int,
        turn_id: int,
        out: TurnOutput,
        items: Iterable[OutboxItem],
        *,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
    ) -> None:
        """One transaction: the turn's output recorded, its messages queued, the prompt done."""
        now = self._clock()
        async with self.db.transaction() as conn:
            for item in items:
                await self._insert_outbox(conn, item, now)
            await conn.execute(
                "UPDATE bot_prompts SET state = 'done', finished_at = ? WHERE id = ?",
                (now, prompt_id),
            )
            await conn.execute(
                "UPDATE bot_bindings SET turns = turns + 1 WHERE chat_id = ? AND thread_id = ?",
                (chat_id, topic_key(thread_id)),
            )
            # Last: its event takes the log's lock, held to the commit (engine.store.events).
            await finish_turn_in(conn, self.db, turn_id, out, now)
        events_written(self.db)

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
        return [prompt_from_row(r) for r in rows]

    async def requeue_steering(self) -> int:
        """Messages that were being handed to a running turn when the bot stopped wait for
        the next turn instead (whether the turn took one is not known: it is not lost)."""
        return await self.db.execute(
            "UPDATE bot_prompts SET state = 'queued' WHERE state = 'steering'"
        )

    async def drop_queued(self, chat_id: PlaceId, thread_id: PlaceId | None) -> int:
        return await self.db.execute(
            "UPDATE bot_prompts SET state = 'dropped', finished_at = ? WHERE chat_id = ?"
            " AND thread_id = ? AND state = 'queued'",
            (self._clock(), chat_id, topic_key(thread_id)),
        )

    async def chats_with_queued(self) -> list[tuple[PlaceId, PlaceId | None]]:
        rows = await self.db.fetchall(
            "SELECT DISTINCT chat_id, thread_id FROM bot_prompts WHERE state = 'queued'"
        )
        return [(str(r["chat_id"]), place_id(r["thread_id"])) for r in rows]

"""Gate messages, the reasons a Reject asks for, and the chats autopilot tasks report to."""

from __future__ import annotations

from dataclasses import replace

from chatfront.store.records import GateRecord, ReasonRequest
from chatfront.store.tables import Tables
from engine.runs.ids import RunMode
from engine.runs.spec import PlaceId, place_id

__all__ = [
    "GateMessageTables",
    "ReasonRequestTables",
    "TaskPlaceTables",
]


class GateMessageTables(Tables):
    """Which chat message shows which gate, and how the bot closed it."""

    async def add_gate(
        self,
        gate_id: str,
        *,
        task: str,
        phase: str,
        sha256: str,
        artifact_name: str,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        run_id: str | None,
    ) -> None:
        async with self.db.transaction() as conn:
            await conn.execute(
                "UPDATE bot_gates SET state = 'superseded' WHERE task = ? AND phase = ?"
                " AND state = 'open' AND gate_id != ?",
                (task, phase, gate_id),
            )
            # A gate added again (the same id) keeps its decision: who decided, when, and
            # how; only where it is shown changes. (A replace would reopen it, unsigned.)
            await conn.execute(
                "INSERT INTO bot_gates (gate_id, task, phase, sha256, artifact_name,"
                " chat_id, thread_id, run_id, state, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'open', ?) ON CONFLICT (gate_id) DO UPDATE"
                " SET chat_id = excluded.chat_id, thread_id = excluded.thread_id,"
                " run_id = excluded.run_id",
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

    async def open_gates(self, *, chat_id: PlaceId | None = None) -> list[GateRecord]:
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
            "SELECT phase, state, decided_by FROM bot_gates WHERE task = ? AND state <> 'open'"
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


class ReasonRequestTables(Tables):
    """A person asked for a rejection reason, one request per chat and person."""

    async def ask_reason(
        self, chat_id: PlaceId, user_id: int, gate_id: str, *, prompt_ref: str | None = None
    ) -> None:
        """Wait for ``user_id``'s rejection reason in ``chat_id`` (one request per pair:
        a new one replaces the old); ``prompt_ref`` is the live message that asked.

        Asked again for the same gate without a ``prompt_ref``, the request keeps the
        message that asked (a replace would forget it).
        """
        if self._asked is not None:
            self._asked.add((chat_id, user_id))
        await self.db.execute(
            "INSERT INTO bot_reason_requests"
            " (chat_id, user_id, gate_id, prompt_message_ref, created_at) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (chat_id, user_id) DO UPDATE SET gate_id = excluded.gate_id,"
            " created_at = excluded.created_at, prompt_message_ref = COALESCE("
            "excluded.prompt_message_ref, CASE WHEN bot_reason_requests.gate_id = excluded.gate_id"
            " THEN bot_reason_requests.prompt_message_ref END)",
            (chat_id, user_id, gate_id, prompt_ref, self._clock()),
        )

    async def reason_request(
        self, chat_id: PlaceId, user_id: int, *, max_age: float | None = None
    ) -> ReasonRequest | None:
        """The pending reason request of ``user_id`` in ``chat_id``, left in place.

        A request older than ``max_age`` seconds is expired: it is dropped, and returned
        once with ``expired`` set (so the question can say so).
        """
        if self._asked is None:
            await self._load_asked()
        assert self._asked is not None
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
        self, chat_id: PlaceId, user_id: int, *, gate_id: str | None = None
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

    async def _load_asked(self) -> None:
        rows = await self.db.fetchall("SELECT chat_id, user_id FROM bot_reason_requests")
        self._asked = {(str(r["chat_id"]), int(r["user_id"])) for r in rows}


class TaskPlaceTables(Tables):
    """The chat each autopilot task started from a chat reports to, read from its drives'
    own rows."""

    async def task_places(self) -> list[tuple[str, PlaceId, PlaceId | None]]:
        """Each task's place: that of its newest drive with one (its autopilot run; a
        wave's sub-task reports where its parent's drive does, so only drives of their
        own count). A drive records the place it reports to when it opens its run, and a
        drive started elsewhere (a terminal's) keeps its task's last place."""
        rows = await self.db.fetchall(
            "SELECT task, chat_id, thread_id FROM ("
            " SELECT task, chat_id, thread_id, created_at, ROW_NUMBER() OVER"
            " (PARTITION BY task ORDER BY created_at DESC, id DESC) AS newest FROM runs"
            " WHERE mode = ? AND task IS NOT NULL AND parent_id IS NULL"
            " AND chat_id IS NOT NULL"
            ") AS drives WHERE newest = 1 ORDER BY created_at, task",
            (RunMode.AUTOPILOT.value,),
        )
        return [(r["task"], str(r["chat_id"]), place_id(r["thread_id"])) for r in rows]

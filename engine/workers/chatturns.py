"""The turns of chat sessions on the workers, as stored: ``worker_chat_turns``.

The bot adds a turn (the message) and follows its row; the worker that runs it records
who ran it, in which agent session, and what came back (engine.workers.chat).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from engine.store.backend import AnyDatabase
from engine.turn import TurnOutput

__all__ = [
    "CHAT_MODE",
    "ChatTurn",
    "ChatTurnStatus",
    "ChatTurnStore",
    "chat_session_key",
    "output_from_json",
    "output_to_json",
]

#: The mode of a chat session's runs on the workers.
CHAT_MODE: Final = "chat"


def chat_session_key(session_id: str) -> str:
    """The name of a chat session's worktree and branch (as in the bot's own process)."""
    return f"chat-{session_id[:8]}"


class ChatTurnStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"
    INTERRUPTED = "interrupted"


_ENDED: Final = frozenset(
    {
        ChatTurnStatus.DONE,
        ChatTurnStatus.FAILED,
        ChatTurnStatus.STOPPED,
        ChatTurnStatus.INTERRUPTED,
    }
)


@dataclass(frozen=True, slots=True)
class ChatTurn:
    run_id: str
    seq: int
    session_key: str
    session_id: str
    resumes: bool
    model: str | None
    prompt: str
    status: ChatTurnStatus
    worker: str | None
    agent_session: str | None
    output_json: str | None
    error: str | None
    created_at: float
    # The files sent with the message (ids of worker_chat_uploads rows; see chatfiles).
    uploads: tuple[str, ...] = ()

    @property
    def ended(self) -> bool:
        return self.status in _ENDED

    @classmethod
    def from_row(cls, row: Any) -> ChatTurn:
        return cls(
            run_id=row["run_id"],
            seq=row["seq"],
            session_key=row["session_key"],
            session_id=row["session_id"],
            resumes=bool(row["resumes"]),
            model=row["model"],
            prompt=row["prompt"],
            status=ChatTurnStatus(row["status"]),
            worker=row["worker"],
            agent_session=row["agent_session"],
            output_json=row["output_json"],
            error=row["error"],
            created_at=row["created_at"],
            uploads=tuple(i for i in (row["uploads"] or "").split(",") if i),
        )


def output_to_json(out: TurnOutput) -> str:
    """A turn's output as the bot needs it (the worker's spill file stays on its disk:
    the head of the text travels, with the full size)."""
    metadata = {k: v for k, v in out.metadata.items() if _json_safe(v)}
    return json.dumps(
        {"text": out.text, "exit_code": out.exit_code, "size": out.size, "metadata": metadata}
    )


def output_from_json(text: str) -> TurnOutput:
    raw: Mapping[str, Any] = json.loads(text)
    return TurnOutput(
        text=str(raw["text"]),
        exit_code=raw.get("exit_code"),
        size=raw.get("size"),
        metadata=dict(raw.get("metadata") or {}),
    )


def _json_safe(value: object) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


class ChatTurnStore:
    """The ``worker_chat_turns`` table (portable SQL, like the workers' other tables)."""

    def __init__(self, db: AnyDatabase, *, clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self._clock = clock

    async def add(
        self,
        run_id: str,
        seq: int,
        *,
        session_key: str,
        session_id: str,
        resumes: bool,
        model: str | None,
        prompt: str,
        uploads: tuple[str, ...] = (),
    ) -> None:
        await self._db.execute(
            "INSERT INTO worker_chat_turns (run_id, seq, session_key, session_id, resumes,"
            " model, prompt, status, created_at, uploads)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                run_id,
                seq,
                session_key,
                session_id,
                int(resumes),
                model,
                prompt,
                ChatTurnStatus.QUEUED.value,
                self._clock(),
                ",".join(uploads) or None,
            ),
        )

    async def get(self, run_id: str, seq: int) -> ChatTurn | None:
        row = await self._db.fetchone(
            "SELECT * FROM worker_chat_turns WHERE run_id = ? AND seq = ?", (run_id, seq)
        )
        return ChatTurn.from_row(row) if row is not None else None

    async def next_queued(self, run_id: str) -> ChatTurn | None:
        row = await self._db.fetchone(
            "SELECT * FROM worker_chat_turns WHERE run_id = ? AND status = ? ORDER BY seq",
            (run_id, ChatTurnStatus.QUEUED.value),
        )
        return ChatTurn.from_row(row) if row is not None else None

    async def start(self, turn: ChatTurn, worker: str, agent_session: str) -> bool:
        """Queued → running on ``worker`` (compare-and-set: a stop may have come first)."""
        count = await self._db.execute(
            "UPDATE worker_chat_turns SET status = ?, worker = ?, agent_session = ?,"
            " started_at = ? WHERE run_id = ? AND seq = ? AND status = ?",
            (
                ChatTurnStatus.RUNNING.value,
                worker,
                agent_session,
                self._clock(),
                turn.run_id,
                turn.seq,
                ChatTurnStatus.QUEUED.value,
            ),
        )
        return count > 0

    async def finish(
        self,
        run_id: str,
        seq: int,
        status: ChatTurnStatus,
        *,
        output_json: str | None = None,
        error: str | None = None,
        only_from: ChatTurnStatus = ChatTurnStatus.RUNNING,
    ) -> bool:
        """End the turn (compare-and-set from ``only_from``); whether this call ended it."""
        count = await self._db.execute(
            "UPDATE worker_chat_turns SET status = ?, output_json = ?, error = ?,"
            " finished_at = ? WHERE run_id = ? AND seq = ? AND status = ?",
            (status.value, output_json, error, self._clock(), run_id, seq, only_from.value),
        )
        return count > 0

    async def interrupt(self, run_id: str, worker: str) -> int:
        """The running turns of ``run_id`` on a gone ``worker`` end interrupted."""
        return await self._db.execute(
            "UPDATE worker_chat_turns SET status = ?, error = ?, finished_at = ?"
            " WHERE run_id = ? AND worker = ? AND status = ?",
            (
                ChatTurnStatus.INTERRUPTED.value,
                f"the worker {worker} running it stopped answering",
                self._clock(),
                run_id,
                worker,
                ChatTurnStatus.RUNNING.value,
            ),
        )

    async def history(self, session_key: str, *, before: float) -> list[ChatTurn]:
        """The session's turns that ran somewhere before ``before``, newest first."""
        rows = await self._db.fetchall(
            "SELECT * FROM worker_chat_turns WHERE session_key = ? AND agent_session IS NOT NULL"
            " AND created_at <= ? ORDER BY created_at DESC, seq DESC",
            (session_key, before),
        )
        return [ChatTurn.from_row(r) for r in rows]

    async def last_worker(self, session_key: str) -> str | None:
        """The worker that ran the session's last turn (None: none ran yet)."""
        row = await self._db.fetchone(
            "SELECT worker FROM worker_chat_turns WHERE session_key = ? AND worker IS NOT NULL"
            " ORDER BY created_at DESC, seq DESC",
            (session_key,),
        )
        return row["worker"] if row is not None else None

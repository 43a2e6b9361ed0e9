"""The audit log: one append-only table for every part of the system.

The gates record approvals, refusals, transitions and turns; a front end records who
asked for what and whether it was allowed. Nothing here updates or deletes an entry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from engine.runs.spec import PlaceId

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = ["MAX_DETAIL", "AuditLog", "AuditRecord", "SqliteAuditLog"]

#: Longer details are cut: an entry is a line, not a document.
MAX_DETAIL: Final = 4000

_COLUMNS: Final = (
    "id, at, task, phase, event, outcome, actor, chat_id, update_id, sha256, detail, origin"
)


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One entry: what happened (``event``, ``outcome``), to what, by whom, from where."""

    id: int
    at: float
    task: str | None
    phase: str | None
    event: str
    outcome: str
    actor: str | None
    chat_id: PlaceId | None
    update_id: int | None
    sha256: str | None
    detail: str | None
    origin: str

    def __post_init__(self) -> None:
        # (text: SQLite hands a number back for a numeric id in its INTEGER column)
        if self.chat_id is not None:
            object.__setattr__(self, "chat_id", str(self.chat_id))


class SqliteAuditLog:
    """The audit log, on either database (SQLite or PostgreSQL)."""

    def __init__(self, db: AnyDatabase, *, clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self._clock = clock

    async def record(
        self,
        event: str,
        outcome: str,
        *,
        origin: str = "gates",
        task: str | None = None,
        phase: str | None = None,
        actor: str | None = None,
        chat_id: PlaceId | None = None,
        update_id: int | None = None,
        sha256: str | None = None,
        detail: str | None = None,
    ) -> None:
        await self._db.execute(
            *self.insert(
                event,
                outcome,
                origin=origin,
                task=task,
                phase=phase,
                actor=actor,
                chat_id=chat_id,
                update_id=update_id,
                sha256=sha256,
                detail=detail,
            )
        )

    def insert(
        self,
        event: str,
        outcome: str,
        *,
        origin: str = "gates",
        task: str | None = None,
        phase: str | None = None,
        actor: str | None = None,
        chat_id: PlaceId | None = None,
        update_id: int | None = None,
        sha256: str | None = None,
        detail: str | None = None,
    ) -> tuple[str, tuple[Any, ...]]:
        """The statement and parameters of one entry, for a caller's own transaction."""
        return (
            "INSERT INTO audit_log (at, task, phase, event, outcome, actor, chat_id, update_id,"
            " sha256, detail, origin) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                self._clock(),
                task,
                phase,
                event,
                outcome,
                actor,
                chat_id,
                update_id,
                sha256,
                detail[:MAX_DETAIL] if detail else detail,
                origin,
            ),
        )

    async def entries(
        self, *, task: str | None = None, origin: str | None = None, limit: int = 100
    ) -> list[AuditRecord]:
        """The latest ``limit`` entries (of ``task``, of ``origin``), oldest first."""
        clauses: list[str] = []
        params: list[object] = []
        if task is not None:
            clauses.append("task = ?")
            params.append(task)
        if origin is not None:
            clauses.append("origin = ?")
            params.append(origin)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = await self._db.fetch_tuples(
            f"SELECT {_COLUMNS} FROM audit_log{where} ORDER BY id DESC LIMIT ?",  # noqa: S608
            (*params, int(limit)),
        )
        return [AuditRecord(*row) for row in reversed(rows)]


#: The audit log (one implementation serves both databases).
AuditLog = SqliteAuditLog

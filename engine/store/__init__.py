"""Persistence behind interfaces; SQLite (aiosqlite, WAL) by default."""

from engine.store.database import Database, Migration, load_migrations
from engine.store.runs import (
    RunRecord,
    RunStatus,
    RunStore,
    SqliteRunStore,
    TurnRecord,
    TurnState,
)

__all__ = [
    "Database",
    "Migration",
    "RunRecord",
    "RunStatus",
    "RunStore",
    "SqliteRunStore",
    "TurnRecord",
    "TurnState",
    "load_migrations",
]

"""Persistence behind interfaces; SQLite (aiosqlite, WAL) by default."""

from engine.store.audit import AuditLog, AuditRecord, SqliteAuditLog
from engine.store.database import (
    Database,
    Migration,
    MigrationSet,
    discover_migrations,
    load_migrations,
)
from engine.store.runs import (
    RunRecord,
    RunStatus,
    RunStore,
    SqliteRunStore,
    TurnRecord,
    TurnState,
)

__all__ = [
    "AuditLog",
    "AuditRecord",
    "Database",
    "Migration",
    "MigrationSet",
    "RunRecord",
    "RunStatus",
    "RunStore",
    "SqliteAuditLog",
    "SqliteRunStore",
    "TurnRecord",
    "TurnState",
    "discover_migrations",
    "load_migrations",
]

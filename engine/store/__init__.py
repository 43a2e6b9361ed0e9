"""Persistence behind interfaces; SQLite (aiosqlite, WAL) by default, PostgreSQL for teams.

:func:`open_database` picks the backend from ``TURNSTILE_DATABASE`` (a file path or a
``postgresql://`` URL); the PostgreSQL one (:mod:`engine.store.postgres`) is loaded only then.
"""

from engine.store.audit import AuditLog, AuditRecord, SqliteAuditLog
from engine.store.backend import open_database
from engine.store.database import (
    Database,
    Migration,
    MigrationSet,
    discover_migrations,
    load_migrations,
)
from engine.store.location import PostgresURL
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
    "PostgresURL",
    "RunRecord",
    "RunStatus",
    "RunStore",
    "SqliteAuditLog",
    "SqliteRunStore",
    "TurnRecord",
    "TurnState",
    "discover_migrations",
    "load_migrations",
    "open_database",
]

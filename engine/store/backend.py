"""Pick the database behind ``TURNSTILE_DATABASE``: a SQLite file or a PostgreSQL server."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from engine.store.database import Database, MigrationSet
from engine.store.location import PostgresURL, parse_database

if TYPE_CHECKING:
    from engine.store.postgres import PostgresDatabase

__all__ = ["AnyDatabase", "execute_later", "open_database"]

#: What the stores take: either backend, with one interface.
AnyDatabase: TypeAlias = "Database | PostgresDatabase"


def open_database(
    target: Any,
    *,
    migrations: Sequence[MigrationSet] | None = None,
    synchronous: str = "FULL",
) -> Database | PostgresDatabase:
    """The database for ``target``: settings (their ``database``), a path, or a URL.

    Nothing is reached yet: use the result as an async context manager (``async with``),
    which connects and migrates. ``synchronous`` applies to SQLite only.
    """
    # Settings carry it as ``database``; a PostgresURL also has a ``database`` (its name).
    where = target if isinstance(target, str | Path | PostgresURL) else target.database
    location = parse_database(where)
    if isinstance(location, PostgresURL):
        from engine.store.postgres import PostgresDatabase  # psycopg only when asked for

        return PostgresDatabase(location, migrations=migrations)
    return Database(location, migrations=migrations, synchronous=synchronous)


async def execute_later(conn: Any, sql: str, parameters: Sequence[Any] = ()) -> None:
    """Run ``sql`` in the transaction ``conn``, its result unread (a write, a lock).

    On PostgreSQL it goes to the server with the transaction's next statement or with its
    COMMIT, in one round trip (:meth:`engine.store.postgres.PgConnection.later`); an error
    it raises fails the transaction there. On SQLite, where nothing crosses a network, it
    runs now.
    """
    later = getattr(conn, "later", None)
    if later is not None:
        later(sql, parameters)
    else:
        await conn.execute(sql, parameters)

"""Pick the database behind ``TURNSTILE_DATABASE``: a SQLite file or a PostgreSQL server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from engine.aio import raise_if_cancelled
from engine.errors import StoreUnreachableError
from engine.store.database import Database, MigrationSet
from engine.store.location import PostgresURL, parse_database

if TYPE_CHECKING:
    from engine.store.postgres import PostgresDatabase

__all__ = ["AnyDatabase", "execute_later", "open_database", "wait_reachable"]

_LOGGER = logging.getLogger(__name__)

#: What the stores take: either backend, with one interface.
AnyDatabase: TypeAlias = "Database | PostgresDatabase"


def open_database(
    target: Any,
    *,
    migrations: Sequence[MigrationSet] | None = None,
    synchronous: str = "FULL",
    pooled: bool = True,
) -> Database | PostgresDatabase:
    """The database for ``target``: settings (their ``database``), a path, or a URL.

    Nothing is reached yet: use the result as an async context manager (``async with``),
    which connects and migrates. ``synchronous`` applies to SQLite only; ``pooled=False``
    (PostgreSQL) works on one connection, for a short command that asks one thing at a time.
    """
    # Settings carry it as ``database``; a PostgresURL also has a ``database`` (its name).
    where = target if isinstance(target, str | Path | PostgresURL) else target.database
    location = parse_database(where)
    if isinstance(location, PostgresURL):
        from engine.store.postgres import PostgresDatabase  # psycopg only when asked for

        return PostgresDatabase(location, migrations=migrations, pooled=pooled)
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


async def wait_reachable(db: AnyDatabase, *, first: float = 0.5, most: float = 10.0) -> None:
    """Return once ``db`` answers a query: at once when it does, else after trying again
    ``first`` seconds later, then twice as long each time up to ``most`` apart, for as
    long as an outage lasts (cancel it to give up). A SQLite file answers at once.

    Raises:
        StoreUnreachableError: the server refuses the login (waiting would not help).
    """
    delay = first
    said = False
    while True:
        try:
            await db.fetchone("SELECT 1")
        except StoreUnreachableError as exc:
            if not exc.retryable:
                raise
            raise_if_cancelled()
            if not said:
                _LOGGER.warning("waiting for the database to come back: %s", exc)
                said = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, most)
            continue
        if said:
            _LOGGER.info("the database is back")
        return

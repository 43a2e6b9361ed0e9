"""Statements whose result nobody reads go with the transaction's next statement.

``execute_later`` (a write, a lock) is sent on PostgreSQL in one pipeline with the next
statement or with the COMMIT, a round trip less each; on SQLite it runs at once. Either
way the transaction is what it was: the statements run in order, a failing one fails
the whole transaction and nothing of it is written, and the connection is clean after.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest

from engine.errors import StoreError
from engine.store.backend import execute_later
from tests.pg_support import PgCluster

# A statement's error inside a transaction: the driver's own on SQLite (as for any
# statement there), the store's on PostgreSQL.
_FAILED = (StoreError, sqlite3.Error)


async def _table(db: Any) -> None:
    await db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL)")


async def _values(db: Any) -> list[tuple[int, str]]:
    return [(int(r[0]), str(r[1])) for r in await db.fetchall("SELECT id, v FROM t ORDER BY id")]


async def test_later_statements_run_in_order_before_the_next_one(database: Any) -> None:
    await _table(database)
    async with database.transaction() as conn:
        await execute_later(conn, "INSERT INTO t (id, v) VALUES (?, ?)", (1, "a"))
        await execute_later(conn, "UPDATE t SET v = ? WHERE id = ?", ("b", 1))
        cursor = await conn.execute("SELECT v FROM t WHERE id = ?", (1,))
        assert (await cursor.fetchone())[0] == "b"
        await execute_later(conn, "INSERT INTO t (id, v) VALUES (?, ?)", (2, "c"))
    # The last one went with the COMMIT.
    assert await _values(database) == [(1, "b"), (2, "c")]


async def test_a_transaction_of_later_statements_only_commits(database: Any) -> None:
    await _table(database)
    async with database.transaction() as conn:
        await execute_later(conn, "INSERT INTO t (id, v) VALUES (?, ?)", (1, "a"))
        await execute_later(conn, "INSERT INTO t (id, v) VALUES (?, ?)", (2, "b"))
    assert await _values(database) == [(1, "a"), (2, "b")]


async def test_a_failing_later_statement_fails_the_commit_and_writes_nothing(
    database: Any,
) -> None:
    await _table(database)
    await database.execute("INSERT INTO t (id, v) VALUES (?, ?)", (1, "old"))

    async def clash() -> None:
        async with database.transaction() as conn:
            await conn.execute("UPDATE t SET v = ? WHERE id = ?", ("new", 1))
            await execute_later(conn, "INSERT INTO t (id, v) VALUES (?, ?)", (2, "x"))
            await execute_later(conn, "INSERT INTO t (id, v) VALUES (?, ?)", (1, "dup"))

    with pytest.raises(_FAILED):
        await clash()
    assert await _values(database) == [(1, "old")]
    # Every connection of the pool is usable after (none left in a failed transaction).
    for _ in range(3):
        async with database.transaction() as conn:
            await execute_later(conn, "UPDATE t SET v = v || ? WHERE id = ?", ("+", 1))
    assert await _values(database) == [(1, "old+++")]


async def test_a_failing_later_statement_fails_the_next_statement(database: Any) -> None:
    await _table(database)

    async def null() -> None:
        async with database.transaction() as conn:
            await execute_later(conn, "INSERT INTO t (id, v) VALUES (?, ?)", (1, None))
            await conn.execute("INSERT INTO t (id, v) VALUES (?, ?)", (2, "b"))

    with pytest.raises(_FAILED):
        await null()
    assert await _values(database) == []


async def test_later_statements_survive_a_connection_dropped_while_idle(
    pg_cluster: PgCluster, pg_url: str
) -> None:
    """Queued before anything reached the server, they are sent again on a fresh one."""
    import psycopg

    from engine.store.backend import open_database
    from engine.store.location import PostgresURL

    async with open_database(PostgresURL(pg_url)) as db:
        await _table(db)
        name = pg_url.rsplit("/", 1)[1]
        with psycopg.connect(pg_cluster.url(), autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
        async with db.transaction() as conn:
            await execute_later(conn, "INSERT INTO t (id, v) VALUES (?, ?)", (1, "a"))
            cursor = await conn.execute("SELECT count(*) FROM t")
            assert (await cursor.fetchone())[0] == 1
        assert await _values(db) == [(1, "a")]

"""A pool connection the server dropped while it sat idle is replaced, nothing lost.

The pool does not check a connection each time it hands one out (a round trip per
operation): the first statement on a dropped one fails before anything was written, and
goes again on a fresh connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.errors import StoreError
from engine.store.backend import open_database
from engine.store.leases import database_lock
from engine.store.location import PostgresURL
from engine.store.postgres import PostgresDatabase
from tests.pg_support import PgCluster


def _drop_idle_connections(cluster: PgCluster, url: str) -> int:
    name = url.rsplit("/", 1)[1]
    import psycopg

    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        ).fetchall()
    return len(rows)


async def _open(url: str) -> Any:
    db = open_database(PostgresURL(url))
    assert isinstance(db, PostgresDatabase)
    return db


async def test_reads_writes_and_locks_survive_dropped_idle_connections(
    pg_cluster: PgCluster, pg_url: str
) -> None:
    async with await _open(pg_url) as db:
        await db.execute("CREATE TABLE t (id BIGINT PRIMARY KEY, v TEXT)")
        await db.execute("INSERT INTO t (id, v) VALUES (?, ?)", (1, "a"))

        assert _drop_idle_connections(pg_cluster, pg_url) >= 1
        row = await db.fetchone("SELECT v FROM t WHERE id = ?", (1,))
        assert row is not None
        assert row["v"] == "a"

        assert _drop_idle_connections(pg_cluster, pg_url) >= 1
        async with db.transaction() as conn:
            cursor = await conn.execute("SELECT v FROM t WHERE id = ?" + db.for_update, (1,))
            assert (await cursor.fetchone())[0] == "a"
            changed = await conn.execute("UPDATE t SET v = ? WHERE id = ?", ("b", 1))
            assert changed.rowcount == 1

        assert _drop_idle_connections(pg_cluster, pg_url) >= 1
        assert await db.execute("UPDATE t SET v = ? WHERE id = ?", ("c", 1)) == 1

        assert _drop_idle_connections(pg_cluster, pg_url) >= 1
        lock = database_lock(db, "x", pg_cluster.folder / "unused", brief=True)
        await lock.acquire()
        assert lock.held
        await lock.release()

        rows = await db.fetch_tuples("SELECT id, v FROM t")
        assert rows == [(1, "c")]


async def test_a_failed_statement_rolls_the_transaction_back(pg_url: str) -> None:
    async with await _open(pg_url) as db:
        await db.execute("CREATE TABLE t (id BIGINT PRIMARY KEY)")
        await db.execute("INSERT INTO t (id) VALUES (?)", (1,))
        with pytest.raises(StoreError, match="duplicate"):
            await _insert_two(db, 2, 1)  # the second one is a duplicate
        assert await db.fetch_tuples("SELECT id FROM t ORDER BY id") == [(1,)]
        # The pool's connection is clean again: the next transaction commits.
        async with db.transaction() as conn:
            await conn.execute("INSERT INTO t (id) VALUES (?)", (3,))
        assert await db.fetch_tuples("SELECT id FROM t ORDER BY id") == [(1,), (3,)]


async def _insert_two(db: Any, first: int, second: int) -> None:
    async with db.transaction() as conn:
        await conn.execute("INSERT INTO t (id) VALUES (?)", (first,))
        await conn.execute("INSERT INTO t (id) VALUES (?)", (second,))


def _backends(cluster: PgCluster, url: str) -> int:
    name = url.rsplit("/", 1)[1]
    import psycopg

    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        ).fetchone()
    assert row is not None
    return int(row[0])


async def test_a_short_command_s_one_connection_survives_being_dropped(
    pg_cluster: PgCluster, pg_url: str
) -> None:
    # A listing's database: one connection, no pool (and none of the pool's module).
    db = open_database(PostgresURL(pg_url), pooled=False)
    assert isinstance(db, PostgresDatabase)
    async with db:
        await db.execute("CREATE TABLE t (id BIGINT PRIMARY KEY, v TEXT)")
        await db.execute("INSERT INTO t (id, v) VALUES (?, ?)", (1, "a"))
        assert _backends(pg_cluster, pg_url) == 1  # the connection that checked the server
        assert _drop_idle_connections(pg_cluster, pg_url) == 1
        row = await db.fetchone("SELECT v FROM t WHERE id = ?", (1,))
        assert row is not None
        assert row["v"] == "a"
        assert _drop_idle_connections(pg_cluster, pg_url) == 1
        async with db.transaction() as conn:
            changed = await conn.execute("UPDATE t SET v = ? WHERE id = ?", ("b", 1))
            assert changed.rowcount == 1
        # Two callers at once take turns on it.
        rows = await asyncio.gather(*(db.fetchone("SELECT v FROM t") for _ in range(5)))
        assert [r["v"] for r in rows if r is not None] == ["b"] * 5
        assert _backends(pg_cluster, pg_url) == 1
    assert _backends(pg_cluster, pg_url) == 0

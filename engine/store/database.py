"""The SQLite database: one file, WAL, numbered migrations, one writer.

Domain stores (runs, tasks, outbox, ...) take a :class:`Database` and keep their SQL
portable: plain ``?`` parameters, no SQLite-only functions in queries, so that a
PostgreSQL implementation can stand behind the same store interfaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sqlite3
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiosqlite

from engine.errors import StoreError

__all__ = ["Database", "Migration", "load_migrations"]

_LOGGER = logging.getLogger(__name__)
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    """One numbered schema step."""

    version: int
    name: str
    statements: tuple[str, ...]


def load_migrations() -> tuple[Migration, ...]:
    """The migrations shipped in ``engine/store/migrations`` (``NNNN_name.sql``), in order."""
    found: list[Migration] = []
    folder = resources.files("engine.store") / "migrations"
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if match is None:
            continue
        text = entry.read_text(encoding="utf-8")
        statements = tuple(s.strip() for s in text.split(";\n") if _has_sql(s))
        found.append(Migration(int(match.group(1)), match.group(2), statements))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise StoreError(f"duplicate migration numbers: {versions}")
    return tuple(found)


def _has_sql(chunk: str) -> bool:
    return any(line.strip() and not line.strip().startswith("--") for line in chunk.splitlines())


class Database:
    """An async SQLite connection with a single-writer discipline.

    Use as an async context manager. Writes go through :meth:`transaction`
    (``BEGIN IMMEDIATE``), so a compare-and-set inside one is atomic across processes.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        migrations: Sequence[Migration] | None = None,
        synchronous: str = "FULL",
        busy_timeout_ms: int = 10_000,
    ) -> None:
        self.path = Path(path)
        self._migrations = tuple(migrations) if migrations is not None else load_migrations()
        self._synchronous = synchronous
        self._busy_timeout_ms = busy_timeout_ms
        self._conn: aiosqlite.Connection | None = None
        self._write_lock = asyncio.Lock()

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def open(self) -> None:
        if self._conn is not None:
            return
        try:
            if self.path.parent and not self.path.parent.exists():
                self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = await aiosqlite.connect(self.path, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open database {self.path}: {exc}") from exc
        try:
            conn.row_factory = aiosqlite.Row
            await conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
            await conn.execute("PRAGMA journal_mode = WAL")
            await conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            await conn.execute("PRAGMA foreign_keys = ON")
            self._conn = conn
            await self._migrate()
        except BaseException:
            self._conn = None
            await conn.close()
            raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    @property
    def conn(self) -> aiosqlite.Connection:
        if self._conn is None:
            raise StoreError("database is not open")
        return self._conn

    async def schema_version(self) -> int:
        row = await self.fetchone("PRAGMA user_version")
        return int(row[0]) if row is not None else 0

    @property
    def latest_version(self) -> int:
        return self._migrations[-1].version if self._migrations else 0

    async def _migrate(self) -> None:
        async with self.transaction() as conn:
            cursor = await conn.execute("PRAGMA user_version")
            row = await cursor.fetchone()
            current = int(row[0]) if row else 0
            for migration in self._migrations:
                if migration.version <= current:
                    continue
                _LOGGER.info("applying migration %04d_%s", migration.version, migration.name)
                for statement in migration.statements:
                    await conn.execute(statement)
                await conn.execute(f"PRAGMA user_version = {int(migration.version)}")

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``); commits on success, rolls back on error."""
        conn = self.conn
        async with self._write_lock:
            try:
                await conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreError(f"cannot begin a transaction: {exc}") from exc
            except asyncio.CancelledError:
                # aiosqlite runs the BEGIN in its thread all the same: undo it before the
                # lock is released, or every later BEGIN fails "within a transaction".
                with contextlib.suppress(sqlite3.Error):
                    await asyncio.shield(conn.execute("ROLLBACK"))
                raise
            try:
                yield conn
            except BaseException:
                await conn.execute("ROLLBACK")
                raise
            else:
                try:
                    await conn.execute("COMMIT")
                except sqlite3.Error as exc:
                    await conn.execute("ROLLBACK")
                    raise StoreError(f"commit failed: {exc}") from exc

    async def execute(self, sql: str, params: Iterable[Any] = ()) -> int:
        """Run one write statement in its own transaction; return the rows changed."""
        async with self.transaction() as conn:
            cursor = await conn.execute(sql, tuple(params))
            return cursor.rowcount

    async def fetchall(self, sql: str, params: Iterable[Any] = ()) -> list[aiosqlite.Row]:
        try:
            cursor = await self.conn.execute(sql, tuple(params))
            rows = await cursor.fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"query failed: {exc}") from exc
        return list(rows)

    async def fetch_tuples(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        """Like :meth:`fetchall` with plain tuples: for listings of thousands of rows."""
        try:
            cursor = await self.conn.execute(sql, tuple(params))
            cursor.row_factory = None
            rows: list[tuple[Any, ...]] = await cursor.fetchall()  # type: ignore[assignment]
        except sqlite3.Error as exc:
            raise StoreError(f"query failed: {exc}") from exc
        return rows

    async def fetchone(self, sql: str, params: Iterable[Any] = ()) -> aiosqlite.Row | None:
        try:
            cursor = await self.conn.execute(sql, tuple(params))
            return await cursor.fetchone()
        except sqlite3.Error as exc:
            raise StoreError(f"query failed: {exc}") from exc

    async def backup(self, target: Path) -> None:
        """A consistent copy of the database while it is in use (SQLite online backup)."""
        target.parent.mkdir(parents=True, exist_ok=True)
        dest = await aiosqlite.connect(target)
        try:
            await self.conn.backup(dest)
        finally:
            await dest.close()

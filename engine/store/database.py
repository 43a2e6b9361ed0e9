"""The SQLite database: one file, WAL, numbered migrations per owner, one writer.

Domain stores (runs, tasks, outbox, ...) take a :class:`Database` and keep their SQL
portable: plain ``?`` parameters, no SQLite-only functions in queries, so that a
PostgreSQL implementation can stand behind the same store interfaces.

Each owner of tables brings its own numbered migrations: the engine's ship in
``engine/store/migrations``; a front end registers a :class:`MigrationSet` factory under
the ``turnstile.migrations`` entry-point group (the bot does), so the engine never names
the front end's tables. The engine's version is ``PRAGMA user_version`` (as it always
was, so backups and older tools read it unchanged); every other owner's version is a row
of ``schema_versions``. Until owners had their own migrations there was one sequence; a
front end whose migrations were in it says which engine versions they were
(:attr:`MigrationSet.adopted`), and a database from then is read as at those versions,
not migrated twice. ``schema_split`` records the engine version at which a database got
``schema_versions``, so a front end installed later is adopted the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import sqlite3
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import aiosqlite

from engine.aio import OpenedAndClosed
from engine.errors import StoreError, StoreReadOnlyError
from engine.store.dialect import runs_on

__all__ = [
    "ENGINE",
    "Database",
    "Migration",
    "MigrationSet",
    "discover_migrations",
    "load_migrations",
    "read_schema_versions",
    "resolve_versions",
]

_LOGGER = logging.getLogger(__name__)
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_OWNER = re.compile(r"^[a-z][a-z0-9_]*$")
ENGINE = "engine"
ENTRY_POINT_GROUP = "turnstile.migrations"
# Created by the database itself, not by a migration: they say which migrations ran.
_BOOKKEEPING = (
    "CREATE TABLE IF NOT EXISTS schema_versions (owner TEXT PRIMARY KEY, version INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS schema_split (engine_version INTEGER NOT NULL)",
)


@dataclass(frozen=True, slots=True)
class Migration:
    """One numbered schema step."""

    version: int
    name: str
    statements: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class MigrationSet:
    """One owner's migrations, in order.

    Attributes:
        owner: who owns the tables (``engine``, ``bot``); the key of its version.
        adopted: ``(own version, engine version)`` pairs: this owner's migration was, before
            owners had their own, the engine's migration of that number.
    """

    owner: str
    migrations: tuple[Migration, ...]
    adopted: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not _OWNER.match(self.owner):
            raise StoreError(f"invalid migration owner {self.owner!r}")
        versions = [m.version for m in self.migrations]
        if versions != sorted(set(versions)):
            raise StoreError(f"{self.owner}: migrations out of order or duplicated: {versions}")

    @property
    def latest(self) -> int:
        return self.migrations[-1].version if self.migrations else 0

    def adopted_version(self, engine_version: int) -> int:
        """This owner's version in a database whose single sequence was at ``engine_version``."""
        return max((own for own, old in self.adopted if old <= engine_version), default=0)


def load_migrations(
    package: str = "engine.store", folder: str = "migrations"
) -> tuple[Migration, ...]:
    """The migrations (``NNNN_name.sql``) in ``folder`` of ``package``, in order."""
    found: list[Migration] = []
    for entry in (resources.files(package) / folder).iterdir():
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


def discover_migrations() -> tuple[MigrationSet, ...]:
    """The engine's migrations, then each registered front end's (by entry-point name)."""
    return (MigrationSet(ENGINE, load_migrations()), *_registered())


@functools.cache
def _registered() -> tuple[MigrationSet, ...]:
    # Cached: entry points and package files do not change while the process runs.
    from importlib.metadata import entry_points  # start-up time: only when a database opens

    found = []
    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda p: p.name):
        schema = point.load()()
        if not isinstance(schema, MigrationSet) or schema.owner == ENGINE:
            raise StoreError(f"entry point {point.name!r} gives no front-end migrations")
        found.append(schema)
    owners = [s.owner for s in found]
    if len(set(owners)) != len(owners):
        raise StoreError(f"two front ends own the same tables: {owners}")
    return tuple(found)


def resolve_versions(
    schemas: Iterable[MigrationSet],
    *,
    engine_version: int,
    split: int | None,
    rows: Mapping[str, int],
) -> dict[str, int]:
    """Each owner's schema version in a database.

    Args:
        engine_version: the database's ``PRAGMA user_version``.
        split: the engine version recorded in ``schema_split``; None when the database
            has no ``schema_versions`` yet (then it is at ``engine_version`` for all).
        rows: the ``schema_versions`` rows.
    """
    base = engine_version if split is None else split
    versions = {ENGINE: engine_version}
    for schema in schemas:
        if schema.owner != ENGINE:
            versions[schema.owner] = rows.get(schema.owner, schema.adopted_version(base))
    return versions


def read_schema_versions(
    path: Path, schemas: Iterable[MigrationSet] | None = None
) -> dict[str, int]:
    """Each owner's schema version of the database at ``path``, read-only (blocking).

    Never creates, migrates or locks the file: the doctor reads what the bot is using.

    Raises:
        sqlite3.Error: the file cannot be read as a database.
    """
    conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=5.0)
    try:
        tables = {
            str(r[0]) for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        engine_version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        split: int | None = None
        rows: dict[str, int] = {}
        if "schema_split" in tables:
            row = conn.execute("SELECT engine_version FROM schema_split").fetchone()
            split = int(row[0]) if row is not None else engine_version
            rows = {
                str(r[0]): int(r[1])
                for r in conn.execute("SELECT owner, version FROM schema_versions")
            }
    finally:
        conn.close()
    return resolve_versions(
        discover_migrations() if schemas is None else schemas,
        engine_version=engine_version,
        split=split,
        rows=rows,
    )


def _has_sql(chunk: str) -> bool:
    return any(line.strip() and not line.strip().startswith("--") for line in chunk.splitlines())


async def _engine_version(conn: Any) -> tuple[int, bool]:
    """The engine's schema version (``PRAGMA user_version``), and whether the owners'
    bookkeeping (``schema_split``) exists yet."""
    cursor = await conn.execute("PRAGMA user_version")
    row = await cursor.fetchone()
    current = int(row[0]) if row else 0
    cursor = await conn.execute(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'schema_split'"
    )
    row = await cursor.fetchone()
    return current, bool(row and row[0])


class Database(OpenedAndClosed):
    """An async SQLite connection with a single-writer discipline.

    Use as an async context manager. Writes go through :meth:`transaction`
    (``BEGIN IMMEDIATE``), so a compare-and-set inside one is atomic across processes.
    """

    dialect = "sqlite"
    #: ``BEGIN IMMEDIATE`` already holds every row a transaction reads: no row locks.
    for_update = ""

    def __init__(
        self,
        path: Path | str,
        *,
        migrations: Sequence[MigrationSet] | None = None,
        synchronous: str = "FULL",
        busy_timeout_ms: int = 10_000,
    ) -> None:
        self.path = Path(path)
        self._schemas = tuple(migrations) if migrations is not None else discover_migrations()
        if [s.owner for s in self._schemas].count(ENGINE) != 1:
            raise StoreError("the migrations must include the engine's, once")
        self._synchronous = synchronous
        self._busy_timeout_ms = busy_timeout_ms
        self._conn: aiosqlite.Connection | None = None
        self._write_lock = asyncio.Lock()

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
        except sqlite3.Error as exc:
            self._conn = None
            await conn.close()
            raise StoreError(f"cannot open database {self.path}: {exc}") from exc
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
        """The engine's schema version."""
        row = await self.fetchone("PRAGMA user_version")
        return int(row[0]) if row is not None else 0

    async def schema_versions(self) -> dict[str, int]:
        """Each owner's schema version (the engine's and every front end's)."""
        engine_version = await self.schema_version()
        split = await self.fetchone("SELECT engine_version FROM schema_split")
        rows = await self.fetchall("SELECT owner, version FROM schema_versions")
        return resolve_versions(
            self._schemas,
            engine_version=engine_version,
            split=int(split[0]) if split is not None else None,
            rows={str(r[0]): int(r[1]) for r in rows},
        )

    @property
    def latest_version(self) -> int:
        """The engine's latest schema version."""
        return self.latest_versions[ENGINE]

    @property
    def latest_versions(self) -> dict[str, int]:
        """Each owner's latest schema version, as this code knows them."""
        return {s.owner: s.latest for s in self._schemas}

    async def _is_current(self) -> bool:
        """Whether opening has nothing to write: every owner's schema is at (or past) the
        latest this code knows, its version recorded. Plain reads, no write lock: a
        listing does not wait behind a writer for a check that finds nothing to do."""
        conn = self.conn
        current, split = await _engine_version(conn)
        if not split:
            return False
        cursor = await conn.execute("SELECT owner, version FROM schema_versions")
        rows = {str(r[0]): int(r[1]) for r in await cursor.fetchall()}
        for schema in self._schemas:
            done = current if schema.owner == ENGINE else rows.get(schema.owner)
            if done is None or done < schema.latest:
                return False
        return True

    async def _migrate(self) -> None:
        if await self._is_current():
            return
        async with self.transaction() as conn:
            current, split_recorded = await _engine_version(conn)
            if not split_recorded:
                for statement in _BOOKKEEPING:
                    await conn.execute(statement)
                # Before this database had owners, its one sequence was at ``current``.
                await conn.execute(
                    "INSERT INTO schema_split (engine_version) VALUES (?)", (current,)
                )
            cursor = await conn.execute("SELECT engine_version FROM schema_split")
            row = await cursor.fetchone()
            split = int(row[0]) if row else current
            cursor = await conn.execute("SELECT owner, version FROM schema_versions")
            rows = {str(r[0]): int(r[1]) for r in await cursor.fetchall()}
            versions = resolve_versions(
                self._schemas, engine_version=current, split=split, rows=rows
            )
            for schema in self._schemas:
                done = versions[schema.owner]
                for migration in schema.migrations:
                    if migration.version <= done:
                        continue
                    _LOGGER.debug(
                        "applying migration %s %04d_%s",
                        schema.owner,
                        migration.version,
                        migration.name,
                    )
                    for statement in migration.statements:
                        if runs_on(statement, "sqlite"):
                            await conn.execute(statement)
                    done = migration.version
                if schema.owner == ENGINE:
                    if done != current:
                        await conn.execute(f"PRAGMA user_version = {int(done)}")
                elif rows.get(schema.owner) != done:
                    await conn.execute(
                        "INSERT INTO schema_versions (owner, version) VALUES (?, ?) "
                        "ON CONFLICT (owner) DO UPDATE SET version = excluded.version",
                        (schema.owner, done),
                    )

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

    async def ensure_writable(self) -> None:
        """Fail now, with one clear error, when the database cannot be written.

        SQLite opens a file it may not write read-only without a word (a file mode, an
        immutable flag, a read-only mount) and only the first write fails. The probe
        rewrites the schema version inside a transaction it rolls back: nothing changes.

        Raises:
            StoreReadOnlyError: the database (or its folder, for the WAL files) refuses writes.
        """
        conn = self.conn
        async with self._write_lock:
            try:
                await conn.execute("BEGIN IMMEDIATE")
                try:
                    cursor = await conn.execute("PRAGMA user_version")
                    row = await cursor.fetchone()
                    await conn.execute(f"PRAGMA user_version = {int(row[0]) if row else 0}")
                finally:
                    with contextlib.suppress(sqlite3.Error):
                        await asyncio.shield(conn.execute("ROLLBACK"))
            except sqlite3.Error as exc:
                raise StoreReadOnlyError(
                    f"the database {self.path} cannot be written ({exc}): make the file and "
                    "its folder writable for the user running turnstile, or point "
                    "TURNSTILE_DATABASE elsewhere",
                    path=str(self.path),
                ) from exc

    async def backup(self, target: Path) -> None:
        """A consistent copy of the database while it is in use (SQLite online backup)."""
        target.parent.mkdir(parents=True, exist_ok=True)
        dest = await aiosqlite.connect(target)
        try:
            await self.conn.backup(dest)
        finally:
            await dest.close()

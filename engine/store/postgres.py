"""The PostgreSQL database: the same interface as the SQLite :class:`Database`.

psycopg 3 (async) with its connection pool. The stores' SQL is written once, with ``?``
parameters; :mod:`engine.store.dialect` turns it into psycopg's form, and rows answer to
``row["name"]`` and ``row[0]`` as SQLite's do, so a store that keeps to portable SQL runs
here unchanged.

What differs from SQLite, and how it is kept equal:

- A SQLite write transaction (``BEGIN IMMEDIATE``) holds the whole database; here
  transactions are READ COMMITTED and run side by side. A store whose transaction reads
  and then writes on what it read locks the rows it reads (:attr:`for_update`), or writes
  with ``INSERT … ON CONFLICT``.
- There is no ``PRAGMA user_version``: every owner's version, the engine's too, is a row
  of ``schema_versions``. Migrations run under a transaction-level advisory lock, so two
  processes starting on an empty database migrate it once.
- A database migrated by a newer turnstile is refused on open (:class:`SchemaTooNewError`).

Long: one connection wrapper with its pool, the reconnect-once rule, the pipelined
statements and the error mapping; they share the connection's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, Protocol

import psycopg
from psycopg import sql
from psycopg.rows import RowMaker, tuple_row

from engine.aio import OpenedAndClosed
from engine.errors import SchemaTooNewError, StoreError, StoreUnreachableError
from engine.store.database import (
    ENGINE,
    MigrationSet,
    discover_migrations,
    resolve_versions,
)
from engine.store.dialect import postgres_ddl, postgres_query, runs_on
from engine.store.location import PostgresURL

__all__ = ["PgConnection", "PgCursor", "PostgresDatabase", "Row"]

_LOGGER = logging.getLogger(__name__)
# While the server is away the pool logs every failed reconnect (a warning of several lines
# each); the store's own error says it once, with the reason.
logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
#: How often a transaction's first statement is tried on fresh connections when the server
#: dropped the one it had (nothing of the transaction was written yet).
_FRESH_TRIES: Final = 3
# pg_advisory_xact_lock key of the migrations ("trnstl" in ASCII).
_MIGRATION_LOCK: Final = 0x74726E73746C
_BOOKKEEPING: Final = (
    "CREATE TABLE IF NOT EXISTS schema_versions (owner TEXT PRIMARY KEY, version BIGINT NOT NULL)",
)


class Row:
    """One result row: by column name (``row["id"]``) or position (``row[0]``)."""

    __slots__ = ("_index", "_values")

    def __init__(self, values: Sequence[Any], index: dict[str, int]) -> None:
        self._values = values
        self._index = index

    def __getitem__(self, key: int | str) -> Any:
        if isinstance(key, str):
            try:
                return self._values[self._index[key]]
            except KeyError:
                raise IndexError(f"no column {key!r}") from None
        return self._values[key]

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def keys(self) -> list[str]:
        return list(self._index)

    def __repr__(self) -> str:
        return f"Row({dict(zip(self._index, self._values, strict=True))!r})"


def _row_factory(cursor: Any) -> RowMaker[Row]:
    names = [c.name for c in cursor.description or ()]
    index = {name: i for i, name in reversed(list(enumerate(names)))}

    def make(values: Sequence[Any]) -> Row:
        return Row(values, index)

    return make


def _translate(exc: psycopg.Error, conn: psycopg.AsyncConnection[Any], where: str) -> StoreError:
    """Ours for the driver's: a lost connection, or a statement that failed."""
    if conn.broken or conn.closed:
        return StoreUnreachableError(
            f"lost the connection to the PostgreSQL database {where}: {_one_line(exc)}",
            target=where,
        )
    return StoreError(f"query failed: {_one_line(exc)}")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class PgCursor:
    """What :meth:`PgConnection.execute` returns: the rows changed, and the rows read."""

    def __init__(self, cursor: psycopg.AsyncCursor[Row], where: str) -> None:
        self._cursor = cursor
        self._where = where

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    async def fetchone(self) -> Row | None:
        try:
            return await self._cursor.fetchone()
        except psycopg.Error as exc:
            raise _translate(exc, self._cursor.connection, self._where) from exc

    async def fetchall(self) -> list[Row]:
        try:
            return await self._cursor.fetchall()
        except psycopg.Error as exc:
            raise _translate(exc, self._cursor.connection, self._where) from exc


class PgConnection:
    """One connection inside a transaction, taking the stores' ``?`` SQL.

    ``BEGIN`` is not a round trip of its own: it goes in one pipeline with the first
    statement. A connection the server dropped while it sat in the pool fails there, before
    anything of the transaction was written, and is swapped once for a fresh one.

    Args:
        where: the database, as it may be shown (password redacted), for error texts.
        database: hands out the fresh connection; None for a connection outside the pool.
    """

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        where: str,
        *,
        database: PostgresDatabase | None = None,
        begin: bool = False,
    ) -> None:
        self.conn = conn
        self._where = where
        self._database = database
        self._begin = begin
        #: A statement of the transaction went to the server: it must end (COMMIT/ROLLBACK).
        self.begun = False
        #: ``conn`` is the pool's, to give back when the transaction ends.
        self.lent = True
        #: Statements of :meth:`later`, not sent yet: they go with the next statement.
        self._later: list[tuple[Any, tuple[Any, ...]]] = []

    def later(self, sql: str, parameters: Iterable[Any] | None = None) -> None:
        """Queue a statement whose result nobody reads (an UPDATE, an INSERT, a lock).

        It reaches the server in one pipeline with the transaction's next statement, or
        with its COMMIT: a round trip less each (on a busy machine a round trip is a
        wake-up of the server and one of this process, a millisecond or more). The server
        runs it in its place, in order; an error it raises fails that next statement, or
        the COMMIT, and the transaction is rolled back.
        """
        if not self._begin:
            raise StoreError("later() is for statements inside a transaction")
        self._later.append((postgres_query(sql), tuple(parameters or ())))

    @property
    def pending(self) -> bool:
        """Statements of :meth:`later` wait to be sent."""
        return bool(self._later)

    async def execute(self, sql: str, parameters: Iterable[Any] | None = None) -> PgCursor:
        query, params = postgres_query(sql), tuple(parameters or ())
        if not self._begin or (self.begun and not self._later):
            cursor = self.conn.cursor(row_factory=_row_factory)
            try:
                await cursor.execute(query, params)
            except psycopg.Error as exc:
                raise _translate(exc, self.conn, self._where) from exc
            return PgCursor(cursor, self._where)
        if self.begun:
            return await self._pipelined(query, params)
        for _ in range(_FRESH_TRIES - 1):
            try:
                return await self._pipelined(query, params)
            except StoreUnreachableError:
                if self._database is None:
                    raise
            # Nothing of this transaction reached the server (its BEGIN went with this
            # statement): the same on a fresh connection. The pool may hand out a second
            # connection the server dropped before noticing it, hence more than one try.
            self.begun = False
            self.lent = False  # given back by _swap; a fresh one may not come
            self.conn = await self._database._swap(self.conn)
            self.lent = True
        return await self._pipelined(query, params)

    async def _pipelined(self, query: Any, params: tuple[Any, ...]) -> PgCursor:
        """``BEGIN`` (if not sent yet), the queued statements and this one: one round trip.

        The queued statements are kept when the transaction had not begun (a connection
        found dropped is swapped and everything sent again); otherwise they are spent.
        """
        cursor = self.conn.cursor(row_factory=_row_factory)
        fresh = not self.begun
        try:
            async with self.conn.pipeline():
                if fresh:
                    await self.conn.execute(b"BEGIN")
                    self.begun = True
                for queued, values in self._later:
                    await self.conn.execute(queued, values)
                await cursor.execute(query, params)
        except psycopg.Error as exc:
            if not fresh:
                self._later.clear()
            raise _translate(exc, self.conn, self._where) from exc
        self._later.clear()
        return PgCursor(cursor, self._where)

    async def commit(self) -> None:
        """``COMMIT``, with the statements still queued by :meth:`later` before it."""
        if not self._later:
            if self.begun:
                await self.conn.execute(b"COMMIT")
            return
        await self._pipelined(b"COMMIT", ())

    async def execute_ddl(self, statement: str) -> None:
        """One statement as written: no parameters, so a ``%`` or ``?`` stays as it is."""
        if self._begin and (not self.begun or self._later):
            await self.execute("SELECT 1")
        try:
            await self.conn.execute(statement.encode())
        except psycopg.Error as exc:
            raise _translate(exc, self.conn, self._where) from exc


def _pool_timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is the pool's "no connection in time" (the pool's module is only
    imported by a database that has a pool)."""
    pools = sys.modules.get("psycopg_pool")
    return pools is not None and isinstance(exc, pools.PoolTimeout)


class _Pool(Protocol):
    """What the database asks of its connections: psycopg's pool, or one connection."""

    async def getconn(self) -> psycopg.AsyncConnection[Any]: ...

    async def putconn(self, conn: psycopg.AsyncConnection[Any]) -> None: ...

    async def check(self) -> None: ...

    async def close(self) -> None: ...


class _OneConnection:
    """One connection lent to one caller at a time (a short command's): the pool's
    interface without its threads, tasks and second connection."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], db: PostgresDatabase) -> None:
        self._conn = conn
        self._db = db
        self._lent = asyncio.Lock()

    async def getconn(self) -> psycopg.AsyncConnection[Any]:
        await self._lent.acquire()
        try:
            if self._conn.closed or self._conn.broken:
                await self._reconnect()
        except BaseException:
            self._lent.release()
            raise
        return self._conn

    async def putconn(self, conn: psycopg.AsyncConnection[Any]) -> None:
        if conn is self._conn and self._lent.locked():
            self._lent.release()

    async def check(self) -> None:
        if self._conn.closed or self._conn.broken:
            async with self._lent:
                await self._reconnect()

    async def _reconnect(self) -> None:
        with contextlib.suppress(psycopg.Error):
            await self._conn.close()
        self._conn = await psycopg.AsyncConnection.connect(
            self._db.url.conninfo(), autocommit=True, prepare_threshold=1
        )

    async def close(self) -> None:
        await self._conn.close()


class PostgresDatabase(OpenedAndClosed):
    """A pool of connections to one PostgreSQL database, with the stores' interface.

    Use as an async context manager; opening it reaches the server and migrates.
    """

    dialect: Final = "postgresql"
    #: Appended to a ``SELECT`` inside a transaction whose writes depend on what it read.
    for_update: Final = " FOR UPDATE"

    def __init__(
        self,
        url: PostgresURL | str,
        *,
        migrations: Sequence[MigrationSet] | None = None,
        min_size: int = 1,
        max_size: int = 8,
        connect_timeout: float = 10.0,
        pooled: bool = True,
    ) -> None:
        self.url = url if isinstance(url, PostgresURL) else PostgresURL(url)
        self._schemas = tuple(migrations) if migrations is not None else discover_migrations()
        if [s.owner for s in self._schemas].count(ENGINE) != 1:
            raise StoreError("the migrations must include the engine's, once")
        self._min_size = min_size
        self._max_size = max_size
        self._connect_timeout = connect_timeout
        # The server could not be reached at the last try (see _why_unreachable).
        self._down = False
        # A short command (a listing) works on one connection: no pool to import and
        # open, and the connection that checks the server is the one it works on.
        self._pooled = pooled
        self._pool: _Pool | None = None

    def _clean(self, exc: BaseException) -> str:
        """The driver's message on one line, with the password (if any) taken out."""
        return _clean(self.url, exc)

    async def _probe(self) -> str | None:
        """Why a direct connection does not open (refused, ...), or None when it does."""
        try:
            probe = await psycopg.AsyncConnection.connect(self.url.conninfo(), connect_timeout=2)
        except psycopg.Error as direct:
            return self._clean(direct)
        await probe.close()
        return None

    async def _why_unreachable(self, exc: BaseException) -> StoreUnreachableError:
        """The pool only says it timed out: one direct attempt says why (refused, ...).

        When the server cannot be reached, the next callers find out with one direct
        attempt each (a refusal takes a millisecond) instead of each waiting for the pool
        to give up, until a direct attempt gets through again (see :meth:`_getconn`).
        """
        reason = await self._probe()
        if reason is None:
            reason = self._clean(exc)  # the server answers: the pool was busy, not cut off
        else:
            self._down = True
        return self._unreachable(reason)

    async def open(self) -> None:
        if self._pool is not None:
            return
        # One direct connection first: the pool would only say "timed out", while this
        # says "connection refused" or "password authentication failed".
        try:
            probe = await psycopg.AsyncConnection.connect(
                self.url.conninfo(), connect_timeout=max(1, int(self._connect_timeout))
            )
        except psycopg.Error as exc:
            raise StoreUnreachableError(
                f"cannot reach the PostgreSQL database {self.url}: {self._clean(exc)}",
                target=str(self.url),
                retryable=not _login_refused(exc),
            ) from None
        if not self._pooled:
            await probe.set_autocommit(True)
            probe.prepare_threshold = 1
            self._pool = _OneConnection(probe, self)
            try:
                await self._migrate()
            except BaseException:
                self._pool = None
                await probe.close()
                raise
            return
        await probe.close()
        from psycopg_pool import AsyncConnectionPool, PoolTimeout  # only when pooled

        pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
            self.url.conninfo(),
            min_size=self._min_size,
            max_size=self._max_size,
            # Statements are prepared on their second use: the stores repeat a few dozen.
            kwargs={"autocommit": True, "prepare_threshold": 1},
            # No liveness check per checkout (a round trip each time): a connection the
            # server dropped fails its first statement, before anything was written, and
            # that statement is tried once more on a fresh connection (see _swap).
            open=False,
            timeout=self._connect_timeout,
            name="turnstile",
        )
        try:
            await pool.open(wait=True, timeout=self._connect_timeout)
        except PoolTimeout as exc:
            await pool.close()
            raise StoreUnreachableError(
                f"cannot open connections to {self.url}: {self._clean(exc)}",
                target=str(self.url),
            ) from None
        self._pool = pool
        try:
            await self._migrate()
        except BaseException:
            self._pool = None
            await pool.close()
            raise

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    @property
    def pool_size(self) -> tuple[int, int]:
        """The connections the pool keeps open at least, and opens at most."""
        return self._min_size, self._max_size

    @property
    def pool(self) -> _Pool:
        if self._pool is None:
            raise StoreError("database is not open")
        return self._pool

    def _unreachable(self, reason: str) -> StoreUnreachableError:
        return StoreUnreachableError(
            f"lost the PostgreSQL database {self.url}: {reason}", target=str(self.url)
        )

    async def _getconn(self) -> psycopg.AsyncConnection[Any]:
        pool = self.pool
        if self._down:
            reason = await self._probe()
            if reason is not None:
                raise self._unreachable(reason)
            self._down = False
        try:
            return await pool.getconn()
        except psycopg.OperationalError as exc:  # the pool's timeout is one too
            if _pool_timed_out(exc):
                raise await self._why_unreachable(exc) from None
            raise self._unreachable(self._clean(exc)) from exc

    async def _swap(self, broken: psycopg.AsyncConnection[Any]) -> psycopg.AsyncConnection[Any]:
        """A fresh connection for one the server dropped, and the pool rid of its likes."""
        await self.pool.putconn(broken)
        # The server restarted, most likely: every idle connection is as dead as this one.
        await self.pool.check()
        return await self._getconn()

    async def checkout(self) -> psycopg.AsyncConnection[Any]:
        """A connection of the pool for a caller's own use; give it back with :meth:`checkin`.

        Raises:
            StoreUnreachableError: no connection can be opened.
        """
        return await self._getconn()

    async def checkin(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Give back a connection of :meth:`checkout` (a broken one is replaced)."""
        await self.pool.putconn(conn)

    async def swap(self, broken: psycopg.AsyncConnection[Any]) -> psycopg.AsyncConnection[Any]:
        """Give back a connection the server dropped and take a fresh one."""
        return await self._swap(broken)

    async def _read(
        self, sql: str, params: Iterable[Any], make: Any, *, binary: bool = False
    ) -> list[Any]:
        """The rows of one query outside a transaction; tried twice if the connection broke.

        A read changes nothing, so a second try on a fresh connection is always safe.
        """
        query, values = postgres_query(sql), tuple(params)
        conn = await self._getconn()
        held = True
        try:
            for attempt in (1, 2):
                try:
                    cursor = conn.cursor(row_factory=make, binary=binary)
                    await cursor.execute(query, values)
                    return await cursor.fetchall()
                except psycopg.Error as exc:
                    if attempt == 2 or not conn.broken:
                        raise _translate(exc, conn, str(self.url)) from exc
                    held = False  # given back by _swap; a fresh one may not come
                    conn = await self._swap(conn)
                    held = True
            raise AssertionError("unreachable")  # pragma: no cover
        finally:
            if held:
                await self.pool.putconn(conn)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[PgConnection]:
        """One transaction; commits on success, rolls back on error."""
        handle = PgConnection(await self._getconn(), str(self.url), database=self, begin=True)
        try:
            try:
                yield handle
            except BaseException:
                if handle.begun and not handle.conn.broken:
                    with contextlib.suppress(psycopg.Error):
                        await handle.conn.execute(b"ROLLBACK")
                raise
            if handle.begun or handle.pending:
                try:
                    await handle.commit()
                except (psycopg.Error, StoreError) as exc:
                    # A statement queued by later() failed (its pipeline stopped before the
                    # COMMIT): the transaction is still open, failed, until rolled back.
                    if handle.begun and not handle.conn.broken:
                        with contextlib.suppress(psycopg.Error):
                            await handle.conn.execute(b"ROLLBACK")
                    if isinstance(exc, StoreError):
                        raise
                    raise _translate(exc, handle.conn, str(self.url)) from exc
        finally:
            if handle.lent:
                await self.pool.putconn(handle.conn)

    async def execute(self, sql: str, params: Iterable[Any] = ()) -> int:
        """Run one write statement in its own transaction; return the rows changed."""
        async with self.transaction() as conn:
            cursor = await conn.execute(sql, params)
            return cursor.rowcount

    async def fetchall(self, sql: str, params: Iterable[Any] = ()) -> list[Row]:
        return await self._read(sql, params, _row_factory)

    async def fetchone(self, sql: str, params: Iterable[Any] = ()) -> Row | None:
        rows = await self._read(sql, params, _row_factory)
        return rows[0] if rows else None

    async def fetch_tuples(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        """Like :meth:`fetchall` with plain tuples: for listings of thousands of rows.

        The rows come in binary (numbers need no parsing: a 10,000-row listing fetched a
        third faster, measured); the values are the same Python types as in text.
        """
        return await self._read(sql, params, tuple_row, binary=True)

    @asynccontextmanager
    async def listen(self, channel: str) -> AsyncIterator[Callable[[float], Awaitable[bool]]]:
        """``LISTEN`` on ``channel`` on a connection of its own; yields ``notified(wait)``,
        True once a notification came (those since the last call count), False after
        ``wait`` seconds without one.

        A lost connection is opened again on the next call (what was notified meanwhile is
        not known: the caller reads again in any case).
        """
        conn: psycopg.AsyncConnection[Any] | None = None

        async def connect() -> psycopg.AsyncConnection[Any]:
            fresh = await psycopg.AsyncConnection.connect(
                self.url.conninfo(), autocommit=True, connect_timeout=2
            )
            try:
                await fresh.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            except BaseException:
                # (cancelled meanwhile: a follower stopping) the connection goes with it
                with contextlib.suppress(psycopg.Error):
                    await asyncio.shield(fresh.close())
                raise
            return fresh

        async def notified(wait: float) -> bool:
            nonlocal conn
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = await connect()
                async for _ in conn.notifies(timeout=wait, stop_after=1):
                    return True
                return False
            except psycopg.Error as exc:
                _LOGGER.debug("listening on %s: %s", channel, _one_line(exc))
                await asyncio.sleep(wait)
                return False

        try:
            yield notified
        finally:
            if conn is not None:
                with contextlib.suppress(psycopg.Error):
                    await conn.close()

    async def schema_version(self) -> int:
        """The engine's schema version."""
        return (await self.schema_versions())[ENGINE]

    async def schema_versions(self) -> dict[str, int]:
        """Each owner's schema version (the engine's and every front end's)."""
        rows = await self.fetchall("SELECT owner, version FROM schema_versions")
        return _versions(self._schemas, {str(r[0]): int(r[1]) for r in rows})

    @property
    def latest_version(self) -> int:
        """The engine's latest schema version."""
        return self.latest_versions[ENGINE]

    @property
    def latest_versions(self) -> dict[str, int]:
        """Each owner's latest schema version, as this code knows them."""
        return {s.owner: s.latest for s in self._schemas}

    async def _is_current(self) -> bool:
        """Whether opening has nothing to write: every owner's version recorded and the
        latest this code knows. Two plain reads, no transaction and no lock."""
        found = await self.fetchone("SELECT to_regclass('schema_versions') IS NOT NULL")
        if not (found and found[0]):
            return False
        rows = await self.fetchall("SELECT owner, version FROM schema_versions")
        recorded = {str(r[0]): int(r[1]) for r in rows}
        return all(recorded.get(s.owner) == s.latest for s in self._schemas)

    async def _migrate(self) -> None:
        if await self._is_current():
            return
        async with self.transaction() as conn:
            await conn.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
            for statement in _BOOKKEEPING:
                await conn.execute(statement)
            cursor = await conn.execute("SELECT owner, version FROM schema_versions")
            rows = {str(r[0]): int(r[1]) for r in await cursor.fetchall()}
            versions = _versions(self._schemas, rows)
            for schema in self._schemas:
                done = versions[schema.owner]
                if done > schema.latest:
                    raise SchemaTooNewError(
                        f"the database {self.url} was migrated by a newer turnstile "
                        f"({schema.owner} schema version {done}; this turnstile knows "
                        f"{schema.latest}): upgrade turnstile, or point TURNSTILE_DATABASE "
                        "at a database of this version",
                        owner=schema.owner,
                        version=done,
                        known=schema.latest,
                    )
                for migration in schema.migrations:
                    if migration.version <= done:
                        continue
                    _LOGGER.info(
                        "applying migration %s %04d_%s",
                        schema.owner,
                        migration.version,
                        migration.name,
                    )
                    for statement in migration.statements:
                        if runs_on(statement, "postgresql"):
                            await _execute_ddl(conn, statement)
                    done = migration.version
                if rows.get(schema.owner) != done:
                    await conn.execute(
                        "INSERT INTO schema_versions (owner, version) VALUES (?, ?) "
                        "ON CONFLICT (owner) DO UPDATE SET version = excluded.version",
                        (schema.owner, done),
                    )


def _clean(url: PostgresURL, exc: BaseException) -> str:
    """The driver's message on one line, with the password (if any) taken out."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    password = url.password
    if password:
        text = text.replace(password, "***")
    return text.replace(url.conninfo(), str(url))


def _login_refused(exc: psycopg.Error) -> bool:
    """The server turned the login down (password, role): trying again will not help."""
    # 28P01 invalid_password, 28000 invalid_authorization_specification; a refused login
    # at connect time may come without its code, only the server's text.
    return exc.sqlstate in ("28P01", "28000") or "authentication failed" in str(exc)


def _versions(schemas: Iterable[MigrationSet], rows: dict[str, int]) -> dict[str, int]:
    # PostgreSQL databases were born with owners: nothing to adopt from a single sequence.
    return resolve_versions(schemas, engine_version=rows.get(ENGINE, 0), split=0, rows=rows)


def _pending(schemas: Iterable[MigrationSet], versions: dict[str, int]) -> dict[str, list[str]]:
    return {
        s.owner: [
            f"{m.version:04d}_{m.name}" for m in s.migrations if m.version > versions[s.owner]
        ]
        for s in schemas
    }


async def _execute_ddl(conn: PgConnection, statement: str) -> None:
    # DDL goes as written (no parameters): only the types are translated.
    await conn.execute_ddl(postgres_ddl(statement))


async def read_pending(
    url: PostgresURL,
    schemas: Sequence[MigrationSet] | None = None,
    *,
    connect_timeout: float = 10.0,
) -> tuple[str, dict[str, int], dict[str, list[str]]]:
    """The server's version, each owner's schema version and the pending migrations.

    Changes nothing (the doctor looks at what the bot is using).

    Raises:
        StoreUnreachableError: the server cannot be reached or refuses the login.
    """
    known = tuple(schemas) if schemas is not None else discover_migrations()
    probe = PostgresDatabase(url, migrations=known, connect_timeout=connect_timeout)
    try:
        conn = await psycopg.AsyncConnection.connect(
            url.conninfo(), connect_timeout=max(1, int(connect_timeout)), autocommit=True
        )
    except psycopg.Error as exc:
        raise StoreUnreachableError(
            f"cannot reach the PostgreSQL database {url}: {probe._clean(exc)}",
            target=str(url),
            retryable=not _login_refused(exc),
        ) from None
    try:
        cursor = await conn.execute("SHOW server_version")
        row = await cursor.fetchone()
        version = str(row[0]) if row else "unknown"
        cursor = await conn.execute("SELECT to_regclass('schema_versions') IS NOT NULL")
        row = await cursor.fetchone()
        rows: dict[str, int] = {}
        if row and row[0]:
            cursor = await conn.execute("SELECT owner, version FROM schema_versions")
            rows = {str(r[0]): int(r[1]) for r in await cursor.fetchall()}
    except psycopg.Error as exc:
        raise StoreError(f"cannot read {url}: {probe._clean(exc)}") from exc
    finally:
        await conn.close()
    versions = _versions(known, rows)
    return version, versions, _pending(known, versions)

"""Locks a PostgreSQL database holds: they exclude holders on every machine that reaches it.

:class:`AdvisoryLock` is the :class:`~engine.locks.Lock` of a database (one bot per
database, one drive per task, one driver per run on PostgreSQL); a file lock
(:class:`~engine.locks.FileLock`) is the one of a single machine.
:func:`engine.store.leases.database_lock` picks one of the two from the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any, Final

import psycopg

from engine.aio import raise_if_cancelled
from engine.errors import StoreUnreachableError
from engine.store.dialect import advisory_key
from engine.store.location import PostgresURL
from engine.store.postgres import PostgresDatabase, _clean, _login_refused

__all__ = ["AdvisoryLock", "PooledAdvisoryLock"]

_LOGGER = logging.getLogger(__name__)

_FIRST_POLL: Final = 0.05
_MAX_POLL: Final = 1.0


class AdvisoryLock:
    """A session-level advisory lock on ``name`` in one PostgreSQL database.

    The :class:`~engine.locks.Lock` of a database: it holds across machines, where a file
    lock holds on one. It lives on a connection of its own (a pool hands its sessions
    around, and a session lock belongs to its session); the server drops the lock when
    that connection ends, so a holder that dies leaves nothing locked (TCP keepalives
    notice a machine that vanished). The holder says who it is in its
    ``application_name`` (pid and host), for :meth:`holder` and :meth:`holder_detail`.

    Raises:
        StoreUnreachableError: (from the acquire methods) the server cannot be reached.
    """

    def __init__(
        self,
        url: PostgresURL,
        name: str,
        *,
        shared: bool = False,
        connect_timeout: float = 10.0,
    ) -> None:
        self.url = url
        self._name = name
        self._shared = shared
        self.key = advisory_key(name)
        self._connect_timeout = connect_timeout
        self._conn: psycopg.AsyncConnection[Any] | None = None

    @property
    def name(self) -> str:
        return f"{self._name} on {self.url}"

    @property
    def shared(self) -> bool:
        """Shared holders coexist (``pg_try_advisory_lock_shared``); an exclusive one waits."""
        return self._shared

    @property
    def held(self) -> bool:
        return self._conn is not None and not self._conn.closed and not self._conn.broken

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        who = self._identity()
        try:
            return await psycopg.AsyncConnection.connect(
                self.url.conninfo(),
                autocommit=True,
                connect_timeout=max(1, int(self._connect_timeout)),
                application_name=who,
                keepalives=1,
                keepalives_idle=30,
                keepalives_interval=10,
                keepalives_count=3,
            )
        except psycopg.Error as exc:
            raise StoreUnreachableError(
                f"cannot reach the PostgreSQL database {self.url}: {_clean(self.url, exc)}",
                target=str(self.url),
                retryable=not _login_refused(exc),
            ) from None

    async def try_acquire(self) -> bool:
        """Take the lock if it is free; never waits."""
        if self._conn is not None:
            raise RuntimeError(f"lock {self.name} is already held by this object")
        conn = await self._connect()
        try:
            call = "pg_try_advisory_lock_shared" if self._shared else "pg_try_advisory_lock"
            cursor = await conn.execute(f"SELECT {call}(%s)", (self.key,))
            row = await cursor.fetchone()
        except psycopg.Error as exc:
            await conn.close()
            raise StoreUnreachableError(
                f"cannot lock {self.name}: {_clean(self.url, exc)}", target=str(self.url)
            ) from None
        except BaseException:
            await conn.close()
            raise
        if not (row and row[0]):
            await conn.close()
            return False
        self._conn = conn
        return True

    async def acquire(self) -> None:
        """Wait until the lock is free and take it (polling: cancellable, nothing left)."""
        delay = _FIRST_POLL
        while not await self.try_acquire():
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_POLL)

    async def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if not conn.closed:
                call = "pg_advisory_unlock_shared" if self._shared else "pg_advisory_unlock"
                await conn.execute(f"SELECT {call}(%s)", (self.key,))
        except psycopg.Error:
            pass  # the connection is gone: so is the lock
        finally:
            await conn.close()

    async def keep(self, interval: float = 5.0) -> str | None:
        """Check the lock's connection every ``interval`` seconds while it is held.

        A connection the server or the network cut has lost the lock with it: it is taken
        again as soon as the server answers (tried again after 1 s, 2 s, … up to
        ``interval`` apart, for as long as the outage lasts). Returns only when another
        holder is seen to have it, saying who (``another turnstile bot (pid 12 on
        host-a)``, or ``another database session`` when it does not say), or None once
        released; cancel it to stop watching.
        """
        me = self._identity()
        lost = False
        retry = min(1.0, interval)
        while True:
            await asyncio.sleep(retry if lost else interval)
            if not lost:
                conn = self._conn
                if conn is None:
                    return None  # released
                try:
                    await conn.execute("SELECT 1")
                    continue
                except psycopg.Error:
                    _LOGGER.warning("lost the connection holding %s; taking it again", self.name)
                self._conn = None
                with contextlib.suppress(psycopg.Error):
                    await conn.close()
                lost, retry = True, min(1.0, interval)
            try:
                taken = await self.try_acquire()
            except StoreUnreachableError as exc:
                raise_if_cancelled()
                _LOGGER.warning("cannot take %s again yet: %s", self.name, exc)
                retry = min(retry * 2, interval)
                continue
            if taken:
                _LOGGER.info("took %s again", self.name)
                lost = False
                continue
            try:
                holder = await self.holder_detail()
            except StoreUnreachableError:
                continue  # gone again at once: tried again at the next check
            if holder == me.removeprefix("turnstile "):
                # Our own cut-off session, which the server has not ended yet: it goes
                # when the server notices (its keepalives), and the lock with it.
                retry = min(retry * 2, interval)
                continue
            return f"another turnstile bot ({holder})" if holder else "another database session"

    def _identity(self) -> str:
        return f"turnstile pid {os.getpid()} on {socket.gethostname()}"[:63]

    async def _holder_name(self) -> str | None:
        # pg_locks shows a bigint key as two halves (classid high, objid low, objsubid 1).
        unsigned = self.key & 0xFFFF_FFFF_FFFF_FFFF
        conn = await self._connect()
        try:
            cursor = await conn.execute(
                "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a"
                " ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted"
                " AND l.mode = 'ExclusiveLock' AND l.objsubid = 1"
                " AND l.classid::bigint = %s AND l.objid::bigint = %s"
                " AND l.database = (SELECT oid FROM pg_database"
                " WHERE datname = current_database())",
                (unsigned >> 32, unsigned & 0xFFFF_FFFF),
            )
            row = await cursor.fetchone()
        except psycopg.Error:
            return None
        finally:
            await conn.close()
        return str(row[0]) if row and row[0] else None

    async def holder(self) -> int | None:
        """The holder's pid (on its own machine: see :meth:`holder_detail`), when known."""
        detail = await self.holder_detail()
        if detail is None:
            return None
        pid = detail.removeprefix("pid ").split(" ", 1)[0]
        return int(pid) if pid.isdigit() else None

    async def holder_detail(self) -> str | None:
        """``pid 123 on host-a``: who holds the lock, when it is a turnstile process."""
        found = await self._holder_name()
        if found is None or not found.startswith("turnstile pid "):
            return None
        return found.removeprefix("turnstile ")


class PooledAdvisoryLock:
    """A session-level advisory lock held on a connection borrowed from the pool.

    For holds of milliseconds on a hot path (a task folder's lock around each transition):
    no connection of its own to open, and the wait is the server's (``pg_advisory_lock``),
    not a poll. The connection goes back to the pool once the lock is released; one that
    fails while the lock is held has lost the lock with its session.
    """

    def __init__(self, db: PostgresDatabase, name: str, *, shared: bool = False) -> None:
        self._db = db
        self._name = name
        self._shared = shared
        self.key = advisory_key(name)
        self._conn: psycopg.AsyncConnection[Any] | None = None

    @property
    def name(self) -> str:
        return f"{self._name} on {self._db.url}"

    @property
    def shared(self) -> bool:
        return self._shared

    @property
    def held(self) -> bool:
        return self._conn is not None and not self._conn.broken

    async def _take(self, function: str) -> bool:
        if self._conn is not None:
            raise RuntimeError(f"lock {self.name} is already held by this object")
        suffix = "_shared" if self._shared else ""
        query = f"SELECT {function}{suffix}(%s)".encode()
        conn = await self._db.checkout()
        held = True
        try:
            try:
                row = await (await conn.execute(query, (self.key,))).fetchone()
            except psycopg.OperationalError:
                if not conn.broken:
                    raise
                held = False  # given back by swap; a fresh one may not come
                conn = await self._db.swap(conn)  # dropped while idle: nothing was taken
                held = True
                row = await (await conn.execute(query, (self.key,))).fetchone()
        except psycopg.Error as exc:
            await self._db.checkin(conn)
            raise StoreUnreachableError(
                f"cannot lock {self.name}: {_clean(self._db.url, exc)}",
                target=str(self._db.url),
            ) from exc
        except BaseException:
            if held:
                # Cancelled while the server made us wait: ending the session ends the wait.
                await conn.close()
                await self._db.checkin(conn)
            raise
        if function == "pg_advisory_lock" or (row and row[0]):
            self._conn = conn
            return True
        await self._db.checkin(conn)
        return False

    async def try_acquire(self) -> bool:
        """Take the lock if it is free; never waits."""
        return await self._take("pg_try_advisory_lock")

    async def acquire(self) -> None:
        """Wait (on the server) until the lock is free and take it; cancellable."""
        await self._take("pg_advisory_lock")

    async def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        call = "pg_advisory_unlock_shared" if self._shared else "pg_advisory_unlock"
        try:
            await conn.execute(f"SELECT {call}(%s)".encode(), (self.key,))
        except BaseException:
            # Not unlocked: the session must not go back to the pool still holding it.
            await conn.close()
            raise
        finally:
            await self._db.checkin(conn)

    async def holder(self) -> int | None:
        return None  # pooled sessions do not name their process

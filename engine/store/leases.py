"""Locks the database holds: a PostgreSQL advisory lock, and the choice of lock per database.

An invariant that spans processes (one drive per task, one driver per run) must hold
across machines once the runs share a PostgreSQL database: an ``flock`` only excludes
processes on the machine whose disk holds the file. :class:`AdvisoryLock` is the same
:class:`~engine.locks.Lock` as :class:`~engine.locks.FileLock`, held by the server instead:
a session-level ``pg_try_advisory_lock`` on a connection of its own (never one of the
pool's: a pooled connection goes back to the pool, and its session lock with it).

The server drops the lock when the holder's connection ends, as the kernel drops an
``flock`` when its process dies: a crashed holder leaves nothing locked. A holder whose
machine vanished without closing its connection keeps the lock until the server notices
(TCP keepalives: see docs/deploy.md).

:func:`database_lock` picks one from the database: on SQLite the ``flock`` on ``path``,
on PostgreSQL the advisory lock on ``key``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from engine.errors import StoreUnreachableError
from engine.locks import FileLock, Lock
from engine.store.database import Database

if TYPE_CHECKING:
    import psycopg

    from engine.store.backend import AnyDatabase
    from engine.store.location import PostgresURL

__all__ = ["AdvisoryLock", "advisory_key", "database_lock"]

_FIRST_POLL: Final = 0.01
_MAX_POLL: Final = 0.5
# What the holder's connection calls itself, so that "busy" can name its pid and machine.
_APP_PREFIX: Final = "turnstile pid "


def advisory_key(key: str) -> int:
    """``key`` as the signed 64-bit number PostgreSQL's advisory locks take."""
    digest = hashlib.blake2b(key.encode(), digest_size=8, person=b"turnstile").digest()
    return int.from_bytes(digest, "big", signed=True)


class AdvisoryLock:
    """A session-level advisory lock on ``key``, on a connection of its own to ``url``.

    Exclusive unless ``shared`` (``pg_try_advisory_lock_shared``). Not re-entrant, like
    :class:`~engine.locks.FileLock`: two objects on one key exclude each other, in one
    process too (each has its own connection).

    Args:
        url: the database.
        key: what is locked (``drive:TASK``, ``run:RUN_ID``); hashed to 64 bits.
        connect_timeout: seconds to reach the server before giving up.
    """

    def __init__(
        self, url: PostgresURL, key: str, *, shared: bool = False, connect_timeout: float = 10.0
    ) -> None:
        self.url = url
        self.key = key
        self._number = advisory_key(key)
        self._shared = shared
        self._connect_timeout = connect_timeout
        self._conn: psycopg.AsyncConnection[Any] | None = None

    @property
    def name(self) -> str:
        return self.key

    @property
    def shared(self) -> bool:
        return self._shared

    @property
    def held(self) -> bool:
        """Held, and its connection still up (a lost connection is a lost lock)."""
        return self._conn is not None and not self._conn.broken and not self._conn.closed

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        import psycopg  # only when the database is PostgreSQL

        try:
            return await psycopg.AsyncConnection.connect(
                self.url.conninfo(),
                autocommit=True,
                connect_timeout=max(1, int(self._connect_timeout)),
                application_name=f"{_APP_PREFIX}{os.getpid()} on {socket.gethostname()}"[:63],
            )
        except psycopg.Error as exc:
            raise StoreUnreachableError(
                f"cannot reach {self.url} to take the lock {self.key}: "
                + _clean(str(exc), self.url),
                target=str(self.url),
            ) from None

    async def try_acquire(self) -> bool:
        """Take the lock if it is free; never waits.

        Raises:
            StoreUnreachableError: the server cannot be reached.
            RuntimeError: this object holds the lock already.
        """
        import psycopg

        if self._conn is not None:
            raise RuntimeError(f"lock {self.key} is already held by this object")
        conn = await self._connect()
        call = "pg_try_advisory_lock_shared" if self._shared else "pg_try_advisory_lock"
        try:
            cursor = await conn.execute(f"SELECT {call}(%s)", (self._number,))
            row = await cursor.fetchone()
        except psycopg.Error as exc:
            await conn.close()
            raise StoreUnreachableError(
                f"lost {self.url} while taking the lock {self.key}: " + _clean(str(exc), self.url),
                target=str(self.url),
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
        """Wait until the lock is free and take it (polling: a cancelled waiter holds
        nothing afterwards, which a blocking ``pg_advisory_lock`` could not promise)."""
        delay = _FIRST_POLL
        while not await self.try_acquire():
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_POLL)

    async def release(self) -> None:
        """Give the lock up: closing its connection ends the session, and the lock."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def holder(self) -> int | None:
        """The pid the exclusive holder's connection names (it may be on another machine)."""
        import psycopg

        try:
            conn = await self._connect()
        except StoreUnreachableError:
            return None
        try:
            cursor = await conn.execute(
                "SELECT a.application_name FROM pg_locks l"
                " JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock'"
                " AND l.classid::bigint = %s AND l.objid::bigint = %s AND l.objsubid = 1",
                ((self._number >> 32) & 0xFFFFFFFF, self._number & 0xFFFFFFFF),
            )
            row = await cursor.fetchone()
        except psycopg.Error:
            return None
        finally:
            await conn.close()
        text = str(row[0]) if row else ""
        if not text.startswith(_APP_PREFIX):
            return None
        pid = text[len(_APP_PREFIX) :].split(" ", 1)[0]
        return int(pid) if pid.isdigit() else None


def _clean(text: str, url: PostgresURL) -> str:
    password = url.password
    text = text.strip()
    return text.replace(password, "***") if password else text


def database_lock(db: AnyDatabase, key: str, path: Path, *, mode: int = 0o600) -> Lock:
    """The lock for ``key`` on ``db``: an advisory lock on PostgreSQL, else an ``flock``
    on ``path`` (SQLite: every process that shares the file shares the machine)."""
    if isinstance(db, Database):
        return FileLock(path, mode=mode)
    return AdvisoryLock(db.url, key)

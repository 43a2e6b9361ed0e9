"""The lock of a shared invariant, chosen from the database.

An invariant that spans processes (one drive per task, one driver per run) must hold
across machines once the runs share a PostgreSQL database: an ``flock`` only excludes
processes on the machine whose disk holds the file. :func:`database_lock` gives the
``flock`` on SQLite (every process that shares the file shares the machine) and an
:class:`~engine.store.advisory.AdvisoryLock` on PostgreSQL; both are an
:class:`~engine.locks.Lock`. The server drops an advisory lock when the holder's
connection ends, as the kernel drops an ``flock`` when its process dies.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.locks import FileLock, Lock
from engine.store.database import Database

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = ["database_lock"]


def database_lock(
    db: AnyDatabase,
    key: str,
    path: Path,
    *,
    mode: int = 0o600,
    shared: bool = False,
    make_parent: bool = True,
    brief: bool = False,
) -> Lock:
    """The lock for ``key`` on ``db``: an advisory lock on PostgreSQL, else an ``flock``
    on ``path``.

    Args:
        brief: held for milliseconds at a time (a folder lock around one transition): on
            PostgreSQL it borrows a connection of the database's pool rather than opening
            its own.
    """
    if isinstance(db, Database):
        return FileLock(path, shared=shared, make_parent=make_parent, mode=mode)
    from engine.store.advisory import AdvisoryLock, PooledAdvisoryLock  # psycopg only then

    if brief:
        return PooledAdvisoryLock(db, key, shared=shared)
    return AdvisoryLock(db.url, key, shared=shared)

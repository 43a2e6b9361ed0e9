"""Locks that exclude other processes: one interface, and its ``flock`` implementation.

Every cross-process "only one at a time" in turnstile goes through a :class:`Lock`: the
worktree a run works in, a task folder's ``.state`` mirror, one autopilot drive per task,
one bot per database. :class:`FileLock` is the implementation on one machine; a lock the
database holds (a PostgreSQL advisory lock) implements the same Protocol, which is why its
methods are coroutines even though ``flock`` answers at once.

Waiting never parks a thread in a blocking ``flock``: :meth:`FileLock.acquire` polls a
non-blocking attempt with a growing pause, so a cancelled waiter leaves nothing behind that
could take the lock later for nobody.

Use :func:`hold` for the body of an ``async with``::

    async with hold(FileLock(path)):                   # wait for it
        ...
    async with hold(FileLock(path), wait=False):       # LockBusyError if it is taken
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final, Protocol, TypeVar

from engine.errors import LockBusyError, LockError

__all__ = ["FileLock", "Lock", "hold"]

_FIRST_POLL: Final = 0.005
_MAX_POLL: Final = 0.1


class Lock(Protocol):
    """A lock that excludes other processes (and other holders in this one).

    Not re-entrant: one object is held at most once; two objects on the same resource
    exclude each other. Shared holders exclude exclusive ones and nobody else.
    """

    @property
    def name(self) -> str:
        """What the lock guards, as shown in messages (a path, a key)."""
        ...

    @property
    def shared(self) -> bool: ...

    @property
    def held(self) -> bool: ...

    async def try_acquire(self) -> bool:
        """Take the lock if it is free; never waits."""
        ...

    async def acquire(self) -> None:
        """Wait until the lock is free and take it; cancellable while waiting."""
        ...

    async def release(self) -> None:
        """Give the lock up (nothing happens when it is not held)."""
        ...

    async def holder(self) -> int | None:
        """The pid of the exclusive holder, when known; for "busy" messages only."""
        ...


class FileLock:
    """An ``flock`` on ``path`` (created if missing), exclusive unless ``shared``.

    ``flock`` locks belong to an open file description, so two objects on one path exclude
    each other even inside one process, and the kernel drops the lock when its holder
    dies: a crashed process never leaves anything locked. An exclusive holder writes its
    pid into the file for :meth:`holder`; the lock is the ``flock``, never the content.

    The file is opened without following a symlink and must be a regular file with no
    other name: lock files live in folders agents can write to, and a lock must never
    truncate the file a planted link points at.

    Args:
        make_parent: create the parent folder when it is missing.
        mode: the permission bits of a new lock file.
    """

    def __init__(
        self, path: Path, *, shared: bool = False, make_parent: bool = True, mode: int = 0o600
    ) -> None:
        self.path = path
        self._shared = shared
        self._make_parent = make_parent
        self._mode = mode
        self._fd: int | None = None

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def shared(self) -> bool:
        return self._shared

    @property
    def held(self) -> bool:
        return self._fd is not None

    async def try_acquire(self) -> bool:
        """Take the lock if it is free; never waits.

        Raises:
            LockError: the lock file cannot be opened, or is not a regular file.
            RuntimeError: this object holds the lock already.
        """
        return self._try()

    def _try(self) -> bool:
        if self._fd is not None:
            raise RuntimeError(f"lock {self.path} is already held by this object")
        fd = self._open()
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self._shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        with contextlib.suppress(OSError):
            # A shared holder clears what a crashed exclusive holder may have left.
            os.ftruncate(fd, 0)
            if not self._shared:
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return True

    async def acquire(self) -> None:
        delay = _FIRST_POLL
        while not self._try():
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_POLL)

    async def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if not self._shared:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    async def holder(self) -> int | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        except OSError:
            return None
        finally:
            os.close(fd)
        return int(text) if text.isdigit() else None

    def _open(self) -> int:
        if self._make_parent:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, self._mode)
        except OSError as exc:
            reason = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise LockError(f"cannot open the lock file {self.path}: {reason}") from exc
        try:
            info = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            raise LockError(f"cannot open the lock file {self.path}: {exc.strerror}") from exc
        if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
            os.close(fd)
            raise LockError(
                f"cannot use {self.path} as a lock file: it is not a plain file of its own"
            )
        return fd


_L = TypeVar("_L", bound=Lock)


@contextlib.asynccontextmanager
async def hold(lock: _L, *, wait: bool = True) -> AsyncIterator[_L]:
    """Hold ``lock`` for the body of an ``async with``, released however the body ends.

    Args:
        wait: wait until the lock is free; when false, take it now or raise.

    Raises:
        LockBusyError: ``wait`` is false and somebody else holds the lock.
        LockError: the lock cannot be taken at all (e.g. its file cannot be opened).
    """
    if wait:
        await lock.acquire()
    elif not await lock.try_acquire():
        pid = await lock.holder()
        raise LockBusyError(
            f"{lock.name} is held by " + (f"pid {pid}" if pid else "another holder"),
            lock=lock.name,
            holder=pid,
        )
    try:
        yield lock
    finally:
        await lock.release()

"""Locks that exclude other processes: one interface, and its ``flock`` implementations.

Every cross-process "only one at a time" in turnstile goes through a :class:`Lock`: the
worktree a run works in, a task folder's ``.state`` mirror, one autopilot drive per task,
one bot per database. :class:`FileLock` (a lock file of its own) and :class:`InodeLock`
(a lock on the file a path names, whatever its names) are the implementations on one
machine; a lock the database holds (a PostgreSQL advisory lock) implements the same
Protocol, which is why its methods are coroutines even though ``flock`` answers at once.

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

import abc
import asyncio
import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import ClassVar, Final, Protocol, TypeVar

from engine.errors import LockBusyError, LockError

__all__ = ["FileLock", "InodeLock", "Lock", "hold"]

_FIRST_POLL: Final = 0.005
_MAX_POLL: Final = 0.1
_PROC_LOCKS: Final = Path("/proc/locks")


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


class _Flock(abc.ABC):
    """What both ``flock`` locks share: a non-blocking attempt, polled while waiting.

    A subclass opens the file (:meth:`_open`) and says what to do once the lock is taken
    and before it is given up (:meth:`_taken`, :meth:`_giving_up`).
    """

    path: Path
    _shared: bool
    _fd: int | None

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
            LockError: the file cannot be opened, or is not a regular file.
            RuntimeError: this object holds the lock already.
        """
        return self._try()

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
            self._giving_up(fd)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _try(self) -> bool:
        if self._fd is not None:
            raise RuntimeError(f"lock {self.path} is already held by this object")
        fd = self._open()
        if fd is None:
            return False
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self._shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        if not self._taken(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return False
        self._fd = fd
        return True

    @abc.abstractmethod
    def _open(self) -> int | None:
        """The descriptor to lock (None: the lock is known to be taken)."""

    @abc.abstractmethod
    def _taken(self, fd: int) -> bool:
        """The lock was taken on ``fd``; False gives it back as if it had been busy."""

    @abc.abstractmethod
    def _giving_up(self, fd: int) -> None:
        """The lock on ``fd`` is about to be released."""


class FileLock(_Flock):
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

    def _taken(self, fd: int) -> bool:
        with contextlib.suppress(OSError):
            # A shared holder clears what a crashed exclusive holder may have left.
            os.ftruncate(fd, 0)
            if not self._shared:
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return True

    def _giving_up(self, fd: int) -> None:
        if not self._shared:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)

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


class InodeLock(_Flock):
    """An exclusive ``flock`` on the file ``path`` names: the file itself, not a name of it.

    A lock file beside a path guards that name only: a hard link in another folder reaches
    the same file and another lock file. This lock is on the file (its device and inode),
    so every way to it finds the lock taken: the path, a symbolic link to it or to a folder
    above it, a hard link. It is how one bot holds its SQLite database.

    The file is never written. A missing one is created empty (an empty file is a new
    SQLite database). On Linux ``flock`` and SQLite's own (``fcntl``) locks never meet, so
    holding it takes nothing from SQLite, with one caveat this class minds: closing *any*
    descriptor of a file drops every ``fcntl`` lock the process holds on it, SQLite's
    included. So a second object in this process on the same file is refused without
    opening it, and the holder releases only after its database is closed. (Not for
    network filesystems, where ``flock`` is emulated with ``fcntl`` locks; SQLite's WAL
    does not work there either.)

    :meth:`holder` reads the pid from ``/proc/locks`` (Linux); elsewhere it is unknown.

    Args:
        make_parent: create the parent folder when it is missing.
        mode: the permission bits of a new (empty) file.
    """

    # The files this process holds, by (device, inode): the kernel's own rule (fcntl locks
    # belong to the process) makes this a fact about the process, not about one object.
    _held_here: ClassVar[set[tuple[int, int]]] = set()

    def __init__(self, path: Path, *, make_parent: bool = True, mode: int = 0o644) -> None:
        self.path = path
        self._shared = False
        self._make_parent = make_parent
        self._mode = mode
        self._fd: int | None = None
        self._key: tuple[int, int] | None = None

    def _open(self) -> int | None:
        with contextlib.suppress(OSError):
            if _identity(os.stat(self.path)) in self._held_here:
                return None  # held in this process: opening it could cost SQLite its locks
        if self._make_parent:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, self._mode)
        except OSError as exc:
            raise LockError(f"cannot open {self.path} to lock it: {exc.strerror}") from exc
        try:
            info = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            raise LockError(f"cannot open {self.path} to lock it: {exc.strerror}") from exc
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise LockError(f"cannot lock {self.path}: it is not a regular file")
        self._key = _identity(info)
        return fd

    def _taken(self, fd: int) -> bool:
        assert self._key is not None
        try:
            now = _identity(os.stat(self.path))
        except OSError:
            now = None
        if now != self._key:
            # Renamed over or removed between the open and the lock: what the path names
            # now is not what was locked; the caller tries again (or waits) on the new one.
            return False
        self._held_here.add(self._key)
        return True

    def _giving_up(self, fd: int) -> None:
        if self._key is not None:
            self._held_here.discard(self._key)

    async def holder(self) -> int | None:
        try:
            key = _identity(os.stat(self.path))
        except OSError:
            return None
        if key in self._held_here:
            return os.getpid()
        return _flock_holder(key)


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _flock_holder(key: tuple[int, int]) -> int | None:
    """The pid holding an exclusive ``flock`` on the file ``key``, from ``/proc/locks``.

    A line reads ``1: FLOCK  ADVISORY  WRITE 1047 fe:00:2148203 0 EOF`` (the device's major
    and minor in hex, the inode in decimal); a waiter's line has ``->`` after the number.
    """
    try:
        text = _PROC_LOCKS.read_text()
    except OSError:
        return None
    device, inode = key
    wanted = (os.major(device), os.minor(device), inode)
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or fields[3] != "WRITE":
            continue
        parts = fields[5].split(":")
        try:
            seen = (int(parts[0], 16), int(parts[1], 16), int(parts[2]))
            pid = int(fields[4])
        except (ValueError, IndexError):
            continue
        if seen == wanted and pid > 0:
            return pid
    return None


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

"""Advisory file locks (``flock``) that exclude other processes and other holders here.

``flock`` locks belong to an open file description, so two :class:`FileLock` objects on
one path exclude each other even inside one process, and the kernel drops the lock when
its holder dies: a crashed run never leaves a worktree locked.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

__all__ = ["FileLock", "hold"]

_FIRST_POLL: Final = 0.005
_MAX_POLL: Final = 0.1


class FileLock:
    """An exclusive ``flock`` on ``path`` (created if missing)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lock if it is free; never waits."""
        if self._fd is not None:
            raise RuntimeError(f"lock {self.path} is already held by this object")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        # The holder's pid, for "busy" messages only; the flock is what excludes.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return True

    async def acquire(self) -> None:
        """Wait until the lock is free and take it (cancellable while waiting)."""
        delay = _FIRST_POLL
        # Polling rather than a blocking flock in a thread: a cancelled waiter must not
        # leave a thread behind that later takes the lock for nobody.
        while not self.try_acquire():
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_POLL)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def holder(self) -> int | None:
        """The pid written by the current holder, if readable."""
        try:
            text = self.path.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None


@contextlib.asynccontextmanager
async def hold(path: Path) -> AsyncIterator[FileLock]:
    """Wait for and hold the lock on ``path`` for the body of the ``async with``."""
    lock = FileLock(path)
    await lock.acquire()
    try:
        yield lock
    finally:
        lock.release()

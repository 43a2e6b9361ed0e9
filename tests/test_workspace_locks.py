"""The worktree lock: one holder at a time, across objects and processes, freed on death."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from hypothesis.strategies import integers

from engine.workspace.locks import FileLock, hold

_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
print("held", flush=True)
sys.stdin.readline()
"""


class LockMachine(RuleBasedStateMachine):
    """Several FileLock objects on one path: at most one ever holds it."""

    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory()
        path = Path(self._dir.name) / "w.lock"
        self.locks = [FileLock(path) for _ in range(3)]
        self.holder: int | None = None

    @rule(i=integers(0, 2))
    def try_acquire(self, i: int) -> None:
        lock = self.locks[i]
        if lock.held:
            return
        got = lock.try_acquire()
        assert got == (self.holder is None)
        if got:
            self.holder = i

    @precondition(lambda self: self.holder is not None)
    @rule()
    def release(self) -> None:
        assert self.holder is not None
        self.locks[self.holder].release()
        self.holder = None

    @invariant()
    def one_holder_at_most(self) -> None:
        assert sum(lock.held for lock in self.locks) == (0 if self.holder is None else 1)

    def teardown(self) -> None:
        for lock in self.locks:
            lock.release()
        self._dir.cleanup()


TestLockMachine = LockMachine.TestCase
TestLockMachine.settings = settings(max_examples=50, stateful_step_count=20, deadline=None)


async def test_another_process_holds_until_it_dies(tmp_path: Path) -> None:
    path = tmp_path / "w.lock"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _HOLDER,
        str(path),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert await proc.stdout.readline() == b"held\n"
    lock = FileLock(path)
    assert not lock.try_acquire()
    assert lock.holder() == proc.pid

    waiter = asyncio.create_task(lock.acquire())
    proc.kill()
    await proc.wait()
    await asyncio.wait_for(waiter, timeout=10)
    assert lock.held
    lock.release()


async def test_a_cancelled_waiter_takes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "w.lock"
    async with hold(path):
        other = FileLock(path)
        waiter = asyncio.create_task(other.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not other.held
    fresh = FileLock(path)
    assert fresh.try_acquire()
    fresh.release()

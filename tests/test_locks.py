"""The file lock: one exclusive holder or many shared ones, across objects and processes,
freed on death; a cancelled waiter takes nothing; planted links are refused."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from hypothesis.strategies import booleans, integers

from engine.errors import LockBusyError, LockError
from engine.locks import FileLock, Lock, hold

REPO = Path(__file__).resolve().parent.parent

# A second process that takes the lock through engine.locks and holds it until stdin closes.
_HOLDER = """
import asyncio, sys
from pathlib import Path
from engine.locks import FileLock

async def main() -> None:
    lock = FileLock(Path(sys.argv[1]), shared=sys.argv[2] == "shared")
    if sys.argv[3] == "try":
        print("got" if await lock.try_acquire() else "busy", flush=True)
        return
    await lock.acquire()
    print("held", flush=True)
    sys.stdin.readline()

asyncio.run(main())
"""


class LockMachine(RuleBasedStateMachine):
    """Several FileLock objects on one path, shared or not: the flock rules always hold."""

    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory()
        self._loop = asyncio.new_event_loop()
        path = Path(self._dir.name) / "w.lock"
        self.locks = [FileLock(path, shared=i >= 3) for i in range(6)]  # 3 exclusive, 3 shared

    def _run(self, coro: object) -> object:
        return self._loop.run_until_complete(coro)  # type: ignore[arg-type]

    @rule(i=integers(0, 5))
    def try_acquire(self, i: int) -> None:
        lock = self.locks[i]
        if lock.held:
            return
        others = [other for other in self.locks if other.held]
        free = not others or (lock.shared and all(other.shared for other in others))
        assert self._run(lock.try_acquire()) is free

    @rule(i=integers(0, 5))
    def release(self, i: int) -> None:
        self._run(self.locks[i].release())  # releasing a lock not held is a no-op
        assert not self.locks[i].held

    @rule(shared=booleans())
    def a_fresh_object_agrees(self, shared: bool) -> None:
        fresh = FileLock(self.locks[0].path, shared=shared)
        held = [lock for lock in self.locks if lock.held]
        expected = not held or (shared and all(lock.shared for lock in held))
        assert self._run(fresh.try_acquire()) is expected
        self._run(fresh.release())

    @invariant()
    def exclusive_means_alone(self) -> None:
        held = [lock for lock in self.locks if lock.held]
        assert all(lock.shared for lock in held) or len(held) == 1

    def teardown(self) -> None:
        for lock in self.locks:
            self._run(lock.release())
        self._loop.close()
        self._dir.cleanup()


TestLockMachine = LockMachine.TestCase
TestLockMachine.settings = settings(max_examples=50, stateful_step_count=20, deadline=None)


@asynccontextmanager
async def _other_process(path: Path, *, shared: bool = False) -> AsyncIterator[int]:
    """A real second process holding the lock on ``path``; yields its pid."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _HOLDER,
        str(path),
        "shared" if shared else "exclusive",
        "wait",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    assert proc.stdout is not None
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"held\n"
        yield proc.pid
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def _try_in_other_process(path: Path, *, shared: bool = False) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _HOLDER,
        str(path),
        "shared" if shared else "exclusive",
        "try",
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    return out.decode().strip()


def test_file_lock_is_a_lock() -> None:
    lock: Lock = FileLock(Path("x.lock"))
    assert lock.name == "x.lock"
    assert not lock.shared
    assert not lock.held


async def test_another_process_holds_until_it_dies(tmp_path: Path) -> None:
    path = tmp_path / "w.lock"
    async with _other_process(path) as pid:
        lock = FileLock(path)
        assert not await lock.try_acquire()
        assert await lock.holder() == pid
        with pytest.raises(LockBusyError, match=f"held by pid {pid}") as info:
            async with hold(FileLock(path), wait=False):
                pytest.fail("took a lock another process holds")
        assert info.value.holder == pid
        assert info.value.lock == str(path)
        assert info.value.retryable
        assert not await FileLock(path, shared=True).try_acquire()

        waiter = asyncio.create_task(lock.acquire())
        os.kill(pid, 9)
        await asyncio.wait_for(waiter, timeout=10)
    assert lock.held
    assert await lock.holder() == os.getpid()
    assert await _try_in_other_process(path) == "busy"
    await lock.release()
    assert path.read_bytes() == b""  # the pid goes with the lock
    assert await lock.holder() is None
    assert await _try_in_other_process(path) == "got"


async def test_shared_holders_in_two_processes_keep_a_writer_out(tmp_path: Path) -> None:
    path = tmp_path / "s.lock"
    async with _other_process(path, shared=True):
        reader = FileLock(path, shared=True)
        assert await reader.try_acquire()
        assert await _try_in_other_process(path, shared=True) == "got"
        writer = FileLock(path)
        assert not await writer.try_acquire()
        assert await writer.holder() is None  # shared holders leave no pid to blame
        await reader.release()
        assert not await writer.try_acquire()  # the other process still reads
    assert await writer.try_acquire()
    assert await _try_in_other_process(path, shared=True) == "busy"
    await writer.release()


async def test_a_cancelled_waiter_takes_nothing_and_leaves_no_thread(tmp_path: Path) -> None:
    path = tmp_path / "w.lock"
    threads = threading.active_count()
    async with hold(FileLock(path)):
        other = FileLock(path)
        waiter = asyncio.create_task(other.acquire())
        shared_waiter = asyncio.create_task(FileLock(path, shared=True).acquire())
        await asyncio.sleep(0)
        assert threading.active_count() == threads  # waiting parks no thread in flock
        waiter.cancel()
        shared_waiter.cancel()
        for task in (waiter, shared_waiter):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert not other.held
    # Nothing holds it now: another process takes it at once.
    assert await _try_in_other_process(path) == "got"
    fresh = FileLock(path)
    assert await fresh.try_acquire()
    await fresh.release()
    assert threading.active_count() == threads


async def test_hold_releases_when_the_body_fails(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "w.lock"  # the folder is created
    lock = FileLock(path)
    inside: list[bool] = []

    async def fail() -> None:
        async with hold(lock) as held:
            inside.append(held is lock and lock.held)
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        await fail()
    assert inside == [True]
    assert not lock.held
    assert await _try_in_other_process(path) == "got"


async def test_the_same_object_twice_is_a_bug(tmp_path: Path) -> None:
    lock = FileLock(tmp_path / "w.lock")
    assert await lock.try_acquire()
    with pytest.raises(RuntimeError, match="already held"):
        await lock.try_acquire()
    await lock.release()
    await lock.release()


async def test_a_planted_link_or_special_file_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("keep me")
    link = tmp_path / "link.lock"
    link.symlink_to(secret)
    with pytest.raises(LockError, match="symbolic link"):
        await FileLock(link).try_acquire()
    hard = tmp_path / "hard.lock"
    hard.hardlink_to(secret)
    with pytest.raises(LockError, match="not a plain file"):
        await FileLock(hard).try_acquire()
    fifo = tmp_path / "fifo.lock"
    os.mkfifo(fifo)
    with pytest.raises(LockError, match="not a plain file"):
        await asyncio.wait_for(FileLock(fifo).try_acquire(), 10)
    assert secret.read_text() == "keep me"
    assert await FileLock(link).holder() is None
    assert await FileLock(fifo).holder() is None


async def test_no_parent_folder_is_made_when_told_not_to(tmp_path: Path) -> None:
    with pytest.raises(LockError, match="cannot open"):
        await FileLock(tmp_path / "gone" / "r.lock", make_parent=False).try_acquire()
    assert not (tmp_path / "gone").exists()

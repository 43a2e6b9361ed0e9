"""The task folder's lock (``.state``) on PostgreSQL holds across processes (machines)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from engine.errors import LockBusyError
from engine.gates.taskfolder import TaskFolders
from engine.locks import FileLock, hold
from engine.store.backend import open_database
from engine.store.leases import database_lock
from engine.store.location import PostgresURL

REPO = Path(__file__).resolve().parent.parent

# Holds the folder's lock (exclusive or shared), says so, and lets go when told to.
HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from engine.gates.taskfolder import TaskFolders
    from engine.store.backend import open_database
    from engine.store.location import PostgresURL

    async def main(url, folder, exclusive):
        async with open_database(PostgresURL(url)) as db:
            async with TaskFolders(db).lock(Path(folder), exclusive=exclusive):
                print("held", flush=True)
                await asyncio.to_thread(sys.stdin.readline)
            print("released", flush=True)

    asyncio.run(main(sys.argv[2], sys.argv[3], sys.argv[4] == "exclusive"))
    """
)


def _holder(url: str, folder: Path, mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(REPO), url, str(folder), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def _let_go(proc: subprocess.Popen[str]) -> None:
    out, _ = proc.communicate("\n", timeout=30)
    assert out.strip() == "released"
    assert proc.returncode == 0


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


async def test_exclusive_holder_in_another_process_excludes(pg_url: str, tmp_path: Path) -> None:
    folder = tmp_path / "task"
    folder.mkdir()
    proc = _holder(pg_url, folder, "exclusive")
    try:
        async with open_database(PostgresURL(pg_url)) as db:
            key = f"task folder {folder}"
            lock = database_lock(db, key, folder / ".state.lock", shared=True, brief=True)
            with pytest.raises(LockBusyError):
                async with hold(lock, wait=False):
                    pass
            # The database excludes, not the file: its flock is free (another machine
            # would not see it anyway).
            async with hold(FileLock(folder / ".state.lock", make_parent=False), wait=False):
                pass
            waiter = asyncio.create_task(_take(TaskFolders(db), folder), name="waiter")
            await asyncio.to_thread(_let_go, proc)
            assert await asyncio.wait_for(waiter, timeout=30) == "taken"
    finally:
        _end(proc)


async def _take(folders: TaskFolders, folder: Path) -> str:
    async with folders.lock(folder):
        return "taken"


async def test_shared_holders_coexist_and_keep_a_writer_out(pg_url: str, tmp_path: Path) -> None:
    folder = tmp_path / "task"
    folder.mkdir()
    proc = _holder(pg_url, folder, "shared")
    try:
        async with open_database(PostgresURL(pg_url)) as db:
            folders = TaskFolders(db)
            async with folders.lock(folder, exclusive=False):
                pass  # a second reader does not wait for the first
            writer = database_lock(db, f"task folder {folder}", folder / "x", brief=True)
            assert not await writer.try_acquire()
            await asyncio.to_thread(_let_go, proc)
            assert await writer.try_acquire()
            await writer.release()
    finally:
        _end(proc)


async def test_cancelled_waiter_leaves_nothing_locked(pg_url: str, tmp_path: Path) -> None:
    folder = tmp_path / "task"
    folder.mkdir()
    async with open_database(PostgresURL(pg_url)) as db:
        folders = TaskFolders(db)
        entered = asyncio.Event()
        release = asyncio.Event()

        async def hold_it() -> None:
            async with folders.lock(folder):
                entered.set()
                await release.wait()

        holder = asyncio.create_task(hold_it(), name="holder")
        await asyncio.wait_for(entered.wait(), timeout=30)
        other: Any = database_lock(db, f"task folder {folder}", folder / "x", brief=True)
        waiting = asyncio.create_task(other.acquire(), name="waiting")
        await asyncio.sleep(0)  # let it send its wait to the server
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        release.set()
        await holder
        assert await other.try_acquire()  # neither the holder nor the cancelled wait kept it
        await other.release()


async def test_sqlite_keeps_the_file_lock(tmp_path: Path) -> None:
    folder = tmp_path / "task"
    folder.mkdir()
    async with open_database(tmp_path / "t.db") as db, TaskFolders(db).lock(folder):
        with pytest.raises(LockBusyError):
            async with hold(FileLock(folder / ".state.lock", make_parent=False), wait=False):
                pass

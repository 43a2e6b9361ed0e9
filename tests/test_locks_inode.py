"""The lock on a file itself (``InodeLock``): every name of the file shares it, across
processes; it dies with its holder, never writes the file, and a refused second attempt in
the same process leaves SQLite's own locks on the file alone."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import LockError
from engine.locks import InodeLock

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent


# A second process that takes the lock on argv[1] and holds it until stdin closes.
_HOLDER = """
import asyncio, sys
from pathlib import Path
from engine.locks import InodeLock

async def main() -> None:
    lock = InodeLock(Path(sys.argv[1]))
    print("got" if await lock.try_acquire() else "busy", flush=True)
    sys.stdin.readline()

asyncio.run(main())
"""


async def _holder(path: Path) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _HOLDER,
        str(path),
        cwd=REPO,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    return proc, line.decode().strip()


async def _end(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        assert proc.stdin is not None
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 30)


async def test_every_name_of_a_file_shares_one_lock_that_dies_with_its_holder(
    tmp_path: Path,
) -> None:
    database = tmp_path / "t.db"
    database.write_bytes(b"")
    hard = tmp_path / "hard.db"
    hard.hardlink_to(database)
    soft = tmp_path / "soft.db"
    soft.symlink_to(database)
    holder, said = await _holder(hard)
    try:
        assert said == "got"
        for name in (database, hard, soft):
            lock = InodeLock(name)
            assert not await lock.try_acquire()
            assert await lock.holder() == holder.pid
        _, said_too = await _holder(soft)
        assert said_too == "busy"
    finally:
        holder.kill()
        await holder.wait()
    # The kernel drops the lock with its holder.
    lock = InodeLock(soft)
    assert await lock.try_acquire()
    assert await lock.holder() == os.getpid()
    await lock.release()
    assert database.read_bytes() == b""  # the lock never writes the file


async def test_a_missing_file_is_created_empty_and_no_plain_file_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "new" / "t.db"
    lock = InodeLock(path)
    assert await lock.try_acquire()
    assert path.read_bytes() == b""
    await lock.release()
    with pytest.raises(LockError, match="cannot open"):
        await InodeLock(tmp_path).try_acquire()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(LockError, match="not a regular file"):
        await asyncio.wait_for(InodeLock(fifo).try_acquire(), 10)


def _write_from_another_process(path: Path) -> str:
    code = (
        "import sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1], timeout=0, isolation_level=None)\n"
        "try:\n"
        "    c.execute('BEGIN IMMEDIATE')\n"
        "    print('wrote')\n"
        "except sqlite3.OperationalError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.strip()


async def test_a_refused_second_lock_in_the_process_leaves_sqlites_locks_alone(
    tmp_path: Path,
) -> None:
    database = tmp_path / "t.db"
    lock = InodeLock(database)
    assert await lock.try_acquire()
    conn = sqlite3.connect(database, isolation_level=None)
    try:
        conn.execute("CREATE TABLE t (x)")
        conn.execute("BEGIN IMMEDIATE")  # SQLite's own (fcntl) lock on the file
        assert _write_from_another_process(database) == "database is locked"
        # A second bot in this process, on another name: refused, and SQLite's lock holds
        # (closing a descriptor of the file would have dropped it).
        hard = tmp_path / "hard.db"
        hard.hardlink_to(database)
        again = InodeLock(hard)
        assert not await again.try_acquire()
        assert await again.holder() == os.getpid()
        assert _write_from_another_process(database) == "database is locked"
        conn.execute("ROLLBACK")
    finally:
        conn.close()
    await lock.release()
    last = InodeLock(hard)
    assert await last.try_acquire()
    await last.release()

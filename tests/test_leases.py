"""One lock interface on both databases: an ``flock`` on SQLite, an advisory lock on
PostgreSQL, picked from the database; held across processes (on PostgreSQL across
machines: another machine's pid says nothing here), freed when the holder dies. Applied
where turnstile guards "one at a time": one drive per task, one driver per auto run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.automode import prepare_auto_run, prepare_resume
from engine.automode.state import owner_token
from engine.errors import ConfigError, StoreUnreachableError
from engine.gates import GateRefused
from engine.locks import FileLock, Lock
from engine.runs import RunSpec
from engine.settings import load_settings
from engine.sink import NullSink
from engine.store.advisory import AdvisoryLock
from engine.store.backend import open_database
from engine.store.dialect import advisory_key
from engine.store.leases import database_lock
from engine.store.location import PostgresURL
from engine.store.runs import SqliteRunStore
from tests.automode_support import AGENT_CMD, GIT_ENV, git_workspace
from tests.gates_support import make_settings, open_gates
from tests.pg_support import PgCluster

REPO = Path(__file__).resolve().parent.parent

# Another process takes the lock the database calls for, says "held" and keeps it until
# its stdin closes (or it is killed).
_HOLDER = """
import asyncio, sys
from pathlib import Path
from engine.store.backend import open_database
from engine.store.leases import database_lock

async def main() -> None:
    async with open_database(sys.argv[1]) as db:
        lock = database_lock(db, sys.argv[2], Path(sys.argv[3]))
        print("held" if await lock.try_acquire() else "busy", flush=True)
        sys.stdin.readline()
        await lock.release()

asyncio.run(main())
"""


def _target(database: Any, tmp_path: Path) -> str:
    return str(database.url.conninfo()) if database.dialect == "postgresql" else str(database.path)


async def _holder(tmp_path: Path, target: str, key: str, path: Path) -> asyncio.subprocess.Process:
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        target,
        key,
        str(path),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    if line != b"held\n":
        proc.kill()
        _, err = await proc.communicate()
        raise AssertionError((line, err.decode()[-2000:]))
    return proc


def test_advisory_keys_are_stable_signed_64_bit_numbers() -> None:
    assert advisory_key("drive:a") == advisory_key("drive:a")
    assert advisory_key("drive:a") != advisory_key("drive:b")
    keys = [advisory_key(f"run:{i}") for i in range(200)]
    assert all(-(2**63) <= k < 2**63 for k in keys)
    assert any(k < 0 for k in keys)  # the whole signed range is used


async def test_the_lock_is_chosen_from_the_database(database: Any, tmp_path: Path) -> None:
    lock: Lock = database_lock(database, "drive:t", tmp_path / "t.lock")
    if database.dialect == "postgresql":
        assert isinstance(lock, AdvisoryLock)
        assert lock.name.startswith("drive:t on postgresql://")
    else:
        assert isinstance(lock, FileLock)
        assert lock.name == str(tmp_path / "t.lock")


async def test_two_holders_exclude_each_other_in_one_process(database: Any, tmp_path: Path) -> None:
    first = database_lock(database, "drive:t", tmp_path / "t.lock")
    second = database_lock(database, "drive:t", tmp_path / "t.lock")
    other = database_lock(database, "drive:u", tmp_path / "u.lock")
    assert await first.try_acquire()
    try:
        assert first.held
        assert not await second.try_acquire()
        assert await second.holder() == os.getpid()
        assert await other.try_acquire()  # another key is another lock
        await other.release()
    finally:
        await first.release()
    assert not first.held
    assert await second.try_acquire()
    await second.release()
    await second.release()  # releasing what is not held does nothing


async def test_a_lock_held_by_another_process_is_busy_and_freed_when_it_dies(
    database: Any, tmp_path: Path
) -> None:
    path = tmp_path / "t.lock"
    proc = await _holder(tmp_path, _target(database, tmp_path), "run:r1", path)
    lock = database_lock(database, "run:r1", path)
    try:
        assert not await lock.try_acquire()
        assert await lock.holder() == proc.pid
        proc.send_signal(signal.SIGKILL)  # no release: the kernel or the server frees it
        await proc.wait()
        # The server notices the dead connection as soon as its socket closes.
        await asyncio.wait_for(lock.acquire(), 30)
        assert lock.held
    finally:
        await lock.release()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_waiter_cancelled_holds_nothing(database: Any, tmp_path: Path) -> None:
    holder = database_lock(database, "drive:t", tmp_path / "t.lock")
    waiter = database_lock(database, "drive:t", tmp_path / "t.lock")
    assert await holder.try_acquire()
    task = asyncio.create_task(waiter.acquire())
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), 0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await holder.release()
    assert not waiter.held
    fresh = database_lock(database, "drive:t", tmp_path / "t.lock")
    assert await fresh.try_acquire()
    await fresh.release()


async def test_shared_advisory_holders_coexist_and_exclude_an_exclusive_one(pg_url: str) -> None:
    url = PostgresURL(pg_url)
    readers = [AdvisoryLock(url, "state:t", shared=True) for _ in range(2)]
    writer = AdvisoryLock(url, "state:t")
    for reader in readers:
        assert await reader.try_acquire()
    assert not await writer.try_acquire()
    for reader in readers:
        await reader.release()
    assert await writer.try_acquire()
    assert not await AdvisoryLock(url, "state:t", shared=True).try_acquire()
    await writer.release()


async def test_an_unreachable_server_is_a_clear_error_without_the_password(
    pg_cluster: PgCluster,
) -> None:
    url = PostgresURL(pg_cluster.url("postgres", user="nobody", password="hunter2-secret"))
    dead = PostgresURL(f"postgresql://bob:hunter2-secret@127.0.0.1:{support_port()}/x")
    for target in (url, dead):
        with pytest.raises(StoreUnreachableError) as caught:
            await AdvisoryLock(target, "drive:t", connect_timeout=2).try_acquire()
        assert "hunter2-secret" not in str(caught.value)
        assert "bob:***" in str(caught.value) or "nobody:***" in str(caught.value)


def support_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again: nothing listens there


# --- at the call sites ----------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "t.db")
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    return cluster.new_database()


async def test_one_drive_per_task_across_processes(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(tmp_path, database=backend)
    async with open_gates(settings, track_git=False) as gates:
        task = await gates.init_task("t1")
        db = gates.store.db
        proc = await _holder(
            tmp_path, _target(db, tmp_path), "drive:t1", task.folder / ".drive.lock"
        )
        try:
            handle = gates.start_autopilot("t1", NullSink(), tool="command")
            with pytest.raises(GateRefused, match=f"already being driven \\(pid {proc.pid}\\)"):
                await asyncio.wait_for(handle.future, 30)
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            await proc.wait()
        assert (await gates.task("t1")).phase == task.phase  # nothing moved


@pytest.fixture
def auto_env(isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FAKE_AGENT_LOG", str(isolated_env / "agent.log"))
    return isolated_env


async def test_a_run_driven_by_another_process_is_not_resumed(
    backend: str, auto_env: Path, tmp_path: Path
) -> None:
    settings = load_settings(database=backend, runs_dir=auto_env / "runs", preempt_grace=1)
    workspace = git_workspace(auto_env / "ws")
    async with open_database(settings) as db:
        run = await prepare_auto_run(
            settings,
            db,
            RunSpec(objective="o", agent="command", workdir=workspace, agent_cmd=AGENT_CMD),
        )
        # Its driver is elsewhere: a pid that names nothing on this machine.
        store = SqliteRunStore(db)
        state = {**(await store.get_run(run.run_id)).state, "owner": "999999999:1"}
        await store.update_run(run.run_id, state=state)
        proc = await _holder(
            tmp_path, _target(db, tmp_path), f"run:{run.run_id}", run.log_dir / ".owner.lock"
        )
        try:
            with pytest.raises(ConfigError, match=f"still driven by process {proc.pid}"):
                await prepare_resume(settings, db, run.run_id)
            assert (await store.get_run(run.run_id)).state["owner"] == "999999999:1"
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            await proc.wait()
        resumed = await prepare_resume(settings, db, run.run_id)  # its driver let go
        try:
            assert resumed.state.owner == owner_token()
            # While this process holds it, a second resumer is refused.
            with pytest.raises(ConfigError, match=f"still driven by process {os.getpid()}"):
                await prepare_resume(settings, db, run.run_id)
        finally:
            await resumed.close()


async def test_on_postgres_a_local_pid_in_the_owner_is_not_taken_for_a_driver(
    pg_url: str, auto_env: Path
) -> None:
    """The owner token names a pid on whichever machine drove the run: on a shared
    database only the lock says whether somebody still drives it."""
    settings = load_settings(database=pg_url, runs_dir=auto_env / "runs", preempt_grace=1)
    workspace = git_workspace(auto_env / "ws")
    other = await asyncio.create_subprocess_exec(sys.executable, "-c", "input()", stdin=-1)
    try:
        async with open_database(settings) as db:
            run = await prepare_auto_run(
                settings,
                db,
                RunSpec(objective="o", agent="command", workdir=workspace, agent_cmd=AGENT_CMD),
            )
            store = SqliteRunStore(db)
            state = {**(await store.get_run(run.run_id)).state, "owner": owner_token(other.pid)}
            await store.update_run(run.run_id, state=state)
            resumed = await prepare_resume(settings, db, run.run_id)
            assert resumed.state.owner == owner_token()
            await resumed.close()
    finally:
        other.kill()
        await other.wait()

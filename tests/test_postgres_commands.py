"""The terminal commands on a PostgreSQL URL, against a real server (tests/pg_support.py).

``auto``, ``runs``, ``status``, ``autopilot``, ``projects`` and ``backup`` take
``TURNSTILE_DATABASE=postgresql://…``; the password never shows in what they print or
log; a backup is a ``pg_dump`` archive that ``pg_restore`` puts into a fresh database;
a wrong password, a refused connection and a server that goes away in the middle of an
auto run are one clear line each, and a run cut off that way is recorded interrupted and
finishes when resumed once the server is back.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from engine.commands.backup import backup_postgres, find_pg_tool
from engine.errors import ConfigError
from engine.store.backend import open_database
from engine.store.location import PostgresURL
from engine.store.runs import SqliteRunStore, TurnState
from tests.automode_support import (
    AGENT_CMD,
    cli_env,
    commit_step,
    git_workspace,
    happy_rules,
    report_head,
    turnstile,
    write_script,
)
from tests.pg_support import PASSWORD, PASSWORD_ROLE, PgCluster, find_bindir

REPO = Path(__file__).resolve().parent.parent


def _grant(url: str) -> str:
    """The password role may use this database; its URL, with the password in it."""
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in (
            f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {PASSWORD_ROLE}",
            f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {PASSWORD_ROLE}",
            f"GRANT CREATE, USAGE ON SCHEMA public TO {PASSWORD_ROLE}",
        ):
            conn.execute(statement.encode())
    parts = PostgresURL(url)
    return f"postgresql://{PASSWORD_ROLE}:{PASSWORD}@{parts.host}:{parts.port}/{parts.database}"


def _run(
    tmp: Path, env: dict[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        turnstile(*args), cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout
    )


def _env(tmp: Path, url: str, script: Path | None = None, **extra: str) -> dict[str, str]:
    env = cli_env(tmp, script, log=tmp / "agent.log")
    env["TURNSTILE_DATABASE"] = url
    env["TURNSTILE_TASKS_ROOT"] = str(tmp / "tasks")
    env["TURNSTILE_LOG_LEVEL"] = "INFO"
    env.update(extra)
    return env


def _no_secret(*done: subprocess.CompletedProcess[str]) -> None:
    for d in done:
        assert PASSWORD not in d.stdout + d.stderr, (d.args, d.stdout[-500:], d.stderr[-500:])


def test_terminal_commands_work_on_a_postgres_url(pg_url: str, tmp_path: Path) -> None:
    url = _grant(pg_url)
    ws = git_workspace(tmp_path / "ws")
    env = _env(tmp_path, url, write_script(tmp_path / "fake", rules=happy_rules()))
    auto = _run(
        tmp_path,
        env,
        "auto",
        "--tool",
        "command",
        "--agent-cmd",
        AGENT_CMD,
        "--workdir",
        str(ws),
        "-p",
        "create result.txt and commit it",
    )
    assert auto.returncode == 0, auto.stderr[-2000:]
    run_id, status = report_head(auto.stdout)
    assert status == "completed"
    runs = _run(tmp_path, env, "runs")
    assert runs.returncode == 0, runs.stderr
    assert run_id in runs.stdout
    shown = _run(tmp_path, env, "runs", run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["status"] == "completed"
    init = _run(tmp_path, env, "status", "--task", "t1", "--init")
    assert init.returncode == 0, init.stderr
    listed = _run(tmp_path, env, "status", "--list")
    assert listed.returncode == 0, listed.stderr
    assert "t1" in listed.stdout
    manual = _run(tmp_path, env, "autopilot", "--task", "t1", "--manual")
    assert manual.returncode == 0, manual.stderr
    assert manual.stdout.startswith("t1: research")
    worktrees = _run(tmp_path, env, "projects", "worktrees")
    assert worktrees.returncode == 0, worktrees.stderr
    _no_secret(auto, runs, shown, init, listed, manual, worktrees)
    assert not list(tmp_path.glob("*.db"))  # nothing fell back to a SQLite file
    # Everything went to the server.
    with psycopg.connect(pg_url) as conn:
        row = conn.execute("SELECT status FROM runs WHERE id = %s", (run_id,)).fetchone()
        assert row == ("completed",)
        assert conn.execute("SELECT count(*) FROM gate_tasks").fetchone() == (1,)


def test_tool_approvals_at_the_terminal_run_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    ws = git_workspace(tmp_path / "ws")
    env = _env(
        tmp_path,
        _grant(pg_url),
        write_script(tmp_path / "fake", rules=happy_rules()),
        TURNSTILE_TOOL_APPROVAL="all",
    )
    argv = ["auto", "--tool", "command", "--agent-cmd", AGENT_CMD, "--workdir", str(ws)]
    done = _run(tmp_path, env, *argv, "-p", "create result.txt and commit it")
    assert done.returncode == 0, done.stderr[-2000:]
    assert report_head(done.stdout)[1] == "completed"
    _no_secret(done)
    assert not list(tmp_path.glob("*.db"))  # nothing fell back to a SQLite file


def test_a_wrong_password_is_one_line_without_the_password(
    pg_cluster: PgCluster, tmp_path: Path
) -> None:
    url = pg_cluster.url("postgres", user=PASSWORD_ROLE, password="hunter2-wrong")
    env = _env(tmp_path, url)
    for command in (["runs"], ["status", "--list"], ["backup", str(tmp_path / "b.dump")]):
        done = _run(tmp_path, env, *command)
        assert done.returncode != 0
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, done.stderr
        assert "authentication failed" in lines[0]
        assert f"{PASSWORD_ROLE}:***@127.0.0.1" in lines[0]
        assert "hunter2-wrong" not in done.stdout + done.stderr
    assert not (tmp_path / "b.dump").exists()


def test_a_refused_connection_is_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = _env(tmp_path, f"postgresql://bob:hunter2-secret@127.0.0.1:{port}/team")
    done = _run(tmp_path, env, "runs")
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "cannot reach the PostgreSQL database postgresql://bob:***@127.0.0.1" in lines[0]
    assert "hunter2-secret" not in done.stdout + done.stderr


def test_a_database_from_a_newer_turnstile_is_refused_in_one_line(
    pg_url: str, tmp_path: Path
) -> None:
    url = _grant(pg_url)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE schema_versions SET version = 999 WHERE owner = 'engine'")
    env = _env(tmp_path, url)
    for command in (["runs"], ["status", "--list"], ["auto", "--resume", "x"]):
        done = _run(tmp_path, env, *command)
        assert done.returncode != 0
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, done.stderr
        assert "was migrated by a newer turnstile (engine schema version 999" in lines[0]
        _no_secret(done)
    with psycopg.connect(pg_url) as conn:  # refused, not touched
        row = conn.execute("SELECT version FROM schema_versions WHERE owner = 'engine'")
        assert row.fetchone() == (999,)


# --- backup and restore ------------------------------------------------------------------


def test_backup_is_a_pg_dump_archive_that_restores_into_a_fresh_database(
    pg_cluster: PgCluster, pg_url: str, tmp_path: Path
) -> None:
    async def fill() -> None:
        async with open_database(pg_url) as db:
            runs = SqliteRunStore(db)
            await runs.create_run("r1", mode="auto", agent="a", session_id="s", chat_id="-100123")
            await runs.start_turn("r1", 1, "the plan prompt", "plan")

    import asyncio

    asyncio.run(fill())
    url = _grant(pg_url)
    env = _env(tmp_path, url)
    done = _run(tmp_path, env, "backup", str(tmp_path / "backups") + "/")
    assert done.returncode == 0, done.stderr
    _no_secret(done)
    assert "postgresql://turnstile_pw:***@" in done.stdout
    assert "archive readable by pg_restore" in done.stdout
    (archive,) = (tmp_path / "backups").glob("turnstile-*.dump")
    assert archive.read_bytes()[:5] == b"PGDMP"  # pg_dump's custom format
    again = _run(tmp_path, env, "backup", str(archive))
    assert again.returncode != 0
    assert "exists: pass --force" in again.stderr

    # Restore (as docs/deploy.md says) into a fresh, empty database.
    pg_cluster.admin('CREATE DATABASE "restored" TEMPLATE template0')
    pg_restore = find_pg_tool("pg_restore")
    assert pg_restore is not None
    restored = pg_cluster.url("restored")
    subprocess.run(
        [str(pg_restore), "--no-owner", f"--dbname={restored}", str(archive)],
        check=True,
        capture_output=True,
        timeout=120,
    )

    async def read() -> tuple[Any, ...]:
        async with open_database(restored) as db:  # opens: nothing pending after restore
            assert await db.schema_version() == db.latest_version
            run = await SqliteRunStore(db).get_run("r1")
            turns = await SqliteRunStore(db).turns("r1")
            return run.chat_id, [(t.seq, t.phase, t.state) for t in turns]

    assert asyncio.run(read()) == ("-100123", [(1, "plan", TurnState.STARTED)])


async def test_backup_without_pg_dump_is_refused_in_one_line(pg_url: str, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="runs pg_dump, which is not installed") as caught:
        await backup_postgres(
            PostgresURL(pg_url), tmp_path / "b.dump", search_path=str(empty), roots=()
        )
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "b.dump").exists()


# --- a server that goes away in the middle of a run ------------------------------------------


class _OwnCluster(PgCluster):
    """A server of this test's own, which it stops and starts again."""

    def start_again(self) -> None:
        options = (
            f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off"
        )
        data = str(self.folder / "data")
        log = str(self.folder / "log")
        self._run(str(self.bindir / "pg_ctl"), "-D", data, "-w", "-l", log, "-o", options, "start")


@pytest.fixture
def own_cluster() -> Iterator[_OwnCluster]:
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries not found")
    folder = Path(tempfile.mkdtemp(prefix="turnstile-pg-own-"))
    cluster = _OwnCluster(bindir, folder)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _wait_for(path: Path, proc: subprocess.Popen[str], deadline: float = 60) -> None:
    end = time.monotonic() + deadline
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"turnstile exited early: {proc.communicate()}")
        if time.monotonic() > end:
            raise AssertionError(f"{path} never appeared")
        time.sleep(0.02)  # polling a file the agent writes, with a deadline


def test_a_server_that_goes_away_mid_run_is_a_clear_error_and_the_run_resumes(
    own_cluster: _OwnCluster, tmp_path: Path
) -> None:
    own_cluster.admin('CREATE DATABASE "team"')
    url = own_cluster.url("team", user=PASSWORD_ROLE, password=PASSWORD)
    own_cluster.admin(f'ALTER DATABASE "team" OWNER TO {PASSWORD_ROLE}')
    ws = git_workspace(tmp_path / "ws")
    started, go = tmp_path / "execute-started", tmp_path / "go"
    # The Execute turn says it started, then waits until the test says go.
    wait = (
        "import pathlib, sys, time\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.02)\n"
    )
    step = commit_step("result.txt")
    step["run"] = [[sys.executable, "-c", wait], *step["run"]]
    rules = happy_rules(execute=step)
    env = _env(tmp_path, url, write_script(tmp_path / "fake", rules=rules))
    argv = ["auto", "--tool", "command", "--agent-cmd", AGENT_CMD, "--workdir", str(ws)]
    proc = subprocess.Popen(
        turnstile(*argv, "-p", "create result.txt and commit it"),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(started, proc)
        own_cluster.stop()  # the server goes away while the turn runs
        go.touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert "turnstile: " in err
    assert "PostgreSQL database postgresql://turnstile_pw:***@127.0.0.1" in err, err[-2000:]
    assert PASSWORD not in out + err
    assert "Traceback" not in err

    own_cluster.start_again()
    with psycopg.connect(url) as conn:
        ((run_id, status),) = conn.execute("SELECT id, status FROM runs").fetchall()
        assert status == "running"  # cut off: nothing recorded it as ended
        turns = conn.execute(
            "SELECT seq, phase, state, output FROM turns WHERE run_id = %s ORDER BY id", (run_id,)
        ).fetchall()
    # The turns before Execute are whole; Execute is started and nothing of it written.
    assert [t[2] for t in turns] == ["finished", "finished", "started"]
    assert turns[-1][1] == "execute"
    assert turns[-1][3] is None

    started.unlink()
    resumed = _run(tmp_path, env, "auto", "--resume", run_id)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert report_head(resumed.stdout) == (run_id, "completed")
    with psycopg.connect(url) as conn:
        states = conn.execute(
            "SELECT seq, attempt, state FROM turns WHERE run_id = %s AND phase = 'execute'"
            " ORDER BY id",
            (run_id,),
        ).fetchall()
        assert states[:2] == [(3, 1, "interrupted"), (3, 2, "finished")]
        row = conn.execute("SELECT status FROM runs WHERE id = %s", (run_id,)).fetchone()
        assert row == ("completed",)

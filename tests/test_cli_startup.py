"""What ``turnstile status --list`` and ``turnstile runs`` do before their first line.

Each test runs the real command in a child process on a real database, and looks at what
that process imported (its ``sys.modules`` when ``main`` returned), what it printed and
what it left in the database. Nothing here is timed: bench/bench_status.py measures.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from engine.commands._settings import SECRET_NAMES, ListingSettings, read_listing_settings
from engine.errors import ConfigError
from engine.settings import SECRET_SETTINGS, load_settings
from engine.store.backend import open_database
from engine.store.database import (
    ENGINE,
    MigrationSet,
    discover_migrations,
    load_migrations,
    read_schema_versions,
)
from engine.store.runs import RunStatus, SqliteRunStore
from engine.turn import TurnOutput
from tests.conftest import REPO
from tests.support import clean_env

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(120)]

# Runs the CLI's own main in a fresh interpreter, then writes what it had imported and
# how many objects it left out of the collector's passes at exit.
_DRIVER = """
import gc, json, sys
import engine.cli
code = engine.cli.main(sys.argv[2:])
redact = sys.modules.get("engine.redact")
compiled = redact._compiled.cache_info().currsize if redact is not None else 0
with open(sys.argv[1], "w") as fh:
    json.dump(
        {"modules": sorted(sys.modules), "frozen": gc.get_freeze_count(), "shapes": compiled},
        fh,
    )
sys.exit(code)
"""

# Loaded by no listing: the settings model, the queue, the chat, other sub-commands' parts.
NEVER = (
    "pydantic",
    "pydantic_settings",
    "engine.settings",
    "procrastinate",
    "telegram",
    "psycopg",
    "psycopg_pool",
    "engine.automode",
    "engine.agents",
    "engine.process",
    "engine.gates.service",
    "engine.sandbox",
    "rich",
    "textual",
    "mcp",
)
# `runs` looks up the runs' worktrees (the workspace package, which knows git); the task
# listing does not.
NEVER_FOR = {
    # Nor the workers' store (looking their migrations up loaded it).
    "status --list": (*NEVER, "engine.workspace", "engine.git", "engine.workers.store"),
    "runs --json": NEVER,
    "runs": NEVER,
}


def run_turnstile(
    tmp_path: Path, *args: str, env: dict[str, str], cwd: Path | None = None
) -> tuple[subprocess.CompletedProcess[str], set[str], int]:
    """The finished child; the modules it had imported and the objects it had frozen."""
    modules = tmp_path / "modules.json"
    modules.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(modules), *args],
        env={**env, "PYTHONPATH": str(REPO)},
        cwd=cwd or tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    found = json.loads(modules.read_text()) if modules.exists() else {}
    return proc, set(found.get("modules", ())), int(found.get("frozen", 0))


def imported(loaded: set[str], package: str) -> bool:
    return any(name == package or name.startswith(package + ".") for name in loaded)


async def fill(target: Path | str) -> None:
    """Three tasks (a parent, its sub-task, another), and two runs: one finished, one
    recorded running whose process is gone."""
    async with open_database(target) as db:
        async with db.transaction() as conn:
            for name, parent, phase in (
                ("alpha", None, "design"),
                ("alpha.sub", "alpha", "implement"),
                ("beta", None, "research"),
            ):
                await conn.execute(
                    "INSERT INTO gate_tasks (name, folder, workdir, phase, version, parent, "
                    "wave, gate_round, created_at, updated_at) "
                    "VALUES (?, ?, ?, ?, 1, ?, ?, 0, 1, 1)",
                    (name, f"/t/{name}", f"/t/{name}", phase, parent, 1 if parent else None),
                )
        store = SqliteRunStore(db)
        for run_id, running in (("auto-done", False), ("auto-cut-off", True)):
            owner = {"owner": "999999999:1"} if running else {}
            await store.create_run(
                run_id, mode="auto", agent="claude", session_id=run_id, state=owner
            )
            turn = await store.start_turn(run_id, 1, "prompt", "execute")
            await store.finish_turn(turn, TurnOutput(text="done", exit_code=0))
            if not running:
                await store.update_run(run_id, status=RunStatus.COMPLETED, turn=1, exit_code=0)


def env_for(database: Path | str, **extra: str) -> dict[str, str]:
    return {**clean_env(), "TURNSTILE_DATABASE": str(database), **extra}


@pytest.mark.parametrize("command", list(NEVER_FOR))
def test_a_listing_loads_only_what_it_needs(tmp_path: Path, command: str) -> None:
    db = tmp_path / "t.db"
    asyncio.run(fill(db))
    proc, loaded, frozen = run_turnstile(tmp_path, *command.split(), env=env_for(db))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert loaded, "the child wrote no module list"
    assert [p for p in NEVER_FOR[command] if imported(loaded, p)] == []
    # The redaction table is compiled on first use, and a listing has nothing to redact.
    assert json.loads((tmp_path / "modules.json").read_text())["shapes"] == 0
    # Its exit skips the collector's full passes over all it loaded.
    assert frozen > 10_000
    if command == "status --list":
        names = [line.split()[0] for line in proc.stdout.splitlines()]
        assert names == ["alpha", "wave", "alpha.sub", "beta"]
    elif command == "runs --json":
        shown = {row["id"]: row["status"] for row in map(json.loads, proc.stdout.splitlines())}
        assert shown == {"auto-done": "completed", "auto-cut-off": "running*"}
    else:
        assert "auto-cut-off" in proc.stdout
        assert "running*" in proc.stdout
        assert "continue it with `turnstile auto --resume RUN`" in proc.stdout


def test_other_status_verbs_still_check_every_setting(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    asyncio.run(fill(db))
    env = env_for(db, TURNSTILE_WEBHOOK_PORT="not-a-port")
    proc, _, _ = run_turnstile(tmp_path, "status", "--task", "beta", env=env)
    assert proc.returncode == 2
    assert "TURNSTILE_WEBHOOK_PORT" in proc.stderr
    assert "not-a-port" not in proc.stderr
    proc, _, frozen = run_turnstile(tmp_path, "status", "--task", "beta", env=env_for(db))
    assert proc.returncode == 0, proc.stderr
    assert frozen == 0  # a command that goes on collects as ever
    # The listing reads only where the database is: a setting it never uses is not its
    # business (the commands that use it say what is wrong with it).
    proc, _, _ = run_turnstile(tmp_path, "status", "--list", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "beta" in proc.stdout


def test_a_malformed_database_setting_is_said_as_before(tmp_path: Path) -> None:
    env = env_for("postgresql://user:hunter2hunter2@127.0.0.1:1/")
    for command in ("status --list", "runs --json", "status --audit"):
        proc, _, _ = run_turnstile(tmp_path, *command.split(), env=env)
        assert proc.returncode == 2, (command, proc.stderr)
        assert proc.stderr.startswith("turnstile: TURNSTILE_DATABASE:"), proc.stderr
        assert "names no database" in proc.stderr
        assert "hunter2" not in proc.stderr


def test_the_listing_reads_dot_env_under_the_environment(tmp_path: Path) -> None:
    from_file = tmp_path / "from-file.db"
    asyncio.run(fill(from_file))
    (tmp_path / ".env").write_text(f"TURNSTILE_DATABASE={from_file}\nTURNSTILE_LOG_LEVEL=\n")
    proc, _, _ = run_turnstile(tmp_path, "status", "--list", env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert "alpha.sub" in proc.stdout
    # The environment wins; an empty value is unset (the file's value stands).
    other = tmp_path / "other.db"
    asyncio.run(fill(other))
    asyncio.run(_drop_task(other, "beta"))
    proc, _, _ = run_turnstile(
        tmp_path, "status", "--list", env={**clean_env(), "turnstile_database": str(other)}
    )
    assert proc.returncode == 0, proc.stderr
    assert "beta" not in proc.stdout
    proc, _, _ = run_turnstile(
        tmp_path, "status", "--list", env={**clean_env(), "TURNSTILE_DATABASE": ""}
    )
    assert "beta" in proc.stdout


async def _drop_task(target: Path, name: str) -> None:
    async with open_database(target) as db:
        await db.execute("DELETE FROM gate_transitions WHERE task = ?", (name,))
        await db.execute("DELETE FROM gate_tasks WHERE name = ?", (name,))


# The listing's reading of the settings agrees with the model's, source by source.
CASES: list[tuple[dict[str, str], str | None]] = [
    ({}, None),
    ({"TURNSTILE_DATABASE": "/srv/t.db", "TURNSTILE_LOG_FORMAT": "json"}, None),
    ({"turnstile_log_level": "debug"}, "TURNSTILE_LOG_LEVEL=WARNING\nTURNSTILE_DATABASE=x.db\n"),
    ({"TURNSTILE_DATABASE": ""}, "TURNSTILE_DATABASE='quoted db.db'  # a comment\n"),
    (
        {"TURNSTILE_TELEGRAM_TOKEN": "123456:abcdefghijklmnopqrstuvwxyz"},
        'TURNSTILE_WEBHOOK_SECRET="s3cret-webhook-value"\n'
        "export TURNSTILE_TRANSCRIPTION_KEY=sk-transcribe-0123456789\n"
        "TURNSTILE_PROJECTS=web=https://bob:pa55word-long@git.example/web.git\n",
    ),
    ({"TURNSTILE_DATABASE": "postgresql://u:pw-in-the-url@127.0.0.1:5/db"}, None),
]


@pytest.mark.parametrize(("environ", "dot_env"), CASES)
def test_the_listing_reads_settings_as_the_model_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], dot_env: str | None
) -> None:
    if dot_env is not None:
        (tmp_path / ".env").write_text(dot_env)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    quick = read_listing_settings()
    model = load_settings()
    assert isinstance(quick, ListingSettings)
    assert quick.database == model.database
    assert quick.log_level == model.log_level
    assert quick.log_format == model.log_format
    assert set(quick.secret_values()) == set(model.secret_values())
    assert quick.full() == model


def test_the_listing_knows_every_secret_setting() -> None:
    assert {"TURNSTILE_" + name.upper() for name in SECRET_NAMES} == SECRET_SETTINGS


def test_what_the_listing_cannot_read_goes_to_the_model(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("TURNSTILE_LOG_FORMAT=yaml\n")
    with pytest.raises(ConfigError, match="TURNSTILE_LOG_FORMAT: Input should be 'text' or 'json'"):
        read_listing_settings()
    env_file.write_text("TURNSTILE_DATABASE\n")  # no value: the model's default
    assert read_listing_settings() == load_settings()
    env_file.write_bytes(b"TURNSTILE_DATABASE=\xff\n")
    with pytest.raises(UnicodeDecodeError):
        load_settings()
    with pytest.raises(UnicodeDecodeError):
        read_listing_settings()


# Migrations: the check that finds nothing to do writes nothing; one that finds a schema
# behind still migrates it.


def older_schemas(engine_up_to: int) -> list[MigrationSet]:
    """The engine's migrations up to ``engine_up_to``; no front end's."""
    return [MigrationSet(ENGINE, tuple(m for m in load_migrations() if m.version <= engine_up_to))]


@pytest.mark.parametrize("command", ["status --list", "runs --json"])
def test_a_schema_behind_is_migrated_by_a_listing(tmp_path: Path, command: str) -> None:
    db = tmp_path / "old.db"
    latest = {s.owner: s.latest for s in discover_migrations()}

    async def make_old() -> None:
        # A database of an older turnstile: before the listing's index, before the
        # front ends had tables.
        async with open_database(db, migrations=older_schemas(latest[ENGINE] - 1)):
            pass

    asyncio.run(make_old())
    before = read_schema_versions(db)
    assert before[ENGINE] == latest[ENGINE] - 1
    proc, _, _ = run_turnstile(tmp_path, *command.split(), env=env_for(db))
    assert proc.returncode == 0, proc.stderr
    # The engine's tables (and its workers') are brought up to date; a front end's are left
    # for the front end itself (a listing does not look the front ends up: start-up time).
    after = read_schema_versions(db)
    assert after[ENGINE] == latest[ENGINE]
    assert after["workers"] == latest["workers"]
    assert after.get("bot", 0) == 0
    with sqlite3.connect(db) as conn:
        index = conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE type = 'index' AND name = ?",
            ("gate_tasks_listing",),
        ).fetchone()
    assert index == (1,)


def test_a_front_end_not_recorded_yet_is_migrated(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    # A database the engine is current in, made before the workers had tables.
    schemas = [s for s in discover_migrations() if s.owner != "workers"]

    async def make() -> None:
        async with open_database(db, migrations=schemas):
            pass

    asyncio.run(make())
    assert "workers" not in read_schema_versions(db, schemas)
    proc, _, _ = run_turnstile(tmp_path, "status", "--list", env=env_for(db))
    assert proc.returncode == 0, proc.stderr
    assert read_schema_versions(db) == {s.owner: s.latest for s in discover_migrations()}
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM workers").fetchone() == (0,)


@pytest.mark.parametrize("command", ["status --list", "runs --json"])
def test_a_listing_does_not_wait_for_a_writer(tmp_path: Path, command: str) -> None:
    db = tmp_path / "t.db"
    asyncio.run(fill(db))
    writer = sqlite3.connect(db, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")  # another process's long write transaction
        writer.execute("UPDATE gate_tasks SET updated_at = 2 WHERE name = 'beta'")
        proc, _, _ = run_turnstile(
            tmp_path, *command.split(), env=env_for(db, TURNSTILE_LOG_LEVEL="WARNING")
        )
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert proc.returncode == 0, proc.stderr
    assert ("beta" if command == "status --list" else "auto-done") in proc.stdout


@pytest.mark.parametrize("command", ["status --list", "runs --json"])
def test_a_listing_on_postgresql_does_not_wait_for_a_migration(
    tmp_path: Path, pg_url: str, command: str
) -> None:
    asyncio.run(fill(pg_url))
    # Another process holds the migrations' lock (its migration takes a while).
    with psycopg.connect(pg_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (0x74726E73746C,))
        proc, loaded, _ = run_turnstile(tmp_path, *command.split(), env=env_for(pg_url))
    assert proc.returncode == 0, proc.stderr
    assert ("beta" if command == "status --list" else "auto-done") in proc.stdout
    assert imported(loaded, "psycopg")
    assert not imported(loaded, "pydantic")


def test_a_postgresql_schema_behind_is_migrated_by_a_listing(tmp_path: Path, pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        # The engine's migrations from 0016 on (0016: a drive's session on its run; 0017: one
        # status per run) undone by hand: gate_sessions back, with a session in it.
        conn.execute(
            b"CREATE TABLE gate_sessions (task TEXT PRIMARY KEY REFERENCES gate_tasks (name),"
            b" agent TEXT NOT NULL, session_id TEXT NOT NULL,"
            b" started BIGINT NOT NULL DEFAULT 0, updated_at DOUBLE PRECISION NOT NULL)"
        )
        conn.execute(
            b"INSERT INTO gate_tasks (name, folder, workdir, phase, version, created_at,"
            b" updated_at) VALUES ('t', '/f', '/w', 'research', 1, 1, 1)"
        )
        conn.execute(
            b"INSERT INTO runs (id, mode, agent, session_id, status, task, created_at,"
            b" updated_at) VALUES ('autopilot-1', 'autopilot', 'claude', '', 'parked', 't', 1, 1)"
        )
        conn.execute(b"INSERT INTO gate_sessions VALUES ('t', 'claude', 's-t', 1, 1)")
        # Back to engine 15: 0016 and every later migration run again (they may be re-run).
        conn.execute("UPDATE schema_versions SET version = 15 WHERE owner = %s", (ENGINE,))
    proc, _, _ = run_turnstile(tmp_path, "status", "--list", env=env_for(pg_url))
    assert proc.returncode == 0, proc.stderr
    latest = {s.owner: s.latest for s in discover_migrations()}
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows: dict[str, int] = dict(
            conn.execute("SELECT owner, version FROM schema_versions").fetchall()
        )
        tables = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name = 'gate_sessions'"
        ).fetchone()
        session = conn.execute("SELECT session_id FROM runs WHERE id = 'autopilot-1'").fetchone()
    assert rows == latest
    assert tables == (0,)
    assert session == ("s-t",)

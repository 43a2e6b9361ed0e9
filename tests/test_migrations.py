"""Migrations per owner: the engine's and the bot's, and databases made by older code.

A database is built the way ``main`` built it before the bot had its own migrations
(``tests/schema_main``: one sequence, ``PRAGMA user_version``), then opened with today's
code: nothing is migrated twice, no row is lost, and the schema ends up the same as a
fresh database's.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from chatfront.migrations import migrations as bot_migrations
from chatfront.store import OutboxItem, SqlBotStore
from engine.commands.doctor import Status, check_database
from engine.errors import StoreError
from engine.store import (
    Database,
    MigrationSet,
    PostgresURL,
    SqliteAuditLog,
    SqliteRunStore,
    discover_migrations,
)
from engine.store.backend import open_database
from engine.store.database import load_migrations, read_schema_versions
from engine.workers.migrations import migrations as workers_migrations
from tests.conftest import REPO

MAIN_SCHEMA = REPO / "tests" / "schema_main"
_FILE = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
BOOKKEEPING = {"schema_versions", "schema_split"}
BOT_TABLES = {
    "bot_inbound",
    "bot_outbox",
    "bot_live",
    "bot_bindings",
    "bot_prompts",
    "bot_gates",
    "bot_reason_requests",
    "bot_chat_migrations",
}
# The latest versions this code ships (main's database is at engine 5, bot 1).
ENGINE_LATEST = load_migrations()[-1].version
BOT_LATEST = bot_migrations().latest
WORKERS_LATEST = workers_migrations().latest
LATEST = {"engine": ENGINE_LATEST, "bot": BOT_LATEST, "workers": WORKERS_LATEST}


def _build_as_main(path: Path, *, up_to: int) -> None:
    """A database made by main's code: each file in order, then ``user_version`` set."""
    files = sorted(f for f in MAIN_SCHEMA.iterdir() if _FILE.match(f.name))
    assert [f.name[:4] for f in files] == ["0001", "0003", "0004", "0005"]
    conn = sqlite3.connect(path)
    try:
        for file in files:
            version = int(file.name[:4])
            if version > up_to:
                break
            conn.executescript(file.read_text())
            conn.execute(f"PRAGMA user_version = {version}")
        conn.execute(
            "INSERT INTO runs (id, mode, agent, session_id, status, created_at, updated_at)"
            " VALUES ('r-old', 'chat', 'claude', 's-old', 'completed', 1.0, 2.0)"
        )
        if up_to >= 4:
            conn.execute(
                "INSERT INTO bot_bindings (chat_id, thread_id, agent, project, workdir,"
                " session_id, created_at) VALUES (-100, 0, 'claude', 'p', '/w', 's-old', 1.0)"
            )
            conn.execute(
                "INSERT INTO bot_outbox (chat_id, kind, body, state, created_at)"
                " VALUES (-100, 'text', 'queued before the upgrade', 'pending', 1.0)"
            )
            conn.execute(
                "INSERT INTO bot_audit (at, user_id, chat_id, update_id, action, outcome,"
                " reason) VALUES (3.0, 42, -100, 7, 'approve', 'refused', 'not an approver')"
            )
        if up_to >= 3:
            conn.execute(
                "INSERT INTO gate_audit (at, task, phase, event, outcome, actor)"
                " VALUES (4.0, 't', 'research', 'approve', 'approved', '43')"
            )
        conn.commit()
    finally:
        conn.close()


def _schema(path: Path) -> dict[str, str]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite_%'"
        ).fetchall()
    finally:
        conn.close()
    return {name: sql for name, sql in rows if name not in BOOKKEEPING}


async def _open_fresh(tmp_path: Path) -> Path:
    path = tmp_path / "fresh.db"
    async with Database(path):
        pass
    return path


async def test_a_database_from_main_migrates_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "main.db"
    _build_as_main(path, up_to=5)
    before = _schema(path)

    # The doctor reads it as behind without touching it.
    assert read_schema_versions(path) == {"engine": 5, "bot": 1, "workers": 0}
    check = await check_database(path)
    assert check.status is Status.FAIL, check
    assert f"at schema version 5, this turnstile needs {ENGINE_LATEST}" in check.detail
    assert _schema(path) == before

    async with Database(path) as db:
        assert await db.schema_versions() == LATEST
        assert await db.schema_version() == ENGINE_LATEST
        run = await SqliteRunStore(db).get_run("r-old")
        assert run is not None
        assert run.session_id == "s-old"
        bot = SqlBotStore(db)
        binding = await bot.binding("-100", None)  # (main wrote the number and topic 0)
        assert binding is not None
        assert binding.session_id == "s-old"
        assert (binding.chat_id, binding.thread_id) == ("-100", None)  # text; no topic: None
        old = await bot.next_outbox()
        assert old is not None
        assert old.item.body == "queued before the upgrade"
        assert old.item.chat_id == "-100"
        await bot.enqueue([OutboxItem(chat_id="-100", kind="text", body="after")])
        assert await bot.pending_outbox() == 2
        # Both audit trails are now the one log, each entry with its origin.
        [refusal] = await bot.audit_entries()
        assert (refusal.user_id, refusal.action, refusal.reason) == (
            42,
            "approve",
            "not an approver",
        )
        entries = await SqliteAuditLog(db).entries()
        assert [(e.origin, e.event, e.outcome) for e in entries] == [
            ("gates", "approve", "approved"),
            ("bot", "approve", "refused"),  # copied in after the gates' own entries
        ]
    # It now has what a fresh database has.
    assert _schema(path) == _schema(await _open_fresh(tmp_path))
    assert (await check_database(path)).status is Status.OK
    # And a second open applies nothing.
    async with Database(path) as db:
        assert await db.schema_versions() == LATEST
    conn = sqlite3.connect(path)
    try:
        assert conn.execute(
            "SELECT owner, version FROM schema_versions ORDER BY owner"
        ).fetchall() == [("bot", BOT_LATEST), ("workers", WORKERS_LATEST)]
        assert conn.execute("PRAGMA user_version").fetchone()[0] == ENGINE_LATEST
    finally:
        conn.close()


async def test_a_database_from_before_the_bot_tables_gets_them(tmp_path: Path) -> None:
    path = tmp_path / "older.db"
    _build_as_main(path, up_to=3)
    assert read_schema_versions(path) == {"engine": 3, "bot": 0, "workers": 0}
    behind = await check_database(path)
    assert behind.status is Status.FAIL
    assert f"at schema version 3, this turnstile needs {ENGINE_LATEST}" in behind.detail
    async with Database(path) as db:
        assert await db.schema_versions() == LATEST
        assert await SqlBotStore(db).bindings() == []
    assert _schema(path) == _schema(await _open_fresh(tmp_path))


async def test_a_fresh_database_has_every_owners_tables(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    async with Database(path) as db:
        assert await db.schema_versions() == db.latest_versions == LATEST
    tables = set(_schema(path))
    assert tables >= BOT_TABLES
    assert {"runs", "turns", "gate_tasks", "workspaces"} <= tables
    assert (await check_database(path)).status is Status.OK


async def test_the_engine_has_no_bot_tables_and_the_bot_is_discovered(tmp_path: Path) -> None:
    engine_sql = " ".join(s for m in load_migrations() for s in m.statements)
    assert "bot_" not in engine_sql
    owners = [s.owner for s in discover_migrations()]
    # the bot and the workers through their entry points
    assert owners == ["engine", "bot", "workers"]
    assert BOT_LATEST >= 2  # 1: its tables; 2: its audit joins the one log
    path = tmp_path / "engine-only.db"
    engine_only = [MigrationSet("engine", load_migrations())]
    async with Database(path, migrations=engine_only) as db:
        assert await db.schema_versions() == {"engine": ENGINE_LATEST}
    assert not [t for t in _schema(path) if t.startswith("bot_")]


async def test_a_front_end_installed_later_is_adopted_or_migrated(tmp_path: Path) -> None:
    engine_only = [MigrationSet("engine", load_migrations())]
    # A database from main, first opened by code without the bot: the bot tables exist.
    old = tmp_path / "main.db"
    _build_as_main(old, up_to=5)
    async with Database(old, migrations=engine_only):
        pass
    async with Database(old) as db:
        assert await db.schema_versions() == LATEST
    # A new database first made without the bot: the bot's tables are created later.
    new = tmp_path / "new.db"
    async with Database(new, migrations=engine_only):
        pass
    async with Database(new) as db:
        assert await db.schema_versions() == LATEST
        assert await SqlBotStore(db).bindings() == []


async def test_a_newer_front_end_schema_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    async with Database(path) as db:
        await db.execute(
            "UPDATE schema_versions SET version = ? WHERE owner = 'bot'", (BOT_LATEST + 1,)
        )
    check = await check_database(path)
    assert check.status is Status.FAIL
    assert (
        f"bot schema version {BOT_LATEST + 1}, newer than this turnstile ({BOT_LATEST})"
        in check.detail
    )


def test_migration_sets_are_validated() -> None:
    with pytest.raises(StoreError, match="invalid migration owner"):
        MigrationSet("Bot tables", ())
    step = load_migrations()[0]
    with pytest.raises(StoreError, match="out of order"):
        MigrationSet("x", (step, step))
    with pytest.raises(StoreError, match="engine's, once"):
        Database(":memory:", migrations=[])


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
async def test_drive_keys_of_stored_messages_and_gates_become_run_ids(
    dialect: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    db_target: Path | PostgresURL = tmp_path / "t.db"
    if dialect == "postgresql":  # an empty database (not the migrated template)
        cluster = request.getfixturevalue("pg_cluster")
        url = cluster.new_database(template="template0")
        request.addfinalizer(lambda: cluster.drop_database(url))
        db_target = PostgresURL(url)
    # A database from before drives reported under their run ids (bot schema 7).
    full = discover_migrations()
    before = tuple(
        MigrationSet(s.owner, s.migrations[:7], s.adopted) if s.owner == "bot" else s for s in full
    )
    async with open_database(db_target, migrations=before) as db:
        assert (await db.schema_versions())["bot"] == 7
        runs = SqliteRunStore(db)
        for run_id, task, at in (("ap-1", "T", 10.0), ("ap-2", "T", 20.0), ("ap-3", "U", 10.0)):
            await runs.create_run(
                run_id, mode="autopilot", agent="claude", session_id="s", task=task
            )
            await db.execute("UPDATE runs SET created_at = ? WHERE id = ?", (at, run_id))
        rows = [
            ("autopilot:T", 15.0),  # said during the first drive of T
            ("autopilot:T", 25.0),  # during the second
            ("autopilot:T", 5.0),  # before any (the start's reply): the first
            ("autopilot:GONE", 9.0),  # a task no drive is recorded for
            ("chat-20250101-120000-aaaaaa", 9.0),  # not a drive's: untouched
        ]
        for run_id, at in rows:
            await db.execute(
                "INSERT INTO bot_outbox (chat_id, kind, body, run_id, state, created_at)"
                " VALUES (-100, 'text', 'x', ?, 'sent', ?)",
                (run_id, at),
            )
        await db.execute(
            "INSERT INTO bot_gates (gate_id, task, phase, sha256, artifact_name, chat_id,"
            " run_id, state, created_at) VALUES ('g1', 'U', 'research', 'a', 'r.md', -100,"
            " 'autopilot:U', 'open', 12.0)"
        )
    async with open_database(db_target) as db:
        assert await db.schema_versions() == LATEST
        found = await db.fetchall("SELECT run_id FROM bot_outbox ORDER BY id")
        assert [r["run_id"] for r in found] == [
            "ap-1",
            "ap-2",
            "ap-1",
            None,
            "chat-20250101-120000-aaaaaa",
        ]
        gate = await db.fetchone("SELECT run_id FROM bot_gates WHERE gate_id = 'g1'")
        assert gate is not None
        assert gate["run_id"] == "ap-3"

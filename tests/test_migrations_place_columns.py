"""A place's columns are text on SQLite too (engine 0019, bot 0010), on both databases.

A database is made at the schemas before (engine 18, bot 9: on SQLite the place columns
still declared INTEGER, so a number written as text was kept as a number), given rows the
way that code wrote them, then opened with today's code: every row keeps its values, read
back as text. After it, an id that only looks like a number (``007``) and one that is no
number (``room-a``) come back as written through every store that keeps a place, and
``007`` is not the place ``7``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from chatfront.store import OutboxItem, SqlBotStore
from engine.gates.store import ApprovalRequest, SqlGateStore
from engine.store import MigrationSet, SqliteAuditLog, SqliteRunStore
from engine.store.backend import AnyDatabase, open_database
from engine.store.database import discover_migrations
from engine.store.location import PostgresURL

# The schemas before the 0019 and 0010 text_place_columns (and the workers' then).
BEFORE = {"engine": 18, "bot": 9, "workers": 7}
GROUP = -1001234567890123
PLACE = str(GROUP)
#: Each table that keeps a place, and its place columns.
PLACE_COLUMNS = {
    "runs": ("chat_id", "thread_id"),
    "gate_approvals": ("chat_id",),
    "audit_log": ("chat_id",),
    "bot_outbox": ("chat_id", "thread_id"),
    "bot_live": ("chat_id", "thread_id"),
    "bot_bindings": ("chat_id", "thread_id"),
    "bot_prompts": ("chat_id", "thread_id"),
    "bot_gates": ("chat_id", "thread_id"),
    "bot_reason_requests": ("chat_id",),
    "bot_chat_migrations": ("old_chat_id", "new_chat_id"),
    "bot_place_permissions": ("chat_id", "thread_id"),
}


def _before() -> list[MigrationSet]:
    return [
        MigrationSet(
            s.owner,
            tuple(m for m in s.migrations if m.version <= BEFORE.get(s.owner, m.version)),
            s.adopted,
        )
        for s in discover_migrations()
    ]


async def _write_as_before(db: AnyDatabase) -> None:
    """Rows as the code before wrote them: a Telegram id (a number on SQLite), a place
    that is no number, and no topic as '' where it is part of a key."""
    statements: list[tuple[str, tuple[object, ...]]] = [
        (
            "INSERT INTO runs (id, mode, agent, session_id, status, chat_id, thread_id, task,"
            " state_json, created_at, updated_at) VALUES"
            " ('r-group', 'autopilot', 'claude', 's1', 'running', ?, 7, 'T', '{}', 1.0, 1.0),"
            " ('r-room', 'chat', 'claude', 's2', 'running', 'room-a', 'thread:b/1', NULL,"
            " '{}', 2.0, 2.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO turns (run_id, seq, prompt, state, started_at)"
            " VALUES ('r-group', 1, 'go', 'finished', 1.0)",
            (),
        ),
        (
            "INSERT INTO gate_tasks (name, folder, workdir, phase, sub_state, version,"
            " gate_round, gate_sha256, created_at, updated_at)"
            " VALUES ('T', '/f', '/w', 'research', 'awaiting_approval', 3, 1, 'abc', 1.0, 1.0)",
            (),
        ),
        (
            "INSERT INTO gate_approvals (task, phase, gate_round, sha256, approver, chat_id, at)"
            " VALUES ('T', 'research', 1, 'abc', '42', ?, 1.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO audit_log (at, event, outcome, chat_id, origin)"
            " VALUES (1.0, 'approve', 'refused', ?, 'bot')",
            (GROUP,),
        ),
        (
            "INSERT INTO bot_bindings (chat_id, thread_id, agent, project, workdir, session_id,"
            " created_at) VALUES (?, '', 'claude', 'p', '/w', 's-chat', 1.0),"
            " ('room-a', 'thread:b/1', 'claude', 'p', '/w', 's-room', 2.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO bot_prompts (chat_id, thread_id, body, state, created_at)"
            " VALUES (?, '', 'waiting since before', 'queued', 1.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO bot_place_permissions (chat_id, thread_id, policy, set_at)"
            " VALUES (?, '', 'trusted', 1.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO bot_outbox (chat_id, thread_id, kind, body, state, created_at)"
            " VALUES (?, 7, 'text', 'queued before', 'pending', 1.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO bot_live (ref, chat_id, thread_id, message_id, body, updated_at)"
            " VALUES ('status:r-group', ?, 7, 55, 'working', 1.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO bot_gates (gate_id, task, phase, sha256, artifact_name, chat_id,"
            " thread_id, run_id, state, created_at)"
            " VALUES ('g1', 'T', 'research', 'abc', 'RESEARCH.md', ?, 7, 'r-group', 'open', 1.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO bot_reason_requests (chat_id, user_id, gate_id, created_at)"
            " VALUES (?, 42, 'g1', 1.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO bot_tasks (task, chat_id, thread_id, created_at) VALUES ('T', ?, 7, 1.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO bot_chat_migrations (old_chat_id, new_chat_id, migrated_at)"
            " VALUES (-5, ?, 1.0)",
            (GROUP,),
        ),
    ]
    for sql, params in statements:
        await db.execute(sql, params)
    # Outbox ids 1..3, the last two sent and pruned: the next id is 4 (not 2) after it too.
    for body in ("two", "three"):
        await db.execute(
            "INSERT INTO bot_outbox (chat_id, kind, body, state, created_at)"
            " VALUES (?, 'text', ?, 'sent', 1.0)",
            (GROUP, body),
        )
    await db.execute("DELETE FROM bot_outbox WHERE state = 'sent'")


@pytest.fixture
async def migrated(empty: Path | PostgresURL) -> AsyncIterator[AnyDatabase]:
    async with open_database(empty, migrations=_before()) as db:
        versions = await db.schema_versions()
        assert (versions["engine"], versions["bot"]) == (18, 9)
        await _write_as_before(db)
        if isinstance(empty, Path):
            # No topic as code before wrote it where the topic is no key: 0, read as none.
            await db.execute(
                "INSERT INTO runs (id, mode, agent, session_id, status, chat_id, thread_id,"
                " state_json, created_at, updated_at)"
                " VALUES ('r-zero', 'chat', 'claude', 's3', 'completed', -5, 0, '{}', 3.0, 3.0)"
            )
            await db.execute(
                "INSERT INTO bot_gates (gate_id, task, phase, sha256, artifact_name, chat_id,"
                " thread_id, state, created_at)"
                " VALUES ('g0', 'T', 'plan', 'def', 'PLAN.md', -5, 0, 'approved', 1.0)"
            )
    async with open_database(empty) as db:
        assert await db.schema_versions() == db.latest_versions
        yield db


async def test_rows_from_before_keep_their_values_as_text(
    migrated: AnyDatabase, empty: Path | PostgresURL
) -> None:
    runs = SqliteRunStore(migrated)
    group, room = await runs.get_run("r-group"), await runs.get_run("r-room")
    assert (group.chat_id, group.thread_id, group.task) == (PLACE, "7", "T")
    assert (room.chat_id, room.thread_id) == ("room-a", "thread:b/1")
    [turn] = await runs.turns("r-group")
    assert turn.prompt == "go"
    gates = SqlGateStore(migrated)
    [approval] = await gates.approvals("T")
    assert (approval.approver, approval.chat_id) == ("42", PLACE)
    [entry] = await SqliteAuditLog(migrated).entries(origin="bot")
    assert entry.chat_id == PLACE
    bot = SqlBotStore(migrated)
    here = await bot.binding(PLACE, None)
    assert here is not None
    assert here.session_id == "s-chat"
    in_room = await bot.binding("room-a", "thread:b/1")
    assert in_room is not None
    assert in_room.session_id == "s-room"
    assert await bot.chats_with_queued() == [(PLACE, None)]
    assert await bot.place_permissions(PLACE, None) == "trusted"
    row = await bot.next_outbox()
    assert row is not None
    assert (row.item.chat_id, row.item.thread_id, row.item.body) == (PLACE, "7", "queued before")
    live = await bot.live_by_message(PLACE, 55)
    assert live is not None
    assert (live.ref, live.thread_id) == ("status:r-group", "7")
    [gate] = await bot.open_gates(chat_id=PLACE)
    assert (gate.gate_id, gate.thread_id) == ("g1", "7")
    asked = await bot.reason_request(PLACE, 42)
    assert asked is not None
    assert asked.gate_id == "g1"
    assert await bot.migrated_from() == {PLACE: "-5"}
    # The outbox goes on counting where it was.
    await bot.enqueue([OutboxItem(chat_id=PLACE, thread_id=None, body="after")])
    ids = [int(r[0]) for r in await migrated.fetchall("SELECT id FROM bot_outbox ORDER BY id")]
    assert ids == [1, 4]
    if isinstance(empty, Path):
        zero = await runs.get_run("r-zero")
        assert (zero.chat_id, zero.thread_id) == ("-5", None)
        old_gate = await bot.gate("g0")
        assert old_gate is not None
        assert (old_gate.chat_id, old_gate.thread_id) == ("-5", None)
        _assert_sqlite_tables(empty)


def _assert_sqlite_tables(path: Path) -> None:
    """Every place column is TEXT and holds text; turns still name their run by a
    foreign key that holds; each table counting its ids has one counter."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA foreign_keys = ON")
        for table, columns in PLACE_COLUMNS.items():
            declared = {r[1]: r[2] for r in conn.execute(f"PRAGMA table_info({table})")}
            for column in columns:
                assert declared[column] == "TEXT", (table, column)
                kinds = conn.execute(
                    f"SELECT DISTINCT typeof({column}) FROM {table} WHERE {column} IS NOT NULL"
                ).fetchall()
                assert kinds in ([("text",)], []), (table, column, kinds)
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        [fk] = conn.execute("PRAGMA foreign_key_list(turns)").fetchall()
        assert (fk[2], fk[3], fk[4]) == ("runs", "run_id", "id")
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute(
                "INSERT INTO turns (run_id, seq, prompt, state, started_at)"
                " VALUES ('no-such-run', 1, 'go', 'finished', 1.0)"
            )
        counters = conn.execute("SELECT name FROM sqlite_sequence ORDER BY name").fetchall()
        names = [r[0] for r in counters]
        assert len(names) == len(set(names))
        assert not [n for n in names if n.endswith("_text")]
        indexes = {
            r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
        }
        assert {
            "runs_status",
            "runs_chat",
            "turns_state",
            "audit_log_task",
            "audit_log_origin",
            "bot_outbox_state",
            "bot_prompts_queue",
            "bot_gates_task",
        } <= indexes
    finally:
        conn.close()


@pytest.mark.parametrize("chat", ["007", "room-a"])
async def test_a_place_id_comes_back_as_written_from_every_store(
    migrated: AnyDatabase, chat: str
) -> None:
    topic = "0012" if chat == "007" else "thread:b/1"
    runs = SqliteRunStore(migrated)
    await runs.create_run(
        "r-new", mode="chat", agent="claude", session_id="s", chat_id=chat, thread_id=topic
    )
    run = await runs.get_run("r-new")
    assert (run.chat_id, run.thread_id) == (chat, topic)
    gates = SqlGateStore(migrated)
    task = await gates.find("T")
    assert task is not None
    tally = await gates.record_approval(
        ApprovalRequest(task=task, approver="43", sha256="abc", quorum=5, at=2.0, chat_id=chat)
    )
    assert tally.fresh
    assert [a.chat_id for a in await gates.approvals("T")] == [PLACE, chat]
    audit = SqliteAuditLog(migrated)
    await audit.record("approve", "allowed", origin="bot", chat_id=chat)
    assert (await audit.entries(origin="bot"))[-1].chat_id == chat

    bot = SqlBotStore(migrated)
    await bot.bind(
        chat, topic, agent="claude", project="p", workdir="/w", session_id="s", user_id=1
    )
    await bot.bind(chat, None, agent="claude", project="p", workdir="/w", session_id="t", user_id=1)
    bound = await bot.binding(chat, topic)
    assert bound is not None
    assert (bound.chat_id, bound.thread_id, bound.session_id) == (chat, topic, "s")
    whole = await bot.binding(chat, None)
    assert whole is not None
    assert (whole.chat_id, whole.thread_id, whole.session_id) == (chat, None, "t")
    await bot.set_place_permissions(chat, topic, "free", by=1)
    assert await bot.place_permissions(chat, topic) == "free"
    assert await bot.queue_prompt(chat, topic, update_id=None, user_id=1, body="hi", depth=5)
    taken = await bot.take_prompt(chat, topic, "r-new", 1)
    assert taken is not None
    assert (taken[0].chat_id, taken[0].thread_id) == (chat, topic)
    await bot.enqueue([OutboxItem(chat_id=chat, thread_id=topic, body="hello")])
    # A live message is kept once it is sent.
    await bot.set_live("status:r-new", chat_id=chat, thread_id=topic, body="working")
    sent = []
    while (row := await bot.next_outbox()) is not None:
        sent.append((row.item.chat_id, row.item.thread_id, row.item.body))
        await bot.outbox_sent(row, 100 + len(sent))
    assert sent[-2:] == [(chat, topic, "hello"), (chat, topic, "working")]
    live = await bot.get_live("status:r-new")
    assert live is not None
    assert (live.chat_id, live.thread_id) == (chat, topic)
    await bot.add_gate(
        "g2",
        task="T",
        phase="research",
        sha256="abc",
        artifact_name="RESEARCH.md",
        chat_id=chat,
        thread_id=topic,
        run_id=None,
    )
    [gate] = await bot.open_gates(chat_id=chat)
    assert (gate.chat_id, gate.thread_id) == (chat, topic)
    await bot.ask_reason(chat, 7, "g2")
    asked = await bot.reason_request(chat, 7)
    assert asked is not None
    assert asked.gate_id == "g2"
    await runs.create_run(
        "r-drive", mode="autopilot", agent="claude", session_id="d", chat_id=chat,
        thread_id=topic, task="U",
    )  # fmt: skip
    assert ("U", chat, topic) in await bot.task_places()
    if chat == "007":
        # Not the place 7 (nor 12): the ids are compared as text.
        assert await bot.binding("7", "12") is None
        assert await bot.open_gates(chat_id="7") == []
        assert await bot.place_permissions("7", "12") is None
        assert await bot.queued_count("7", "12") == 0
    await bot.migrate_chat(chat, "-1009")
    assert (await bot.migrated_from())["-1009"] == chat
    moved = await bot.binding("-1009", topic)
    assert moved is not None
    assert moved.session_id == "s"

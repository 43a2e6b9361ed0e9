"""A place's ids are text, on both databases (engine 0018, bot 0009).

A database is made at the schemas before (engine 17, bot 8), given rows the way that code
wrote them (Telegram's ids as numbers, "no topic" as 0 where the topic is part of a key),
then opened with today's code: every id reads back as its text, no topic as None, and the
rows are still found by their place. After it, a place whose ids are not numbers (another
messenger's) works through the stores and the chat mode's queue like a Telegram chat.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from chatfront.store import OutboxItem, SqlBotStore
from engine.runs.spec import ChatPlace
from engine.store import MigrationSet, SqliteAuditLog, SqliteRunStore
from engine.store.backend import AnyDatabase, open_database
from engine.store.database import discover_migrations
from engine.store.location import PostgresURL
from engine.turn import TurnOutput
from engine.workspace.manager import place_workspace_name

# The schemas before 0018_text_place_ids and 0009_text_place_ids (and the workers' then).
BEFORE = {"engine": 17, "bot": 8, "workers": 7}
GROUP = -1001234567890123  # beyond a 4-byte INTEGER
PLACE = str(GROUP)


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
    """Rows as the code before wrote them: numbers, and 0 for no topic in the keys."""
    statements: list[tuple[str, tuple[object, ...]]] = [
        (
            "INSERT INTO runs (id, mode, agent, session_id, status, chat_id, thread_id,"
            " state_json, created_at, updated_at)"
            " VALUES ('r-topic', 'chat', 'claude', 's1', 'running', ?, 7, '{}', 1.0, 1.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO runs (id, mode, agent, session_id, status, chat_id, thread_id,"
            " state_json, created_at, updated_at)"
            " VALUES ('r-chat', 'auto', 'claude', 's2', 'running', -5, NULL, '{}', 2.0, 2.0)",
            (),
        ),
        (
            # (a drive from before its run kept its chat: bot_tasks kept it)
            "INSERT INTO runs (id, mode, agent, session_id, status, task, state_json,"
            " created_at, updated_at)"
            " VALUES ('r-drive', 'autopilot', 'claude', 's3', 'parked', 'T', '{}', 3.0, 3.0)",
            (),
        ),
        (
            "INSERT INTO bot_bindings (chat_id, thread_id, agent, project, workdir, session_id,"
            " created_at) VALUES (?, 0, 'claude', 'p', '/w', 's-chat', 1.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO bot_bindings (chat_id, thread_id, agent, project, workdir, session_id,"
            " created_at) VALUES (?, 7, 'claude', 'p', '/w', 's-topic', 2.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO bot_prompts (chat_id, thread_id, body, state, created_at)"
            " VALUES (?, 0, 'waiting since before', 'queued', 1.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO bot_place_permissions (chat_id, thread_id, policy, set_at)"
            " VALUES (?, 0, 'trusted', 1.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO bot_outbox (chat_id, thread_id, kind, body, state, created_at)"
            " VALUES (?, 7, 'text', 'queued before', 'pending', 1.0)",
            (GROUP,),
        ),
        (
            "INSERT INTO bot_live (ref, chat_id, thread_id, body, updated_at)"
            " VALUES ('status:r-topic', ?, 7, 'working', 1.0)",
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
        (
            "INSERT INTO audit_log (at, event, outcome, chat_id, origin)"
            " VALUES (1.0, 'approve', 'refused', ?, 'bot')",
            (GROUP,),
        ),
    ]
    for sql, params in statements:
        await db.execute(sql, params)


@pytest.fixture
async def migrated(empty: Path | PostgresURL) -> AsyncIterator[AnyDatabase]:
    async with open_database(empty, migrations=_before()) as db:
        versions = await db.schema_versions()
        assert (versions["engine"], versions["bot"]) == (17, 8)
        await _write_as_before(db)
    async with open_database(empty) as db:
        assert await db.schema_versions() == db.latest_versions
        yield db


async def test_ids_written_as_numbers_read_back_as_text(migrated: AnyDatabase) -> None:
    runs = SqliteRunStore(migrated)
    topic, chat = await runs.get_run("r-topic"), await runs.get_run("r-chat")
    assert (topic.chat_id, topic.thread_id) == (PLACE, "7")
    assert (chat.chat_id, chat.thread_id) == ("-5", None)
    bot = SqlBotStore(migrated)
    here = await bot.binding(PLACE, None)  # was topic 0
    assert here is not None
    assert (here.chat_id, here.thread_id, here.session_id) == (PLACE, None, "s-chat")
    in_topic = await bot.binding(PLACE, "7")
    assert in_topic is not None
    assert (in_topic.thread_id, in_topic.session_id) == ("7", "s-topic")
    assert [(b.chat_id, b.thread_id) for b in await bot.bindings()] == [
        (PLACE, None),
        (PLACE, "7"),
    ]
    assert await bot.chats_with_queued() == [(PLACE, None)]
    assert await bot.queued_count(PLACE, None) == 1
    assert await bot.place_permissions(PLACE, None) == "trusted"
    row = await bot.next_outbox()
    assert row is not None
    assert (row.item.chat_id, row.item.thread_id, row.item.body) == (PLACE, "7", "queued before")
    live = await bot.get_live("status:r-topic")
    assert live is not None
    assert (live.chat_id, live.thread_id) == (PLACE, "7")
    assert await bot.task_places() == [("T", PLACE, "7")]
    assert await bot.migrated_from() == {PLACE: "-5"}
    [entry] = await SqliteAuditLog(migrated).entries(origin="bot")
    assert entry.chat_id == PLACE
    # The chat's workspace folder keeps the name it had.
    assert place_workspace_name(PLACE) == f"chat_{GROUP}"
    assert place_workspace_name(PLACE, "7") == f"chat_{GROUP}_topic_7"
    # A Telegram chat moving to a new id still moves its rows.
    await bot.migrate_chat(PLACE, "-1009")
    moved = await bot.binding("-1009", None)
    assert moved is not None
    assert moved.session_id == "s-chat"
    assert (await runs.get_run("r-topic")).chat_id == "-1009"


async def test_a_place_whose_ids_are_not_numbers_works_like_a_chat(
    migrated: AnyDatabase,
) -> None:
    room, thread = "room-a", "thread:b/1"
    runs = SqliteRunStore(migrated)
    run = await runs.create_run(
        "r-room", mode="chat", agent="claude", session_id="s", chat_id=room, thread_id=thread
    )
    assert (run.chat_id, run.thread_id) == (room, thread)
    assert ChatPlace(run.chat_id, run.thread_id) == ChatPlace(room, thread)
    bot = SqlBotStore(migrated)
    for where in (None, thread):
        binding = await bot.bind(
            room, where, agent="claude", project="p", workdir="/w", session_id="s", user_id=1
        )
        assert (binding.chat_id, binding.thread_id) == (room, where)
        await bot.set_place_permissions(room, where, "free", by=1)
        assert await bot.place_permissions(room, where) == "free"
    assert await bot.place_permissions("room-b", None) is None
    # The chat mode's queue: queued, taken as a turn, committed with its answer.
    assert await bot.queue_prompt(room, thread, update_id=None, user_id=1, body="hi", depth=5)
    assert await bot.queued_count(room, thread) == 1
    assert await bot.queued_count(room, None) == 0
    assert (room, thread) in await bot.chats_with_queued()
    taken = await bot.take_prompt(room, thread, "r-room", 1)
    assert taken is not None
    prompt, turn_id = taken
    assert (prompt.chat_id, prompt.thread_id, prompt.body) == (room, thread, "hi")
    answer = OutboxItem(chat_id=room, thread_id=thread, body="hello", run_id="r-room")
    out = TurnOutput(text="hello", exit_code=0)
    await bot.commit_turn(prompt.id, turn_id, out, [answer], chat_id=room, thread_id=thread)
    bound = await bot.binding(room, thread)
    assert bound is not None
    assert bound.turns == 1
    row = await bot.next_outbox()
    while row is not None and row.item.chat_id != room:  # (the migrated row comes first)
        await bot.outbox_sent(row, 1)
        row = await bot.next_outbox()
    assert row is not None
    assert (row.item.chat_id, row.item.thread_id, row.item.body) == (room, thread, "hello")
    # Its folder name stays inside the chats' folder and is its own.
    assert place_workspace_name(room) == "chat_room-a"
    name = place_workspace_name(room, thread)
    assert name.startswith("chat_room-a_topic_.")
    assert "/" not in name
    assert name != place_workspace_name(room, "thread:b/2")

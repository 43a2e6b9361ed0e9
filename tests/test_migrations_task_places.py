"""A task's chat is read from its drives' runs; ``bot_tasks`` goes (bot 0011), on both
databases.

A database is made at the bot's schema before (10: ``bot_tasks`` kept the chat each
task was started from), given tasks the way that code left them, then opened with today's
code: a task whose drives recorded no place gives its newest drive the one ``bot_tasks``
kept, a task whose drive recorded one keeps that, and the table is gone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from chatfront.store import SqlBotStore
from engine.errors import StoreError
from engine.store import MigrationSet, SqliteRunStore
from engine.store.backend import AnyDatabase, open_database
from engine.store.database import discover_migrations
from engine.store.location import PostgresURL

BEFORE = {"bot": 10}  # the bot's schema before 0011_task_places_in_runs


def _before() -> list[MigrationSet]:
    return [
        MigrationSet(
            s.owner,
            tuple(m for m in s.migrations if m.version <= BEFORE.get(s.owner, m.version)),
            s.adopted,
        )
        for s in discover_migrations()
    ]


async def _drive(
    db: AnyDatabase,
    run_id: str,
    task: str,
    at: float,
    *,
    chat: str | None = None,
    topic: str | None = None,
    parent: str | None = None,
) -> None:
    await db.execute(
        "INSERT INTO runs (id, mode, agent, session_id, status, chat_id, thread_id, task,"
        " parent_id, state_json, created_at, updated_at)"
        " VALUES (?, 'autopilot', 'claude', 's', 'parked', ?, ?, ?, ?, '{}', ?, ?)",
        (run_id, chat, topic, task, parent, at, at),
    )


async def _task_place(db: AnyDatabase, task: str, chat: str, topic: str | None, at: float) -> None:
    await db.execute(
        "INSERT INTO bot_tasks (task, chat_id, thread_id, started_by, created_at)"
        " VALUES (?, ?, ?, 1, ?)",
        (task, chat, topic, at),
    )


@pytest.fixture
async def migrated(empty: Path | PostgresURL) -> AsyncIterator[AnyDatabase]:
    async with open_database(empty, migrations=_before()) as db:
        assert (await db.schema_versions())["bot"] == 10
        # A: its drives kept no chat (an old drive, and a newer one): bot_tasks's goes
        # to the newest.
        await _drive(db, "r-a1", "A", 1.0)
        await _drive(db, "r-a2", "A", 2.0)
        await _task_place(db, "A", "-100", "7", 1.0)
        # B: its newest drive reports to another chat than the one bot_tasks kept (it
        # was resumed there): the drive's place is the truth.
        await _drive(db, "r-b1", "B", 3.0, chat="-100")
        await _drive(db, "r-b2", "B", 4.0, chat="room-b", topic="t/1")
        await _task_place(db, "B", "-100", None, 3.0)
        # C: started from a chat, no drive ever ran: nothing reports, nothing to keep.
        await _task_place(db, "C", "-100", None, 5.0)
        # D: a terminal drive of a chat's task (it kept the chat), no bot_tasks row; and
        # D's wave sub-task S, driven under D's drive.
        await _drive(db, "r-d", "D", 6.0, chat="007", topic="0012")
        await _drive(db, "r-s", "S", 7.0, chat="007", topic="0012", parent="r-d")
        # E: a sub-task's run is no drive of its own: bot_tasks's place goes to E's
        # own drive, not to it.
        await _drive(db, "r-e", "E", 8.0)
        await _drive(db, "r-e-sub", "E", 9.0, parent="r-d")
        await _task_place(db, "E", "-200", None, 8.0)
    async with open_database(empty) as db:
        assert await db.schema_versions() == db.latest_versions
        yield db


async def test_each_task_s_place_is_its_newest_drive_s(migrated: AnyDatabase) -> None:
    bot = SqlBotStore(migrated)
    assert await bot.task_places() == [
        ("A", "-100", "7"),
        ("B", "room-b", "t/1"),
        ("D", "007", "0012"),
        ("E", "-200", None),
    ]
    runs = SqliteRunStore(migrated)
    a1, a2 = await runs.get_run("r-a1"), await runs.get_run("r-a2")
    assert (a1.chat_id, a2.chat_id, a2.thread_id) == (None, "-100", "7")
    assert (await runs.get_run("r-b1")).chat_id == "-100"
    assert (await runs.get_run("r-e-sub")).chat_id is None
    with pytest.raises(StoreError):
        await migrated.fetchall("SELECT * FROM bot_tasks")


async def test_a_new_drive_s_place_is_the_task_s(migrated: AnyDatabase) -> None:
    runs = SqliteRunStore(migrated)
    await runs.create_run(
        "r-a3", mode="autopilot", agent="claude", session_id="s", chat_id="-300", task="A"
    )
    await runs.create_run(
        "r-f", mode="autopilot", agent="claude", session_id="s", chat_id="-300", task="F"
    )
    places = {
        task: (chat, topic) for task, chat, topic in await SqlBotStore(migrated).task_places()
    }
    assert places["A"] == places["F"] == ("-300", None)
    assert "C" not in places
    # A chat that moves (a group that became a supergroup) takes its tasks with it.
    await SqlBotStore(migrated).migrate_chat("-300", "-1009")
    places = {
        task: (chat, topic) for task, chat, topic in await SqlBotStore(migrated).task_places()
    }
    assert places["A"] == places["F"] == ("-1009", None)

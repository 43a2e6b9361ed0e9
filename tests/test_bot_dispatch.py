"""The one place every feature's handlers are wrapped (bot/handlers.py ``Dispatch``).

A real python-telegram-bot ``Application`` on the fake Bot API (initialized, not started:
updates are handed to ``process_update`` directly) and a real store, on a SQLite file and
on a fresh PostgreSQL database in turn (``database``); what the bot says is read from the
outbox, button answers from the fake API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from telegram import Update
from telegram.ext import ApplicationBuilder

from bot.handlers import Dispatch
from bot.render import TELEGRAM
from bot.replies import Replies
from chatfront.auth import Action, Authorizer
from chatfront.publish import Publisher
from chatfront.store import BotStore, SqlBotStore
from engine.redact import Redactor
from tests.fakes.bot_api import FakeBotApi
from tests.support import make_settings

CHAT = 100
ADMIN = 1
STRANGER = 9

# Routing alone, nothing written: the store's part runs on SQLite only.
_ROUTING_ONLY = pytest.mark.parametrize("database", ["sqlite"], indirect=True)


def _text(update_id: int, text: str, user: int = ADMIN) -> dict[str, Any]:
    entities = (
        [{"type": "bot_command", "offset": 0, "length": len(text.split()[0])}]
        if text.startswith("/")
        else []
    )
    return {
        "update_id": update_id,
        "message": {
            "message_id": update_id,
            "date": 0,
            "chat": {"id": CHAT, "type": "private"},
            "from": {"id": user, "is_bot": False, "first_name": "u"},
            "text": text,
            "entities": entities,
        },
    }


def _press(update_id: int, data: str, user: int = ADMIN) -> dict[str, Any]:
    return {
        "update_id": update_id,
        "callback_query": {
            "id": str(update_id),
            "chat_instance": "c",
            "from": {"id": user, "is_bot": False, "first_name": "u"},
            "data": data,
            "message": {
                "message_id": 5,
                "date": 0,
                "chat": {"id": CHAT, "type": "private"},
                "text": "buttons",
            },
        },
    }


class _Bench:
    def __init__(self, dispatch: Dispatch, store: BotStore, app: Any, api: FakeBotApi) -> None:
        self.dispatch = dispatch
        self.store = store
        self.app = app
        self.api = api

    async def feed(self, payload: dict[str, Any]) -> None:
        update = Update.de_json(payload, self.app.bot)
        assert update is not None
        await self.app.process_update(update)

    async def said(self) -> list[str]:
        rows = await self.store.db.fetchall("SELECT body FROM bot_outbox ORDER BY id")
        return [row["body"] for row in rows]


@asynccontextmanager
async def _bench(tmp_path: Path, db: Any) -> AsyncIterator[_Bench]:
    async with FakeBotApi() as api:
        store = SqlBotStore(db)
        authorizer = Authorizer.from_ids(
            admins=[ADMIN], approvers=[], operators=[], allowed_chats=[str(CHAT)]
        )
        publisher = Publisher(
            store, None, renderer=TELEGRAM, redactor=Redactor(), document_threshold=100_000
        )
        replies = Replies(publisher, authorizer, store)
        app = ApplicationBuilder().token(api.token).base_url(api.base_url).updater(None).build()
        await app.initialize()

        async def no_migration(update: Update) -> None:
            raise AssertionError("no migration in these tests")

        dispatch = Dispatch(
            app,
            settings=make_settings(tmp_path),
            authorizer=authorizer,
            store=store,
            replies=replies,
            follow_migration=no_migration,
        )
        try:
            yield _Bench(dispatch, store, app, api)
        finally:
            await app.shutdown()


@_ROUTING_ONLY
async def test_texts_go_to_features_in_order_until_one_takes_it(
    tmp_path: Path, database: Any
) -> None:
    seen: list[tuple[str, str]] = []

    def feature(name: str, takes: str | None) -> Any:
        async def on_text(update: Update, text: str, thread: int) -> bool:
            seen.append((name, text))
            return takes is None or text == takes

        return on_text

    async with _bench(tmp_path, database) as bench:
        bench.dispatch.text(feature("approvals", "APPROVED"))
        bench.dispatch.text(feature("steering", "steer me"))
        bench.dispatch.text(feature("chat", None))
        bench.dispatch.finish()
        await bench.feed(_text(1, "APPROVED"))
        await bench.feed(_text(2, "steer me"))
        await bench.feed(_text(3, "hello"))
    assert seen == [
        ("approvals", "APPROVED"),
        ("approvals", "steer me"),
        ("steering", "steer me"),
        ("approvals", "hello"),
        ("steering", "hello"),
        ("chat", "hello"),
    ]


async def test_a_failing_feature_is_answered_once_and_no_later_feature_sees_it(
    tmp_path: Path, database: Any, caplog: pytest.LogCaptureFixture
) -> None:
    later: list[str] = []

    async def fails(update: Update, text: str, thread: int) -> bool:
        raise RuntimeError("the store is gone")

    async def chat(update: Update, text: str, thread: int) -> bool:
        later.append(text)
        return True

    async with _bench(tmp_path, database) as bench:
        bench.dispatch.text(fails)
        bench.dispatch.text(chat)
        bench.dispatch.finish()
        await bench.feed(_text(1, "hello"))
        said = await bench.said()
    assert later == []
    assert said == ["⚠️ Something went wrong handling that; it is in the log."]
    assert "the store is gone" in caplog.text


async def test_commands_check_the_right_and_the_usage_before_the_feature(
    tmp_path: Path,
    database: Any,
) -> None:
    called: list[list[str]] = []

    async def cmd(update: Update, args: list[str]) -> None:
        called.append(args)

    async with _bench(tmp_path, database) as bench:
        bench.dispatch.command("auto", Action.START_RUN, cmd, usage="Usage: /auto OBJECTIVE")
        bench.dispatch.finish()
        await bench.feed(_text(1, "/auto"))
        await bench.feed(_text(2, "/auto fix it"))
        await bench.feed(_text(3, "/auto fix it", user=STRANGER))
        await bench.feed(_text(4, "/nosuch"))
        said = await bench.said()
        refused = [e for e in await bench.store.audit_entries() if e.outcome == "refused"]
    assert called == [["fix", "it"]]
    assert said[0] == "Usage: /auto OBJECTIVE"
    assert said[-1] == "Unknown command. /help lists what I understand."
    assert [(e.user_id, e.action) for e in refused] == [(STRANGER, "start_run")]


@_ROUTING_ONLY
async def test_buttons_go_by_pattern_and_the_rest_is_only_answered(
    tmp_path: Path, database: Any
) -> None:
    pressed: list[str] = []

    async def on_button(update: Update, data: str) -> None:
        pressed.append(data)

    async with _bench(tmp_path, database) as bench:
        bench.dispatch.buttons(r"^ap(:|\Z)", Action.APPROVE, on_button)
        bench.dispatch.buttons(r"^tq:\d+:[osd]\Z", None, on_button)
        bench.dispatch.finish()
        presses = ["ap:g1", "apx:g1", "tq:3:o", "tq:3:x", "ap", "old", "tq:3:o\n"]
        for i, data in enumerate(presses):
            await bench.feed(_press(i + 1, data))
        # Only what no feature took is answered here (a feature answers its own).
        answered = [presses[int(a["callback_query_id"]) - 1] for a in bench.api.callback_answers]
    assert pressed == ["ap:g1", "tq:3:o", "ap"]
    assert answered == ["apx:g1", "tq:3:x", "old", "tq:3:o\n"]

"""Delivery on the edges: Telegram took a message but its answer cannot be read, a refusal
that passes (a 401 or 403 once), and one that does not.

The bot is the real one in-process (``running_bot``) where what a person sees matters, or
the outbox sender on its own with a real SQLite file where the store's rows do; both talk
to the fake Bot API over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from telegram.ext import ExtBot

from bot.outbox import TelegramTransport
from chatfront.outbox import OutboxSender
from chatfront.store import OutboxItem, SqlBotStore
from engine.store.backend import open_database
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(60)]

HELP = "Your commands:"
BUTTONS = {"inline_keyboard": [[{"text": "✅ Approve", "callback_data": "ap:g1"}]]}


def _tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What turnstile logged as a failure (python-telegram-bot logs an answer that is not
    JSON itself, with its traceback: its own words, not a failure of the bot)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(("bot", "engine"))
        and (r.exc_info or "handler failed" in r.getMessage() or "step failed" in r.getMessage())
    ]


@asynccontextmanager
async def _sender(
    root: Path, **options: int
) -> AsyncIterator[tuple[FakeBotApi, SqlBotStore, OutboxSender]]:
    """The outbox sender on its own, running, on a SQLite file under ``root``."""
    async with FakeBotApi() as api, open_database(root / "bot.db") as db:
        bot = ExtBot(api.token, base_url=api.base_url, base_file_url=api.file_url)
        store = SqlBotStore(db)
        sender = OutboxSender(
            TelegramTransport(bot), store, edit_interval=0.01, first_backoff=0.01, **options
        )
        async with bot:
            task = asyncio.create_task(sender.run(), name="outbox-sender")
            try:
                yield api, store, sender
            finally:
                sender.stop()
                await task


# --- Telegram took it, its answer cannot be read ----------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"<html><body>502 Bad Gateway</body></html>",
        b'{"ok": true}',
        b'{"ok": true, "result": "sent"}',
        b'{"ok": true, "result": {}}',
    ],
    ids=["not-json", "no-result", "not-a-message", "empty-message"],
)
async def test_a_send_whose_answer_cannot_be_read_is_delivered_once(
    tmp_path: Path, body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        assert rt.sender is not None
        api.garble_answers(["sendMessage"], body=body)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/help")
        await api.wait_for_message(lambda m: HELP in m.text)
        await rt.sender.wait_idle()
        # The bot goes on: the next answer arrives as usual.
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/help")
        await api.wait_until(lambda: len([m for m in api.sent if HELP in m.text]) == 2)
        await rt.sender.wait_idle()
        rows = await rt.db.fetchall("SELECT state, message_id FROM bot_outbox ORDER BY id")
        entries = await rt.store.audit_entries()
    # Each answer once in the chat: the unreadable answer was not taken for a failure.
    assert len([m for m in api.sent if HELP in m.text]) == 2
    assert len(api.calls_of("sendMessage")) == 2
    assert [(r["state"], r["message_id"] is None) for r in rows] == [
        ("sent", True),
        ("sent", False),
    ]
    assert not [e for e in entries if e.action == "deliver"]
    assert any("could not be read" in r.getMessage() for r in caplog.records)
    assert not _tracebacks(caplog)


async def test_a_live_message_delivered_without_its_id_goes_on_as_a_new_one(
    tmp_path: Path,
) -> None:
    async with _sender(tmp_path) as (api, store, sender):
        api.garble_answers(["sendMessage"], body=b'{"ok": true}')
        await store.set_live("status:r1", chat_id="7", thread_id=None, body="one")
        sender.wake()
        await api.wait_for_message(lambda m: m.text == "one")
        await sender.wait_idle()
        # Not sent again, and not silently dropped at its next change: a new message.
        await store.set_live("status:r1", chat_id="7", thread_id=None, body="two")
        sender.wake()
        two = await api.wait_for_message(lambda m: m.text == "two")
        await sender.wait_idle()
        # That one the bot knows: later changes are edits of it.
        await store.set_live("status:r1", chat_id="7", thread_id=None, body="three")
        sender.wake()
        await api.wait_until(lambda: two.text == "three")
        live = await store.get_live("status:r1")
        rows = await store.db.fetchall("SELECT body, state FROM bot_outbox ORDER BY id")
    assert [m.history[0] if m.history else m.text for m in api.sent] == ["one", "two"]
    assert [(r["body"], r["state"]) for r in rows] == [("one", "sent"), ("two", "sent")]
    assert live is not None
    assert live.message_id == two.message_id


async def test_a_message_with_buttons_delivered_without_its_id_is_posted_again(
    tmp_path: Path,
) -> None:
    async with _sender(tmp_path) as (api, store, sender):
        api.garble_answers(["sendMessage"])
        await store.set_live("gate:g1", chat_id="7", thread_id=None, body="gate", markup=BUTTONS)
        sender.wake()
        await api.wait_until(lambda: len(api.sent) == 2)
        await sender.wait_idle()
        live = await store.get_live("gate:g1")
    # Its buttons count only on a message the bot knows: the second copy.
    first, second = api.sent
    assert (first.text, second.text) == ("gate", "gate")
    assert second.buttons == first.buttons == BUTTONS["inline_keyboard"][0]
    assert live is not None
    assert live.message_id == second.message_id


# --- refusals that pass, and those that do not -----------------------------------------


@pytest.mark.parametrize(
    ("status", "description"),
    [(403, "Forbidden"), (401, None)],
    ids=["403", "401"],
)
async def test_a_refusal_once_does_not_lose_the_answer(
    tmp_path: Path, status: int, description: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        assert rt.sender is not None
        api.fail(["sendMessage"], status, description=description)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/help")
        await api.wait_for_message(lambda m: HELP in m.text)
        await rt.sender.wait_idle()
        rows = await rt.db.fetchall("SELECT state FROM bot_outbox")
        entries = await rt.store.audit_entries()
        assert rt.fatal is None  # the token works: the bot goes on
        assert not rt.stopping
    assert [c.status for c in api.calls_of("sendMessage")] == [status, 200]
    assert [r["state"] for r in rows] == ["sent"]
    assert not [e for e in entries if e.action == "deliver"]
    assert not _tracebacks(caplog)


async def test_a_refusal_that_does_not_pass_fails_the_message_after_a_few_tries(
    tmp_path: Path,
) -> None:
    async with _sender(tmp_path, refusal_retries=2) as (api, store, sender):
        api.fail(["sendMessage"], 403, count=3, description="Forbidden")
        await store.enqueue(
            [OutboxItem(chat_id="7", body="m1"), OutboxItem(chat_id="7", body="m2")]
        )
        sender.wake()
        await api.wait_for_message(lambda m: m.text == "m2")
        await sender.wait_idle()
        rows = await store.db.fetchall("SELECT body, state FROM bot_outbox ORDER BY id")
        entries = await store.audit_entries()
    assert [c.status for c in api.calls_of("sendMessage")] == [403, 403, 403, 200]
    assert [(r["body"], r["state"]) for r in rows] == [("m1", "failed"), ("m2", "sent")]
    [lost] = [e for e in entries if e.action == "deliver"]
    assert lost.outcome == "failed"
    assert lost.reason is not None
    assert "Forbidden" in lost.reason


@pytest.mark.parametrize(
    "description",
    [
        "Forbidden: bot was kicked from the supergroup chat",
        "Forbidden: bot is not a member of the supergroup chat",
        "Forbidden: user is deactivated",
    ],
)
async def test_a_chat_gone_for_the_bot_is_not_tried_again(tmp_path: Path, description: str) -> None:
    async with _sender(tmp_path) as (api, store, sender):
        api.fail(["sendMessage"], 403, description=description)
        await store.enqueue(
            [OutboxItem(chat_id="7", body="m1"), OutboxItem(chat_id="8", body="m2")]
        )
        sender.wake()
        await api.wait_for_message(lambda m: m.text == "m2")
        await sender.wait_idle()
        rows = await store.db.fetchall("SELECT body, state FROM bot_outbox ORDER BY id")
    assert [c.status for c in api.calls_of("sendMessage")] == [403, 200]
    assert [(r["body"], r["state"]) for r in rows] == [("m1", "failed"), ("m2", "sent")]


async def test_an_edit_refused_once_is_made_later(tmp_path: Path) -> None:
    async with _sender(tmp_path) as (api, store, sender):
        await store.set_live("status:r1", chat_id="7", thread_id=None, body="running")
        sender.wake()
        shown = await api.wait_for_message(lambda m: m.text == "running")
        await sender.wait_idle()
        api.fail(["editMessageText"], 403, description="Forbidden")
        await store.set_live("status:r1", chat_id="7", thread_id=None, body="done")
        sender.wake()
        await api.wait_until(lambda: shown.text == "done")
    assert [c.status for c in api.calls_of("editMessageText")] == [403, 200]

"""Edit pacing from Telegram's answer: a 429 in a chat slows that chat's edits (at least
``retry_after`` apart, then easing back), other chats keep their pace, and the last state
of every live message lands."""

from __future__ import annotations

import asyncio
import itertools
import statistics
from pathlib import Path

import pytest
from telegram.ext import ExtBot

from bot.outbox import PacedRateLimiter, TelegramTransport
from chatfront.outbox import OutboxSender
from chatfront.store import SqlBotStore
from engine.store.backend import open_database
from tests.fakes.bot_api import ApiCall, FakeBotApi

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(60)]

SLOWED, OTHER = 101, 202


def _edits(api: FakeBotApi, chat: int, after: float = 0.0) -> list[ApiCall]:
    return [
        c
        for c in api.calls_of("editMessageText")
        if int(c.params["chat_id"]) == chat and c.at >= after
    ]


def _gaps(calls: list[ApiCall]) -> list[float]:
    return [b.at - a.at for a, b in itertools.pairwise(calls)]


async def _keep_changing(
    store: SqlBotStore, sender: OutboxSender, chats: tuple[int, ...], seconds: float, tag: str
) -> None:
    """Change each chat's live message every 10 ms for ``seconds`` (a busy progress)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    n = 0
    while loop.time() < end:
        n += 1
        for chat in chats:
            await store.set_live(f"p{chat}", chat_id=str(chat), thread_id=None, body=f"{tag} {n}")
        sender.wake()
        await asyncio.sleep(0.01)  # the pace of the agent's events, not a synchronization


async def test_a_429_slows_that_chats_edits_and_loses_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PTB_TIMEDELTA", "true")  # as the bot sets it (bot.app)
    async with FakeBotApi() as api, open_database(tmp_path / "bot.db") as db:
        limiter = PacedRateLimiter(max_retries=3)
        bot = ExtBot(
            api.token, base_url=api.base_url, base_file_url=api.file_url, rate_limiter=limiter
        )
        store = SqlBotStore(db)
        sender = OutboxSender(TelegramTransport(bot), store, edit_interval=0.05)
        limiter.on_retry_after = sender.slow_down
        async with bot:
            task = asyncio.create_task(sender.run())
            for chat in (SLOWED, OTHER):
                await store.set_live(f"p{chat}", chat_id=str(chat), thread_id=None, body="start")
            sender.wake()
            await api.wait_until(lambda: len(api.sent) == 2)
            # The slowed chat alone is busy, then Telegram answers one of its edits 429.
            await _keep_changing(store, sender, (SLOWED,), 0.5, "before")
            flood = api.fail(["editMessageText"], 429, count=1, retry_after=1)
            # Changes go on until Telegram has refused one (the last "before" edit may have
            # landed before the refusal was armed: waiting alone would wait for ever).
            for _ in range(40):
                if flood.seen:
                    break
                await _keep_changing(store, sender, (SLOWED,), 0.5, "refused")
            assert flood.seen == 1
            refused = next(c for c in api.calls_of("editMessageText") if c.status == 429)
            await _keep_changing(store, sender, (SLOWED, OTHER), 3.0, "after")
            for chat in (SLOWED, OTHER):
                await store.set_live(f"p{chat}", chat_id=str(chat), thread_id=None, body="last")
            sender.wake()
            # No edit is lost: the last state of both messages lands.
            await api.wait_until(lambda: all(m.text == "last" for m in api.sent), timeout=20)
            sender.stop()
            await task
    before = _edits(api, SLOWED)
    before = [c for c in before if c.at < refused.at]
    assert len(before) >= 4
    assert statistics.median(_gaps(before)) < 0.3
    after = [c for c in _edits(api, SLOWED, refused.at) if c is not refused]
    # The refused edit was sent again after retry_after, and the chat's next edits kept
    # at least that far apart at first, then eased back (never all at once).
    assert after[0].at - refused.at >= 1.0
    gaps = _gaps(after)
    assert gaps[0] >= 1.0
    assert all(g >= 0.3 for g in gaps[:3])
    assert gaps[0] >= gaps[1] >= gaps[2] - 0.1
    # The other chat kept its own pace once the retry was over.
    other = _edits(api, OTHER, after[0].at)
    assert len(other) > 2 * len(_edits(api, SLOWED, after[0].at))
    assert statistics.median(_gaps(other)) < 0.3

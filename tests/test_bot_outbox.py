"""The outbox sender against the fake Bot API under random failures (Hypothesis).

Invariant: whatever mix of 5xx and 429 answers Telegram gives, every queued message is
delivered exactly once and, per chat, in the order it was queued.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from telegram.ext import AIORateLimiter, ExtBot

from bot.outbox import TelegramTransport
from chatfront.outbox import OutboxSender
from chatfront.store import OutboxItem, SqlBotStore
from engine.store.backend import open_database
from tests.fakes.bot_api import FakeBotApi
from tests.pg_support import PgCluster

STATUSES = st.lists(st.sampled_from([0, 0, 0, 500, 502, 504]), min_size=0, max_size=12).flatmap(
    lambda xs: st.permutations([*xs, *([429] if len(xs) % 4 == 1 else [])])
)


async def _deliver(
    statuses: list[int], messages: int, target: str | None = None
) -> tuple[list[tuple[int, str]], int]:
    """Deliver ``messages`` through ``statuses``, on ``target`` (None: a new SQLite file)."""
    with tempfile.TemporaryDirectory() as tmp:
        where = target if target is not None else Path(tmp) / "bot.db"
        async with FakeBotApi() as api, open_database(where) as db:
            api.script(["sendMessage"], statuses)
            bot = ExtBot(
                api.token,
                base_url=api.base_url,
                base_file_url=api.file_url,
                rate_limiter=AIORateLimiter(max_retries=3),
            )
            store = SqlBotStore(db)
            sender = OutboxSender(TelegramTransport(bot), store, first_backoff=0.01)
            async with bot:
                await store.enqueue(
                    OutboxItem(chat_id=str(1 + i % 3), body=f"m{i}") for i in range(messages)
                )
                task = asyncio.create_task(sender.run())
                sender.wake()
                assert await sender.drain(30)
                sender.stop()
                await task
            return [(m.chat_id, m.text) for m in api.sent], len(api.calls_of("sendMessage"))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(statuses=STATUSES, messages=st.integers(min_value=1, max_value=9))
def test_every_message_exactly_once_in_order(statuses: list[int], messages: int) -> None:
    _check(statuses, messages, *asyncio.run(_deliver(list(statuses), messages)))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(statuses=STATUSES, messages=st.integers(min_value=1, max_value=9))
def test_every_message_exactly_once_in_order_on_postgresql(
    pg_cluster: PgCluster, statuses: list[int], messages: int
) -> None:
    target = pg_cluster.new_database()
    try:
        _check(statuses, messages, *asyncio.run(_deliver(list(statuses), messages, target)))
    finally:
        pg_cluster.drop_database(target)


def _check(statuses: list[int], messages: int, sent: list[tuple[int, str]], calls: int) -> None:
    expected = [(1 + i % 3, f"m{i}") for i in range(messages)]
    assert sorted(sent) == sorted(expected)
    for chat in (1, 2, 3):
        assert [t for c, t in sent if c == chat] == [t for c, t in expected if c == chat]
    # each failure cost one more call, nothing else did
    assert calls == messages + sum(1 for s in statuses[:calls] if s)

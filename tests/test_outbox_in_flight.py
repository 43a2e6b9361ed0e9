"""A message whose send was under way when the bot died is never sent twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatfront.store import OutboxItem, SqlBotStore
from engine.store import open_database
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import CHAT, bot_settings, running_bot
from tests.support import wait_until

pytestmark = [pytest.mark.usefixtures("isolated_env", "bot_backend"), pytest.mark.timeout(120)]


async def _none_pending(store: SqlBotStore) -> bool:
    return await store.pending_outbox() == 0


async def test_an_in_flight_message_is_noticed_not_resent(tmp_path: Path) -> None:
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path)
        # What a killed bot leaves: one row whose send began, one never tried.
        async with open_database(settings.database) as db:
            store = SqlBotStore(db)
            await store.enqueue(
                [
                    OutboxItem(
                        chat_id=str(CHAT), kind="text", body="part one of the answer", run_id="r1"
                    ),
                    OutboxItem(
                        chat_id=str(CHAT), kind="text", body="part two of the answer", run_id="r1"
                    ),
                ]
            )
            first = await store.next_outbox()
            assert first is not None
            await store.outbox_sending(first.id)
        async with running_bot(api, settings) as rt:
            await api.wait_for_message(lambda m: m.text == "part two of the answer")
            notice = await api.wait_for_message(lambda m: "may be missing" in m.text)
            assert "«part one of the answer»" in notice.text
            assert "run r1" in notice.text
            # The notice reached Telegram; its row is marked sent just after the answer.
            await wait_until(
                lambda: _none_pending(rt.store), timeout=10, what="the outbox emptying"
            )
        assert not [m for m in api.sent if m.text == "part one of the answer"]
        # A send that failed and will be retried is no longer in flight.
        async with open_database(settings.database) as db:
            store = SqlBotStore(db)
            await store.enqueue([OutboxItem(chat_id=str(CHAT), kind="text", body="retried")])
            row = await store.next_outbox()
            assert row is not None
            await store.outbox_sending(row.id)
            await store.outbox_not_sent(row.id)
            assert await store.outbox_uncertain() == []

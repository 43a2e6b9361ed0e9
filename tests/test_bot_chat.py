"""Chat sessions end to end: the real bot, the fake Bot API over HTTP, the fake agent."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.store.runs import SqliteRunStore
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import (
    CHAT,
    OPERATOR,
    agent_log,
    bot_settings,
    running_bot,
    write_script,
)

pytestmark = pytest.mark.usefixtures("isolated_env")


async def test_three_turn_chat_session_resumes_the_same_session(tmp_path: Path) -> None:
    write_script(tmp_path, {"rules": [{"match": "", "text": "**turn {turn}**: {prompt}"}]})
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        assert [c["command"] for c in api.commands][:2] == ["help", "chat"]
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
        await api.wait_for_message(lambda m: "bound to a new command session" in m.text)
        for i in range(1, 4):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"question {i}")
            reply = await api.wait_for_message(lambda m, i=i: f": question {i}" in m.text)
            assert reply.text == f"turn {i}: question {i}"
            assert reply.entities[0]["type"] == "bold"
        log = agent_log(tmp_path)
        assert [e["prompt"] for e in log] == ["question 1", "question 2", "question 3"]
        assert len({e["session"] for e in log}) == 1
        binding = await rt.store.binding(CHAT, 0)
        assert binding is not None
        assert binding.turns == 3
        runs = await SqliteRunStore(rt.db).list_runs()
        turns = await SqliteRunStore(rt.db).turns(runs[0].id)
        assert [t.state.value for t in turns] == ["finished"] * 3
    # the status message was created once and edited in place, never re-sent
    status = [m for m in api.sent if m.text.startswith("💬 chat session")]
    assert len(status) == 1

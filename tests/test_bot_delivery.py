"""Publishing and delivery: big outputs, flood limits, server errors, redaction, bad input."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from engine.settings import Settings
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import (
    CHAT,
    OPERATOR,
    agent_log,
    bot_settings,
    running_bot,
    write_script,
)

pytestmark = pytest.mark.usefixtures("isolated_env", "bot_backend")


def _big_output(size: int) -> str:
    lines = []
    n = 0
    while sum(len(x) + 1 for x in lines) < size:
        n += 1
        lines.append(f"line {n:05d}: the quick brown fox jumps over the lazy dog {n * 7919}")
    return "\n".join(lines)


async def _bind(api: FakeBotApi, chat: int = CHAT) -> None:
    api.push_message(chat_id=chat, user_id=OPERATOR, text="/chat")
    await api.wait_for_message(lambda m: "bound" in m.text and m.chat_id == chat)


async def test_50kb_output_arrives_complete_as_a_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = _big_output(50_000)
    write_script(tmp_path, {"rules": [{"match": "", "text": output}]}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)):
        await _bind(api)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="big please")
        doc = await api.wait_for_message(lambda m: m.document is not None)
    assert doc.document is not None
    assert doc.document.decode() == output
    assert "characters" in doc.text
    assert doc.text.count("\n") < 20


async def test_50kb_output_split_into_messages_is_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = _big_output(50_000)
    write_script(tmp_path, {"rules": [{"match": "", "text": output + "\nTHE END"}]}, monkeypatch)
    settings_kw: dict[str, Any] = {"document_threshold": 10_000_000}
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, **settings_kw)
        async with running_bot(api, settings):
            await _bind(api)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="big please")
            await api.wait_for_message(lambda m: m.text.endswith("THE END"))
    parts = [m.text for m in api.sent if m.text.startswith("line ") or m.text.endswith("THE END")]
    assert all(len(p.encode("utf-16-le")) // 2 <= 4096 for p in parts)
    assert len(parts) <= 14
    assert "".join(parts) == output + "\nTHE END"


async def test_429_storm_loses_and_duplicates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": [{"match": "", "text": "answer to {prompt}"}]}, monkeypatch)
    # A private chat: the storm, not the 20-per-minute group limit, is under test here.
    chat = OPERATOR
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, allowed_chats=(chat,))
        await _storm(api, settings, chat)
    answers = [t for t in api.texts() if t.startswith("answer to")]
    assert sorted(answers) == sorted(f"answer to q{i}" for i in range(6))
    # one turn per message, in order
    assert [e["prompt"] for e in agent_log(tmp_path)] == [f"q{i}" for i in range(6)]


async def _storm(api: FakeBotApi, settings: Settings, chat: int) -> None:
    async with running_bot(api, settings):
        await _bind(api, chat)
        storm = api.fail(["sendMessage", "editMessageText"], 429, every=3, retry_after=1)
        for i in range(6):
            api.push_message(chat_id=chat, user_id=OPERATOR, text=f"q{i}")
        await api.wait_until(
            lambda: all(f"answer to q{i}" in api.texts() for i in range(6)), timeout=40
        )
        assert storm.seen >= 6
        assert any(c.status == 429 for c in api.calls)


async def test_server_errors_are_retried_with_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": [{"match": "", "text": "fine"}]}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)):
        await _bind(api)
        api.fail(["sendMessage"], 502, count=3)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="hello")
        await api.wait_for_message(lambda m: m.text == "fine", timeout=30)
    assert api.texts().count("fine") == 1
    assert sum(1 for c in api.calls if c.status == 502) == 3


async def test_secrets_are_redacted_before_sending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeBotApi() as api:
        leak = f"the token is {api.token} and key sk-ant-abcdefghijklmnop1234"
        write_script(tmp_path, {"rules": [{"match": "", "text": leak}]}, monkeypatch)
        async with running_bot(api, bot_settings(api, tmp_path)):
            await _bind(api)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="leak it")
            msg = await api.wait_for_message(lambda m: m.text.startswith("the token is"))
    assert api.token not in msg.text
    assert "sk-ant-abcdefghijklmnop1234" not in msg.text
    assert "[REDACTED]" in msg.text
    assert all(api.token not in json.dumps(c.params) for c in api.calls)


async def test_bad_inbound_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_script(tmp_path, {"rules": [{"match": "", "text": "**got**: {prompt}"}]}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        await _bind(api)
        # 100 KB message: refused politely, nothing run
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="x" * 100_000)
        await api.wait_for_message(lambda m: "the limit is" in m.text)
        # whitespace only: ignored
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="   \n\t ")
        # missing arguments: usage
        for cmd in ("/auto", "/reject", "/steer", "/autopilot"):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text=cmd)
        await api.wait_until(lambda: sum("Usage" in t for t in api.texts()) >= 3)
        # callback data that is not ours: answered, ignored
        api.push_callback(chat_id=CHAT, user_id=OPERATOR, data="something-else", message_id=1)
        await api.wait_until(lambda: len(api.callback_answers) == 1)
        # an edited old message, a channel post and another bot: ignored
        edited = api.message_payload(chat_id=CHAT, user_id=OPERATOR, text="edited text")
        edited["edit_date"] = int(time.time())
        api.push_update({"edited_message": edited})
        post = api.message_payload(chat_id=-100777, user_id=OPERATOR, text="channel text")
        post["chat"]["type"] = "channel"
        api.push_update({"channel_post": post})
        api.push_message(chat_id=CHAT, user_id=OPERATOR + 1000, text="bot text", is_bot=True)
        # Unicode, RTL and emoji reach the agent unchanged and come back with right offsets
        fancy = "שלום 👋🏽 — ünïcödé 𝔘 done"
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text=fancy)
        reply = await api.wait_for_message(lambda m: m.text.startswith("got: "))
        assert reply.text == f"got: {fancy}"
        assert reply.entities == [{"type": "bold", "offset": 0, "length": 3}]
        prompts = [e["prompt"] for e in agent_log(tmp_path)]
        assert prompts == [fancy]
        # every update was recorded, once
        rows = await rt.db.fetchall("SELECT update_id, state FROM bot_inbound")
        assert len(rows) == len({r["update_id"] for r in rows}) >= 10
        assert not any(r["state"] == "received" for r in rows)
    assert not any(
        "edited text" in t or "channel text" in t or "bot text" in t for t in api.texts()
    )


async def test_chat_migrated_to_supergroup_is_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": [{"match": "", "text": "reply {prompt}"}]}, monkeypatch)
    old_chat, new_chat = -4001, -1004001
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, allowed_chats=(old_chat,))
        async with running_bot(api, settings) as rt:
            await _bind(api, old_chat)
            migrate = api.message_payload(chat_id=old_chat, user_id=OPERATOR, text="")
            del migrate["text"]
            migrate["chat"]["type"] = "group"
            migrate["migrate_to_chat_id"] = new_chat
            api.push_update({"message": migrate})
            api.push_message(chat_id=new_chat, user_id=OPERATOR, text="after")
            await api.wait_for_message(lambda m: m.text == "reply after" and m.chat_id == new_chat)
            assert await rt.store.binding(str(new_chat), None) is not None
            assert await rt.store.binding(str(old_chat), None) is None


async def test_duplicate_update_ids_are_acted_on_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": [{"match": "", "text": "once {prompt}"}]}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)):
        await _bind(api)
        payload = {"message": api.message_payload(chat_id=CHAT, user_id=OPERATOR, text="dup")}
        # Telegram re-delivers an update (at-least-once): the bot acts once
        uid = api.push_update(payload)
        api.push_update(payload, update_id=uid)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="next")
        await api.wait_for_message(lambda m: m.text == "once next")
    assert api.texts().count("once dup") == 1

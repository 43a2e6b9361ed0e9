"""Chat sessions end to end: the real bot, the fake Bot API over HTTP, the fake agent."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.store.runs import RunStatus, SqliteRunStore, TurnState
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import (
    CHAT,
    OPERATOR,
    STRANGER,
    agent_log,
    alive,
    bot_settings,
    running_bot,
    wait_for_file,
    write_script,
)

pytestmark = pytest.mark.usefixtures("isolated_env")


async def test_three_turn_chat_session_resumes_the_same_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(
        tmp_path, {"rules": [{"match": "", "text": "**turn {turn}**: {prompt}"}]}, monkeypatch
    )
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        assert [c["command"] for c in api.commands][:2] == ["help", "chat"]
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
        await api.wait_for_message(lambda m: "bound to a new command session" in m.text)
        for i in range(1, 4):
            asked = api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"question {i}")
            question = api.pushed(asked)["message"]["message_id"]
            reply = await api.wait_for_message(lambda m, i=i: f": question {i}" in m.text)
            assert reply.text == f"turn {i}: question {i}"
            assert reply.entities[0]["type"] == "bold"
            # the answer and the turn's progress message are replies to the question
            assert reply.reply_to == question
            progress = [m for m in api.sent if m.reply_to == question and m is not reply]
            assert len(progress) == 1
            assert progress[0].message_id < reply.message_id
            await api.wait_until(lambda p=progress[0]: p.text.startswith("✅ done"))
            assert progress[0].history[0].startswith("⏳ working")
            assert not progress[0].buttons
        log = agent_log(tmp_path)
        assert [e["prompt"] for e in log] == ["question 1", "question 2", "question 3"]
        assert len({e["session"] for e in log}) == 1
        binding = await rt.store.binding(CHAT, 0)
        assert binding is not None
        assert binding.turns == 3
        runs = await SqliteRunStore(rt.db).list_runs()
        turns = await SqliteRunStore(rt.db).turns(runs[0].id)
        assert [t.state.value for t in turns] == ["finished"] * 3
    # no status message far up the chat: each turn has its own progress message
    assert not any(m.text.startswith("💬 chat session") for m in api.sent)


async def test_stop_preempts_a_long_turn_and_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_AGENT_PIDS", str(pids))
    write_script(
        tmp_path,
        {"rules": [{"match": "long", "grandchild": True, "ignore_term": True, "sleep": 3600}]},
        monkeypatch,
    )
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, preempt_grace=0.5)
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="a long job")
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="queued behind it")
            await api.wait_for_message(lambda m: "Queued" in m.text)
            await wait_for_file(pids)
            agent_pid, child_pid = (int(p) for p in pids.read_text().split())
            assert alive(agent_pid)
            stopped_at = time.monotonic()
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/stop")
            note = await api.wait_for_message(lambda m: "stopped during turn 1" in m.text)
            elapsed = time.monotonic() - stopped_at
            assert "1 queued message(s) were discarded" in note.text
            assert not alive(agent_pid)
            assert not alive(child_pid)
            # Nowhere near the agent's 3600 s: the grace period, SIGKILL, and a margin for
            # the bot's round trips on a loaded machine.
            assert elapsed < settings.preempt_grace + 10
            runs = await rt.runs.list_runs()
            assert runs[0].status is RunStatus.STOPPED
            turns = await rt.runs.turns(runs[0].id)
            assert [t.state for t in turns] == [TurnState.INTERRUPTED]
            # the chat stays bound: the next message starts a new run of the same session
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="hello again")
            await api.wait_for_message(lambda m: m.text == "echo: hello again")


async def test_unauthorized_command_and_button_are_refused_and_audited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.push_message(chat_id=CHAT, user_id=STRANGER, text="/chat")
        refusal = await api.wait_for_message(lambda m: "Not allowed" in m.text)
        assert str(STRANGER) in refusal.text
        api.push_message(chat_id=CHAT, user_id=STRANGER, text="/stop")
        api.push_callback(chat_id=CHAT, user_id=STRANGER, data="ap:gate1", message_id=1)
        await api.wait_until(lambda: len(api.callback_answers) == 1)
        assert "Not allowed" in api.callback_answers[0].get("text", "")
        # a chat that is not allowed is ignored (audited, nothing said)
        api.push_message(chat_id=-555, user_id=OPERATOR, text="/chat")
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
        await api.wait_for_message(lambda m: "No runs in this chat" in m.text)
        entries = await rt.store.audit_entries()
        refused = [(e.user_id, e.chat_id, e.action) for e in entries if e.outcome == "refused"]
        assert (STRANGER, CHAT, "chat") in refused
        assert (STRANGER, CHAT, "stop") in refused
        assert (STRANGER, CHAT, "approve") in refused
        assert (OPERATOR, -555, "any") in refused
        assert await rt.store.binding(CHAT, 0) is None
        assert not await rt.runs.list_runs()
    # one refusal message per user per minute, never a flood
    assert sum("Not allowed" in t for t in api.texts()) == 1
    assert not api.texts(-555)
    assert agent_log(tmp_path) == []


async def test_private_chat_not_allowed_tells_the_user_their_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)):
        api.push_message(chat_id=777, user_id=777, text="/start")
        reply = await api.wait_for_message(lambda m: m.chat_id == 777)
        assert "777" in reply.text
        assert "not allowed" in reply.text


async def test_queue_depth_is_never_exceeded_silently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = tmp_path / "release"
    write_script(
        tmp_path,
        {"rules": [{"match": "", "text": "done {prompt}", "wait_file": str(release)}]},
        monkeypatch,
    )
    settings_kw = {"queue_depth": 1}
    async with FakeBotApi() as api:
        async with running_bot(api, bot_settings(api, tmp_path, **settings_kw)):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="one")
            await api.wait_for_message(lambda m: m.text.startswith("⏳ working"))
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="two")
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="three")
            refused = await api.wait_for_message(lambda m: "Not queued" in m.text)
            assert "limit 1" in refused.text
            release.touch()
            await api.wait_for_message(lambda m: m.text == "done two")
        assert "done three" not in api.texts()
        assert "done one" in api.texts()


async def test_an_agent_that_cannot_start_is_reported_not_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, agent_command="/nonexistent/agent {prompt}")
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="hello")
            failed = await api.wait_for_message(lambda m: "failed" in m.text)
            assert "cannot start" in failed.text
            assert "not found" in failed.text
            runs = await rt.runs.list_runs()
            assert runs[0].status is RunStatus.ERROR
            turns = await rt.runs.turns(runs[0].id)
            assert [t.state for t in turns] == [TurnState.FAILED]


async def test_the_stop_button_of_a_turns_progress_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(
        tmp_path,
        {"rules": [{"match": "long", "wait_file": str(tmp_path / "never")}]},
        monkeypatch,
    )
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.names[OPERATOR] = "Olga"
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
        await api.wait_for_message(lambda m: "bound" in m.text)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="a long job")
        progress = await api.wait_for_message(lambda m: m.text.startswith("⏳ working"))
        # the elapsed time moves while the turn runs (edited in place)
        await api.wait_until(lambda: progress.edits >= 1)
        stop = next(b["callback_data"] for b in progress.buttons if "Stop" in b["text"])
        # a stranger's press is refused and changes nothing
        api.push_callback(chat_id=CHAT, user_id=STRANGER, data=stop, message_id=progress.message_id)
        await api.wait_until(lambda: len(api.callback_answers) == 1)
        assert progress.buttons
        api.push_callback(chat_id=CHAT, user_id=OPERATOR, data=stop, message_id=progress.message_id)
        await api.wait_until(lambda: progress.text.startswith("⏹ stopped by Olga"))
        assert not progress.buttons
        runs = await rt.runs.list_runs()
        assert runs[0].status is RunStatus.STOPPED

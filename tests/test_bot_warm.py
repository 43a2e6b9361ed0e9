"""A warm chat session in the real bot: the fake Bot API, the real ``claude``, the fake model.

The auto run and the autopilot drive (their runs, gates and drive locks in the store) run on
both databases (``bot_backend``); the rest is about the resident agent process and runs on
SQLite only."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from engine.agents.factory import create_agent, turn_mode
from engine.agents.warm import WarmClaudeAgent
from engine.agents.warm_codex import WarmCodexAgent
from engine.settings import Settings
from engine.store.runs import RunStatus
from tests.agent_clis import ensure_cli
from tests.automode_support import GIT_ENV, git_workspace
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import (
    CHAT,
    OPERATOR,
    bot_settings,
    running_bot,
    wait_for_run_status,
)
from tests.fakes.model_api import FakeModelAPI, Hold, Text, ToolCall
from tests.fakes.realcli import MARKER_VAR, Sandbox, marked_processes

pytestmark = [
    pytest.mark.realcli,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("isolated_env"),
]


def test_the_setting_and_the_cli_choose_the_mode(tmp_path: Path) -> None:
    claude = str(ensure_cli("claude"))
    off = Settings(_env_file=None, claude_bin=claude)  # type: ignore[call-arg]
    on = Settings(_env_file=None, claude_bin=claude, warm_sessions="claude")  # type: ignore[call-arg]
    old_cli = tmp_path / "old-claude"
    old_cli.write_text("#!/bin/sh\necho 'Usage: claude [options] --print'\n")
    old_cli.chmod(0o755)
    old = Settings(_env_file=None, claude_bin=str(old_cli), warm_sessions="on")  # type: ignore[call-arg]
    assert not turn_mode("claude", off).warm
    assert turn_mode("claude", on).warm
    assert not turn_mode("claude", old).warm
    assert "--input-format" in turn_mode("claude", old).reason
    assert not turn_mode("copilot", old).warm
    assert not isinstance(create_agent("claude", off, cwd=tmp_path), WarmClaudeAgent)
    assert isinstance(create_agent("claude", on, cwd=tmp_path), WarmClaudeAgent)
    assert not isinstance(create_agent("claude", old, cwd=tmp_path), WarmClaudeAgent)


async def test_a_message_sent_during_a_warm_turn_reaches_that_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "claude-config"
    config.mkdir()
    gate = tmp_path / "go"
    waiting = f"while [ ! -e {gate} ]; do sleep 0.05; done; echo tool-done"
    async with FakeModelAPI() as model, FakeBotApi() as api:
        for key, value in model.claude_env(config).items():
            monkeypatch.setenv(key, value)
        model.enqueue(
            ToolCall("Bash", {"command": waiting, "description": "wait"}),
            Text("done, with bananas"),
            Text("second turn"),
        )
        settings = bot_settings(
            api,
            tmp_path,
            default_agent="claude",
            claude_bin=str(ensure_cli("claude")),
            warm_sessions="claude",
            allowed_tools=("bash",),
        )
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="run the tool")
            await model.wait_for_model_requests(1)
            assert rt.chats is not None
            async with asyncio.timeout(60):
                while not (
                    (run := rt.chats.active.get((str(CHAT), None))) is not None
                    and run.agent.preempt.active
                    and run.agent.turn.tool_calls
                ):
                    await asyncio.sleep(0.02)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="also mention bananas")
            # The CLI notes the message in its transcript when it reads it, and takes it
            # up after the running tool: only then let the tool finish.
            assert isinstance(run.agent, WarmClaudeAgent)
            transcript = run.agent.transcript_path()
            async with asyncio.timeout(60):
                while not (
                    transcript.exists() and "also mention bananas" in transcript.read_text()
                ):
                    await asyncio.sleep(0.02)
            gate.touch()
            await api.wait_for_message(lambda m: "Sent to the running turn" in m.text)
            await api.wait_for_message(lambda m: m.text == "done, with bananas")
            assert "also mention bananas" in model.model_requests[1].all_text()
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="and now?")
            await api.wait_for_message(lambda m: m.text == "second turn")
            run = rt.chats.active[(str(CHAT), None)]
            assert isinstance(run.agent, WarmClaudeAgent)
            assert run.agent.spawns == 1
            # Two turns, the steering message in the first, none queued as a turn of its own.
            assert run.turns_done == 2
            assert len(model.model_requests) == 3
        assert not run.agent.resident


async def test_per_tool_approval_works_on_a_warm_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_tool_approvals_realcli import TOUCH, bind_and_ask, press, workdir

    box = Sandbox(tmp_path / "claude")
    async with FakeModelAPI() as model, FakeBotApi() as api:
        for key, value in box.env(model.claude_env(box.config)).items():
            monkeypatch.setenv(key, value)
        model.enqueue(TOUCH, Text("file made"), Text("still warm"))
        settings = bot_settings(
            api,
            tmp_path,
            default_agent="claude",
            claude_bin=str(ensure_cli("claude")),
            tool_approval="unlisted",
            warm_sessions="claude",
        )
        async with running_bot(api, settings) as rt:
            ask = await bind_and_ask(api)
            press(api, ask, "Allow once", OPERATOR)
            await api.wait_for_message(lambda m: m.text == "file made", timeout=60)
            assert (workdir(tmp_path) / "allowed.txt").exists()
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="and now?")
            await api.wait_for_message(lambda m: m.text == "still warm", timeout=60)
            assert rt.chats is not None
            agent = rt.chats.active[(str(CHAT), None)].agent
            assert isinstance(agent, WarmClaudeAgent)
            assert agent.spawns == 1
    assert marked_processes(box.marker) == []


async def test_a_warm_codex_chat_session_says_so_in_status_and_takes_steering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "codex-home"
    async with FakeModelAPI() as model, FakeBotApi() as api:
        for key, value in model.codex_env(home).items():
            monkeypatch.setenv(key, value)
        hold = Hold(text="first part")
        model.enqueue(Text("first turn"), hold, Text("steered, with bananas"))
        settings = bot_settings(
            api,
            tmp_path,
            default_agent="codex",
            codex_bin=str(ensure_cli("codex")),
            warm_sessions="codex",
        )
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="hello")
            await api.wait_for_message(lambda m: m.text == "first turn")
            assert rt.chats is not None
            run = rt.chats.active[(str(CHAT), None)]
            assert isinstance(run.agent, WarmCodexAgent)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            await api.wait_for_message(lambda m: "chat session · codex · warm" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="a long one")
            await asyncio.wait_for(hold.arrived.wait(), 60)
            async with asyncio.timeout(60):
                while not run.agent.preempt.active:
                    await asyncio.sleep(0.02)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="also mention bananas")
            await api.wait_for_message(lambda m: "Sent to the running turn" in m.text)
            hold.release.set()
            await api.wait_for_message(lambda m: m.text == "steered, with bananas")
            assert "also mention bananas" in model.model_requests[2].all_text()
            assert run.agent.spawns == 1
            assert run.turns_done == 2
        assert not run.agent.resident


@pytest.mark.usefixtures("bot_backend")
async def test_a_warm_auto_run_says_so_in_status_and_its_process_ends_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    git_workspace(tmp_path / "ws" / "default")
    marker = uuid.uuid4().hex
    monkeypatch.setenv(MARKER_VAR, marker)
    home = tmp_path / "codex-home"
    async with FakeModelAPI() as model, FakeBotApi() as api:
        for key, value in model.codex_env(home).items():
            monkeypatch.setenv(key, value)
        plan = Hold(text="1. nothing")
        model.enqueue(Text("Goal: nothing."), plan)
        settings = bot_settings(
            api,
            tmp_path,
            default_agent="codex",
            codex_bin=str(ensure_cli("codex")),
            warm_sessions="codex",
        )
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto do nothing")
            started = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run "))
            run_id = started.text.split()[3]
            await asyncio.wait_for(plan.arrived.wait(), 120)
            assert marked_processes(marker) != []
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            await api.wait_for_message(
                lambda m: m.text.startswith(f"🤖 auto {run_id}") and "· warm" in m.text
            )
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/stop {run_id}")
            await wait_for_run_status(rt, run_id, RunStatus.STOPPED)
            # The run is over: its resident process is gone, not left for idle eviction.
            async with asyncio.timeout(30):
                while marked_processes(marker):
                    await asyncio.sleep(0.05)


async def test_an_auto_run_counts_in_the_warm_cap_with_the_chat_sessions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    git_workspace(tmp_path / "ws" / "default")
    box = Sandbox(tmp_path / "claude")
    async with FakeModelAPI() as model, FakeBotApi() as api:
        for key, value in box.env(model.claude_env(box.config)).items():
            monkeypatch.setenv(key, value)
        clarify = Hold(text="Goal: nothing.")
        model.enqueue(Text("chat answer"), clarify)
        settings = bot_settings(
            api,
            tmp_path,
            default_agent="claude",
            claude_bin=str(ensure_cli("claude")),
            warm_sessions="claude",
            max_warm_sessions=1,
        )
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="hello")
            await api.wait_for_message(lambda m: m.text == "chat answer", timeout=60)
            assert rt.chats is not None
            chat = rt.chats.active[(str(CHAT), None)].agent
            assert isinstance(chat, WarmClaudeAgent)
            assert chat.resident  # idle between turns, its process stays
            assert rt.warm_pool.members == [chat]

            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto do nothing")
            started = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run "))
            run_id = started.text.split()[3]
            await asyncio.wait_for(clarify.arrived.wait(), 120)
            # The auto run's process took the one place: the idle chat's process left.
            assert rt.warm_pool.evictions == 1
            assert not chat.resident
            [auto] = rt.warm_pool.members
            assert isinstance(auto, WarmClaudeAgent)
            assert auto is not chat
            assert auto.resident
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/stop {run_id}")
            await wait_for_run_status(rt, run_id, RunStatus.STOPPED)
    assert marked_processes(box.marker) == []


@pytest.mark.usefixtures("bot_backend")
async def test_a_warm_autopilot_drive_says_so_in_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "claude-config"
    config.mkdir()
    marker = uuid.uuid4().hex
    monkeypatch.setenv(MARKER_VAR, marker)
    async with FakeModelAPI() as model, FakeBotApi() as api:
        for key, value in model.claude_env(config).items():
            monkeypatch.setenv(key, value)
        research = Hold(text="research notes")
        model.enqueue(research)
        settings = bot_settings(
            api,
            tmp_path,
            default_agent="claude",
            claude_bin=str(ensure_cli("claude")),
            warm_sessions="claude",
        )
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T1 a widget")
            await api.wait_for_message(lambda m: "Autopilot for task T1 started" in m.text)
            await asyncio.wait_for(research.arrived.wait(), 120)
            assert marked_processes(marker) != []
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            line = await api.wait_for_message(lambda m: "🛂 autopilot T1" in m.text)
            assert "🛂 autopilot T1 · research · driving · warm" in line.text
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/stop T1")
            await api.wait_for_message(lambda m: "Autopilot for T1 stopped" in m.text)
            # The drive is over: its resident process is gone.
            async with asyncio.timeout(30):
                while marked_processes(marker):
                    await asyncio.sleep(0.05)

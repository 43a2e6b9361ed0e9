"""Webhook mode, /status, /tasks paging, /audit, /help and setMyCommands, forum topics."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import aiohttp
import pytest

from bot.app import BotRuntime
from engine.errors import ConfigError
from engine.gates import Gates
from engine.store.runs import RunStatus
from engine.workspace.runs import checkout_for_run
from tests.automode_support import CLARIFY, GIT_ENV, git_workspace
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import (
    ADMIN,
    CHAT,
    OPERATOR,
    STRANGER,
    agent_log,
    bot_settings,
    running_bot,
    runs_shown,
    wait_for_run_status,
    write_script,
)
from tests.gates_support import phase_rules

pytestmark = pytest.mark.usefixtures("isolated_env", "bot_backend")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_webhook_checks_the_secret_and_dedupes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    port = _free_port()
    url = f"http://127.0.0.1:{port}/tg/hook"
    async with FakeBotApi() as api:
        settings = bot_settings(
            api,
            tmp_path,
            webhook_url=url,
            webhook_listen="127.0.0.1",
            webhook_port=port,
            webhook_secret="s3cret-token_x",
        )
        async with running_bot(api, settings), aiohttp.ClientSession() as http:
            assert api.webhook is not None
            assert api.webhook["url"] == url
            assert api.webhook["secret_token"] == "s3cret-token_x"
            update = {
                "update_id": 77,
                "message": api.message_payload(chat_id=CHAT, user_id=OPERATOR, text="/help"),
            }
            body = json.dumps(update)
            headers = {"Content-Type": "application/json"}
            async with http.post(url, data=body, headers=headers) as resp:
                assert resp.status == 403
            bad = {**headers, "X-Telegram-Bot-Api-Secret-Token": "wrong"}
            async with http.post(url, data=body, headers=bad) as resp:
                assert resp.status == 403
            good = {**headers, "X-Telegram-Bot-Api-Secret-Token": "s3cret-token_x"}
            for _ in range(2):  # Telegram retries: the second delivery is a duplicate
                async with http.post(url, data=body, headers=good) as resp:
                    assert resp.status == 200
            await api.wait_for_message(lambda m: m.text.startswith("You are an operator."))
            status = {
                "update_id": 78,
                "message": api.message_payload(chat_id=CHAT, user_id=OPERATOR, text="/status"),
            }
            async with http.post(url, data=json.dumps(status), headers=good) as resp:
                assert resp.status == 200
            await api.wait_for_message(lambda m: "No runs in this chat" in m.text)
    assert sum(t.startswith("You are an operator.") for t in api.texts()) == 1
    assert not api.calls_of("getUpdates")


async def test_help_commands_and_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = tmp_path / "release"
    write_script(
        tmp_path, {"rules": [{"match": "", "text": "ok", "wait_file": str(release)}]}, monkeypatch
    )
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        names = [c["command"] for c in api.commands]
        assert names == [
            "help", "chat", "agent", "model", "project", "new", "auto", "steer", "autopilot",
            "approve", "reject", "cancel", "pending", "status", "stop", "pause", "resume", "get",
            "diff", "web", "permissions", "tasks", "audit",
        ]  # fmt: skip
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/help")
        help_text = await api.wait_for_message(lambda m: "/chat — talk to agents" in m.text)
        assert "/model — set the model" in help_text.text
        # a folder already under the workspaces root is a project /chat accepts
        (tmp_path / "ws" / "proj-a").mkdir(parents=True)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat command proj-a")
        await api.wait_for_message(lambda m: "bound" in m.text and "proj-a" in m.text)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="work")
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="more work")
        await api.wait_for_message(lambda m: "Queued" in m.text)
        # The agent reported a tool call: /status still shows the turn and its elapsed time.
        assert rt.chats is not None
        rt.chats.active[(str(CHAT), None)].last_event = "🔧 Bash: ls"
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
        status = await api.wait_for_message(lambda m: m.text.startswith("💬 chat session ·"))
        assert "proj-a" in status.text
        assert re.search(
            r"· \d+ turn\(s\) · ⏳ a turn is running · \d+s · 🔧 Bash: ls · queue 1$",
            status.text,
            re.M,
        )
        # one turn count, not the session's and the run's side by side
        assert len(re.findall(r"turn", status.text)) == 2
        assert "🌿" not in status.text  # a plain folder, not a worktree
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat nosuchagent x y")
        await api.wait_for_message(lambda m: m.text.startswith("Usage: /chat"))
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/frobnicate")
        await api.wait_for_message(lambda m: m.text.startswith("Unknown command"))
        release.touch()
        await api.wait_until(lambda: api.texts().count("ok") == 2)
    assert (tmp_path / "ws" / "proj-a").is_dir()


async def test_tasks_is_paged_and_admin_only_and_audit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.names[OPERATOR] = "Olga"
        gates = Gates(rt.db, rt.settings)
        for i in range(40):
            await gates.init_task(f"task-{i:02d}")
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/tasks")
        await api.wait_for_message(lambda m: "/tasks needs the admin role" in m.text)
        api.push_message(chat_id=CHAT, user_id=ADMIN, text="/tasks")
        board = await api.wait_for_message(lambda m: m.text.startswith("📋 "))
        assert "page 1 of 2" in board.text
        # short lines per task, in words, no space-padded columns, no state names
        assert board.text.startswith("📋 40 tasks: 40 idle\npage 1 of 2\n")
        assert re.search(r"\n💤 task-00\n  research · \d+s\n", board.text), board.text
        assert all(len(line) <= 35 for line in board.text.splitlines())
        assert "awaiting_approval" not in board.text
        assert "task-39" not in board.text
        nxt = board.buttons[0]["callback_data"]
        api.push_callback(chat_id=CHAT, user_id=STRANGER, data=nxt, message_id=board.message_id)
        api.push_callback(chat_id=CHAT, user_id=ADMIN, data=nxt, message_id=board.message_id)
        await api.wait_until(lambda: "page 2 of 2" in board.text)
        assert "task-39" in board.text
        assert [b["text"] for b in board.buttons] == ["◀ previous"]
        api.push_message(chat_id=CHAT, user_id=ADMIN, text="/audit")
        audit = await api.wait_for_message(lambda m: m.text.startswith("🔎 Audit of 40 task(s)"))
        # people by name (the bot saw them), actions and roles in words, no raw ids
        assert "- Olga here: listing the tasks, refused: needs the admin role" in audit.text
        assert f"- user{STRANGER} here: " in audit.text
        assert "_" not in audit.text.split("Bot refusals", 1)[1]
        assert f"chat {CHAT}" not in audit.text


async def test_forum_group_gets_a_topic_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)):
        payload = api.message_payload(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T9")
        payload["chat"]["is_forum"] = True
        api.push_update({"message": payload})
        started = await api.wait_for_message(lambda m: "Autopilot for task T9" in m.text)
        assert api.calls_of("createForumTopic")
        assert started.thread_id is not None
        gate = await api.wait_for_message(lambda m: m.text.startswith("🛂 Gate:"), timeout=30)
        assert gate.thread_id == started.thread_id


async def test_chat_on_a_configured_project_gets_its_own_worktree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    repo = git_workspace(tmp_path / "origin")
    write_script(tmp_path, {"rules": [{"match": "", "text": "in {prompt}"}]}, monkeypatch)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, projects=f"web={repo}")
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat command web")
            await api.wait_for_message(lambda m: "bound" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="where")
            await api.wait_for_message(lambda m: m.text == "in where")
            binding = await rt.store.binding(str(CHAT), None)
            assert binding is not None
            # /status shows the session's branch and the worktree's disk usage.
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            status = await api.wait_for_message(lambda m: m.text.startswith("💬 chat session ·"))
            head, worktree = runs_shown(status.text)
            assert "web" in head
            assert re.fullmatch(
                rf"   🌿 turnstile/chat-{binding.session_id[:8]} · \d+(\.\d)? (kB|MB)", worktree
            ), worktree
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat command cache")
            await api.wait_for_message(lambda m: "There is no project 'cache'" in m.text)
    workdir = Path(binding.workdir)
    assert workdir.is_relative_to((tmp_path / "ws").resolve())
    assert (workdir / "README").exists()
    assert [e["cwd"] for e in agent_log(tmp_path)] == [str(workdir)]


async def test_status_shows_the_branch_and_disk_usage_of_an_auto_runs_worktree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    repo = git_workspace(tmp_path / "origin")
    never = tmp_path / "never"
    write_script(
        tmp_path, {"rules": [{"match": CLARIFY, "text": "?", "wait_file": str(never)}]},
        monkeypatch,
    )  # fmt: skip
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, projects=f"web={repo}")
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat command web")
            await api.wait_for_message(lambda m: "bound" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto tidy up")
            started = await api.wait_for_message(lambda m: "Auto run" in m.text)
            run_id = started.text.split()[3]
            try:
                workdir = (await rt.runs.get_run(run_id)).workdir
                assert workdir is not None
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
                status = await api.wait_for_message(
                    lambda m: m.text.startswith("💬 chat session") and f"auto {run_id}" in m.text
                )
            finally:  # the turn never ends by itself
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/stop {run_id}")
                await wait_for_run_status(rt, run_id, RunStatus.STOPPED, timeout=10)
    lines = runs_shown(status.text)
    auto_line = next(i for i, line in enumerate(lines) if line.startswith(f"🤖 auto {run_id}"))
    branch = f"turnstile/{Path(workdir).name}"
    assert branch.startswith("turnstile/auto-")
    assert re.fullmatch(rf"   🌿 {branch} · \d+(\.\d)? (kB|MB)", lines[auto_line + 1])


async def test_status_shows_the_worktree_of_a_checked_out_autopilot_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    repo = git_workspace(tmp_path / "origin")
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, projects=f"web={repo}")
        async with running_bot(api, settings) as rt:
            # As `turnstile autopilot --task T5 --init --checkout-repo web` makes it.
            async with checkout_for_run(settings, rt.db, "web", run_id="T5") as ws:
                assert ws is not None
                await Gates(rt.db, rt.settings).init_task("T5", workdir=ws.path)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T5")
            await api.wait_for_message(lambda m: "Autopilot for task T5" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            status = await api.wait_for_message(lambda m: m.text.startswith("🛂 autopilot T5 · "))
    _head, worktree = runs_shown(status.text)
    assert re.fullmatch(r"   🌿 turnstile/T5 · \d+(\.\d)? (kB|MB)", worktree), status.text


async def test_forum_topics_are_separate_sessions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": [{"match": "", "text": "{session}: {prompt}"}]}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        for topic in (7, 8):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat", thread_id=topic)
            await api.wait_for_message(
                lambda m, t=topic: "topic is bound" in m.text and m.thread_id == t
            )
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="in seven", thread_id=7)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="in eight", thread_id=8)
        seven = await api.wait_for_message(lambda m: m.text.endswith(": in seven"))
        eight = await api.wait_for_message(lambda m: m.text.endswith(": in eight"))
        b7, b8 = await rt.store.binding(str(CHAT), "7"), await rt.store.binding(str(CHAT), "8")
        assert b7 is not None
        assert b8 is not None
        assert b7.session_id != b8.session_id
    assert (seven.thread_id, eight.thread_id) == (7, 8)
    assert seven.text.startswith(b7.session_id)
    assert eight.text.startswith(b8.session_id)


async def test_one_bot_per_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path)
        async with running_bot(api, settings):
            with pytest.raises(ConfigError, match="another turnstile bot already runs"):
                async with BotRuntime(settings):
                    pass
        # released on exit: the next start works
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            await api.wait_for_message(lambda m: "No runs in this chat" in m.text)

"""What a new user in a team group sees on a phone: /help for their role, /tasks in short
lines, /pending, and a gate opened from a terminal posted in the chat bound to its project."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest
from telegram.ext import CommandHandler

from chatfront.commands import ALL_COMMANDS
from engine.gates import Gates
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import (
    ADMIN,
    APPROVER,
    CHAT,
    OPERATOR,
    STRANGER,
    approved,
    bot_settings,
    running_bot,
    write_script,
)
from tests.gates_support import REPO, cli_env, phase_rules

pytestmark = [pytest.mark.usefixtures("isolated_env", "bot_backend"), pytest.mark.timeout(120)]

_PHONE = 35


def _words(text: str) -> int:
    return sum(any(ch.isalnum() for ch in token) for token in text.split())


async def _help_of(api: FakeBotApi, user: int) -> SentMessage:
    before = len(api.sent)
    api.push_message(chat_id=CHAT, user_id=user, text="/help")
    await api.wait_until(lambda: len(api.sent) > before)
    return api.sent[before]


async def test_help_shows_each_role_its_own_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        operator = await _help_of(api, OPERATOR)
        approver = await _help_of(api, APPROVER)
        admin = await _help_of(api, ADMIN)
        stranger = await _help_of(api, STRANGER)
        assert operator.text.startswith("You are an operator. Your commands:")
        assert "\n/chat — talk to agents\n" in operator.text
        assert "/approve" not in operator.text
        assert "/tasks" not in operator.text
        assert _words(operator.text) <= 80, operator.text
        assert approver.text.startswith("You are an approver.")
        assert "/approve" in approver.text
        assert "/chat" not in approver.text
        assert _words(approver.text) <= 50, approver.text
        assert "/tasks — every task's state" in admin.text
        assert "/audit" in admin.text
        assert _words(admin.text) <= 120, admin.text
        # someone without a role learns their id and that an admin grants roles; no commands
        assert f"Your Telegram user id is {STRANGER}" in stranger.text
        assert "/chat" not in stranger.text
        assert _words(stranger.text) <= 40
        # no voice transcription configured: no promise of it
        for shown in (operator, approver, admin):
            assert "voice" not in shown.text.lower()
        # the rest is one tap away: every command with the role it needs
        [button] = operator.buttons
        assert button["text"] == "All commands"
        api.push_callback(
            chat_id=CHAT,
            user_id=OPERATOR,
            data=button["callback_data"],
            message_id=operator.message_id,
        )
        full = await api.wait_for_message(lambda m: m.text.startswith("All commands"))
        assert "/tasks — every task's state (admin)" in full.text
        assert "/approve [TASK] — approve a gate (approver)" in full.text
        assert "voice" not in full.text.lower()
        # Every command the bot answers is in the one table /help is made from.
        assert rt.app is not None
        handled = {
            name
            for group in rt.app.handlers.values()
            for handler in group
            if isinstance(handler, CommandHandler)
            for name in handler.commands
        }
        assert handled - {"start"} == {c.name for c in ALL_COMMANDS}
        assert [c["command"] for c in api.commands] == [c.name for c in ALL_COMMANDS]


async def test_help_mentions_voice_notes_only_when_they_are_transcribed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, transcription_url="http://127.0.0.1:9/v1")
        async with running_bot(api, settings):
            operator = await _help_of(api, OPERATOR)
            assert "voice notes too" in operator.text
            assert _words(operator.text) <= 85


async def test_tasks_fit_a_phone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = tmp_path / "release"
    rules = [{"match": "", "text": "thinking", "wait_file": str(release)}]
    write_script(tmp_path, {"rules": rules}, monkeypatch)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path)
        async with running_bot(api, settings) as rt:
            api.names[OPERATOR] = "Olga"
            gates = Gates(rt.db, rt.settings)
            long_name = "a-task-with-a-name-too-long-for-a-phone-12"
            for name in ("feature-10", "feature-2", "feature-1", long_name):
                await gates.init_task(name, started_by=str(OPERATOR))
            task = await gates.task("feature-2")
            (task.folder / "research.md").write_text("# research\n")
            await gates.transition("feature-2", "research:awaiting_approval")
            await gates.transition("feature-1", "human_intervention")
            # feature-3 is being driven: its turn waits
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot feature-3")
            await api.wait_for_message(lambda m: "Autopilot for task feature-3 started" in m.text)
            api.push_message(chat_id=CHAT, user_id=ADMIN, text="/tasks")
            board = await api.wait_for_message(lambda m: m.text.startswith("📋 "))
            lines = board.text.splitlines()
            head = " ".join(lines[: lines.index("")])
            assert head == "📋 5 tasks: 1 wait for approval, 1 running, 2 idle, 1 need a person"
            # a line a phone shows whole, but the name too long for one
            assert all(len(line) <= _PHONE for line in lines if long_name not in line), lines
            names = [line.split(" ", 1)[1] for line in lines if line and line[0] in "🛂⏳💤✋"]
            # waiting for approval first, then as people count: feature-3 before feature-10
            assert names == ["feature-2", long_name, "feature-1", "feature-3", "feature-10"]
            assert "🛂 feature-2" in lines
            assert "⏳ feature-3" in lines
            assert "💤 feature-10" in lines
            assert "✋ feature-1" in lines
            assert board.text.count("⏳") == 1
            # then the phase, who started it, how long since it moved
            detail = lines[lines.index("💤 feature-10") + 1]
            assert re.fullmatch(r"  research · Olga · \d+[smhd]", detail), detail
            assert "awaiting_approval" not in board.text
            assert "_" not in board.text.replace(long_name, "")
            # its turn ends; the drive goes on to its end (nothing left running at exit)
            release.touch()
            await api.wait_for_message(lambda m: "needs a person" in m.text, timeout=60)


async def test_pending_lists_the_gates_a_person_may_approve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, forbid_self_approval=True)
        async with running_bot(api, settings) as rt:
            gates = Gates(rt.db, rt.settings)
            for name, starter in (("feature-2", ADMIN), ("feature-3", OPERATOR)):
                task = await gates.init_task(name, started_by=str(starter))
                (task.folder / "research.md").write_text(f"# research of {name}\n")
                await gates.transition(name, "research:awaiting_approval")
            api.push_message(chat_id=CHAT, user_id=APPROVER, text="/pending")
            pending = await api.wait_for_message(lambda m: "wait for you" in m.text)
            assert pending.text.startswith("2 things wait for you:")
            assert "🛂 feature-2 · research" in pending.text
            assert "/approve feature-3" in pending.text
            # the admin started feature-2: self-approval is refused here, so only feature-3
            api.push_message(chat_id=CHAT, user_id=ADMIN, text="/pending")
            mine = await api.wait_for_message(lambda m: m.text.startswith("1 thing waits"))
            assert "feature-3" in mine.text
            assert "feature-2" not in mine.text
            # an operator approves nothing
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/pending")
            await api.wait_for_message(lambda m: m.text.startswith("Nothing waits for you"))
            # the line says how to act on it, and that works
            api.push_message(chat_id=CHAT, user_id=APPROVER, text="/approve feature-3")
            await api.wait_for_message(approved("feature-3", "research"))
            api.push_message(chat_id=CHAT, user_id=APPROVER, text="/pending")
            await api.wait_for_message(lambda m: m.text.startswith("1 thing waits for you:"))


async def test_a_gate_opened_in_a_terminal_is_posted_in_the_chat_bound_to_its_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent works in the project; it writes each phase's artifact in the task's folder.
    folder = tmp_path / "tasks" / "T9"
    rules = phase_rules()
    for rule in rules:
        rule["files"] = {str(folder / name): text for name, text in rule["files"].items()}
    write_script(tmp_path, {"rules": rules}, monkeypatch)
    project = tmp_path / "ws" / "proj-a"
    project.mkdir(parents=True)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.names[APPROVER] = "Ann"
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat command proj-a")
        await api.wait_for_message(lambda m: "bound" in m.text and "proj-a" in m.text)
        env = cli_env(rt.settings, {"TURNSTILE_DEFAULT_AGENT": "command"})
        terminal = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "engine.cli",
            "autopilot",
            "--task",
            "T9",
            "--init",
            "--workdir",
            str(project),
            "--poll",
            "0.2",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
        try:

            def gate(phase: str):  # type: ignore[no-untyped-def]
                return lambda m: m.text.startswith(f"🛂 Gate: task T9 · phase {phase}")

            research = await api.wait_for_message(gate("research"), timeout=60)
            assert [b["text"] for b in research.buttons] == ["✅ Approve", "❌ Reject"]
            await api.wait_for_message(lambda m: m.filename == "research.md")  # (after it)
            api.push_callback(
                chat_id=CHAT,
                user_id=APPROVER,
                data=research.buttons[0]["callback_data"],
                message_id=research.message_id,
            )
            await api.wait_until(lambda: "✅ Approved by Ann" in research.text)
            # the terminal's drive goes on, and its next gate comes here too
            await api.wait_for_message(gate("decomposition"), timeout=60)
        finally:
            if terminal.returncode is None:
                terminal.terminate()
            out, _ = await terminal.communicate()
        said = out.decode()
        assert "T9 · research waits for approval" in said, said

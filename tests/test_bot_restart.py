"""The real ``turnstile bot`` process killed with SIGKILL mid-run, then started again: on a
SQLite file and on a fresh PostgreSQL database in turn (``db_target``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest

from tests.automode_support import GIT_ENV, git_workspace, happy_rules
from tests.bot_process import bot_env, start_polling
from tests.db_support import Target, rows, setting
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import OPERATOR, wait_for_file, write_script

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parent.parent
CHAT = OPERATOR  # a private chat: the group flood limit is not under test here


def _env(api: FakeBotApi, root: Path, db: Target) -> dict[str, str]:
    return bot_env(
        root,
        api,
        TURNSTILE_DATABASE=setting(db),
        TURNSTILE_ALLOWED_CHATS=str(CHAT),
        TURNSTILE_PREEMPT_GRACE="1",
        # the fake agent's script, state and pid files, set by each test
        **{k: v for k, v in os.environ.items() if k.startswith("FAKE_")},
    )


async def _start(api: FakeBotApi, root: Path, db: Target) -> asyncio.subprocess.Process:
    return await start_polling(api, root, _env(api, root, db), timeout=30)


def _outbox(db: Target) -> list[tuple[str, str]]:
    return [(str(b), str(s)) for b, s in rows(db, "SELECT body, state FROM bot_outbox ORDER BY id")]


async def test_sigkill_mid_run_then_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, db_target: Target
) -> None:
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_AGENT_PIDS", str(pids))
    write_script(
        tmp_path,
        {
            "rules": [
                {
                    "match": "second",
                    "grandchild": True,
                    "wait_file": str(tmp_path / "never"),
                },
                {"match": "", "text": "answer: {prompt}"},
            ]
        },
        monkeypatch,
    )
    async with FakeBotApi() as api:
        bot = await _start(api, tmp_path, db_target)
        try:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound" in m.text)
            # Telegram is down for sends: the first answer is committed but not delivered.
            api.fail(["sendMessage"], 502, count=10_000)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="first")
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="second")
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="third")
            await wait_for_file(pids)  # the second turn's agent is running
            assert ("answer: first", "pending") in _outbox(db_target)
            bot.send_signal(signal.SIGKILL)
            await bot.wait()
        finally:
            if bot.returncode is None:
                bot.kill()
                await bot.wait()
        api.failures.clear()
        sent_before = len(api.sent)

        bot = await _start(api, tmp_path, db_target)
        try:
            await api.wait_for_message(lambda m: m.text == "answer: third", timeout=30)
            await api.wait_for_message(lambda m: "was cut off" in m.text)
            bot.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(bot.wait(), 30) == 0
        finally:
            if bot.returncode is None:
                bot.kill()
                await bot.wait()
            for pid in pids.read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)

    after = [m.text for m in api.sent[sent_before:]]
    everything = api.texts()
    assert everything.count("answer: first") == 1
    assert everything.count("answer: third") == 1
    assert "answer: first" in after
    cut = [t for t in after if "was cut off" in t]
    assert len(cut) == 1
    assert "Prompt was: second" in cut[0]
    assert all(state == "sent" for _, state in _outbox(db_target))


async def test_auto_run_resumes_after_sigkill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, db_target: Target
) -> None:
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_AGENT_PIDS", str(pids))
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    git_workspace(tmp_path / "ws" / "default")
    write_script(
        tmp_path,
        {
            "replies": [{"grandchild": True, "wait_file": str(tmp_path / "never"), "text": "x"}],
            "rules": happy_rules(),
        },
        monkeypatch,
    )
    async with FakeBotApi() as api:
        bot = await _start(api, tmp_path, db_target)
        try:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto write result.txt")
            started = await api.wait_for_message(lambda m: "Auto run" in m.text)
            run_id = started.text.split()[3]
            await wait_for_file(pids)  # the clarify turn is running
            bot.send_signal(signal.SIGKILL)
            await bot.wait()
        finally:
            if bot.returncode is None:
                bot.kill()
                await bot.wait()
            for pid in pids.read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        bot = await _start(api, tmp_path, db_target)
        try:
            await api.wait_for_message(lambda m: f"Auto run {run_id} resumed" in m.text)
            await api.wait_for_message(lambda m: "Objective achieved" in m.text, timeout=60)
            bot.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(bot.wait(), 30) == 0
        finally:
            if bot.returncode is None:
                bot.kill()
                await bot.wait()
    cut = [t for t in api.texts() if "was cut off" in t]
    assert len(cut) == 1
    assert run_id in cut[0]
    [(status,)] = rows(db_target, "SELECT status FROM runs WHERE id = ?", run_id)
    attempts = rows(
        db_target, "SELECT seq, attempt, state FROM turns WHERE run_id = ? ORDER BY id", run_id
    )
    assert status == "completed"
    assert attempts[0][2] == "interrupted"
    assert attempts[1][:2] == (attempts[0][0], 2)

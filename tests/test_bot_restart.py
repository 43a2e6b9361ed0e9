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
from tests.fakes.bot_harness import OPERATOR, STRANGER, wait_for_file, write_script

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


async def _cut_off_chat_turn(
    api: FakeBotApi, root: Path, db: Target, pids: Path
) -> asyncio.subprocess.Process:
    """A chat turn running when the bot is killed; the bot started again (returned)."""
    bot = await _start(api, root, db)
    try:
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
        await api.wait_for_message(lambda m: "bound" in m.text)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="build the index")
        await wait_for_file(pids)  # its agent is running
        bot.send_signal(signal.SIGKILL)
        await bot.wait()
    finally:
        if bot.returncode is None:
            bot.kill()
            await bot.wait()
        for pid in pids.read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    return await _start(api, root, db)


async def _stop(bot: asyncio.subprocess.Process) -> None:
    if bot.returncode is None:
        bot.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(bot.wait(), 30)
        except TimeoutError:
            bot.kill()
            await bot.wait()


def _chat_script(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The session's first turn hangs (the bot is killed under it); later ones answer.
    monkeypatch.setenv("FAKE_AGENT_PIDS", str(root / "pids"))
    write_script(
        root,
        {
            "replies": [{"grandchild": True, "wait_file": str(root / "never"), "text": "x"}],
            "rules": [{"match": "", "text": "answer: {prompt}"}],
        },
        monkeypatch,
    )


async def test_a_cut_off_chat_turn_runs_again_from_its_button(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, db_target: Target
) -> None:
    _chat_script(tmp_path, monkeypatch)
    async with FakeBotApi() as api:
        bot = await _cut_off_chat_turn(api, tmp_path, db_target, tmp_path / "pids")
        try:
            cut = await api.wait_for_message(lambda m: "was cut off" in m.text, timeout=30)
            assert "Prompt was: build the index" in cut.text
            assert [b["text"] for b in cut.buttons] == ["🔁 Run it again"]
            data = cut.buttons[0]["callback_data"]
            # someone who may not start turns is refused; the button stays
            api.push_callback(chat_id=CHAT, user_id=STRANGER, data=data, message_id=cut.message_id)
            await api.wait_until(lambda: len(api.callback_answers) == 1)
            assert cut.buttons
            api.push_callback(chat_id=CHAT, user_id=OPERATOR, data=data, message_id=cut.message_id)
            answer = await api.wait_for_message(lambda m: m.text == "answer: build the index")
            # once: the button is gone, and a press on it again runs nothing
            await api.wait_until(lambda: not cut.buttons)
            assert "🔁 Run again by" in cut.text
            api.push_callback(chat_id=CHAT, user_id=OPERATOR, data=data, message_id=cut.message_id)
            await api.wait_until(lambda: len(api.callback_answers) == 3)
            # (Each press is answered once; two answers may reach Telegram in either order.)
            answered = [a.get("text") for a in api.callback_answers[1:]]
            assert sorted(answered) == ["Running it again…", "This button was already used."]
            await _stop(bot)
        finally:
            await _stop(bot)
    assert api.texts().count("answer: build the index") == 1
    assert answer.message_id > cut.message_id
    prompts = rows(
        db_target, "SELECT prompt, state FROM turns ORDER BY id"
    )  # the cut-off turn, then the same prompt run again in the same session
    assert [(str(p), str(s)) for p, s in prompts] == [
        ("build the index", "interrupted"),
        ("build the index", "finished"),
    ]
    [(sessions,)] = rows(db_target, "SELECT COUNT(DISTINCT session_id) FROM runs")
    assert sessions == 1


async def test_a_cut_off_chat_turn_whose_session_is_gone_is_not_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, db_target: Target
) -> None:
    _chat_script(tmp_path, monkeypatch)
    async with FakeBotApi() as api:
        bot = await _cut_off_chat_turn(api, tmp_path, db_target, tmp_path / "pids")
        try:
            cut = await api.wait_for_message(lambda m: "was cut off" in m.text, timeout=30)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/new")
            await api.wait_for_message(lambda m: "A fresh" in m.text)
            data = cut.buttons[0]["callback_data"]
            api.push_callback(chat_id=CHAT, user_id=OPERATOR, data=data, message_id=cut.message_id)
            await api.wait_until(lambda: not cut.buttons)
            assert "Not run again: its session is gone" in cut.text
            assert api.callback_answers[-1]["text"] == "Its session is gone: send the prompt again."
        finally:
            await _stop(bot)
    assert not any(t.startswith("answer:") for t in api.texts())

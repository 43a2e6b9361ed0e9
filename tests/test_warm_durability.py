"""A warm turn's answer goes out as soon as Claude Code prints its result, before the CLI
has saved the turn to its transcript. The guarantee this must keep: a ``turnstile bot``
killed with ``kill -9`` right after the answer reached the chat resumes, after a restart,
a session that still holds that exchange.

The real bot process, the real ``claude`` on the fake model, the fake Bot API; the bot is
killed from inside the fake's request handler the moment the answer arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest

from tests.agent_clis import ensure_cli
from tests.bot_process import bot_env, start_polling
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import CHAT, OPERATOR
from tests.fakes.model_api import FakeModelAPI, Text
from tests.fakes.realcli import Sandbox, marked_processes

pytestmark = [pytest.mark.realcli, pytest.mark.timeout(240)]

WORD = "pelican-7731"


async def test_an_answer_shown_before_a_kill_is_in_the_session_after_the_restart(
    tmp_path: Path,
) -> None:
    box = Sandbox(tmp_path / "claude")
    async with FakeModelAPI() as model, FakeBotApi() as api:
        model.enqueue(Text(f"Noted: the word is {WORD}."), Text("It was the bird."))
        env = bot_env(
            tmp_path,
            api,
            **box.env(model.claude_env(box.config)),
            TURNSTILE_DEFAULT_AGENT="claude",
            TURNSTILE_CLAUDE_BIN=str(ensure_cli("claude")),
            TURNSTILE_WARM_SESSIONS="claude",
            TURNSTILE_WORKSPACES=str(box.workspace),
        )
        bot = await start_polling(api, tmp_path, env)
        try:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound" in m.text, timeout=60)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="remember the word")

            killed: list[SentMessage] = []

            def kill_on_answer(m: SentMessage) -> bool:
                # Checked inside the fake's handler of the very call that carries it: most
                # runs kill the bot before the CLI has saved the answer to its transcript
                # (without the watchdog letting it finish, about one run in three then
                # resumed a session without the answer).
                if WORD in m.text and not killed:
                    os.kill(bot.pid, signal.SIGKILL)
                    killed.append(m)
                return bool(killed)

            await api.wait_for_message(kill_on_answer, timeout=90)
            await bot.wait()
            assert bot.returncode == -signal.SIGKILL
            # The resident CLI (its input closed with the bot) is gone shortly after.
            async with asyncio.timeout(15):
                while marked_processes(box.marker):
                    await asyncio.sleep(0.05)

            bot = await start_polling(api, tmp_path, env)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="which word was it?")
            await api.wait_for_message(lambda m: m.text == "It was the bird.", timeout=90)
            # The second process resumed a session that has the first answer in it.
            assert len(model.model_requests) >= 2
            assert WORD in model.model_requests[-1].all_text()
        finally:
            if bot.returncode is None:
                bot.send_signal(signal.SIGTERM)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(bot.wait(), 30)
            if bot.returncode is None:
                bot.kill()
                await bot.wait()
            for pid in marked_processes(box.marker):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

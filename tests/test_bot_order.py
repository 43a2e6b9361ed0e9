"""Messages of one chat session are taken in the order they were sent, warm or not.

A warm session's running turn takes a message sent meanwhile ("steering"), but never past
an earlier message of the same session that still waits in the queue: that one goes
first, and the later one queues behind it.

The bot is the real one against the fake Bot API; the agent is a resident stand-in for
Claude Code (tests/fake_warm_claude.py) driven by the real warm-session adapter. What the
agent saw, and in which turn, is its own log.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from telegram.ext import AIORateLimiter

from bot.app import BotRuntime
from engine.settings import Settings
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot
from tests.support import wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("isolated_env")]

FAKE_WARM = Path(__file__).resolve().parent / "fake_warm_claude.py"
OTHER_CHAT = -1002


@pytest.fixture
def warm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The warm stand-in as a ``claude`` binary; returns its gates folder."""
    binary = tmp_path / "bin" / "claude"
    binary.parent.mkdir()
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_WARM} "$@"\n')
    binary.chmod(0o755)
    gates = tmp_path / "gates"
    gates.mkdir()
    monkeypatch.setenv("FAKE_WARM_LOG", str(tmp_path / "warm-log.jsonl"))
    monkeypatch.setenv("FAKE_WARM_GATES", str(gates))
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "claude-config"))
    return gates


def seen(tmp_path: Path) -> list[tuple[int, str]]:
    """(turn of its process, text) of every message the agent took up, in order."""
    path = tmp_path / "warm-log.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(int(r["turn"]), str(r["text"])) for r in rows]


def settings_for(api: FakeBotApi, tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "default_agent": "claude",
        "claude_bin": str(tmp_path / "bin" / "claude"),
        "warm_sessions": "claude",
    }
    values.update(overrides)
    return bot_settings(api, tmp_path, **values)


def answers(api: FakeBotApi, chat: int = CHAT) -> list[str]:
    return [m.text for m in api.sent if m.chat_id == chat and m.text.startswith("answer: ")]


def all_answered(api: FakeBotApi) -> bool:
    """Every one of A1, A2 and A3 is in an answer (alone or with others)."""
    said = " + ".join(answers(api))
    return all(name in said for name in ("A1", "A2", "A3"))


def reply_to(api: FakeBotApi, update_id: int) -> SentMessage | None:
    """The bot's answer to the message of ``update_id`` ("Queued" or "Sent to ...")."""
    asked = api.pushed(update_id)["message"]["message_id"]
    return next(
        (
            m
            for m in api.sent
            if m.reply_to == asked and ("Queued" in m.text or "running turn" in m.text)
        ),
        None,
    )


async def bind(api: FakeBotApi, chat: int) -> None:
    api.push_message(chat_id=chat, user_id=OPERATOR, text="/chat")
    await api.wait_for_message(lambda m: m.chat_id == chat and "bound" in m.text)


async def test_a_message_queued_before_the_turn_took_messages_goes_before_a_later_one(
    tmp_path: Path, warm: Path
) -> None:
    """A1 is taken but its turn has not started in the agent yet (it waits for the one
    turn slot another chat holds), so A2 queues; A3 comes once A1's turn takes messages.
    A3 must not overtake A2: the agent sees A1, A2, A3, and the answers come in that order.
    """
    async with FakeBotApi() as api:
        settings = settings_for(
            api, tmp_path, allowed_chats=(CHAT, OTHER_CHAT), max_concurrent_turns=1
        )
        async with running_bot(api, settings) as rt:
            assert rt.chats is not None
            await bind(api, OTHER_CHAT)
            await bind(api, CHAT)
            api.push_message(chat_id=OTHER_CHAT, user_id=OPERATOR, text="B1 hold:b1")
            await wait_until(lambda: seen(tmp_path) == [(1, "B1 hold:b1")], what="B1 runs")
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="A1 hold:a1")

            def a1_taken() -> bool:
                run = rt.chats.active.get((str(CHAT), None)) if rt.chats else None
                return run is not None and run.busy

            await wait_until(a1_taken, what="A1 taken for a turn")
            a2 = api.push_message(chat_id=CHAT, user_id=OPERATOR, text="A2")
            await api.wait_until(lambda: reply_to(api, a2) is not None)
            (warm / "b1").touch()
            await wait_until(
                lambda: (1, "A1 hold:a1") in seen(tmp_path), what="A1 reaches the agent"
            )
            run = rt.chats.active[(str(CHAT), None)]
            await wait_until(lambda: run.agent.preempt.active, what="A1's turn takes messages")
            a3 = api.push_message(chat_id=CHAT, user_id=OPERATOR, text="A3")
            await api.wait_until(lambda: reply_to(api, a3) is not None)
            (warm / "a1").touch()
            await api.wait_until(lambda: all_answered(api), timeout=60)
            said_to_a3 = reply_to(api, a3)
    texts = [t for _, t in seen(tmp_path) if t.startswith("A")]
    assert texts == ["A1 hold:a1", "A2", "A3"]
    assert answers(api) == ["answer: A1", "answer: A2", "answer: A3"]
    assert said_to_a3 is not None
    assert "Queued: 2 message(s)" in said_to_a3.text


async def test_three_quick_messages_are_taken_in_order(tmp_path: Path, warm: Path) -> None:
    """A1, A2 and A3 sent at once while nothing runs: whatever the timing of the turn's
    start, the agent takes them in the order they were sent."""
    async with FakeBotApi() as api, running_bot(api, settings_for(api, tmp_path)):
        await bind(api, CHAT)
        for text in ("A1 hold:a1", "A2", "A3"):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text=text)
        await wait_until(lambda: len(seen(tmp_path)) >= 1, what="A1 reaches the agent")
        (warm / "a1").touch()
        await wait_until(lambda: len(seen(tmp_path)) == 3, what="all three taken up")
        await api.wait_until(lambda: all_answered(api), timeout=60)
    assert [t for _, t in seen(tmp_path)] == ["A1 hold:a1", "A2", "A3"]
    joined = " + ".join(answers(api)).replace("answer: ", "")
    assert joined == "A1 + A2 + A3"


@asynccontextmanager
async def started_with_queue(
    api: FakeBotApi, settings: Settings, queued: list[str]
) -> AsyncIterator[BotRuntime]:
    """The bot started with ``queued`` waiting in the chat's queue (left by a restart)."""
    limiter = AIORateLimiter(group_max_rate=10_000, max_retries=8)
    async with BotRuntime(settings, rate_limiter=limiter) as rt:
        for body in queued:
            await rt.store.queue_prompt(
                str(CHAT), None, update_id=None, user_id=OPERATOR, body=body, depth=10
            )
        await rt.start()
        try:
            yield rt
        finally:
            rt.request_shutdown()
            await rt.shutdown()


async def test_after_a_restart_queued_messages_go_before_a_new_one(
    tmp_path: Path, warm: Path
) -> None:
    """A1 and A2 waited in the queue over a restart; A1's warm turn runs when A3 comes.
    A3 waits behind A2 instead of joining A1's turn."""
    async with FakeBotApi() as api:
        settings = settings_for(api, tmp_path)
        async with running_bot(api, settings):
            await bind(api, CHAT)
        async with started_with_queue(api, settings, ["A1 hold:a1", "A2"]) as rt:
            assert rt.chats is not None
            await wait_until(
                lambda: seen(tmp_path) == [(1, "A1 hold:a1")], what="A1 reaches the agent"
            )
            run = rt.chats.active[(str(CHAT), None)]
            await wait_until(lambda: run.agent.preempt.active, what="A1's turn takes messages")
            a3 = api.push_message(chat_id=CHAT, user_id=OPERATOR, text="A3")
            await api.wait_until(lambda: reply_to(api, a3) is not None)
            said_to_a3 = reply_to(api, a3)
            (warm / "a1").touch()
            await api.wait_until(lambda: all_answered(api), timeout=60)
    assert [t for _, t in seen(tmp_path)] == ["A1 hold:a1", "A2", "A3"]
    assert answers(api) == ["answer: A1", "answer: A2", "answer: A3"]
    assert said_to_a3 is not None
    assert "Queued: 2 message(s)" in said_to_a3.text


async def test_a_message_being_handed_to_a_turn_when_the_bot_stopped_is_not_lost(
    tmp_path: Path, warm: Path
) -> None:
    """The bot stopped while a message was on its way into a running turn (recorded for
    it, not yet taken): after the restart that message has a turn of its own."""
    async with FakeBotApi() as api:
        settings = settings_for(api, tmp_path)
        async with running_bot(api, settings):
            await bind(api, CHAT)
        async with BotRuntime(settings) as rt:
            # As the crashed bot left it: recorded for the running turn, never taken.
            held = await rt.store.hold_for_steering(
                str(CHAT), None, update_id=None, user_id=OPERATOR, body="B1"
            )
            assert held is not None
            await rt.start()
            try:
                await wait_until(lambda: seen(tmp_path) == [(1, "B1")], what="B1 reaches the agent")
                await api.wait_until(lambda: answers(api) == ["answer: B1"], timeout=60)
            finally:
                rt.request_shutdown()
                await rt.shutdown()

"""Strangers in an allowed group never spend the group's message budget.

Telegram lets a bot send 20 messages a minute to a group. Refusals to people without any
role are answered at most once a minute per group (every one is audited), so a flood of
strangers leaves the budget to the team: the operator's next answer is not behind them.
What is checked is how many messages went to the group and in which order (each one is a
share of that budget), not how long anything took. The bot runs with its production rate
limiter (20 messages a minute per group).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import APPROVER, CHAT, OPERATOR, bot_settings, running_bot
from tests.support import wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("isolated_env")]

STRANGERS = range(5000, 5200)
COMMANDS = ("/chat", "/status", "/help", "/auto fix it", "/approve")
LIMIT = 200  # characters a message may have (TURNSTILE_MAX_INBOUND_CHARS)


def _refusal(text: str) -> bool:
    return text.startswith("⛔")


async def test_a_flood_of_strangers_gets_one_refusal_a_minute_and_the_operator_is_answered(
    tmp_path: Path,
) -> None:
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, max_inbound_chars=LIMIT)
        async with running_bot(api, settings, fast_groups=False) as rt:
            for n, uid in enumerate(STRANGERS):
                # Every tenth an over-long message, the rest commands nobody of them may use.
                text = "x" * (LIMIT + 1) if n % 10 == 9 else COMMANDS[n % len(COMMANDS)]
                api.push_message(chat_id=CHAT, user_id=uid, text=text)

            async def commands_refused() -> bool:
                entries = await rt.store.audit_entries(limit=1000)
                refused = {e.user_id for e in entries if e.outcome == "refused"}
                return refused >= {uid for n, uid in enumerate(STRANGERS) if n % 10 != 9}

            await wait_until(commands_refused, timeout=60, what="every command refused")
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/help")
            answer = await api.wait_for_message(lambda m: "Your commands:" in m.text, timeout=60)
            in_group = [m for m in api.sent if m.chat_id == CHAT]
            # Of the group's 20 messages a minute, the flood took one at most before the
            # operator's answer: it had nothing to wait for.
            assert len(in_group[: in_group.index(answer)]) <= 1
            # A team member who lacks the role is still told, also right after the flood.
            api.push_message(chat_id=CHAT, user_id=APPROVER, text="/chat")
            told = await api.wait_for_message(lambda m: f"user id is {APPROVER};" in m.text)
            assert told.text.startswith("⛔ /chat needs the operator role.")
            assert rt.sender is not None
            await rt.sender.wait_idle()
            entries = await rt.store.audit_entries(limit=1000)
    # The whole flood cost the group one message, and that one says why it is the only one.
    flood = [m for m in api.sent if m.chat_id == CHAT and m is not answer and m is not told]
    assert len(flood) == 1
    assert _refusal(flood[0].text)
    assert "once a minute" in flood[0].text
    # Every stranger's refusal is audited; all but the one answered say they were not.
    refused = [e for e in entries if e.outcome == "refused" and e.user_id in STRANGERS]
    assert len(refused) == len(STRANGERS)
    unanswered = [e for e in refused if "not answered" in (e.reason or "")]
    assert len(unanswered) == len(STRANGERS) - 1
    # Not a word about message length to a stranger: the over-long ones are refused too.
    assert not any("characters; the limit is" in m.text for m in api.sent)


async def test_a_stranger_in_a_private_chat_still_learns_their_id(tmp_path: Path) -> None:
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, allowed_chats=(CHAT, 7001))
        async with running_bot(api, settings, fast_groups=False) as rt:
            # A private chat that is not allowed, and one that is.
            api.push_message(chat_id=7000, user_id=7000, text="hello")
            api.push_message(chat_id=7001, user_id=7001, text="/chat")
            first = await api.wait_for_message(lambda m: m.chat_id == 7000)
            second = await api.wait_for_message(lambda m: m.chat_id == 7001)
            # Refused again in the minute: a 👎 on each message, no message of its own.
            status = api.push_message(chat_id=7001, user_id=7001, text="/status")
            help_ = api.push_message(chat_id=7001, user_id=7001, text="/help")
            await api.wait_until(lambda: len(api.reactions) == 2)

            async def audited() -> bool:
                entries = await rt.store.audit_entries()
                return sum(e.user_id == 7001 for e in entries) == 3

            await wait_until(audited, what="every refusal audited")
            assert rt.sender is not None
            await rt.sender.wait_idle()
    assert "Your Telegram user id is 7000" in first.text
    assert "Your Telegram user id is 7001" in second.text
    assert [(int(r["chat_id"]), int(r["message_id"])) for r in api.reactions] == [
        (7001, api.pushed(status)["message"]["message_id"]),
        (7001, api.pushed(help_)["message"]["message_id"]),
    ]
    assert all("👎" in str(r["reaction"]) for r in api.reactions)
    assert len(api.texts(7001)) == 1

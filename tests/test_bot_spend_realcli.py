"""What a run cost, where people look: the real Claude Code CLI against the fake model API
(which reports token usage; Claude Code prices it), the real bot against the fake Bot API.

An ``/auto`` run's live message says what it spent so far, its final report has the spend
line, ``/status`` says what the chat spent today, and the web board lists the run's cost.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.spend import Spend
from tests.agent_clis import ensure_cli
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import ADMIN, CHAT, OPERATOR, bot_settings, running_bot
from tests.fakes.model_api import FakeModelAPI, Text

pytestmark = [
    pytest.mark.realcli,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("isolated_env"),
]


async def test_an_auto_run_shows_what_it_spent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "claude-config"
    config.mkdir()
    async with FakeModelAPI() as model, FakeBotApi() as api:
        for key, value in model.claude_env(config).items():
            monkeypatch.setenv(key, value)
        model.enqueue(
            Text("Goal: say hello."),  # Clarify
            Text("1. say hello"),  # Plan
            Text("hello"),  # Execute
            Text("Said hello.\nAUTO-MODE STATUS: COMPLETE"),  # Evaluate
        )
        settings = bot_settings(
            api,
            tmp_path,
            default_agent="claude",
            claude_bin=str(ensure_cli("claude")),
            completion_threshold=0.0,  # nothing to commit: the claim alone completes it
        )
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto say hello")
            live = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run"))
            run_id = live.text.split()[3]
            report = await api.wait_for_message(
                lambda m: m.text.startswith(f"Auto run {run_id}: completed"), timeout=120
            )
            turns = await rt.runs.turns(run_id)
            total = sum((t.spend for t in turns), Spend())
            assert len(turns) == 4
            assert total.cost_usd is not None
            assert total.cost_usd > 0
            assert total.unknown == 0
            # The report's spend line is the turns' sum.
            assert total.line() in report.text
            # The live message says what it spent so far, as its turns go.
            shown = [*live.history, live.text]
            assert any(re.search(r"\$0\.\d{4} so far", text) for text in shown), shown
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            status = await api.wait_for_message(lambda m: "💰 Today in this chat:" in m.text)
    today = next(line for line in status.text.splitlines() if line.startswith("💰"))
    assert total.cost_text() in today
    assert f"{total.tokens:,} tokens" in today


async def test_an_admin_raises_a_spent_budget_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "claude-config"
    config.mkdir()
    async with FakeModelAPI() as model, FakeBotApi() as api:
        for key, value in model.claude_env(config).items():
            monkeypatch.setenv(key, value)
        model.enqueue(
            Text("Goal: say hello."),  # Clarify
            Text("1. say hello"),  # Plan
            Text("hello"),  # Execute: the third turn spends $0.0006 (about $0.0002 each)
            Text("Said hello.\nAUTO-MODE STATUS: COMPLETE"),  # Evaluate, once raised
        )
        settings = bot_settings(
            api,
            tmp_path,
            default_agent="claude",
            claude_bin=str(ensure_cli("claude")),
            completion_threshold=0.0,
        )
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto --budget 0.0006 hi")
            live = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run"))
            run_id = live.text.split()[3]
            offer = await api.wait_for_message(
                lambda m: m.text.startswith(f"💰 Auto run {run_id} stopped at its budget"),
                timeout=120,
            )
            assert "of $0.0006" in offer.text
            [button] = offer.buttons
            assert button["text"] == "⬆️ Raise to $0.0012 and go on"
            report = next(m for m in api.sent if m.text.startswith(f"Auto run {run_id}: stopped"))
            assert "Stopped by its budget: $0.0007 of $0.0006 spent" in report.text
            assert len(await rt.runs.turns(run_id)) == 3
            # Only an admin raises it.
            answered = len(api.callback_answers)
            api.push_callback(
                chat_id=CHAT,
                user_id=OPERATOR,
                data=button["callback_data"],
                message_id=offer.message_id,
            )
            await api.wait_until(lambda: len(api.callback_answers) > answered)
            assert (await rt.runs.get_run(run_id)).status.value == "stopped"
            api.push_callback(
                chat_id=CHAT,
                user_id=ADMIN,
                data=button["callback_data"],
                message_id=offer.message_id,
            )
            await api.wait_for_message(
                lambda m: (
                    m.text.startswith(f"▶️ Auto run {run_id} goes on under a budget of $0.0012")
                    and "(raised by" in m.text
                )
            )
            await api.wait_for_message(
                lambda m: m.text.startswith(f"Auto run {run_id}: completed"), timeout=120
            )
            record = await rt.runs.get_run(run_id)
    assert record.state["config"]["budget_usd"] == 0.0012
    assert len(model.model_requests) == 4

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
from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot
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

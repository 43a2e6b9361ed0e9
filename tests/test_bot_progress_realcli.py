"""A turn's progress message fed by a real event stream: the real Claude Code CLI against
the fake model API, the real bot against the fake Bot API. While the agent's tool runs,
the progress message shows that tool and the last line of the agent's text."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent_clis import ensure_cli
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot
from tests.fakes.model_api import FakeModelAPI, Text, ToolCall

pytestmark = [
    pytest.mark.realcli,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("isolated_env"),
]


async def test_progress_shows_the_running_tool_and_the_last_line_of_text(
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
            ToolCall(
                "Bash",
                {"command": waiting, "description": "wait for the go file"},
                text="Looking at the tree.\n\nWaiting for the go file now.",
            ),
            Text("All done: the go file came."),
        )
        settings = bot_settings(
            api,
            tmp_path,
            default_agent="claude",
            claude_bin=str(ensure_cli("claude")),
            allowed_tools=("bash",),
        )
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound" in m.text)
            asked = api.push_message(chat_id=CHAT, user_id=OPERATOR, text="wait for it")
            progress = await api.wait_for_message(lambda m: m.text.startswith("⏳ working"))
            # While the tool runs: the tool being run and the agent's last line of text.
            await api.wait_until(
                lambda: (
                    "🔧 Bash" in progress.text
                    and "💬 Waiting for the go file now." in progress.text
                ),
                timeout=120,
            )
            lines = progress.text.splitlines()
            assert lines[0].startswith("⏳ working · ")
            # the command, not the tool's raw JSON input
            assert lines[1].startswith("🔧 Bash: while [ ! -e "), lines[1]
            assert lines[2] == "💬 Waiting for the go file now."
            assert progress.buttons  # ⏹ Stop while it runs
            assert progress.reply_to == api.pushed(asked)["message"]["message_id"]
            gate.touch()
            answer = await api.wait_for_message(lambda m: m.text == "All done: the go file came.")
            assert answer.reply_to == progress.reply_to
            # finalized in place: done, with the tool call counted, no button
            await api.wait_until(lambda: progress.text.startswith("✅ done"), timeout=30)
            assert progress.text.endswith("· 1 tool call")
            assert not progress.buttons

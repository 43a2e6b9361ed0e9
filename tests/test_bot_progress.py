"""A turn's progress message: created under the question, fed by the agent's events,
finalized in place, and settled after a bot that died mid-turn starts again."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from chatfront.progress import TurnProgress, stop_button
from engine.agents.stream import AgentEvent, EventKind
from tests.bot_process import CHAT, OPERATOR, bot_env, spawn
from tests.fakes.bot_api import FakeBotApi

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(120)]


class _Recorder:
    """Stands in for the publisher: records what each live message would say."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, dict[str, object] | None, int | None]] = []

    async def live(self, ref: str, text: str, **kw: object) -> None:
        self.bodies.append((text, kw.get("markup"), kw.get("reply_to")))  # type: ignore[arg-type]


async def test_events_become_the_progress_lines() -> None:
    now = [100.0]
    recorder = _Recorder()
    progress = TurnProgress(
        recorder,  # type: ignore[arg-type]
        chat_id="5",
        thread_id=None,
        run_id="chat-x",
        turn=2,
        reply_to=41,
        clock=lambda: now[0],
    )
    await progress.show()
    assert recorder.bodies[-1] == ("⏳ working · 0s", stop_button("chat-x"), 41)
    tool = AgentEvent(kind=EventKind.TOOL_USE, session_id="s", text="ls  -la\n", tool="Bash")
    assert progress.on_event(tool)
    text = AgentEvent(kind=EventKind.TEXT, session_id="s", text="Looking.\n\nFound 3 files.\n")
    assert progress.on_event(text)
    assert not progress.on_event(AgentEvent(kind=EventKind.RESULT, session_id="s", text=""))
    now[0] = 172.0
    await progress.show()
    assert recorder.bodies[-1][0] == "⏳ working · 1m12s\n🔧 Bash: ls -la\n💬 Found 3 files."
    # a tool input reported as JSON (Claude Code) shows its command, even cut short
    claude = '{"command": "git status --short", "description": "See what changed"}'
    assert progress.on_event(AgentEvent(EventKind.TOOL_USE, "s", text=claude, tool="Bash"))
    assert progress.body().splitlines()[1] == "🔧 Bash: git status --short"
    cut = '{"file_path": "/srv/ws/src/app.py", "content": "import os\\nimport sys\\nprint('
    assert progress.on_event(AgentEvent(EventKind.TOOL_USE, "s", text=cut, tool="Write"))
    assert progress.body().splitlines()[1] == "🔧 Write: /srv/ws/src/app.py"
    await progress.finish("✅ done")
    assert recorder.bodies[-1] == ("✅ done · 1m12s · 3 tool calls", None, 41)
    await progress.show()  # a late tick changes nothing once finalized
    assert len(recorder.bodies) == 3


async def test_a_progress_message_left_by_a_killed_bot_is_settled(tmp_path: Path) -> None:
    (tmp_path / "agent-script.json").write_text(
        json.dumps({"rules": [{"match": "", "wait_file": str(tmp_path / "never")}]})
    )
    async with FakeBotApi() as api:
        env = bot_env(tmp_path, api)
        bot = await spawn(tmp_path, env, "bot")
        try:
            await bot.wait_log("running (polling)")
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound to" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="a long one")
            progress = await api.wait_for_message(lambda m: m.text.startswith("⏳ working"))
            assert progress.buttons
            # edited once: the bot has recorded it as its turn's progress message
            await api.wait_until(lambda: progress.edits >= 1)
            bot.signal(signal.SIGKILL)
            await bot.exit_code()
        finally:
            await bot.kill()
        bot = await spawn(tmp_path, env, "bot")
        try:
            await bot.wait_log("running (polling)")
            # never left saying "working" with a Stop button that stops nothing
            await api.wait_until(lambda: progress.text.startswith("⏹ stopped by a restart"))
            assert not progress.buttons
        finally:
            bot.signal()
            await bot.exit_code()

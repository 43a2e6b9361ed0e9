"""The chat mode with a place whose ids are not numbers, as another messenger gives them.

Nothing below the front end assumes a Telegram id: a place ``room-a`` with the topic
``thread:b/1`` is bound, its message queued and answered by a real agent process (the fake
agent CLI), the answer committed to the outbox for that place, and its workspace is a
folder of its own under the chats' folder, on both databases.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from chatfront.store import OutboxItem, SqlBotStore
from engine.agents.factory import create_agent
from engine.agents.stream import AgentEvent
from engine.chats.records import Binding, PromptRow
from engine.chats.sessions import ChatRun, ChatSessions, TurnView
from engine.executors import chat_agents
from engine.runs import RunSupervisor
from engine.store import SqliteRunStore
from engine.turn import TurnOutput
from engine.workspace.manager import DEFAULT_PROJECT, place_workspace_name
from engine.workspace.store import SqliteWorkspaceStore
from tests.support import make_settings, wait_until

pytestmark = pytest.mark.usefixtures("isolated_env")

ROOM, TOPIC = "room-a", "thread:b/1"
FAKE_AGENT = Path(__file__).resolve().parent / "fake_agent.py"


def _agent_script(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake agent CLI answers ``answer: PROMPT``; the log of its turns (returned)."""
    script = root / "agent-script.json"
    script.write_text(json.dumps({"rules": [{"match": "", "text": "answer: {prompt}"}]}))
    monkeypatch.setenv("FAKE_AGENT_SCRIPT", str(script))
    monkeypatch.setenv("FAKE_AGENT_STATE", str(root / "agent-state"))
    monkeypatch.setenv("FAKE_AGENT_LOG", str(root / "agent-log.jsonl"))
    return root / "agent-log.jsonl"


class _View:
    def on_event(self, event: AgentEvent) -> bool:
        return False

    async def show(self) -> None:
        pass

    async def finish(self, final: str) -> None:
        pass


class _Front:
    """A messenger's front end that is not Telegram: answers go to the outbox as they are."""

    def __init__(self, store: SqlBotStore) -> None:
        self.store = store
        self.said: list[tuple[str, str | None, str]] = []

    def open_turn(self, run: ChatRun, prompt: PromptRow) -> TurnView:
        return _View()

    async def publish_turn(
        self, run: ChatRun, prompt_id: int, turn_id: int, out: TurnOutput, view: TurnView | None
    ) -> None:
        b = run.binding
        answer = OutboxItem(chat_id=b.chat_id, thread_id=b.thread_id, body=out.text)
        await self.store.commit_turn(
            prompt_id, turn_id, out, [answer], chat_id=b.chat_id, thread_id=b.thread_id
        )

    async def say(self, binding: Binding, text: str, *, run_id: str) -> None:
        self.said.append((binding.chat_id, binding.thread_id, text))

    def name(self, user_id: int) -> str:
        return f"person {user_id}"


async def test_a_place_named_by_text_is_bound_and_answered(
    database: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _agent_script(tmp_path, monkeypatch)
    settings = make_settings(
        tmp_path,
        default_agent="command",
        agent_command=f"{sys.executable} {FAKE_AGENT} --session {{session_id}} --prompt {{prompt}}",
    )
    store, runs = SqlBotStore(database), SqliteRunStore(database)
    chats = ChatSessions(
        settings=settings,
        store=store,
        runs=runs,
        front=_Front(store),
        agents=chat_agents(settings, database, agent_factory=create_agent),
        supervisor=RunSupervisor(runs),
        workspaces=SqliteWorkspaceStore(database),
        db=database,
    )
    try:
        binding = await chats.bind(ROOM, TOPIC, agent="command", project=DEFAULT_PROJECT, user_id=7)
        assert (binding.chat_id, binding.thread_id) == (ROOM, TOPIC)
        # The place's own workspace: inside the chats' folder, under a name of its own.
        folder = Path(binding.workdir)
        assert folder.name == place_workspace_name(ROOM, TOPIC)
        assert folder.parent == settings.workspaces / "chats"
        result = await chats.submit(ROOM, TOPIC, update_id=None, user_id=7, text="hello")
        assert result.queued

        async def answered() -> bool:
            bound = await store.binding(ROOM, TOPIC)
            return bound is not None and bound.turns == 1

        await wait_until(answered, what="the turn answered")
        row = await store.next_outbox()
        assert row is not None
        assert (row.item.chat_id, row.item.thread_id, row.item.body) == (
            ROOM,
            TOPIC,
            "answer: hello",
        )
        [run] = [r for r in await runs.list_runs() if r.mode == "chat"]
        assert (run.chat_id, run.thread_id) == (ROOM, TOPIC)
        turns = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        assert [t["prompt"] for t in turns] == ["hello"]
        # Another topic of the same room is another place.
        assert await store.binding(ROOM, None) is None
    finally:
        await chats.shutdown(park=False)

"""Pause: a paused run waits before its next turn (keeping its slot) until it may go on;
in the chat, /pause, /resume and the buttons on the run's message (fake Bot API, fake
agent; on SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import TurnPreempted
from engine.runs import RunSupervisor
from engine.runs.pause import Pauses
from engine.store.backend import AnyDatabase, open_database
from engine.store.events import EventLog
from engine.store.runs import SqliteRunStore
from engine.turn import TurnOutput
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import (
    APPROVER,
    CHAT,
    OPERATOR,
    agent_log,
    bot_settings,
    running_bot,
    write_script,
)
from tests.test_tool_approvals import db  # the store on SQLite and on PostgreSQL

__all__ = ["db"]

pytestmark = pytest.mark.timeout(120)


class _Agent:
    """An agent session that counts its turns (what a paused run must not start)."""

    def __init__(self) -> None:
        self.session_id = "s1"
        self.turns = 0

    async def run_turn(self, prompt: str) -> TurnOutput:
        self.turns += 1
        return TurnOutput(text=f"done: {prompt}")


async def test_a_pause_is_recorded_once_and_logged(db: AnyDatabase) -> None:
    pauses = Pauses(db)
    assert await pauses.pause("r1", by=7)
    assert not await pauses.pause("r1", by=8)
    pause = await pauses.get("r1")
    assert pause is not None
    assert pause.paused_by == 7
    assert set(await pauses.of()) == {"r1"}
    assert await pauses.of(["r2"]) == {}
    assert await pauses.resume("r1", by=9)
    assert not await pauses.resume("r1", by=9)
    assert await pauses.get("r1") is None
    events = await EventLog(db).read("r1")
    assert [(e.kind, e.data.get("by")) for e in events] == [("paused", 7), ("pause_ended", 9)]


async def test_a_paused_run_waits_in_its_slot_and_goes_on(db: AnyDatabase) -> None:
    runs = SqliteRunStore(db)
    slots = asyncio.Semaphore(1)
    supervisor = RunSupervisor(runs, slots=slots, pauses=Pauses(db, poll=0.02))
    paused_agent, other_agent = _Agent(), _Agent()
    supervisor.attach("paused", paused_agent, stop=asyncio.Event())
    supervisor.attach("other", other_agent)
    await supervisor.pauses.pause("paused", by=1)  # type: ignore[union-attr]
    waiting = asyncio.create_task(supervisor.run_turn("paused", "next"))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    assert paused_agent.turns == 0
    # it keeps the one slot: a turn of another run queues behind it
    other = asyncio.create_task(supervisor.run_turn("other", "mine"))
    await asyncio.sleep(0.2)
    assert not other.done()
    await supervisor.pauses.resume("paused", by=1)  # type: ignore[union-attr]
    assert (await asyncio.wait_for(waiting, 10)).text == "done: next"
    assert (await asyncio.wait_for(other, 10)).text == "done: mine"
    assert (paused_agent.turns, other_agent.turns) == (1, 1)


async def test_stopping_a_paused_run_ends_its_wait(db: AnyDatabase) -> None:
    supervisor = RunSupervisor(SqliteRunStore(db), pauses=Pauses(db, poll=0.02))
    agent = _Agent()
    supervisor.attach("r", agent, stop=asyncio.Event())
    await Pauses(db).pause("r", by=1)
    waiting = asyncio.create_task(supervisor.run_turn("r", "next"))
    await asyncio.sleep(0.2)
    assert supervisor.stop("r")
    with pytest.raises(TurnPreempted):
        await asyncio.wait_for(waiting, 10)
    assert agent.turns == 0


@pytest.mark.usefixtures("isolated_env", "bot_backend")
async def test_pause_in_the_chat_holds_the_next_turn_until_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = tmp_path / "go"
    write_script(
        tmp_path,
        {"rules": [{"match": "first", "wait_file": str(gate), "text": "first done"}]},
        monkeypatch,
    )
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.names[OPERATOR] = "Olga"
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/pause")
        await api.wait_for_message(lambda m: m.text == "Nothing is running here.")
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
        await api.wait_for_message(lambda m: "bound" in m.text)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="the first job")
        progress = await api.wait_for_message(lambda m: m.text.startswith("⏳ working"))
        assert [b["text"] for b in progress.buttons] == ["⏹ Stop", "⏸ Pause"]
        pause = next(b["callback_data"] for b in progress.buttons if "Pause" in b["text"])
        # an approver may not pause (operators do)
        api.push_callback(
            chat_id=CHAT, user_id=APPROVER, data=pause, message_id=progress.message_id
        )
        await api.wait_until(
            lambda: any("operator" in a.get("text", "") for a in api.callback_answers)
        )
        api.push_callback(
            chat_id=CHAT, user_id=OPERATOR, data=pause, message_id=progress.message_id
        )
        await api.wait_until(
            lambda: "⏸ Paused by Olga: it finishes the turn it is in" in progress.text
        )
        assert [b["text"] for b in progress.buttons] == ["⏹ Stop", "▶ Go on"]
        # the turn it is in finishes; the next one waits
        gate.write_text("")
        await api.wait_for_message(lambda m: m.text == "first done")
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="the second job")
        second = await api.wait_for_message(
            lambda m: m.text.startswith("⏳ working") and m is not progress
        )
        await api.wait_until(lambda: "⏸ Paused by Olga" in second.text)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
        status = await api.wait_for_message(lambda m: "is paused (by Olga" in m.text)
        assert "it keeps its turn slot" in status.text
        await asyncio.sleep(1.5)
        assert not [m for m in api.sent if m.text == "echo: the second job"]
        assert [e["prompt"] for e in agent_log(tmp_path)] == ["the first job"]
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/resume")
        await api.wait_for_message(
            lambda m: m.text.startswith("▶ Run ") and "goes on (Olga)" in m.text
        )
        await api.wait_for_message(lambda m: m.text == "echo: the second job", timeout=30)
        run_id = (await rt.runs.list_runs())[0].id
        events = [e.kind for e in await EventLog(rt.db).read(run_id)]
    assert "paused" in events
    assert "pause_ended" in events
    assert "⏸" not in second.text


@pytest.mark.usefixtures("isolated_env")
async def test_turnstile_pause_and_resume_from_a_terminal(tmp_path: Path) -> None:
    database = tmp_path / "t.db"
    env = {**os.environ, "TURNSTILE_DATABASE": str(database)}
    async with open_database(database) as db:
        await SqliteRunStore(db).create_run("auto-1", mode="auto", agent="command", session_id="s")

    def turnstile(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "engine.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    paused = turnstile("pause", "auto-1")
    assert (paused.returncode, paused.stdout.strip()) == (
        0,
        "run auto-1 pauses: it finishes what it is doing, then waits. "
        "turnstile resume auto-1 lets it go on",
    )
    again = turnstile("pause", "auto-1")
    assert again.returncode == 1
    assert "paused already" in again.stdout
    async with open_database(database) as db:
        assert await Pauses(db).get("auto-1") is not None
    resumed = turnstile("resume", "auto-1")
    assert (resumed.returncode, resumed.stdout.strip()) == (0, "run auto-1 goes on")
    assert turnstile("resume", "auto-1").returncode == 1
    unknown = turnstile("pause", "nosuch")
    assert (unknown.returncode, unknown.stdout.strip()) == (2, "no run nosuch")
    async with open_database(database) as db:
        await SqliteRunStore(db).update_run("auto-1", status="completed")
    ended = turnstile("pause", "auto-1")
    assert ended.returncode == 2
    assert "has ended" in ended.stdout

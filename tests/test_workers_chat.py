"""Chat sessions on the workers: the bot queues each chat turn, a ``turnstile worker`` runs
it in the chat's worktree and agent session, the bot posts the reply.

Real PostgreSQL, real worker subprocesses, the real bot (python-telegram-bot against the
fake Bot API on 127.0.0.1) and the fake agent CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.automode_support import agent_log, write_script
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot
from tests.workers_support import HEARTBEAT, TIMEOUT, Cluster, wait_for
from tests.workers_support import cluster as cluster

pytestmark = pytest.mark.timeout(120)

SLOW = "take your time"
SECRET = "sk-live1234567890abcdefXYZ"


def _script(cluster: Cluster) -> None:
    """Echo every message; a message with SLOW hangs (its pids recorded) until stopped."""
    write_script(
        cluster.tmp / "fake",
        rules=[
            {"match": "hello two", "text": f"two: the key is {SECRET}, done"},
            {
                "match": SLOW,
                "progress": "working",
                "grandchild": True,
                "sleep": 120,
                "text": "slow done",
            },
        ],
    )
    cluster.env["FAKE_AGENT_PIDS"] = str(cluster.tmp / "pids")
    cluster.env["TURNSTILE_PROJECTS"] = f"default={cluster.remote}#main"


@contextlib.asynccontextmanager
async def _bot(cluster: Cluster) -> AsyncIterator[FakeBotApi]:
    root = cluster.tmp / "bot"
    root.mkdir(exist_ok=True)
    async with FakeBotApi() as api:
        settings = bot_settings(
            api,
            root,
            database=cluster.url,
            execution="workers",
            projects=cluster.env["TURNSTILE_PROJECTS"],
            worker_heartbeat=float(HEARTBEAT),
            worker_timeout=float(TIMEOUT),
        )
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound to a new command session" in m.text)
            yield api


def _say(api: FakeBotApi, text: str) -> None:
    api.push_message(chat_id=CHAT, user_id=OPERATOR, text=text)


def _text(needle: str) -> Callable[[SentMessage], bool]:
    return lambda m: needle in m.text


async def _until(what: str, check: Callable[[], Any], within: float = 60.0) -> Any:
    return await asyncio.to_thread(wait_for, what, check, within=within)


def _chat_turns(cluster: Cluster) -> list[tuple[Any, ...]]:
    return cluster.query(
        "SELECT run_id, seq, status, worker, agent_session FROM worker_chat_turns"
        " ORDER BY created_at, seq"
    )


def _pids(cluster: Cluster) -> list[int]:
    path = cluster.tmp / "pids"
    if not path.exists():
        return []
    return [int(p) for p in path.read_text().split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    return False


def _log(cluster: Cluster) -> list[dict[str, Any]]:
    return agent_log(cluster.tmp / "agent.log")


async def test_two_chat_turns_run_on_a_worker_in_one_resumed_session(cluster: Cluster) -> None:
    _script(cluster)
    await asyncio.to_thread(cluster.start_worker, "w1")
    async with _bot(cluster) as api:
        _say(api, "hello one")
        await api.wait_for_message(_text("echo: hello one"), timeout=60)
        _say(api, "hello two")
        reply = await api.wait_for_message(_text("two: the key is"), timeout=60)
        # Redacted on its way to the chat, as a local turn's reply.
        assert SECRET not in reply.text
        assert reply.text.endswith(", done")
        assert not any(SECRET in m.text for m in api.sent)

        turns = _chat_turns(cluster)
        assert [(seq, status, worker) for _, seq, status, worker, _ in turns] == [
            (1, "done", "w1"),
            (2, "done", "w1"),
        ]
        log = _log(cluster)
        assert [e["prompt"] for e in log] == ["hello one", "hello two"]
        # The same agent session, resumed, in the chat's worktree on the worker.
        assert log[0]["session"] == log[1]["session"] == turns[0][4]
        assert all(e["cwd"].startswith(str(cluster.tmp / "w1" / "ws")) for e in log)
        run_id = turns[0][0]
        run = cluster.runs()[run_id]
        assert run["worker"] == "w1"
        assert run["mode"] == "chat"
        _say(api, "/status")
        await api.wait_for_message(_text("on the workers · last turn on worker w1"))


async def test_stop_in_the_chat_stops_the_turn_on_its_worker(cluster: Cluster) -> None:
    _script(cluster)
    await asyncio.to_thread(cluster.start_worker, "w1")
    async with _bot(cluster) as api:
        _say(api, f"please {SLOW}")
        await _until("the slow turn to run", lambda: _pids(cluster))
        agent_pids = _pids(cluster)
        progress = await api.wait_for_message(lambda m: "⏹" in str(m.reply_markup or ""))
        assert progress is not None
        began = time.monotonic()
        _say(api, "/stop")
        await api.wait_for_message(_text("stopped during turn 1"), timeout=30)
        took = time.monotonic() - began
        assert took < 20, took  # the grace is 1 s; generous for a loaded machine
        await _until(
            "the agent's processes to be gone",
            lambda: not any(map(_alive, agent_pids)),
            within=10,
        )
        assert [row[2] for row in _chat_turns(cluster)] == ["stopped"]
        # The chat goes on: the next message is a turn again, on the same worker.
        _say(api, "after the stop")
        await api.wait_for_message(_text("echo: after the stop"), timeout=60)
        assert [row[2:4] for row in _chat_turns(cluster)] == [
            ("stopped", "w1"),
            ("done", "w1"),
        ]


async def test_a_dead_worker_s_chat_turn_is_reported_and_the_next_runs_elsewhere(
    cluster: Cluster,
) -> None:
    _script(cluster)
    first = await asyncio.to_thread(cluster.start_worker, "w1", concurrency=1)
    async with _bot(cluster) as api:
        _say(api, "hello one")
        await api.wait_for_message(_text("echo: hello one"), timeout=60)
        _say(api, f"please {SLOW}")
        await _until("the slow turn to run", lambda: _pids(cluster))
        cut_off = _pids(cluster)
        await asyncio.to_thread(cluster.start_worker, "w2", concurrency=1)

        first.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.proc.wait, 10)
        await api.wait_for_message(_text("w1 running it stopped answering"), timeout=60)
        await _until(
            "the cut-off agent to be gone", lambda: not any(map(_alive, cut_off)), within=20
        )

        _say(api, "hello again")
        reply = await api.wait_for_message(_text("hello again"), timeout=60)
        turns = _chat_turns(cluster)
        assert [row[2:4] for row in turns] == [
            ("done", "w1"),
            ("interrupted", "w1"),
            ("done", "w2"),
        ]
        # Not re-run: the slow turn's agent started once (it never finished, so the agent
        # log has only the two answered turns).
        assert len((cluster.tmp / "pids").read_text().splitlines()) == 1
        log = _log(cluster)
        assert len(log) == 2
        assert log[0]["prompt"] == "hello one"
        assert log[1]["prompt"].endswith("hello again")
        # A new agent session on w2, told so in plain words.
        last = log[-1]
        assert last["session"] != log[0]["session"]
        assert last["cwd"].startswith(str(cluster.tmp / "w2" / "ws"))
        assert "this chat session moved to another machine (worker w2)" in last["prompt"]
        assert "Person: hello one" in last["prompt"]
        assert "moved to another machine" in reply.text  # the echo carries the primer


async def test_no_worker_alive_the_message_waits_then_runs(cluster: Cluster) -> None:
    _script(cluster)
    async with _bot(cluster) as api:
        _say(api, "hello anyone")
        await api.wait_for_message(_text("your message waits for one"), timeout=30)
        assert not any("echo: hello anyone" in m.text for m in api.sent)
        await asyncio.to_thread(cluster.start_worker, "w1")
        await api.wait_for_message(_text("echo: hello anyone"), timeout=60)
        notices = [m for m in api.sent if "your message waits for one" in m.text]
        assert len(notices) == 1
        assert [row[2:4] for row in _chat_turns(cluster)] == [("done", "w1")]

"""Tool approvals for chat turns on the workers: the worker's agent asks turnstile's
permission server on the worker's machine, the request lands in the shared database, the
bot posts it to the chat and records the press, and the server hands the decision back.

Real PostgreSQL, a real ``turnstile worker`` subprocess, the real bot against the fake Bot
API, and a fake Claude Code (tests/fake_claude_approvals.py) that starts the permission
server from its ``--mcp-config`` and calls it over stdio, as the real CLI does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine.approvals import ApprovalPolicy
from engine.settings import Settings
from engine.store.backend import open_database
from engine.store.location import PostgresURL
from engine.workers.store import QueuedRun, WorkerStore
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import APPROVER, CHAT, OPERATOR, bot_settings, running_bot
from tests.workers_support import HEARTBEAT, TIMEOUT, Cluster
from tests.workers_support import cluster as cluster

pytestmark = pytest.mark.timeout(150)

FAKE_CLAUDE = Path(__file__).with_name("fake_claude_approvals.py")


def _fake_claude(cluster: Cluster) -> Path:
    """An executable ``claude`` on the worker that runs the fake with this interpreter."""
    program = cluster.tmp / "bin" / "claude"
    program.parent.mkdir(exist_ok=True)
    program.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_CLAUDE} "$@"\n')
    program.chmod(0o755)
    cluster.env["TURNSTILE_CLAUDE_BIN"] = str(program)
    cluster.env["FAKE_CLAUDE_LOG"] = str(cluster.tmp / "claude.log")
    cluster.env["TURNSTILE_PROJECTS"] = f"default={cluster.remote}#main"
    return program


@contextlib.asynccontextmanager
async def _bot(cluster: Cluster, policy: str) -> AsyncIterator[FakeBotApi]:
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
            default_agent="claude",
            tool_approval=policy,
        )
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound to a new claude session" in m.text)
            yield api


def _say(api: FakeBotApi, text: str) -> None:
    api.push_message(chat_id=CHAT, user_id=OPERATOR, text=text)


def _requests(cluster: Cluster) -> list[tuple[Any, ...]]:
    return cluster.query(
        "SELECT run_id, tool, input_json, state, decided_by, starter_id FROM tool_requests"
        " ORDER BY id"
    )


def _claude_argv(cluster: Cluster) -> list[list[str]]:
    path = cluster.tmp / "claude.log"
    if not path.exists():
        return []
    return [json.loads(line)["argv"] for line in path.read_text().splitlines()]


def _press(api: FakeBotApi, ask: SentMessage, label: str, user: int) -> None:
    [button] = [b for b in ask.buttons if label in b["text"]]
    api.push_callback(
        chat_id=CHAT, user_id=user, data=button["callback_data"], message_id=ask.message_id
    )


async def test_a_worker_turn_asks_in_the_chat_and_goes_on_when_approved_or_denied(
    cluster: Cluster,
) -> None:
    _fake_claude(cluster)
    await asyncio.to_thread(cluster.start_worker, "w1")
    async with _bot(cluster, "unlisted") as api:
        _say(api, "please run: touch approved.txt")
        ask = await api.wait_for_message(lambda m: "asks to use Bash" in m.text, timeout=60)
        assert "$ touch approved.txt" in ask.text
        assert "(on worker w1) asks to use Bash" in ask.text
        assert "The turn waits" in ask.text
        # The turn waits on the worker for the person: no answer yet.
        assert not any("ran touch" in m.text for m in api.sent)
        [(run_id, tool, tool_input, state, _, starter)] = _requests(cluster)
        assert (tool, json.loads(tool_input), state) == (
            "Bash",
            {"command": "touch approved.txt"},
            "pending",
        )
        assert starter == OPERATOR
        assert cluster.query("SELECT status, worker FROM worker_chat_turns") == [("running", "w1")]
        _press(api, ask, "Allow once", APPROVER)
        reply = await api.wait_for_message(
            lambda m: "ran touch approved.txt (exit 0)" in m.text, timeout=60
        )
        assert reply.chat_id == CHAT
        await api.wait_until(lambda: f"Allowed once by user{APPROVER}" in ask.text)
        assert "(on worker w1)" in ask.text
        # The command ran on the worker, in the chat's worktree there.
        made = list((cluster.tmp / "w1" / "ws").rglob("approved.txt"))
        assert len(made) == 1, made

        _say(api, "now run: rm -rf precious")
        second = await api.wait_for_message(
            lambda m: "asks to use Bash" in m.text and "rm -rf precious" in m.text, timeout=60
        )
        _press(api, second, "Deny", OPERATOR)
        refused = await api.wait_for_message(lambda m: "refused:" in m.text, timeout=60)
        assert f"A person denied this Bash call (user {OPERATOR})" in refused.text
        await api.wait_until(lambda: f"Denied by user{OPERATOR}" in second.text)

        rows = _requests(cluster)
        assert [(r[0], r[3], r[4]) for r in rows] == [
            (run_id, "allowed", APPROVER),
            (run_id, "denied", OPERATOR),
        ]
        assert [r[0] for r in cluster.query("SELECT status FROM worker_chat_turns")] == [
            "done",
            "done",
        ]
    argvs = _claude_argv(cluster)
    assert len(argvs) == 2
    for argv in argvs:
        assert "--permission-prompt-tool" in argv
        config = json.loads(argv[argv.index("--mcp-config") + 1])
        # A relay to the worker's own permission server: no database, password or run.
        server = config["mcpServers"]["turnstile"]
        assert server["env"] == {}
        assert server["args"][2].endswith("relay.py")
        assert "postgresql" not in json.dumps(config)


async def test_with_approvals_off_the_worker_s_agent_is_not_wired(cluster: Cluster) -> None:
    _fake_claude(cluster)
    await asyncio.to_thread(cluster.start_worker, "w1")
    async with _bot(cluster, "off") as api:
        _say(api, "please run: touch nope.txt")
        reply = await api.wait_for_message(lambda m: "refused:" in m.text, timeout=60)
        assert "not on the allowed list" in reply.text
    [argv] = _claude_argv(cluster)
    assert "--mcp-config" not in argv
    assert "--permission-prompt-tool" not in argv
    assert _requests(cluster) == []
    assert not list((cluster.tmp / "w1" / "ws").rglob("nope.txt"))


async def test_the_worker_s_route_never_hands_the_password_to_the_agent(tmp_path: Path) -> None:
    from engine.approvals.listener import ApprovalListener
    from engine.workers.chat import _approvals

    url = PostgresURL("postgresql://turnstile:s3cret-pw@127.0.0.1:5432/db")
    settings = Settings(_env_file=None, database=url)  # type: ignore[call-arg]
    spec = QueuedRun(
        run_id="rchat1",
        objective="",
        tool="claude",
        project="p",
        mode="chat",
        tool_approval="all",
        approval_starter=7,
    )
    with _approvals(settings, spec) as route:
        assert route is not None
        assert (route.run_id, route.policy, route.starter) == ("rchat1", ApprovalPolicy.ALL, 7)
        # The permission server is the worker's own (it opens the store itself); what the
        # agent's CLI is told is a relay to its socket: no address, no password.
        assert route.database is settings.database
        async with ApprovalListener(route) as listener:
            config = json.dumps(listener.mcp_config())
        assert "s3cret-pw" not in config
        assert "127.0.0.1:5432" not in config
    for off in (
        QueuedRun(run_id="r", objective="", tool="claude", project="p"),
        QueuedRun(run_id="r", objective="", tool="command", project="p", tool_approval="all"),
    ):
        with _approvals(settings, off) as none:
            assert none is None
    # The spec travels through the database (its placement and its run's row), approvals
    # included; a placement written before them has none.
    async with open_database(tmp_path / "spec.sqlite") as db:
        workers = WorkerStore(db)
        await workers.place(spec)
        placed = await workers.placement(spec.run_id)
        assert placed is not None
        assert placed.spec == spec
        older = {
            k: v
            for k, v in json.loads(spec.to_json()).items()
            if k not in ("tool_approval", "approval_starter")
        }
        await db.execute(
            "UPDATE worker_runs SET spec_json = ? WHERE run_id = ?", (json.dumps(older), "rchat1")
        )
        placed = await workers.placement(spec.run_id)
        assert placed is not None
        assert placed.spec.tool_approval is None


async def test_stop_while_a_worker_turn_waits_withdraws_the_request(cluster: Cluster) -> None:
    _fake_claude(cluster)
    await asyncio.to_thread(cluster.start_worker, "w1")
    async with _bot(cluster, "all") as api:
        _say(api, "please run: touch never.txt")
        ask = await api.wait_for_message(lambda m: "asks to use Bash" in m.text, timeout=60)
        _say(api, "/stop")
        await api.wait_for_message(lambda m: "stopped during turn 1" in m.text, timeout=30)
        await api.wait_until(lambda: "Not decided: the turn was stopped" in ask.text)
        assert not ask.buttons
        assert [r[3] for r in _requests(cluster)] == ["cancelled"]
        # The chat goes on, on the same worker.
        _say(api, "hello after")
        await api.wait_for_message(lambda m: "echo: hello after" in m.text, timeout=60)
    assert not list((cluster.tmp / "w1" / "ws").rglob("never.txt"))

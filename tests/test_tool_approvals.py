"""Tool approvals without an agent CLI: policy, store, the MCP server over stdio, the bot.

The MCP permission server runs as a real subprocess and is called through the MCP SDK's
own stdio client, the way Claude Code calls it; the store is a real SQLite file.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import stat
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import AgentOptions
from engine.agents.claude import ClaudeAgent
from engine.agents.factory import create_agent
from engine.approvals import (
    PERMISSION_TOOL,
    ApprovalPolicy,
    ApprovalRoute,
    Decision,
    Scope,
    SqliteApprovalStore,
    command_prefix,
    grant_key,
    summarize,
)
from engine.approvals.listener import ApprovalListener
from engine.approvals.mcp_server import answer_for
from engine.errors import ConfigError, TurnExecError
from engine.settings import Settings
from engine.store.backend import AnyDatabase, open_database
from engine.store.database import Database
from engine.store.location import PostgresURL
from engine.store.runs import SqliteRunStore
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import APPROVER, CHAT, OPERATOR, bot_settings, running_bot
from tests.pg_support import PASSWORD, PASSWORD_ROLE, PgCluster
from tests.support import wait_until


@pytest.mark.parametrize(
    ("command", "prefix"),
    [
        ("touch allowed.txt", "touch"),
        ("  ls -la src ", "ls"),
        ("git status -s", "git status"),
        ("npm run test", "npm run"),
        ("git -C elsewhere push", "=git -C elsewhere push"),
        ("touch a && rm -rf /", "=touch a && rm -rf /"),
        ("cat x | sh", "=cat x | sh"),
        ("echo $(id)", "=echo $(id)"),
        ("rm *", "=rm *"),
        ("FOO=1 make", "=FOO=1 make"),
        ("echo 'unclosed", "=echo 'unclosed"),
        ("printf hi > out", "=printf hi > out"),
        ("", "="),
    ],
)
def test_command_prefix(command: str, prefix: str) -> None:
    assert command_prefix(command) == prefix


def test_grant_keys_are_per_command_for_bash_and_per_tool_otherwise() -> None:
    assert grant_key("Bash", {"command": "touch x"}) == "touch"
    assert grant_key("Write", {"file_path": "/x", "content": "y"}) == ""


def test_summaries_show_the_command_and_a_diff_excerpt_for_edits() -> None:
    assert summarize("Bash", {"command": "touch a", "description": "make a"}) == (
        "$ touch a\n(make a)"
    )
    edit = summarize(
        "Edit", {"file_path": "/repo/app.py", "old_string": "x = 1\n", "new_string": "x = 2\n"}
    )
    assert edit.splitlines()[0] == "/repo/app.py"
    assert "-x = 1" in edit
    assert "+x = 2" in edit
    write = summarize("Write", {"file_path": "/repo/n.txt", "content": "a\n" * 100})
    assert "(200 bytes)" in write
    assert "more lines" in write
    assert len(summarize("Other", {"blob": "z" * 10_000})) <= 1500


def test_answers_have_the_shape_claude_code_expects() -> None:
    from engine.approvals.store import ToolRequest

    base: dict[str, Any] = {
        "id": 1,
        "run_id": "r1",
        "tool": "Bash",
        "input": {"command": "ls"},
        "tool_use_id": None,
        "starter_id": None,
        "scope": None,
        "reason": None,
        "posted_at": None,
        "created_at": 0.0,
        "decided_at": 0.0,
    }
    allowed = ToolRequest(**base, state=Decision.ALLOWED, decided_by=5)
    denied = ToolRequest(**base, state=Decision.DENIED, decided_by=5)
    cancelled = ToolRequest(
        **{**base, "reason": "the turn was stopped"}, state=Decision.CANCELLED, decided_by=None
    )
    assert answer_for(allowed) == {"behavior": "allow", "updatedInput": {"command": "ls"}}
    assert answer_for(denied) == {
        "behavior": "deny",
        "message": "A person denied this Bash call (user 5).",
    }
    assert answer_for(cancelled) == {
        "behavior": "deny",
        "message": "Not run: the turn was stopped.",
    }


# -- the store ------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AnyDatabase]:
    """The approvals' database: a SQLite file, or a PostgreSQL database whose role must
    give its password (so the approval server can only get in through its password file)."""
    target: Path | PostgresURL = tmp_path / "t.db"
    if request.param == "postgresql":
        cluster: PgCluster = request.getfixturevalue("pg_cluster")
        name = f"ap_{os.getpid()}_{next(_NAMES)}"
        cluster.admin(f'CREATE DATABASE "{name}" OWNER "{PASSWORD_ROLE}" TEMPLATE template0')
        target = PostgresURL(cluster.url(name, user=PASSWORD_ROLE, password=PASSWORD))
    async with open_database(target) as database:
        yield database


_NAMES = itertools.count()


def _target(db: AnyDatabase) -> Path | PostgresURL:
    return db.path if isinstance(db, Database) else db.url


async def test_a_decision_is_made_once(db: AnyDatabase) -> None:
    store = SqliteApprovalStore(db)
    request = await store.open_request("r1", "Bash", {"command": "touch a"}, starter_id=7)
    assert request.state is Decision.PENDING
    first = await store.decide(request.id, Decision.ALLOWED, scope=Scope.ONCE, by=1)
    second = await store.decide(request.id, Decision.DENIED, by=2)
    assert first.changed
    assert not second.changed
    assert second.request.state is Decision.ALLOWED
    assert second.request.decided_by == 1


async def test_a_session_grant_covers_its_run_tool_and_prefix_only(db: AnyDatabase) -> None:
    store = SqliteApprovalStore(db)
    request = await store.open_request("r1", "Bash", {"command": "touch a"})
    await store.decide(request.id, Decision.ALLOWED, scope=Scope.SESSION, by=1)
    covered = await store.open_request("r1", "Bash", {"command": "touch b c"})
    assert (covered.state, covered.scope, covered.decided_by) == (Decision.ALLOWED, Scope.GRANT, 1)
    for run, command in [
        ("r1", "rm a"),
        ("r1", "touch a; rm -rf /"),
        ("r2", "touch a"),
    ]:
        other = await store.open_request(run, "Bash", {"command": command})
        assert other.state is Decision.PENDING, (run, command)
    write = await store.open_request("r1", "Write", {"file_path": "/x", "content": ""})
    assert write.state is Decision.PENDING


async def test_a_once_allow_grants_nothing(db: AnyDatabase) -> None:
    store = SqliteApprovalStore(db)
    request = await store.open_request("r1", "Bash", {"command": "touch a"})
    await store.decide(request.id, Decision.ALLOWED, scope=Scope.ONCE, by=1)
    again = await store.open_request("r1", "Bash", {"command": "touch a"})
    assert again.state is Decision.PENDING


async def test_cancel_pending_by_run(db: AnyDatabase) -> None:
    store = SqliteApprovalStore(db)
    a = await store.open_request("r1", "Bash", {"command": "ls"})
    b = await store.open_request("r2", "Bash", {"command": "ls"})
    [cancelled] = await store.cancel_pending("the turn was stopped", run_ids=["r1"])
    assert cancelled.id == a.id
    assert cancelled.state is Decision.CANCELLED
    assert [r.id for r in await store.pending()] == [b.id]
    assert await store.cancel_pending("x", run_ids=[]) == []


# -- flags ----------------------------------------------------------------------------


async def _claude(tmp_path: Path, policy: ApprovalPolicy | None, allow: list[str]) -> list[str]:
    route = (
        ApprovalRoute(database=tmp_path / "t.db", run_id="r1", policy=policy) if policy else None
    )
    options = AgentOptions(
        binary="claude",
        cwd=tmp_path,
        allowlist=ToolAllowlist.from_flags(allow),
        approval=route,
    )
    agent = ClaudeAgent(options)
    if route is None:
        return agent.turn_argv("claude") + [f"{k}={v}" for k, v in agent.turn_env().items()]
    async with ApprovalListener(route) as listener:
        agent._listener = listener
        return agent.turn_argv("claude") + [f"{k}={v}" for k, v in agent.turn_env().items()]


async def test_claude_flags_per_policy(tmp_path: Path) -> None:
    off = await _claude(tmp_path, None, ["bash"])
    assert "--allowedTools=Bash" in off
    assert "--permission-prompt-tool" not in off
    unlisted = await _claude(tmp_path, ApprovalPolicy.UNLISTED, ["bash"])
    assert "--allowedTools=Bash" in unlisted
    assert unlisted[unlisted.index("--permission-prompt-tool") + 1] == PERMISSION_TOOL
    assert f"--disallowedTools={PERMISSION_TOOL}" in unlisted
    assert "MCP_CONNECTION_NONBLOCKING=0" in unlisted
    assert "MCP_TOOL_TIMEOUT=2147483647" in unlisted
    config = json.loads(unlisted[unlisted.index("--mcp-config") + 1])
    server = config["mcpServers"]["turnstile"]
    # The CLI starts a relay to the listener's socket: its argv names no database, no run.
    assert server["args"][:2] == ["-I", "-S"]
    assert server["args"][2].endswith("relay.py")
    assert server["env"] == {}
    assert "t.db" not in json.dumps(config)
    assert "TURNSTILE" not in json.dumps(config)
    every = await _claude(tmp_path, ApprovalPolicy.ALL, ["bash"])
    assert not any(a.startswith("--allowedTools") for a in every)
    assert "--permission-prompt-tool" in every


def test_a_turn_without_its_listener_is_refused(tmp_path: Path) -> None:
    route = ApprovalRoute(database=tmp_path / "t.db", run_id="r1", policy=ApprovalPolicy.ALL)
    agent = ClaudeAgent(AgentOptions(binary="claude", cwd=tmp_path, approval=route))
    with pytest.raises(TurnExecError, match="permission server"):
        agent.turn_argv("claude")


def test_only_claude_gets_a_route(tmp_path: Path) -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    route = ApprovalRoute(database=tmp_path / "t.db", run_id="r1", policy=ApprovalPolicy.ALL)
    claude = create_agent("claude", settings, cwd=tmp_path, approval=route)
    copilot = create_agent("copilot", settings, cwd=tmp_path, approval=route)
    assert claude.options.approval == route
    assert copilot.options.approval is None


# -- the MCP server, spoken to over stdio ---------------------------------------------


async def _call_server(listener: ApprovalListener, arguments: dict[str, Any]) -> Any:
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    # What the CLI starts: the relay named by the MCP config, with the CLI's environment.
    server = listener.mcp_config()["mcpServers"]
    assert isinstance(server, dict)
    spec = server["turnstile"]
    params = StdioServerParameters(command=spec["command"], args=spec["args"], env={})
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = await session.list_tools()
        assert [t.name for t in tools.tools] == ["approve", "ask"]
        return await session.call_tool("approve", arguments)


@pytest.mark.timeout(120)
async def test_the_server_waits_for_the_decision_and_answers_in_one_text_block(
    db: AnyDatabase, tmp_path: Path
) -> None:
    store = SqliteApprovalStore(db)
    route = ApprovalRoute(database=_target(db), run_id="r9", policy=ApprovalPolicy.UNLISTED)
    async with ApprovalListener(route) as listener:
        # What the CLI's argv shows (the MCP config) names no database and no password.
        assert PASSWORD not in json.dumps(listener.mcp_config())
        assert str(_target(db)) not in json.dumps(listener.mcp_config())
        assert stat.S_IMODE(os.stat(listener.folder).st_mode) == 0o700
        arguments = {
            "tool_name": "Bash",
            "input": {"command": "touch x"},
            "tool_use_id": "toolu_1",
        }
        call = asyncio.create_task(_call_server(listener, arguments))
        while not (pending := await store.pending(run_id="r9")):
            assert not call.done(), call
            await asyncio.sleep(0.05)
        [request] = pending
        assert (request.tool, dict(request.input), request.tool_use_id) == (
            "Bash",
            {"command": "touch x"},
            "toolu_1",
        )
        assert not call.done()
        await store.decide(request.id, Decision.ALLOWED, scope=Scope.ONCE, by=3)
        result = await asyncio.wait_for(call, 60)
        folder = listener.folder
    [block] = result.content
    assert block.type == "text"
    assert json.loads(block.text) == {"behavior": "allow", "updatedInput": {"command": "touch x"}}
    assert not folder.exists()


# -- the bot, with requests written to the store directly ----------------------------


async def _request_in_bot(rt: Any, starter: int) -> int:
    run_id = "rtest01"
    await SqliteRunStore(rt.db).create_run(
        run_id, mode="chat", agent="claude", session_id="s", workdir="/tmp", chat_id=str(CHAT)
    )
    store = SqliteApprovalStore(rt.db)
    request = await store.open_request(
        run_id, "Bash", {"command": "rm -r build"}, starter_id=starter
    )
    ext = next(e for e in rt.handlers.extensions if type(e).__name__ == "ToolApprovalExtension")
    await ext._started.wait()
    ext.watcher.poke()
    return request.id


@pytest.mark.usefixtures("isolated_env")
async def test_self_approval_can_be_forbidden(tmp_path: Path) -> None:
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, tool_approval="unlisted", forbid_self_approval=True)
        async with running_bot(api, settings) as rt:
            request_id = await _request_in_bot(rt, starter=OPERATOR)
            ask = await api.wait_for_message(lambda m: "asks to use Bash" in m.text)
            assert "$ rm -r build" in ask.text
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            status = await api.wait_for_message(lambda m: "waits for a decision" in m.text)
            assert "🔐 run rtest01 waits for a decision: Bash $ rm -r build" in status.text
            data = ask.buttons[0]["callback_data"]
            api.push_callback(chat_id=CHAT, user_id=OPERATOR, data=data, message_id=ask.message_id)
            await api.wait_until(
                lambda: any("self-approval" in a.get("text", "") for a in api.callback_answers)
            )
            store = SqliteApprovalStore(rt.db)
            assert (await store.get(request_id)).state is Decision.PENDING
            api.push_callback(chat_id=CHAT, user_id=APPROVER, data=data, message_id=ask.message_id)
            await api.wait_until(lambda: "Allowed once by user22" in ask.text)
            assert (await store.get(request_id)).state is Decision.ALLOWED


OTHER_CHAT = -1002
MISPLACED = "⛔ This button does not belong to this message."


async def _delivered(rt: Any, request_id: int) -> bool:
    live = await rt.store.get_live(f"tool:{request_id}")
    return live is not None and live.message_id is not None


async def _press(api: FakeBotApi, *, chat_id: int, data: str, message_id: int) -> str:
    """An approver's press; the bot's answer to it."""
    answered = len(api.callback_answers)
    api.push_callback(chat_id=chat_id, user_id=APPROVER, data=data, message_id=message_id)
    await api.wait_until(lambda: len(api.callback_answers) > answered)
    return str(api.callback_answers[-1].get("text", ""))


@pytest.mark.usefixtures("isolated_env")
async def test_a_press_counts_only_on_the_requests_own_message(tmp_path: Path) -> None:
    async with FakeBotApi() as api:
        settings = bot_settings(
            api, tmp_path, tool_approval="unlisted", allowed_chats=(CHAT, OTHER_CHAT)
        )
        async with running_bot(api, settings) as rt:
            # a message of the bot in another allowed chat, for a forged press to be on
            api.push_message(chat_id=OTHER_CHAT, user_id=OPERATOR, text="/help")
            elsewhere = await api.wait_for_message(
                lambda m: m.chat_id == OTHER_CHAT and "Your commands:" in m.text
            )
            request_id = await _request_in_bot(rt, starter=OPERATOR)
            ask = await api.wait_for_message(lambda m: "asks to use Bash" in m.text)
            await wait_until(lambda: _delivered(rt, request_id))
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            status = await api.wait_for_message(lambda m: "waits for a decision" in m.text)
            allow = ask.buttons[0]["callback_data"]
            store = SqliteApprovalStore(rt.db)
            forged = [
                (OTHER_CHAT, elsewhere.message_id),  # another allowed chat
                (OTHER_CHAT, ask.message_id),  # the request's message id, in another chat
                (CHAT, status.message_id),  # another message in the request's chat
            ]
            for chat, message in forged:
                answer = await _press(api, chat_id=chat, data=allow, message_id=message)
                assert answer == MISPLACED
                assert (await store.get(request_id)).state is Decision.PENDING
            assert "The turn waits." in ask.text
            assert ask.buttons
            refused = [
                (e.chat_id, e.reason)
                for e in await rt.store.audit_entries()
                if (e.action, e.outcome) == ("tool_approval", "refused")
            ]
            assert [chat for chat, _ in reversed(refused)] == [str(c) for c, _ in forged]
            assert all(
                f"not on its own (message {ask.message_id} in chat {CHAT})" in (reason or "")
                for _, reason in refused
            )
            # the press on the request's own message still decides it
            api.push_callback(chat_id=CHAT, user_id=APPROVER, data=allow, message_id=ask.message_id)
            await api.wait_until(lambda: "Allowed once by user22" in ask.text)
            assert (await store.get(request_id)).state is Decision.ALLOWED


@pytest.mark.usefixtures("isolated_env")
async def test_a_request_not_yet_delivered_cannot_be_decided_by_a_press(tmp_path: Path) -> None:
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, tool_approval="unlisted")
        async with running_bot(api, settings) as rt:
            # Telegram has the message, the bot has not heard back: no message id recorded
            api.hold_answers(["sendMessage"])
            request_id = await _request_in_bot(rt, starter=OPERATOR)
            ask = await api.wait_for_message(lambda m: "asks to use Bash" in m.text)
            deny = ask.buttons[-1]["callback_data"]
            answer = await _press(api, chat_id=CHAT, data=deny, message_id=ask.message_id)
            assert answer == "⏳ This request's message is still being delivered; press again."
            store = SqliteApprovalStore(rt.db)
            assert (await store.get(request_id)).state is Decision.PENDING
            [entry] = [e for e in await rt.store.audit_entries() if e.action == "tool_approval"]
            assert entry.outcome == "refused"
            assert "not delivered yet" in (entry.reason or "")
            api.release()
            await wait_until(lambda: _delivered(rt, request_id))
            api.push_callback(chat_id=CHAT, user_id=APPROVER, data=deny, message_id=ask.message_id)
            await api.wait_until(lambda: "Denied by user22" in ask.text)
            assert (await store.get(request_id)).state is Decision.DENIED


@pytest.mark.usefixtures("isolated_env")
async def test_requests_left_by_a_crash_are_reported_at_start(tmp_path: Path) -> None:
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, tool_approval="unlisted")
        async with Database(settings.database) as db:
            await SqliteRunStore(db).create_run(
                "rgone01",
                mode="chat",
                agent="claude",
                session_id="s",
                workdir="/tmp",
                chat_id=str(CHAT),
            )
            request = await SqliteApprovalStore(db).open_request(
                "rgone01", "Bash", {"command": "ls"}
            )
        async with running_bot(api, settings) as rt:
            got = await SqliteApprovalStore(rt.db).get(request.id)
            assert got.state is Decision.CANCELLED
            assert got.reason is not None
            assert "restarted" in got.reason
            # never posted with buttons: there is nothing left to answer
            assert not any("asks to use" in m.text for m in api.sent)


# -- auto mode hands the route to its agent -----------------------------------------


async def test_auto_runs_get_a_route_for_their_own_run_id(tmp_path: Path) -> None:
    from engine.automode import prepare_auto_run
    from engine.runs import RunSpec
    from tests.automode_support import git_workspace

    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, database=tmp_path / "t.db", runs_dir=tmp_path / "runs"
    )
    asked: list[str] = []

    def route_for(run_id: str, own: ApprovalPolicy | None) -> ApprovalRoute:
        asked.append(run_id)
        return ApprovalRoute(
            database=settings.database, run_id=run_id, policy=own or ApprovalPolicy.ALL
        )

    async with Database(settings.database) as database:
        spec = RunSpec(objective="do it", agent="claude", workdir=git_workspace(tmp_path / "ws"))
        run = await prepare_auto_run(settings, database, spec, approval_for=route_for)
        agent: Any = run.runner.agent
        assert agent.options.approval.run_id == run.run_id
        assert agent.options.approval.policy is ApprovalPolicy.ALL
        # a run's own permissions go with it (and stay in its state for a resume)
        trusted = replace(spec, workdir=git_workspace(tmp_path / "ws2"), permissions="trusted")
        run2 = await prepare_auto_run(settings, database, trusted, approval_for=route_for)
        agent = run2.runner.agent
        assert agent.options.approval.policy is ApprovalPolicy.TRUSTED
        assert run2.state.config["permissions"] == "trusted"
        for wrong, said in (("codex", "only Claude Code can"), ("claude", "no permissions")):
            bad = replace(
                spec,
                agent=wrong,
                workdir=git_workspace(tmp_path / f"ws-{wrong}"),
                permissions="trusted" if wrong == "codex" else "careless",
            )
            with pytest.raises(ConfigError, match=said):
                await prepare_auto_run(settings, database, bad, approval_for=route_for)
    assert asked == [run.run_id, run2.run_id]


@pytest.mark.usefixtures("isolated_env")
async def test_help_says_what_asks_and_what_cannot(tmp_path: Path) -> None:
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, tool_approval="unlisted")
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/help")
            help_text = await api.wait_for_message(lambda m: "Your commands:" in m.text)
            # what asks is in the list of all commands, one tap away
            api.push_callback(
                chat_id=CHAT,
                user_id=OPERATOR,
                data=help_text.buttons[0]["callback_data"],
                message_id=help_text.message_id,
            )
            help_text = await api.wait_for_message(lambda m: "Tool approvals" in m.text)
    assert "on here for tools outside the allowed list" in help_text.text
    assert "Copilot CLI and Codex cannot ask: their allowed tools alone decide" in help_text.text

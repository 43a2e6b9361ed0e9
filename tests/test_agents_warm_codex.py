"""Warm Codex sessions: one resident ``codex app-server``, turn after turn.

The real pinned CLI against the fake model API, except where a test needs a CLI that
behaves in a way the real one will not (exiting on its own, or lacking the app-server):
those are small scripts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import AgentOptions
from engine.agents.codex import CodexAgent
from engine.agents.factory import create_agent, turn_mode
from engine.agents.stream import AgentEvent, EventKind
from engine.agents.warm import WarmPool, WarmPreemptHandle, close_agent
from engine.agents.warm_codex import CodexWarmSupport, WarmCodexAgent, codex_warm_support
from engine.commands.agents import turn_modes_text
from engine.commands.doctor import check_turn_modes
from engine.errors import TurnPreempted
from tests.agent_clis import ensure_cli
from tests.fakes.model_api import FakeModelAPI, Hold, Status, Text, ToolCall
from tests.fakes.realcli import Sandbox, alive, cmdline, marked_processes, parent_of
from tests.support import make_settings

pytestmark = [pytest.mark.realcli, pytest.mark.timeout(300)]

SHELL = ToolAllowlist.from_flags(["bash"])
READ_ONLY = ToolAllowlist.read_only_default()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="session")
def codex_bin() -> Path:
    return ensure_cli("codex")


@pytest.fixture
def api(model_api: FakeModelAPI) -> FakeModelAPI:
    return model_api  # conftest's fake model API (and its sandbox fixture), by a short name


@pytest.fixture
async def pool() -> AsyncIterator[WarmPool]:
    async with WarmPool(max_sessions=4) as warm:
        yield warm


def make_agent(
    codex_bin: Path | str,
    api: FakeModelAPI,
    sandbox: Sandbox,
    pool: WarmPool,
    *,
    allowlist: ToolAllowlist = READ_ONLY,
    session_id: str | None = None,
    resume: bool = False,
    grace: float = 5.0,
    support: CodexWarmSupport | None = None,
) -> WarmCodexAgent:
    options = AgentOptions(
        binary=str(codex_bin),
        cwd=sandbox.workspace,
        config_dir=sandbox.config,
        extra_env=sandbox.env(api.codex_env(sandbox.config)),
        allowlist=allowlist,
        walls=sandbox.walls(str(codex_bin)),
    )
    return WarmCodexAgent(
        options,
        session_id=session_id,
        resume=resume,
        pool=pool,
        preempt=WarmPreemptHandle(grace=grace),
        support=support or codex_warm_support(str(codex_bin)),
    )


def resident_cli(sandbox: Sandbox) -> int:
    """The pid of the test's resident CLI (our direct child carrying the marker)."""
    [cli] = [pid for pid in marked_processes(sandbox.marker) if parent_of(pid) == os.getpid()]
    return cli


async def wait_gone(pid: int) -> None:
    async with asyncio.timeout(30):
        while alive(pid):
            await asyncio.sleep(0.02)


def test_the_pinned_cli_is_detected_from_its_schema(codex_bin: Path) -> None:
    support = codex_warm_support(str(codex_bin))
    assert support.supported, support.reason
    assert support.interrupt
    assert support.steer
    # Cached: the schema is generated once per binary file.
    assert codex_warm_support(str(codex_bin)) is support


def test_a_cli_without_the_app_server_runs_per_turn(tmp_path: Path) -> None:
    old = tmp_path / "codex"
    old.write_text("#!/bin/sh\necho \"error: unrecognized subcommand 'app-server'\" >&2\nexit 2\n")
    old.chmod(0o755)
    support = codex_warm_support(str(old))
    assert not support.supported
    assert "one process per turn" in support.reason
    settings = make_settings(tmp_path, warm_sessions=("codex",), codex_bin=str(old))
    mode = turn_mode("codex", settings)
    assert not mode.warm
    assert mode.reason == support.reason
    agent = create_agent("codex", settings, cwd=tmp_path)
    assert not isinstance(agent, WarmCodexAgent)
    assert f"codex: per turn - {support.reason}" in turn_modes_text(settings)
    [check] = check_turn_modes(settings)
    assert "one process per turn" in check.detail


def test_the_factory_makes_a_warm_codex_session_when_asked(codex_bin: Path, tmp_path: Path) -> None:
    settings = make_settings(tmp_path, warm_sessions=("codex",), codex_bin=str(codex_bin))
    assert turn_mode("codex", settings).warm
    assert isinstance(create_agent("codex", settings, cwd=tmp_path), WarmCodexAgent)
    assert "codex: warm - takes turn after turn on its app-server" in turn_modes_text(settings)
    [check] = check_turn_modes(settings)
    assert check.detail.startswith("warm: ")
    off = make_settings(tmp_path, warm_sessions=(), codex_bin=str(codex_bin))
    assert not isinstance(create_agent("codex", off, cwd=tmp_path), WarmCodexAgent)


async def test_three_turns_on_one_process_carry_the_context(
    codex_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    api.enqueue(Text("first answer"), Text("second answer"), Text("third answer"))
    agent = make_agent(codex_bin, api, sandbox, pool)
    outs = []
    pids = set()
    for prompt in ("remember 42", "and 43", "what numbers?"):
        outs.append(await agent.run_turn(prompt))
        pids.add(resident_cli(sandbox))
    assert [o.text for o in outs] == ["first answer", "second answer", "third answer"]
    assert agent.spawns == 1
    assert len(pids) == 1
    assert "app-server" in cmdline(next(iter(pids)))
    assert [o.metadata["process_started"] for o in outs] == [True, False, False]
    for out in outs:
        assert out.exit_code == 0
        assert out.metadata["session_id"] == agent.session_id
        assert out.metadata["is_error"] is False
        assert out.metadata["num_turns"] == 1
        assert out.metadata["warm"] is True
        assert out.metadata["rollout_saved"] is True
        assert isinstance(out.metadata["usage"], dict)
        assert out.metadata["usage"]["output_tokens"] > 0
    conversation = api.model_requests[2].conversation()
    assert ("user", "remember 42") in conversation
    assert ("assistant", "first answer") in conversation
    assert ("assistant", "second answer") in conversation
    assert conversation[-1] == ("user", "what numbers?")
    assert agent.resident
    await agent.aclose()
    assert marked_processes(sandbox.marker) == []


async def test_progress_events_and_a_tool_call(
    codex_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    target = sandbox.workspace / "x.txt"
    api.enqueue(
        Text("hello"), ToolCall("exec_command", {"cmd": f"echo hi > {target}"}), Text("done")
    )
    agent = make_agent(codex_bin, api, sandbox, pool, allowlist=SHELL)
    seen: list[AgentEvent] = []
    agent.on_event = seen.append
    await agent.run_turn("one")
    first = [e.kind for e in seen]
    seen.clear()
    out = await agent.run_turn("two")
    second = [e.kind for e in seen]
    assert first[0] is EventKind.SESSION
    assert first[-2:] == [EventKind.RESULT, EventKind.TURN_END]
    assert EventKind.TOOL_USE in second
    assert second.index(EventKind.TOOL_USE) < second.index(EventKind.TOOL_RESULT)
    assert second[-2:] == [EventKind.RESULT, EventKind.TURN_END]
    assert out.text == "done"
    assert out.metadata["tool_calls"] == 1
    assert target.read_text().strip() == "hi"
    await agent.aclose()


async def test_kill_9_between_turns_resumes_in_a_new_process(
    codex_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    api.enqueue(Text("remembered"), Text("still here"))
    agent = make_agent(codex_bin, api, sandbox, pool)
    await agent.run_turn("remember 42")
    thread = agent.session_id
    first = resident_cli(sandbox)
    os.kill(first, signal.SIGKILL)
    await wait_gone(first)
    out = await agent.run_turn("what number?")
    assert out.exit_code == 0
    assert out.text == "still here"
    assert out.metadata["process_started"] is True
    assert out.metadata["session_id"] == thread
    assert agent.spawns == 2
    assert resident_cli(sandbox) != first
    conversation = api.model_requests[1].conversation()
    assert ("user", "remember 42") in conversation
    assert ("assistant", "remembered") in conversation
    await agent.aclose()


async def test_a_new_agent_resumes_the_thread_by_id(
    codex_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    """A bot restart: a new session object on the recorded thread id."""
    api.enqueue(Text("remembered"), Text("resumed"))
    agent = make_agent(codex_bin, api, sandbox, pool)
    await agent.run_turn("remember 42")
    await agent.aclose()
    again = make_agent(codex_bin, api, sandbox, pool, session_id=agent.session_id, resume=True)
    out = await again.run_turn("what number?")
    assert out.text == "resumed"
    assert ("assistant", "remembered") in api.model_requests[1].conversation()
    await again.aclose()


async def test_stop_during_a_tool_interrupts_and_keeps_the_process(
    codex_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    api.enqueue(
        Text("ready"), ToolCall("exec_command", {"cmd": "sleep 300"}), Text("after the stop")
    )
    agent = make_agent(codex_bin, api, sandbox, pool, allowlist=SHELL)
    tool_started = asyncio.Event()
    agent.on_event = lambda e: tool_started.set() if e.kind is EventKind.TOOL_USE else None
    await agent.run_turn("warm up")
    cli = resident_cli(sandbox)
    turn = asyncio.create_task(agent.run_turn("wait a long time"))
    await asyncio.wait_for(tool_started.wait(), 60)
    async with asyncio.timeout(30):
        while not any(
            "sleep 300" in " ".join(cmdline(p)) for p in marked_processes(sandbox.marker)
        ):
            await asyncio.sleep(0.02)
    assert agent.preempt.active
    assert await agent.preempt.stop()
    with pytest.raises(TurnPreempted):
        await turn
    assert not agent.preempt.active
    # The interrupt stopped the command; the app-server itself (the Node wrapper and the
    # native server in its group) stays for the next turn.
    left = marked_processes(sandbox.marker)
    assert cli in left
    assert all(os.getpgid(pid) == cli for pid in left)
    assert not any("sleep" in " ".join(cmdline(pid)) for pid in left)
    out = await agent.run_turn("still there?")
    assert out.text == "after the stop"
    assert agent.spawns == 1
    await agent.aclose()


async def test_steering_reaches_the_model_in_the_same_turn(
    codex_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    hold = Hold(text="first part")
    api.enqueue(hold, Text("steered"))
    agent = make_agent(codex_bin, api, sandbox, pool)
    turn = asyncio.create_task(agent.run_turn("start"))
    await asyncio.wait_for(hold.arrived.wait(), 60)
    assert await agent.steer("also mention bananas") is True
    hold.release.set()
    out = await turn
    assert out.text == "steered"
    [first, second] = api.model_requests
    assert "bananas" not in first.all_text()
    assert "also mention bananas" in second.all_text()
    # No turn is running: the caller queues the message.
    assert await agent.steer("too late") is False
    api.enqueue(Text("next"))
    assert (await agent.run_turn("next")).text == "next"
    assert agent.spawns == 1
    await agent.aclose()


async def test_an_api_error_mid_session_is_a_failed_turn_and_the_session_goes_on(
    codex_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    api.enqueue(Text("one"), Status(400), Text("three"))
    agent = make_agent(codex_bin, api, sandbox, pool)
    await agent.run_turn("first")
    failed = await agent.run_turn("second")
    assert failed.exit_code == 1
    assert failed.metadata["is_error"] is True
    assert "scripted error from the fake model API" in failed.text
    assert "Codex turn failed" in failed.text
    out = await agent.run_turn("third")
    assert out.text == "three"
    assert out.metadata["is_error"] is False
    assert agent.spawns == 1
    await agent.aclose()


async def test_a_turn_whose_output_is_one_megabyte(
    codex_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    big = "".join(f"line {i:07d} of the long answer\n" for i in range(36_000))
    assert len(big) > 1_000_000
    api.enqueue(Text(big), Text("small"))
    agent = make_agent(codex_bin, api, sandbox, pool)
    out = await agent.run_turn("print a lot")
    assert out.size == len(big.encode())
    assert out.exit_code == 0
    # Beyond the default spill limit (1 MiB) the answer is on disk, its head in the text.
    assert out.spill_path is not None
    assert out.spill_path.read_text() == big
    assert out.full_text() == big
    assert out.text
    assert big.startswith(out.text)
    assert (await agent.run_turn("and now?")).text == "small"
    assert agent.spawns == 1
    await agent.aclose()


# What the pinned app-server offers; a stub that cannot print a schema borrows it.
PINNED_SUPPORT = CodexWarmSupport(True, "stub", interrupt=True, steer=True)


def stub_app_server(
    tmp_path: Path, *, exit_on_turn: int = 0, hang_on_turn: int = 0, ignore_interrupt: bool = False
) -> Path:
    """A tiny app-server that answers like Codex; it exits (code 3) on turn
    ``exit_on_turn``, and never finishes turn ``hang_on_turn`` unless interrupted."""
    script = tmp_path / "fake-codex"
    script.write_text(
        f"#!{sys.executable}\n"
        + textwrap.dedent(
            f"""
            import json, os, sys
            state = os.path.join(os.getcwd(), "turns")
            def send(m):
                sys.stdout.write(json.dumps(m) + "\\n"); sys.stdout.flush()
            for line in sys.stdin:
                m = json.loads(line)
                method, rid, p = m.get("method"), m.get("id"), m.get("params") or {{}}
                if method == "initialize":
                    send({{"id": rid, "result": {{}}}})
                elif method in ("thread/start", "thread/resume"):
                    send({{"id": rid, "result": {{"thread": {{"id": p.get("threadId", "t-1"),
                        "path": None}}}}}})
                elif method == "turn/start":
                    n = int(open(state).read()) + 1 if os.path.exists(state) else 1
                    open(state, "w").write(str(n))
                    send({{"id": rid, "result": {{"turn": {{"id": f"turn-{{n}}"}}}}}})
                    if n == {exit_on_turn}:
                        sys.exit(3)
                    if n == {hang_on_turn}:
                        open(os.path.join(os.getcwd(), "hanging"), "w").close()
                        continue
                    text = p["input"][0]["text"]
                    item = {{"type": "agentMessage", "id": f"m{{n}}", "text": "answer to " + text}}
                    send({{"method": "item/completed", "params": {{"threadId": "t-1",
                        "turnId": f"turn-{{n}}", "item": item}}}})
                    send({{"method": "turn/completed", "params": {{"threadId": "t-1",
                        "turn": {{"id": f"turn-{{n}}", "status": "completed", "error": None}}}}}})
                elif method == "turn/interrupt" and not {ignore_interrupt}:
                    send({{"id": rid, "result": {{}}}})
                    send({{"method": "turn/completed", "params": {{"threadId": "t-1",
                        "turn": {{"id": p["turnId"], "status": "interrupted", "error": None}}}}}})
            """
        )
    )
    script.chmod(0o755)
    return script


async def test_a_cli_that_exits_on_its_own_fails_the_turn_and_the_next_resumes(
    tmp_path: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    cli = stub_app_server(tmp_path, exit_on_turn=2)
    agent = make_agent(cli, api, sandbox, pool, support=PINNED_SUPPORT)
    assert (await agent.run_turn("one")).text == "answer to one"
    failed = await agent.run_turn("two")
    assert failed.exit_code == 3
    assert failed.metadata["is_error"] is True
    assert not agent.resident
    out = await agent.run_turn("three")
    assert out.text == "answer to three"
    assert out.metadata["process_started"] is True
    assert agent.spawns == 2
    await close_agent(agent)
    assert not agent.resident
    assert marked_processes(sandbox.marker) == []


async def test_eviction_at_the_cap_closes_the_idle_session(
    codex_bin: Path, api: FakeModelAPI, tmp_path: Path
) -> None:
    async with WarmPool(max_sessions=1) as small:
        one = make_agent(codex_bin, api, Sandbox(tmp_path / "one"), small)
        two = make_agent(codex_bin, api, Sandbox(tmp_path / "two"), small)
        await one.run_turn("first")
        assert one.resident
        await two.run_turn("second")
        assert two.resident
        assert not one.resident
        assert small.evictions == 1
        assert (await one.run_turn("back")).metadata["process_started"] is True
        assert one.spawns == 2


async def test_a_thread_the_cli_no_longer_knows_is_reported(
    codex_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    agent = make_agent(
        codex_bin,
        api,
        sandbox,
        pool,
        session_id="01a230f2-0000-7000-8000-000000000000",
        resume=True,
    )
    out = await agent.run_turn("hello?")
    assert out.metadata["session_missing"] is True
    assert out.metadata["is_error"] is True
    assert "no longer knows session" in out.text
    assert api.model_requests == []
    assert not agent.resident
    assert marked_processes(sandbox.marker) == []


@pytest.mark.parametrize(
    ("support", "ignore"),
    [
        (CodexWarmSupport(True, "stub without interrupt", interrupt=False, steer=False), False),
        (PINNED_SUPPORT, True),
    ],
    ids=["no-interrupt-in-the-cli", "interrupt-ignored"],
)
async def test_stop_kills_the_group_when_the_interrupt_cannot_end_the_turn(
    tmp_path: Path,
    api: FakeModelAPI,
    sandbox: Sandbox,
    pool: WarmPool,
    support: CodexWarmSupport,
    ignore: bool,
) -> None:
    cli = stub_app_server(tmp_path, hang_on_turn=2, ignore_interrupt=ignore)
    agent = make_agent(cli, api, sandbox, pool, grace=0.5, support=support)
    await agent.run_turn("first")
    first = resident_cli(sandbox)
    turn = asyncio.create_task(agent.run_turn("hang"))
    async with asyncio.timeout(30):
        while not (sandbox.workspace / "hanging").exists():
            await asyncio.sleep(0.02)
    assert await agent.preempt.stop()
    with pytest.raises(TurnPreempted):
        await turn
    assert marked_processes(sandbox.marker) == []
    out = await agent.run_turn("again")
    assert out.text == "answer to again"
    assert resident_cli(sandbox) != first
    assert agent.spawns == 2
    await agent.aclose()


async def test_stop_uses_the_interrupt_and_keeps_the_stub_process(
    tmp_path: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    cli = stub_app_server(tmp_path, hang_on_turn=2)
    agent = make_agent(cli, api, sandbox, pool, support=PINNED_SUPPORT)
    await agent.run_turn("first")
    first = resident_cli(sandbox)
    turn = asyncio.create_task(agent.run_turn("hang"))
    async with asyncio.timeout(30):
        while not (sandbox.workspace / "hanging").exists():
            await asyncio.sleep(0.02)
    assert await agent.preempt.stop()
    with pytest.raises(TurnPreempted):
        await turn
    assert resident_cli(sandbox) == first
    assert (await agent.run_turn("again")).text == "answer to again"
    assert agent.spawns == 1
    await agent.aclose()


async def test_an_idle_session_is_closed_after_the_idle_time(
    codex_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    clock = FakeClock()
    async with WarmPool(max_sessions=4, idle_seconds=60, clock=clock) as idle_pool:
        agent = make_agent(codex_bin, api, sandbox, idle_pool)
        await agent.run_turn("first")
        cli = resident_cli(sandbox)
        clock.now += 59
        assert await idle_pool.sweep() == 0
        assert agent.resident
        clock.now += 2
        assert await idle_pool.sweep() == 1
        assert not agent.resident
        await wait_gone(cli)
        assert marked_processes(sandbox.marker) == []
        out = await agent.run_turn("back")
        assert out.metadata["process_started"] is True


async def test_a_thread_begun_per_turn_continues_warm(
    codex_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    """Turning warm sessions on mid-session: ``codex exec``'s thread, then the app-server."""
    api.enqueue(Text("per turn"), Text("warm now"))
    options = AgentOptions(
        binary=str(codex_bin),
        cwd=sandbox.workspace,
        config_dir=sandbox.config,
        extra_env=sandbox.env(api.codex_env(sandbox.config)),
    )
    cold = CodexAgent(options)
    assert (await cold.run_turn("remember 42")).text == "per turn"
    warm = make_agent(codex_bin, api, sandbox, pool, session_id=cold.session_id, resume=True)
    out = await warm.run_turn("what number?")
    assert out.text == "warm now"
    assert out.metadata["session_id"] == cold.session_id
    conversation = api.model_requests[1].conversation()
    assert ("user", "remember 42") in conversation
    assert ("assistant", "per turn") in conversation
    await warm.aclose()

"""Warm Claude Code sessions: one resident ``claude`` process, turn after turn.

The real pinned CLI against the fake model API, except where a test needs a CLI that
behaves in a way the real one will not (exiting on its own): that one is a small script.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import AgentOptions
from engine.agents.stream import AgentEvent, EventKind
from engine.agents.warm import (
    WarmClaudeAgent,
    WarmPool,
    WarmPreemptHandle,
    claude_warm_support,
)
from engine.errors import TurnPreempted, TurnstileError
from tests.agent_clis import ensure_cli
from tests.fakes.model_api import FakeModelAPI, Hold, Status, Text, ToolCall
from tests.fakes.realcli import Sandbox, alive, cmdline, marked_processes, parent_of

pytestmark = [pytest.mark.realcli, pytest.mark.timeout(300)]

SHELL = ToolAllowlist.from_flags(["bash"])
READ_ONLY = ToolAllowlist.read_only_default()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    return ensure_cli("claude")


@pytest.fixture
def api(model_api: FakeModelAPI) -> FakeModelAPI:
    return model_api  # conftest's fake model API (and its sandbox fixture), by a short name


@pytest.fixture
async def pool() -> AsyncIterator[WarmPool]:
    async with WarmPool(max_sessions=4) as warm:
        yield warm


def make_agent(
    claude_bin: Path | str,
    api: FakeModelAPI,
    sandbox: Sandbox,
    pool: WarmPool,
    *,
    allowlist: ToolAllowlist = READ_ONLY,
    session_id: str | None = None,
    resume: bool = False,
    grace: float = 5.0,
) -> WarmClaudeAgent:
    options = AgentOptions(
        binary=str(claude_bin),
        cwd=sandbox.workspace,
        config_dir=sandbox.config,
        extra_env=sandbox.env(api.claude_env(sandbox.config)),
        allowlist=allowlist,
        walls=sandbox.walls(str(claude_bin)),
    )
    return WarmClaudeAgent(
        options,
        session_id=session_id,
        resume=resume,
        pool=pool,
        preempt=WarmPreemptHandle(grace=grace),
    )


def resident_cli(sandbox: Sandbox) -> int:
    """The pid of the test's resident CLI (our direct child carrying the marker)."""
    [cli] = [pid for pid in marked_processes(sandbox.marker) if parent_of(pid) == os.getpid()]
    return cli


def resident_tree(cli: int) -> list[int]:
    """``cli`` and the sandbox's own processes under it, down to the CLI (no tools)."""
    tree = [cli]
    while True:
        children = [
            int(entry)
            for entry in os.listdir("/proc")
            if entry.isdigit() and parent_of(int(entry)) == tree[-1]
        ]
        if len(children) != 1 or "sleep" in " ".join(cmdline(children[0])):
            return tree
        tree.append(children[0])
        if Path(cmdline(children[0])[0]).name != "bwrap":
            return tree


async def wait_gone(pid: int) -> None:
    async with asyncio.timeout(30):
        while alive(pid):
            await asyncio.sleep(0.02)


async def wait_in_transcript(agent: WarmClaudeAgent, text: str) -> None:
    path = agent.transcript_path()
    async with asyncio.timeout(60):
        while not (path.exists() and text in path.read_text()):
            await asyncio.sleep(0.02)


def test_the_pinned_cli_is_detected_as_warm_capable(claude_bin: Path) -> None:
    support = claude_warm_support(str(claude_bin))
    assert support.supported, support.reason
    # Cached: the second answer is the same object, --help is not read again.
    assert claude_warm_support(str(claude_bin)) is support


def test_a_cli_without_stream_input_is_not_warm_capable(tmp_path: Path) -> None:
    old = tmp_path / "claude"
    old.write_text("#!/bin/sh\necho 'Usage: claude [options]'\necho '  --print'\n")
    old.chmod(0o755)
    support = claude_warm_support(str(old))
    assert not support.supported
    assert "--input-format" in support.reason


async def test_three_turns_on_one_process_carry_the_context(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    api.enqueue(Text("first answer"), Text("second answer"), Text("third answer"))
    agent = make_agent(claude_bin, api, sandbox, pool)
    outs = []
    pids = set()
    for prompt in ("remember 42", "and 43", "what numbers?"):
        outs.append(await agent.run_turn(prompt))
        pids.add(resident_cli(sandbox))
    assert [o.text for o in outs] == ["first answer", "second answer", "third answer"]
    assert agent.spawns == 1
    assert len(pids) == 1
    assert [o.metadata["process_started"] for o in outs] == [True, False, False]
    for out in outs:
        assert out.exit_code == 0
        assert out.metadata["session_id"] == agent.session_id
        assert out.metadata["is_error"] is False
        assert out.metadata["num_turns"] == 1
        assert out.metadata["warm"] is True
        assert isinstance(out.metadata["usage"], dict)
        assert out.metadata["usage"]["output_tokens"] == 7
    # The CLI counts cost from its start; each turn reports its own share.
    costs = [o.metadata["cost_usd"] for o in outs]
    assert all(isinstance(c, float) and c > 0 for c in costs)
    assert costs[0] == pytest.approx(costs[1]) == pytest.approx(costs[2])
    conversation = api.model_requests[2].conversation()
    assert ("user", "remember 42") in conversation
    assert ("assistant", "first answer") in conversation
    assert ("assistant", "second answer") in conversation
    assert conversation[-1] == ("user", "what numbers?")
    assert agent.resident
    await agent.aclose()
    assert marked_processes(sandbox.marker) == []


async def test_progress_events_per_turn_end_with_turn_end(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    target = sandbox.workspace / "x.txt"
    api.enqueue(Text("hello"), ToolCall("Bash", {"command": f"echo hi > {target}"}), Text("done"))
    agent = make_agent(claude_bin, api, sandbox, pool, allowlist=SHELL)
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
    assert target.read_text().strip() == "hi"
    await agent.aclose()


async def test_a_process_started_ahead_takes_the_first_turn(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    api.enqueue(Text("first answer"))
    agent = make_agent(claude_bin, api, sandbox, pool)
    await agent.prestart()
    assert agent.resident
    ahead = resident_cli(sandbox)
    assert api.model_requests == []  # started, not asked anything
    await agent.prestart()  # already there: nothing more
    out = await agent.run_turn("hello")
    assert out.text == "first answer"
    assert out.metadata["process_started"] is True  # this turn's process, started ahead
    assert agent.spawns == 1
    assert resident_cli(sandbox) == ahead
    await agent.aclose()


async def test_a_process_that_cannot_start_ahead_leaves_the_error_to_the_turn(
    tmp_path: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    agent = make_agent(tmp_path / "no-such-claude", api, sandbox, pool)
    await agent.prestart()  # says nothing: the turn reports it
    assert not agent.resident
    with pytest.raises(TurnstileError):
        await agent.run_turn("hello")


async def test_kill_9_between_turns_resumes_in_a_new_process(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    api.enqueue(Text("remembered"), Text("still here"))
    agent = make_agent(claude_bin, api, sandbox, pool)
    await agent.run_turn("remember 42")
    # Between turns: once the CLI has saved the turn (the answer is returned before).
    assert await agent.settled()
    first = resident_cli(sandbox)
    os.kill(first, signal.SIGKILL)
    await wait_gone(first)
    out = await agent.run_turn("what number?")
    assert out.exit_code == 0
    assert out.text == "still here"
    assert out.metadata["process_started"] is True
    assert agent.spawns == 2
    second = resident_cli(sandbox)
    assert second != first
    assert "--resume" in cmdline(second)
    assert ("user", "remember 42") in api.model_requests[1].conversation()
    await agent.aclose()


async def test_kill_9_during_a_turn_is_a_failed_turn_then_resume(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    hold = Hold()
    api.enqueue(Text("one"), hold, Text("after the crash"))
    agent = make_agent(claude_bin, api, sandbox, pool)
    await agent.run_turn("first")
    turn = asyncio.create_task(agent.run_turn("second"))
    await asyncio.wait_for(hold.arrived.wait(), 60)
    os.kill(resident_cli(sandbox), signal.SIGKILL)
    out = await turn
    assert out.exit_code == -signal.SIGKILL
    assert out.metadata["is_error"] is True
    again = await agent.run_turn("third")
    assert again.text == "after the crash"
    assert agent.spawns == 2
    await agent.aclose()


async def test_stop_during_a_turn_interrupts_and_keeps_the_process(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    api.enqueue(
        Text("ready"),
        ToolCall("Bash", {"command": "sleep 300", "description": "wait"}),
        Text("after the stop"),
    )
    agent = make_agent(claude_bin, api, sandbox, pool, allowlist=SHELL)
    events: list[AgentEvent] = []
    tool_started = asyncio.Event()

    def on_event(event: AgentEvent) -> None:
        events.append(event)
        if event.kind is EventKind.TOOL_USE:
            tool_started.set()

    agent.on_event = on_event
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
    # The interrupt stopped the tool; the CLI process itself (in its sandbox: bwrap, the
    # sandbox's first process, the CLI) stays for the next turn.
    assert sorted(marked_processes(sandbox.marker)) == sorted(resident_tree(cli))
    out = await agent.run_turn("still there?")
    assert out.text == "after the stop"
    assert agent.spawns == 1
    assert events[-1].kind is EventKind.TURN_END
    await agent.aclose()


async def test_stop_kills_the_group_when_the_interrupt_is_ignored(
    tmp_path: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    cli = stub_cli(tmp_path, ignore_interrupt=True)
    agent = make_agent(cli, api, sandbox, pool, grace=0.5)
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


async def test_steering_while_a_tool_runs_reaches_the_model_in_the_same_turn(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    gate = sandbox.workspace / "go"
    waiting = f"while [ ! -e {gate} ]; do sleep 0.05; done; echo tool-done"
    api.enqueue(ToolCall("Bash", {"command": waiting, "description": "wait"}), Text("steered"))
    agent = make_agent(claude_bin, api, sandbox, pool, allowlist=SHELL)
    tool_started = asyncio.Event()
    agent.on_event = lambda e: tool_started.set() if e.kind is EventKind.TOOL_USE else None
    turn = asyncio.create_task(agent.run_turn("start the tool"))
    await asyncio.wait_for(tool_started.wait(), 60)
    steer = asyncio.create_task(agent.steer("also mention bananas"))
    # The CLI notes a message it read in its transcript at once and takes it up once the
    # tool is done: release the tool only after that.
    await wait_in_transcript(agent, "also mention bananas")
    gate.touch()
    assert await steer is True
    out = await turn
    assert out.text == "steered"
    assert "follow_on_results" not in out.metadata
    [_, second] = api.model_requests
    assert "also mention bananas" in second.all_text()
    assert agent.spawns == 1
    # Nothing is left over for the next turn.
    api.enqueue(Text("next"))
    assert (await agent.run_turn("next")).text == "next"
    await agent.aclose()


async def test_steering_while_the_model_answers_runs_as_a_follow_on_in_the_turn(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    hold = Hold(text="first part")
    api.enqueue(hold, Text("second part"))
    agent = make_agent(claude_bin, api, sandbox, pool)
    turn = asyncio.create_task(agent.run_turn("start"))
    await asyncio.wait_for(hold.arrived.wait(), 60)
    steer = asyncio.create_task(agent.steer("and then this"))
    await wait_in_transcript(agent, "and then this")
    hold.release.set()
    assert await steer is True
    out = await turn
    # The agent went idle only after the steering message had its answer.
    assert out.text == "first part\n\nsecond part"
    assert out.metadata["follow_on_results"] == 1
    assert out.metadata["num_turns"] == 2
    assert api.model_requests[1].conversation()[-1] == ("user", "and then this")
    await agent.aclose()


async def test_steer_without_a_running_turn_says_so(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    agent = make_agent(claude_bin, api, sandbox, pool)
    assert await agent.steer("nobody listens") is False


async def test_api_error_mid_session_is_a_result_and_the_session_goes_on(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    api.enqueue(Text("fine"), Status(400, "the fake says no"), Text("recovered"))
    agent = make_agent(claude_bin, api, sandbox, pool)
    assert (await agent.run_turn("one")).text == "fine"
    bad = await agent.run_turn("two")
    assert bad.exit_code == 1
    assert bad.metadata["is_error"] is True
    assert bad.metadata["api_error_status"] == 400
    assert "the fake says no" in bad.text
    good = await agent.run_turn("three")
    assert good.exit_code == 0
    assert good.text == "recovered"
    assert agent.spawns == 1
    await agent.aclose()


async def test_one_megabyte_output(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    big = "".join(f"{i:06d}" + "y" * 1017 + "\n" for i in range(1024))
    api.enqueue(Text("small"), Text(big), Text("after"))
    agent = make_agent(claude_bin, api, sandbox, pool)
    await agent.run_turn("one")
    out = await agent.run_turn("two")
    assert out.size == len(big.encode()) == 1024 * 1024
    assert out.text == big
    assert out.metadata["stdout_bytes"] > 2 * 1024 * 1024  # the assistant and result records
    assert (await agent.run_turn("three")).text == "after"
    await agent.aclose()


async def test_eviction_at_the_cap_stops_the_least_recently_used_idle_process(
    claude_bin: Path, api: FakeModelAPI, tmp_path: Path
) -> None:
    clock = FakeClock()
    async with WarmPool(max_sessions=2, idle_seconds=600, clock=clock) as pool:
        boxes = [Sandbox(tmp_path / f"s{i}") for i in range(3)]
        agents = [make_agent(claude_bin, api, box, pool) for box in boxes]
        for i, agent in enumerate(agents[:2]):
            clock.now += 1
            assert (await agent.run_turn(f"hello {i}")).exit_code == 0
        first = resident_cli(boxes[0])
        clock.now += 1
        await agents[2].run_turn("hello 2")
        # Session 0 was used least recently: its process made room.
        await wait_gone(first)
        assert not agents[0].resident
        assert agents[1].resident
        assert agents[2].resident
        assert len(pool) == 2
        assert pool.evictions == 1
        # It comes back on its next turn, resuming the session (and evicting session 1).
        api.enqueue(Text("back"))
        clock.now += 1
        out = await agents[0].run_turn("are you back?")
        assert out.text == "back"
        assert "--resume" in cmdline(resident_cli(boxes[0]))
        assert ("user", "hello 0") in api.model_requests[-1].conversation()
        assert not agents[1].resident
    for box in boxes:
        assert marked_processes(box.marker) == []


async def test_idle_processes_are_stopped_after_the_idle_time(
    claude_bin: Path, api: FakeModelAPI, tmp_path: Path
) -> None:
    clock = FakeClock()
    async with WarmPool(max_sessions=4, idle_seconds=60, clock=clock) as pool:
        old, fresh = Sandbox(tmp_path / "old"), Sandbox(tmp_path / "fresh")
        a = make_agent(claude_bin, api, old, pool)
        b = make_agent(claude_bin, api, fresh, pool)
        await a.run_turn("one")
        clock.now += 50
        await b.run_turn("two")
        clock.now += 20
        assert await pool.sweep() == 1
        assert not a.resident
        assert b.resident
        assert pool.expired == 1
        assert marked_processes(old.marker) == []
        api.enqueue(Text("resumed"))
        assert (await a.run_turn("again")).text == "resumed"
        assert a.spawns == 2


async def test_all_busy_at_the_cap_runs_the_turn_without_staying(
    claude_bin: Path, api: FakeModelAPI, tmp_path: Path
) -> None:
    async with WarmPool(max_sessions=1) as pool:
        busy_box, other_box = Sandbox(tmp_path / "busy"), Sandbox(tmp_path / "other")
        hold = Hold(text="held")
        api.enqueue(hold, Text("other answer"))
        busy = make_agent(claude_bin, api, busy_box, pool)
        other = make_agent(claude_bin, api, other_box, pool)
        turn = asyncio.create_task(busy.run_turn("hold on"))
        await asyncio.wait_for(hold.arrived.wait(), 60)
        out = await other.run_turn("quick one")
        assert out.text == "other answer"
        assert not other.resident
        assert marked_processes(other_box.marker) == []
        hold.release.set()
        assert (await turn).text == "held"
        assert busy.resident


def stub_cli(tmp_path: Path, *, exit_after: int = 0, ignore_interrupt: bool = False) -> Path:
    """A stand-in for ``claude`` in stream-json mode (a real CLI will not misbehave so)."""
    script = tmp_path / "stub-claude"
    body = textwrap.dedent(
        f"""\
        import json, os, sys
        exit_after = {exit_after}
        ignore_interrupt = {ignore_interrupt}
        sid = sys.argv[sys.argv.index("--resume" if "--resume" in sys.argv else "--session-id") + 1]
        cost = 0.0
        turns = 0
        with open("argv.log", "a") as log:
            log.write(json.dumps(sys.argv[1:]) + "\\n")
        def out(obj):
            sys.stdout.write(json.dumps(obj) + "\\n")
            sys.stdout.flush()
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["type"] == "control_request":
                if not ignore_interrupt:
                    out({{"type": "control_response", "response": {{"subtype": "success",
                        "request_id": msg["request_id"]}}}})
                continue
            text = msg["message"]["content"]
            out({{"type": "system", "subtype": "init", "session_id": sid, "model": "stub"}})
            out({{"type": "user", "message": msg["message"], "isReplay": True}})
            if text == "hang":
                open("hanging", "w").close()
                continue
            cost += 0.5
            turns += 1
            out({{"type": "result", "subtype": "success", "is_error": False,
                 "result": "answer to " + text, "session_id": sid, "num_turns": 1,
                 "total_cost_usd": cost, "usage": {{"output_tokens": 1}}}})
            if exit_after and turns >= exit_after:
                sys.exit(0)
        """
    )
    script.write_text(f"#!{sys.executable}\n{body}")
    script.chmod(0o755)
    return script


async def test_a_cli_that_exits_on_its_own_is_restarted_with_resume(
    tmp_path: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    cli = stub_cli(tmp_path, exit_after=1)
    agent = make_agent(cli, api, sandbox, pool)
    first = await agent.run_turn("one")
    assert first.text == "answer to one"
    assert first.metadata["cost_usd"] == 0.5
    async with asyncio.timeout(30):
        while agent.resident:
            await asyncio.sleep(0.02)
    # The stub keeps no transcript, so make the session look known to the CLI's store.
    transcript = agent.transcript_path()
    transcript.parent.mkdir(parents=True, exist_ok=True)
    transcript.write_text("{}\n")
    second = await agent.run_turn("two")
    assert second.text == "answer to two"
    assert second.metadata["process_started"] is True
    assert second.metadata["cost_usd"] == 0.5
    assert agent.spawns == 2
    first_argv, second_argv = (
        json.loads(line) for line in (sandbox.workspace / "argv.log").read_text().splitlines()
    )
    assert "--session-id" in first_argv
    assert second_argv[second_argv.index("--resume") + 1] == agent.session_id
    async with asyncio.timeout(30):
        while agent.resident:
            await asyncio.sleep(0.02)
    assert len(pool) == 0  # it left again after its turn


async def test_a_cli_that_exits_mid_turn_without_a_result_is_a_failed_turn(
    tmp_path: Path, api: FakeModelAPI, sandbox: Sandbox, pool: WarmPool
) -> None:
    cli = stub_cli(tmp_path, ignore_interrupt=True)
    agent = make_agent(cli, api, sandbox, pool)
    turn = asyncio.create_task(agent.run_turn("hang"))
    async with asyncio.timeout(30):
        while not (sandbox.workspace / "hanging").exists():
            await asyncio.sleep(0.02)
    os.kill(resident_cli(sandbox), signal.SIGTERM)
    out = await turn
    assert out.exit_code == -signal.SIGTERM
    assert out.metadata["is_error"] is True
    assert "exited with code" in out.text


async def test_the_pool_closes_idle_processes_on_its_own(
    tmp_path: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    cli = stub_cli(tmp_path)
    async with WarmPool(max_sessions=2, idle_seconds=0.2) as pool:
        agent = make_agent(cli, api, sandbox, pool)
        assert (await agent.run_turn("one")).text == "answer to one"
        pid = resident_cli(sandbox)
        # No sweep called: the pool's own task notices the idle time and closes it.
        await wait_gone(pid)
        async with asyncio.timeout(30):
            while agent.resident:  # its reader sees the output close a moment later
                await asyncio.sleep(0.02)
        assert pool.expired == 1
        assert len(pool) == 0

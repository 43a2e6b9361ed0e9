"""The Claude Code adapter against the real ``claude`` CLI and the fake model API."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import AgentOptions
from engine.agents.claude import ClaudeAgent
from engine.agents.stream import AgentEvent, EventKind, EventStream
from engine.errors import TurnPreempted
from engine.process import PreemptHandle
from tests.agent_clis import ensure_cli
from tests.fakes.model_api import FakeModelAPI, Hold, Status, Text, ToolCall
from tests.fakes.realcli import (
    Sandbox,
    cmdline,
    group_alive,
    groups_of,
    marked_processes,
    parent_of,
)

pytestmark = [pytest.mark.realcli, pytest.mark.timeout(300)]

WRITE = ToolAllowlist.from_flags(["view", "create"])
READ_ONLY = ToolAllowlist.read_only_default()
SHELL = ToolAllowlist.from_flags(["bash"])


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    return ensure_cli("claude")


@pytest.fixture
async def api() -> AsyncIterator[FakeModelAPI]:
    async with FakeModelAPI() as server:
        yield server


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return Sandbox(tmp_path)


def make_agent(
    claude_bin: Path,
    api: FakeModelAPI,
    sandbox: Sandbox,
    *,
    allowlist: ToolAllowlist = READ_ONLY,
    session_id: str | None = None,
    resume: bool = False,
    preempt: PreemptHandle | None = None,
) -> ClaudeAgent:
    options = AgentOptions(
        binary=str(claude_bin),
        cwd=sandbox.workspace,
        config_dir=sandbox.config,
        extra_env=sandbox.env(api.claude_env(sandbox.config)),
        allowlist=allowlist,
    )
    return ClaudeAgent(options, session_id=session_id, resume=resume, preempt=preempt)


async def test_one_turn_returns_the_scripted_reply(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    api.enqueue(Text("hello from the fake model"))
    agent = make_agent(claude_bin, api, sandbox)
    out = await agent.run_turn("say hello")
    assert out.exit_code == 0
    assert out.text == "hello from the fake model"
    assert out.metadata["session_id"] == agent.session_id
    assert out.metadata["is_error"] is False
    assert out.metadata["num_turns"] == 1
    assert isinstance(out.metadata["usage"], dict)
    assert out.metadata["usage"]["output_tokens"] == 7
    assert isinstance(out.metadata["cost_usd"], float)
    [request] = api.model_requests
    assert ("user", "say hello") in request.conversation()


async def test_second_turn_resumes_the_session(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    api.enqueue(Text("first answer"), Text("second answer"))
    agent = make_agent(claude_bin, api, sandbox)
    first = await agent.run_turn("first question")
    second = await agent.run_turn("second question")
    assert (first.text, second.text) == ("first answer", "second answer")
    assert second.metadata["session_id"] == first.metadata["session_id"] == agent.session_id
    conversation = api.model_requests[1].conversation()
    assert ("user", "first question") in conversation
    assert ("assistant", "first answer") in conversation
    assert conversation[-1] == ("user", "second question")


async def test_resume_from_a_new_process_with_resume_flag(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    api.enqueue(Text("remembered"), Text("still here"))
    first = make_agent(claude_bin, api, sandbox)
    await first.run_turn("remember 42")
    # A new adapter object (as after a restart) resumes the same session.
    later = make_agent(claude_bin, api, sandbox, session_id=first.session_id, resume=True)
    out = await later.run_turn("what number?")
    assert out.exit_code == 0
    assert out.text == "still here"
    assert ("user", "remember 42") in api.model_requests[1].conversation()


async def test_allowed_tool_writes_the_file(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    target = sandbox.workspace / "made.txt"
    api.enqueue(ToolCall("Write", {"file_path": str(target), "content": "written"}), Text("done"))
    agent = make_agent(claude_bin, api, sandbox, allowlist=WRITE)
    out = await agent.run_turn("write the file")
    assert out.exit_code == 0
    assert out.text == "done"
    assert target.read_text() == "written"
    assert out.metadata["permission_denials"] == []


async def test_read_only_allowlist_denies_the_write(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    target = sandbox.workspace / "made.txt"
    api.enqueue(ToolCall("Write", {"file_path": str(target), "content": "written"}), Text("done"))
    agent = make_agent(claude_bin, api, sandbox, allowlist=READ_ONLY)
    out = await agent.run_turn("write the file")
    assert out.exit_code == 0
    assert not target.exists()
    denials = out.metadata["permission_denials"]
    assert isinstance(denials, list)
    assert denials[0]["tool_name"] == "Write"
    tool_result = api.model_requests[1].conversation()[-1]
    assert tool_result[0] == "tool_result"
    assert "permission" in tool_result[1]


async def test_dangerous_allows_every_tool_as_root(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    target = sandbox.workspace / "ran.txt"
    api.enqueue(
        ToolCall("Bash", {"command": f"echo ran > {target}", "description": "write"}),
        Text("ok"),
    )
    agent = make_agent(
        claude_bin, api, sandbox, allowlist=ToolAllowlist.from_flags([], dangerous=True)
    )
    out = await agent.run_turn("run it")
    assert out.exit_code == 0, out.text
    assert target.read_text().strip() == "ran"


async def test_progress_events_tool_use_then_result_before_final(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    target = sandbox.workspace / "made.txt"
    # The final answer is held back so the test can see the events arrive mid-turn.
    final = Hold(text="all done")
    api.enqueue(
        ToolCall("Write", {"file_path": str(target), "content": "x"}, text="writing now"),
        final,
    )
    agent = make_agent(claude_bin, api, sandbox, allowlist=WRITE)
    seen: list[AgentEvent] = []
    stream = EventStream()
    agent.on_event = lambda event: (seen.append(event), stream(event))[-1]
    turn = asyncio.create_task(agent.run_turn("write it"))
    streamed: list[AgentEvent] = []
    async for event in stream:
        streamed.append(event)
        if event.kind is EventKind.TOOL_RESULT:
            # Surfaced while the turn runs: the CLI is still waiting for the model.
            await final.arrived.wait()
            assert not turn.done()
            final.release.set()
    out = await turn
    kinds = [event.kind for event in seen]
    assert streamed == seen
    assert kinds[0] is EventKind.SESSION
    assert kinds[-2:] == [EventKind.RESULT, EventKind.TURN_END]
    use = kinds.index(EventKind.TOOL_USE)
    result = kinds.index(EventKind.TOOL_RESULT)
    assert kinds.index(EventKind.TEXT) < use < result < kinds.index(EventKind.RESULT)
    assert seen[use].tool == "Write"
    assert seen[result].tool_id == seen[use].tool_id
    assert not seen[result].is_error
    assert seen[-2].text == out.text == "all done"
    lines = [event.line for event in seen[:-1]]
    assert lines == sorted(lines)
    assert lines[0] >= 1


async def test_model_api_400_is_a_nonzero_exit_not_an_exception(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    api.enqueue(Status(400, "the fake says no"))
    agent = make_agent(claude_bin, api, sandbox)
    out = await agent.run_turn("hello")
    assert out.exit_code not in (0, None)
    assert out.metadata["is_error"] is True
    assert out.metadata["api_error_status"] == 400
    assert "the fake says no" in out.text
    # The session survives a failed turn: the next one resumes it.
    api.enqueue(Text("recovered"))
    again = await agent.run_turn("try again")
    assert again.exit_code == 0
    assert again.text == "recovered"


async def test_preempt_while_response_held_kills_cli_and_children(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    hold = Hold()
    # A tool first starts a background command; claude runs tools in a session of their
    # own, so that child is outside the CLI's process group. Then the fake holds the
    # next response open.
    background = {"command": "sleep 300", "description": "bg", "run_in_background": True}
    api.enqueue(ToolCall("Bash", background), hold)
    agent = make_agent(claude_bin, api, sandbox, allowlist=SHELL, preempt=PreemptHandle(grace=2.0))
    turn = asyncio.create_task(agent.run_turn("take your time"))
    await asyncio.wait_for(hold.arrived.wait(), 120)
    pids = marked_processes(sandbox.marker)
    [cli] = [pid for pid in pids if parent_of(pid) == os.getpid()]
    group_of = groups_of(pids)
    outside = [pid for pid, group in group_of.items() if group != group_of[cli]]
    assert outside, [cmdline(pid) for pid in pids]
    groups = set(group_of.values())
    assert await agent.preempt.stop()
    with pytest.raises(TurnPreempted):
        await turn
    assert marked_processes(sandbox.marker) == []
    assert not any(group_alive(group) for group in groups)
    # The stopped turn's session is still there: the next turn resumes it.
    api.enqueue(Text("after the stop"))
    again = await agent.run_turn("still there?")
    assert again.exit_code == 0
    assert again.text == "after the stop"
    assert again.metadata["session_id"] == agent.session_id


async def test_one_megabyte_prompt_reaches_the_model_whole(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    # 1 MB; long runs of one letter keep the CLI's token estimate under its budget.
    prompt = "BEGIN\n" + "".join(f"{i:06d}" + "x" * 993 + "\n" for i in range(1000)) + "END"
    assert len(prompt.encode()) >= 1_000_000
    api.enqueue(Text("got it"))
    out = await make_agent(claude_bin, api, sandbox).run_turn(prompt)
    assert out.exit_code == 0
    assert out.text == "got it"
    assert ("user", prompt) in api.model_requests[0].conversation()


async def test_prompt_starting_with_dash_is_not_a_flag(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    api.enqueue(Text("fine"))
    out = await make_agent(claude_bin, api, sandbox).run_turn("--help --version -p")
    assert out.exit_code == 0
    assert out.text == "fine"
    assert ("user", "--help --version -p") in api.model_requests[0].conversation()


async def test_unknown_session_on_resume_is_reported_plainly(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    api.enqueue(Text("first"))
    agent = make_agent(claude_bin, api, sandbox)
    await agent.run_turn("start")
    shutil.rmtree(sandbox.config / "projects")
    out = await agent.run_turn("and now?")
    assert out.exit_code not in (0, None)
    assert agent.session_id in out.text
    assert "no longer knows session" in out.text
    assert f"exited with code {out.exit_code}" in out.text
    assert out.metadata["session_missing"] is True
    assert len(api.model_requests) == 1


# -- a first turn cut off: the next turn's flag comes from the CLI's own store -----------


def request_session(api: FakeModelAPI, index: int = -1) -> str | None:
    """The session id the CLI sent with a model request."""
    return api.model_requests[index].headers.get("X-Claude-Code-Session-Id")


def kill_on_session_event(agent: ClaudeAgent, sandbox: Sandbox) -> None:
    """SIGKILL the CLI's group the moment it announces the session (a crash).

    That is before it flushes its first transcript entries (it batches writes every
    100 ms), so the session never reaches the CLI's store.
    """

    def on_event(event: AgentEvent) -> None:
        if event.kind is EventKind.SESSION:
            [cli] = [
                pid for pid in marked_processes(sandbox.marker) if parent_of(pid) == os.getpid()
            ]
            os.killpg(os.getpgid(cli), signal.SIGKILL)

    agent.on_event = on_event


async def test_first_turn_preempted_while_held_next_turn_resumes(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    hold = Hold()
    api.enqueue(hold, Text("second answer"))
    agent = make_agent(claude_bin, api, sandbox, preempt=PreemptHandle(grace=5.0))
    turn = asyncio.create_task(agent.run_turn("first question"))
    await asyncio.wait_for(hold.arrived.wait(), 120)
    assert await agent.preempt.stop()
    with pytest.raises(TurnPreempted):
        await turn
    # On SIGTERM the CLI flushes what it has: the question, with no answer.
    assert agent.transcript_path().stat().st_size > 0
    out = await agent.run_turn("second question")
    assert out.exit_code == 0, out.text
    assert out.text == "second answer"
    assert out.metadata["session_id"] == agent.session_id
    assert request_session(api, 0) == request_session(api, 1) == agent.session_id
    conversation = api.model_requests[1].conversation()
    assert ("user", "first question") in [(role, text.strip()) for role, text in conversation]
    assert conversation[-1] == ("user", "second question")


async def test_first_turn_killed_before_the_cli_wrote_it_next_turn_creates(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox, caplog: pytest.LogCaptureFixture
) -> None:
    agent = make_agent(claude_bin, api, sandbox)
    kill_on_session_event(agent, sandbox)
    first = await agent.run_turn("first question")
    assert first.exit_code == -signal.SIGKILL
    agent.on_event = None
    api.enqueue(Text("second answer"))
    # The CLI announced the session but never wrote it: --resume would be refused.
    assert agent.started
    assert not agent.transcript_path().exists()
    with caplog.at_level(logging.INFO, logger="engine.agents.claude"):
        out = await agent.run_turn("second question")
    assert out.exit_code == 0, out.text
    assert out.text == "second answer"
    assert out.metadata["session_id"] == agent.session_id
    assert request_session(api) == agent.session_id
    texts = [text.strip() for _, text in api.model_requests[-1].conversation()]
    assert "first question" not in texts
    assert texts[-1] == "second question"
    assert any(agent.session_id in r.getMessage() for r in caplog.records)
    # From now on the session exists: the third turn resumes it.
    api.enqueue(Text("third answer"))
    third = await agent.run_turn("third question")
    assert third.text == "third answer"
    assert ("user", "second question") in api.model_requests[-1].conversation()


async def test_resume_flag_for_a_session_the_cli_never_wrote_creates_it(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox, caplog: pytest.LogCaptureFixture
) -> None:
    first = make_agent(claude_bin, api, sandbox)
    kill_on_session_event(first, sandbox)
    cut = await first.run_turn("first question")
    assert cut.exit_code == -signal.SIGKILL
    assert not first.transcript_path().exists()
    api.enqueue(Text("fresh start"))
    # As after a restart: our store recorded the session before its first turn ran.
    later = make_agent(claude_bin, api, sandbox, session_id=first.session_id, resume=True)
    with caplog.at_level(logging.INFO, logger="engine.agents.claude"):
        out = await later.run_turn("hello again")
    assert out.exit_code == 0, out.text
    assert out.text == "fresh start"
    assert out.metadata["session_id"] == first.session_id
    assert request_session(api) == first.session_id
    [log] = [r for r in caplog.records if r.name == "engine.agents.claude"]
    assert log.levelno == logging.INFO
    assert first.session_id in log.getMessage()
    assert later.transcript_path().stat().st_size > 0


async def test_new_object_without_resume_flag_resumes_a_written_session(
    claude_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    # The first turn finished, but the restarted caller did not pass resume=True:
    # the store decides, so there is no "Session ID ... is already in use" failure.
    api.enqueue(Text("remembered"), Text("still here"))
    first = make_agent(claude_bin, api, sandbox)
    await first.run_turn("remember 42")
    later = make_agent(claude_bin, api, sandbox, session_id=first.session_id)
    out = await later.run_turn("what number?")
    assert out.exit_code == 0, out.text
    assert out.text == "still here"
    assert ("user", "remember 42") in api.model_requests[1].conversation()

"""The Copilot CLI adapter against the real ``copilot`` CLI and the fake model API."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import AgentOptions
from engine.agents.copilot import CopilotAgent
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
def copilot_bin() -> Path:
    return ensure_cli("copilot")


@pytest.fixture
async def api() -> AsyncIterator[FakeModelAPI]:
    async with FakeModelAPI() as server:
        yield server


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return Sandbox(tmp_path)


def said(conversation: list[tuple[str, str]], role: str, text: str) -> bool:
    """Copilot prefixes user text with ``<current_datetime>…</current_datetime>``."""
    return any(r == role and (t == text or t.endswith("\n\n" + text)) for r, t in conversation)


def make_agent(
    copilot_bin: Path,
    api: FakeModelAPI,
    sandbox: Sandbox,
    *,
    allowlist: ToolAllowlist = READ_ONLY,
    session_id: str | None = None,
    resume: bool = False,
    preempt: PreemptHandle | None = None,
) -> CopilotAgent:
    options = AgentOptions(
        binary=str(copilot_bin),
        cwd=sandbox.workspace,
        config_dir=sandbox.config,
        extra_env=sandbox.env(api.copilot_env(sandbox.config)),
        allowlist=allowlist,
    )
    return CopilotAgent(options, session_id=session_id, resume=resume, preempt=preempt)


async def test_one_turn_returns_the_scripted_reply(
    copilot_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    api.enqueue(Text("hello from the fake model"))
    agent = make_agent(copilot_bin, api, sandbox)
    out = await agent.run_turn("say hello")
    assert out.exit_code == 0
    assert out.text == "hello from the fake model"
    assert out.metadata["session_id"] == agent.session_id
    assert out.metadata["is_error"] is False
    assert out.metadata["num_turns"] == 1
    assert isinstance(out.metadata["usage"], dict)
    [request] = api.model_requests
    assert said(request.conversation(), "user", "say hello")


async def test_second_turn_resumes_the_session(
    copilot_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    api.enqueue(Text("first answer"), Text("second answer"))
    agent = make_agent(copilot_bin, api, sandbox)
    first = await agent.run_turn("first question")
    second = await agent.run_turn("second question")
    assert (first.text, second.text) == ("first answer", "second answer")
    assert second.metadata["session_id"] == first.metadata["session_id"] == agent.session_id
    conversation = api.model_requests[1].conversation()
    assert said(conversation, "user", "first question")
    assert ("assistant", "first answer") in conversation
    assert said(conversation[-1:], "user", "second question")


async def test_resume_from_a_new_process_with_resume_flag(
    copilot_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    api.enqueue(Text("remembered"), Text("still here"))
    first = make_agent(copilot_bin, api, sandbox)
    await first.run_turn("remember 42")
    # A new adapter object (as after a restart) resumes the same session.
    later = make_agent(copilot_bin, api, sandbox, session_id=first.session_id, resume=True)
    out = await later.run_turn("what number?")
    assert out.exit_code == 0
    assert out.text == "still here"
    assert said(api.model_requests[1].conversation(), "user", "remember 42")


async def test_allowed_tool_writes_the_file(
    copilot_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    target = sandbox.workspace / "made.txt"
    api.enqueue(ToolCall("create", {"path": str(target), "file_text": "written"}), Text("done"))
    agent = make_agent(copilot_bin, api, sandbox, allowlist=WRITE)
    out = await agent.run_turn("write the file")
    assert out.exit_code == 0
    assert out.text == "done"
    assert target.read_text() == "written"
    assert out.metadata["tool_calls"] == 1


async def test_read_only_allowlist_denies_the_write(
    copilot_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    target = sandbox.workspace / "made.txt"
    api.enqueue(ToolCall("create", {"path": str(target), "file_text": "written"}), Text("done"))
    agent = make_agent(copilot_bin, api, sandbox, allowlist=READ_ONLY)
    seen: list[AgentEvent] = []
    agent.on_event = seen.append
    out = await agent.run_turn("write the file")
    assert out.exit_code == 0
    assert not target.exists()
    [denied] = [event for event in seen if event.kind is EventKind.TOOL_RESULT]
    assert denied.is_error
    assert "Permission denied" in denied.text
    tool_result = api.model_requests[1].conversation()[-1]
    assert tool_result[0] == "tool_result"
    assert "Permission denied" in tool_result[1]


async def test_dangerous_allows_every_tool_as_root(
    copilot_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    target = sandbox.workspace / "ran.txt"
    api.enqueue(
        ToolCall("bash", {"command": f"echo ran > {target}", "description": "write"}),
        Text("ok"),
    )
    agent = make_agent(
        copilot_bin, api, sandbox, allowlist=ToolAllowlist.from_flags([], dangerous=True)
    )
    out = await agent.run_turn("run it")
    assert out.exit_code == 0, out.text
    assert target.read_text().strip() == "ran"


async def test_progress_events_tool_use_then_result_before_final(
    copilot_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    target = sandbox.workspace / "made.txt"
    api.enqueue(
        ToolCall("create", {"path": str(target), "file_text": "x"}, text="writing now"),
        Text("all done"),
    )
    agent = make_agent(copilot_bin, api, sandbox, allowlist=WRITE)
    seen: list[AgentEvent] = []
    stream = EventStream()
    agent.on_event = lambda event: (seen.append(event), stream(event))[-1]
    turn = asyncio.create_task(agent.run_turn("write it"))
    streamed = [event async for event in stream]
    out = await turn
    kinds = [event.kind for event in seen]
    assert streamed == seen
    assert kinds[0] is EventKind.SESSION
    assert kinds[-2:] == [EventKind.RESULT, EventKind.TURN_END]
    use = kinds.index(EventKind.TOOL_USE)
    result = kinds.index(EventKind.TOOL_RESULT)
    assert kinds.index(EventKind.TEXT) < use < result < kinds.index(EventKind.RESULT)
    assert seen[use].tool == "create"
    assert seen[result].tool_id == seen[use].tool_id
    assert not seen[result].is_error
    assert seen[-2].text == out.text == "all done"
    lines = [event.line for event in seen[:-1]]
    assert lines == sorted(lines)
    assert lines[0] >= 1


async def test_model_api_400_is_a_nonzero_exit_not_an_exception(
    copilot_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    api.enqueue(Status(400, "the fake says no"))
    agent = make_agent(copilot_bin, api, sandbox)
    out = await agent.run_turn("hello")
    assert out.exit_code not in (0, None)
    assert out.metadata["is_error"] is True
    assert "the fake says no" in out.text
    # The session survives a failed turn: the next one resumes it.
    api.enqueue(Text("recovered"))
    again = await agent.run_turn("try again")
    assert again.exit_code == 0
    assert again.text == "recovered"


async def test_preempt_while_response_held_kills_cli_and_children(
    copilot_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    hold = Hold()
    # A tool first starts a background command; copilot runs tools in a session of their
    # own, so that child is outside the CLI's process group. Then the fake holds the
    # next response open.
    api.enqueue(ToolCall("bash", {"command": "sleep 300 &", "description": "bg"}), hold)
    agent = make_agent(copilot_bin, api, sandbox, allowlist=SHELL, preempt=PreemptHandle(grace=2.0))
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
    copilot_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    # 1 MB; long runs of one letter keep the CLI's token estimate under its budget.
    prompt = "BEGIN\n" + "".join(f"{i:06d}" + "x" * 993 + "\n" for i in range(1000)) + "END"
    assert len(prompt.encode()) >= 1_000_000
    api.enqueue(Text("got it"))
    out = await make_agent(copilot_bin, api, sandbox).run_turn(prompt)
    assert out.exit_code == 0
    assert out.text == "got it"
    assert said(api.model_requests[0].conversation(), "user", prompt)


async def test_prompt_starting_with_dash_is_not_a_flag(
    copilot_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    api.enqueue(Text("fine"))
    out = await make_agent(copilot_bin, api, sandbox).run_turn("--help --version -p")
    assert out.exit_code == 0
    assert out.text == "fine"
    assert said(api.model_requests[0].conversation(), "user", "--help --version -p")


async def test_unknown_session_on_resume_is_reported_plainly(
    copilot_bin: Path, api: FakeModelAPI, sandbox: Sandbox
) -> None:
    api.enqueue(Text("first"))
    agent = make_agent(copilot_bin, api, sandbox)
    await agent.run_turn("start")
    shutil.rmtree(sandbox.config / "session-state")
    for store in sandbox.config.glob("session-store.db*"):
        store.unlink()
    out = await agent.run_turn("and now?")
    assert out.exit_code not in (0, None)
    assert agent.session_id in out.text
    assert "no longer knows session" in out.text
    assert f"exited with code {out.exit_code}" in out.text
    assert out.metadata["session_missing"] is True
    assert len(api.model_requests) == 1

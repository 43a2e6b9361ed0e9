"""The agent-adapter contract, one suite over the real Claude Code, Copilot and Codex CLIs.

Each case runs against every CLI (``tests/agent_contract.py`` holds what differs between
them) talking to the fake model API: one turn, the session resumed with the first
exchange, an allowed write and a denied one, a model API error as a non-zero exit,
pre-emption while the response is held, and bad input. Cases only one CLI has stay in its
own file (``tests/test_agents_claude.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest

from engine.agents.allowlist import ToolAllowlist
from engine.agents.stream import AgentEvent, EventKind, EventStream
from engine.errors import TurnPreempted
from engine.process import PreemptHandle
from tests.agent_clis import ensure_cli
from tests.agent_contract import PROFILES, READ_ONLY, SHELL, WRITE, Profile, make_agent
from tests.fakes.model_api import FakeModelAPI, Hold, Status, Text
from tests.fakes.realcli import (
    Sandbox,
    cmdline,
    group_alive,
    groups_of,
    marked_processes,
    parent_of,
)

pytestmark = [pytest.mark.realcli, pytest.mark.timeout(300)]


@pytest.fixture(scope="session", params=PROFILES, ids=[p.name for p in PROFILES])
def profile(request: pytest.FixtureRequest) -> Profile:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def binary(profile: Profile) -> Path:
    return ensure_cli(profile.name)


async def test_one_turn_returns_the_scripted_reply(
    profile: Profile, binary: Path, model_api: FakeModelAPI, sandbox: Sandbox
) -> None:
    model_api.enqueue(Text("hello from the fake model"))
    agent = make_agent(profile, binary, model_api, sandbox)
    provisional = agent.session_id
    out = await agent.run_turn("say hello")
    assert out.exit_code == 0
    assert out.text == "hello from the fake model"
    assert out.metadata["session_id"] == agent.session_id
    if profile.mints_session:
        assert out.metadata["session_id"] != provisional
    assert out.metadata["is_error"] is False
    assert out.metadata["num_turns"] == 1
    assert isinstance(out.metadata["usage"], dict)
    if profile.output_tokens is not None:
        assert out.metadata["usage"]["output_tokens"] == profile.output_tokens
    if profile.reports_cost:
        assert isinstance(out.metadata["cost_usd"], float)
    [request] = model_api.model_requests
    assert profile.said(request.conversation(), "user", "say hello")


async def test_second_turn_resumes_the_session(
    profile: Profile, binary: Path, model_api: FakeModelAPI, sandbox: Sandbox
) -> None:
    model_api.enqueue(Text("first answer"), Text("second answer"))
    agent = make_agent(profile, binary, model_api, sandbox)
    first = await agent.run_turn("first question")
    second = await agent.run_turn("second question")
    assert (first.text, second.text) == ("first answer", "second answer")
    assert second.metadata["session_id"] == first.metadata["session_id"] == agent.session_id
    conversation = model_api.model_requests[1].conversation()
    assert profile.said(conversation, "user", "first question")
    assert ("assistant", "first answer") in conversation
    assert profile.said(conversation[-1:], "user", "second question")


async def test_resume_from_a_new_process_with_resume_flag(
    profile: Profile, binary: Path, model_api: FakeModelAPI, sandbox: Sandbox
) -> None:
    model_api.enqueue(Text("remembered"), Text("still here"))
    first = make_agent(profile, binary, model_api, sandbox)
    await first.run_turn("remember 42")
    # A new adapter object (as after a restart) resumes the same session.
    later = make_agent(
        profile, binary, model_api, sandbox, session_id=first.session_id, resume=True
    )
    out = await later.run_turn("what number?")
    assert out.exit_code == 0
    assert out.text == "still here"
    assert profile.said(model_api.model_requests[1].conversation(), "user", "remember 42")


async def test_allowed_tool_writes_the_file(
    profile: Profile, binary: Path, model_api: FakeModelAPI, sandbox: Sandbox
) -> None:
    target = sandbox.workspace / "made.txt"
    model_api.enqueue(profile.write(target, "written"), Text("done"))
    agent = make_agent(profile, binary, model_api, sandbox, allowlist=WRITE)
    out = await agent.run_turn("write the file")
    assert out.exit_code == 0
    assert out.text == "done"
    assert target.read_text() == "written"
    for key, value in profile.clean_write.items():
        assert out.metadata[key] == value, key


async def test_read_only_allowlist_denies_the_write(
    profile: Profile, binary: Path, model_api: FakeModelAPI, sandbox: Sandbox
) -> None:
    target = sandbox.workspace / "made.txt"
    model_api.enqueue(profile.write(target, "written"), Text("done"))
    agent = make_agent(profile, binary, model_api, sandbox, allowlist=READ_ONLY)
    seen: list[AgentEvent] = []
    agent.on_event = seen.append
    out = await agent.run_turn("write the file")
    assert out.exit_code == 0
    assert not target.exists()
    if profile.denial_metadata_tool is not None:
        denials = out.metadata["permission_denials"]
        assert isinstance(denials, list)
        assert denials[0]["tool_name"] == profile.denial_metadata_tool
    if profile.denial_event:
        [denied] = [event for event in seen if event.kind is EventKind.TOOL_RESULT]
        assert denied.is_error
        assert profile.denial in denied.text
    tool_result = model_api.model_requests[1].conversation()[-1]
    assert tool_result[0] == "tool_result"
    assert profile.denial in tool_result[1]


async def test_dangerous_allows_every_tool_as_root(
    profile: Profile, binary: Path, model_api: FakeModelAPI, sandbox: Sandbox
) -> None:
    target = sandbox.workspace / "ran.txt"
    model_api.enqueue(profile.shell(f"echo ran > {target}"), Text("ok"))
    agent = make_agent(
        profile,
        binary,
        model_api,
        sandbox,
        allowlist=ToolAllowlist.from_flags([], dangerous=True),
    )
    out = await agent.run_turn("run it")
    assert out.exit_code == 0, out.text
    assert target.read_text().strip() == "ran"


async def test_progress_events_tool_use_then_result_before_final(
    profile: Profile, binary: Path, model_api: FakeModelAPI, sandbox: Sandbox
) -> None:
    target = sandbox.workspace / "made.txt"
    # Held back where the CLI streams while it waits: the events arrive mid-turn.
    final = Hold(text="all done") if profile.hold_final else None
    model_api.enqueue(
        dataclasses.replace(profile.write(target, "x"), text="writing now"),
        final if final is not None else Text("all done"),
    )
    agent = make_agent(profile, binary, model_api, sandbox, allowlist=WRITE)
    seen: list[AgentEvent] = []
    stream = EventStream()
    agent.on_event = lambda event: (seen.append(event), stream(event))[-1]
    turn = asyncio.create_task(agent.run_turn("write it"))
    streamed: list[AgentEvent] = []
    async for event in stream:
        streamed.append(event)
        if final is not None and event.kind is EventKind.TOOL_RESULT:
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
    assert seen[use].tool == profile.tool_name
    assert seen[result].tool_id == seen[use].tool_id
    assert not seen[result].is_error
    assert seen[-2].text == out.text == "all done"
    lines = [event.line for event in seen[:-1]]
    assert lines == sorted(lines)
    assert lines[0] >= 1


async def test_model_api_400_is_a_nonzero_exit_not_an_exception(
    profile: Profile, binary: Path, model_api: FakeModelAPI, sandbox: Sandbox
) -> None:
    model_api.enqueue(Status(400, "the fake says no"))
    agent = make_agent(profile, binary, model_api, sandbox)
    out = await agent.run_turn("hello")
    assert out.exit_code not in (0, None)
    assert out.metadata["is_error"] is True
    if profile.reports_api_status:
        assert out.metadata["api_error_status"] == 400
    assert "the fake says no" in out.text
    # The session survives a failed turn: the next one resumes it.
    model_api.enqueue(Text("recovered"))
    again = await agent.run_turn("try again")
    assert again.exit_code == 0
    assert again.text == "recovered"


async def test_preempt_while_response_held_kills_cli_and_children(
    profile: Profile, binary: Path, model_api: FakeModelAPI, sandbox: Sandbox
) -> None:
    hold = Hold()
    # Where the CLI runs tools in a session of their own, a tool first starts a background
    # command outside the CLI's process group; then the fake holds the next response open.
    if profile.background is not None:
        model_api.enqueue(profile.background, hold)
        allowlist = SHELL
    else:
        model_api.enqueue(hold)
        allowlist = READ_ONLY
    agent = make_agent(
        profile, binary, model_api, sandbox, allowlist=allowlist, preempt=PreemptHandle(grace=2.0)
    )
    turn = asyncio.create_task(agent.run_turn("take your time"))
    await asyncio.wait_for(hold.arrived.wait(), 120)
    pids = marked_processes(sandbox.marker)
    assert pids, "the CLI should be running while the response is held"
    group_of = groups_of(pids)
    if profile.background is not None:
        [cli] = [pid for pid in pids if parent_of(pid) == os.getpid()]
        outside = [pid for pid, group in group_of.items() if group != group_of[cli]]
        assert outside, [cmdline(pid) for pid in pids]
    groups = set(group_of.values())
    assert await agent.preempt.stop()
    with pytest.raises(TurnPreempted):
        await turn
    assert marked_processes(sandbox.marker) == []
    assert not any(group_alive(group) for group in groups)
    # The stopped turn's session is still there: the next turn resumes it.
    model_api.enqueue(Text("after the stop"))
    again = await agent.run_turn("still there?")
    assert again.exit_code == 0
    assert again.text == "after the stop"
    assert again.metadata["session_id"] == agent.session_id


# -- bad input --------------------------------------------------------------------------


async def test_one_megabyte_prompt_reaches_the_model_whole(
    profile: Profile, binary: Path, model_api: FakeModelAPI, sandbox: Sandbox
) -> None:
    # 1 MB; long runs of one letter keep the CLI's token estimate under its budget.
    prompt = "BEGIN\n" + "".join(f"{i:06d}" + "x" * 993 + "\n" for i in range(1000)) + "END"
    assert len(prompt.encode()) >= 1_000_000
    model_api.enqueue(Text("got it"))
    out = await make_agent(profile, binary, model_api, sandbox).run_turn(prompt)
    assert out.exit_code == 0
    assert out.text == "got it"
    assert profile.said(model_api.model_requests[0].conversation(), "user", prompt)


async def test_prompt_starting_with_dash_is_not_a_flag(
    profile: Profile, binary: Path, model_api: FakeModelAPI, sandbox: Sandbox
) -> None:
    model_api.enqueue(Text("fine"))
    out = await make_agent(profile, binary, model_api, sandbox).run_turn("--help --version -p")
    assert out.exit_code == 0
    assert out.text == "fine"
    assert profile.said(model_api.model_requests[0].conversation(), "user", "--help --version -p")


async def test_unknown_session_on_resume_is_reported_plainly(
    profile: Profile, binary: Path, model_api: FakeModelAPI, sandbox: Sandbox
) -> None:
    model_api.enqueue(Text("first"))
    agent = make_agent(profile, binary, model_api, sandbox)
    await agent.run_turn("start")
    profile.forget(sandbox.config)
    out = await agent.run_turn("and now?")
    assert out.exit_code not in (0, None)
    assert agent.session_id in out.text
    assert "no longer knows session" in out.text
    assert f"exited with code {out.exit_code}" in out.text
    assert out.metadata["session_missing"] is True
    assert len(model_api.model_requests) == 1

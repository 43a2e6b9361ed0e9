"""Cases only the Claude Code adapter has, against the real ``claude`` CLI and the fake
model API. Everything the adapters share is in ``tests/test_agents_contract.py``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import pytest

from engine.agents.claude import ClaudeAgent
from engine.agents.stream import AgentEvent, EventKind, JsonStreamAgent
from engine.errors import TurnPreempted
from engine.process import PreemptHandle
from tests import agent_contract
from tests.agent_clis import ensure_cli
from tests.fakes.model_api import FakeModelAPI, Hold, Text
from tests.fakes.realcli import Sandbox, marked_processes, parent_of

pytestmark = [pytest.mark.realcli, pytest.mark.timeout(300)]

[CLAUDE] = [p for p in agent_contract.PROFILES if p.name == "claude"]


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    return ensure_cli("claude")


@pytest.fixture
def api(model_api: FakeModelAPI) -> FakeModelAPI:
    return model_api


def make_agent(
    claude_bin: Path,
    api: FakeModelAPI,
    sandbox: Sandbox,
    *,
    session_id: str | None = None,
    resume: bool = False,
    preempt: PreemptHandle | None = None,
) -> ClaudeAgent:
    agent = agent_contract.make_agent(
        CLAUDE, claude_bin, api, sandbox, session_id=session_id, resume=resume, preempt=preempt
    )
    assert isinstance(agent, ClaudeAgent)
    return agent


# -- a first turn cut off: the next turn's flag comes from the CLI's own store -----------


def request_session(api: FakeModelAPI, index: int = -1) -> str | None:
    """The session id the CLI sent with a model request."""
    return api.model_requests[index].headers.get("X-Claude-Code-Session-Id")


def kill_on_session_event(agent: JsonStreamAgent, sandbox: Sandbox) -> None:
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

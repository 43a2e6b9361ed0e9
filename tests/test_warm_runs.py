"""Warm sessions in runs: ``turnstile runs`` says a session is warm, and an auto run or an
autopilot drive closes its resident agent process when it ends (not at idle eviction)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import AgentOptions
from engine.agents.warm import WarmPool, WarmPreemptHandle
from engine.agents.warm_codex import WarmCodexAgent
from engine.automode import start_auto_run
from engine.commands import runs as runs_command
from engine.gates import DriveOutcome
from engine.gates.tasks import TaskRecord
from engine.runs import AgentEnv, RunSpec
from engine.settings import Settings
from engine.store.database import Database
from engine.store.runs import TurnState
from tests.agent_clis import ensure_cli
from tests.automode_support import GIT_ENV, git_workspace
from tests.fakes.model_api import FakeModelAPI, Hold, Text
from tests.fakes.realcli import Sandbox, marked_processes
from tests.gates_support import EventSink, make_settings, open_gates
from tests.support import make_settings as plain_settings
from tests.test_agents_warm_codex import PINNED_SUPPORT, stub_app_server

pytestmark = [pytest.mark.realcli, pytest.mark.timeout(300)]


@pytest.fixture(scope="session")
def codex_bin() -> Path:
    return ensure_cli("codex")


async def listed(settings: Settings, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    """``turnstile runs --json``'s line for the only run."""
    capsys.readouterr()
    args = argparse.Namespace(run=None, status=None, mode=None, limit=20, json=True)
    assert await runs_command.handle(args, settings) == 0
    [line] = capsys.readouterr().out.splitlines()
    value = json.loads(line)
    assert isinstance(value, dict)
    return value


async def test_an_auto_run_is_warm_while_it_runs_and_its_process_goes_with_it(
    codex_bin: Path,
    model_api: FakeModelAPI,
    isolated_env: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    api = model_api
    sandbox = Sandbox(isolated_env / "sandbox")
    workspace = git_workspace(sandbox.workspace)
    plan = Hold(text="1. nothing to do")
    api.enqueue(Text("Goal: nothing."), plan)
    settings = plain_settings(isolated_env, codex_bin=str(codex_bin), warm_sessions=("codex",))
    async with Database(settings.database) as db:
        spec = RunSpec(
            objective="do nothing",
            agent="codex",
            workdir=workspace,
            env=AgentEnv(
                extra_env=sandbox.env({**api.codex_env(sandbox.config), **GIT_ENV}),
                config_dir=sandbox.config,
            ),
            max_turns=3,
        )
        run = await start_auto_run(settings, db, spec)
        agent = getattr(run.runner, "agent", None)
        assert isinstance(agent, WarmCodexAgent)
        # The Plan turn is in flight: the Clarify turn's process is still there.
        await asyncio.wait_for(plan.arrived.wait(), 120)
        row = await listed(settings, capsys)
        assert row["status"] == "running"
        assert row["warm"] is True
        plan.release.set()
        await run.task
        turns = await run.channel._store.turns(run.run_id)
    assert len(turns) >= 2
    assert all(t.state is TurnState.FINISHED for t in turns)
    assert agent.spawns == 1
    # Every turn ran on the one resident process, and it is gone with the run.
    assert {t.proc_pgid for t in turns} == {turns[0].proc_pgid}
    assert not agent.resident
    assert marked_processes(sandbox.marker) == []
    row = await listed(settings, capsys)
    assert row["warm"] is False


async def test_an_autopilot_drive_closes_its_warm_process_when_it_ends(
    tmp_path: Path,
) -> None:
    sandbox = Sandbox(tmp_path / "sandbox")
    cli = stub_app_server(tmp_path, exit_on_turn=0)
    pool = WarmPool(max_sessions=4)
    made: list[WarmCodexAgent] = []

    def factory(task: TaskRecord, session_id: str, resume: bool) -> WarmCodexAgent:
        agent = WarmCodexAgent(
            AgentOptions(
                binary=str(cli),
                cwd=task.workdir,
                extra_env=sandbox.env({}),
                allowlist=ToolAllowlist.read_only_default(),
            ),
            session_id=session_id,
            resume=resume,
            pool=pool,
            preempt=WarmPreemptHandle(),
            support=PINNED_SUPPORT,
        )
        made.append(agent)
        return agent

    sink = EventSink()
    async with pool, open_gates(make_settings(tmp_path), poll_interval=0.02) as gates:
        await gates.init_task("w")
        handle = gates.start_autopilot("w", sink, agent_factory=factory)
        # The stub never writes the research artifact: the drive ends needing a person.
        outcome = await asyncio.wait_for(handle.wait(), 120)
        assert outcome is DriveOutcome.HUMAN_INTERVENTION
        [agent] = made
        assert agent.spawns == 1
        assert agent.turns_started >= 1
        assert not agent.resident
        assert len(pool) == 0
        assert marked_processes(sandbox.marker) == []

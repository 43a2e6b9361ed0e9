"""One auto run with the real Claude Code CLI against the fake model API: the scripted
model writes and commits a file, reports COMPLETE, and the verifier accepts it — its turns
recorded in a SQLite file and in a fresh PostgreSQL database in turn (``db_target``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.automode import AutoStatus, prepare_resume, start_auto_run
from engine.errors import ConfigError
from engine.runs import AgentEnv, RunSpec
from engine.settings import load_settings
from engine.spend import Budget, Spend
from engine.store.backend import open_database
from engine.store.runs import SqliteRunStore, TurnState
from tests.agent_clis import ensure_cli
from tests.automode_support import GIT_ENV, git_workspace
from tests.db_support import Target
from tests.fakes.model_api import FakeModelAPI, Text, ToolCall
from tests.fakes.realcli import Sandbox
from tests.gates_support import EventSink

pytestmark = [pytest.mark.realcli, pytest.mark.timeout(300)]


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    return ensure_cli("claude")


async def test_auto_run_with_claude_code_commits_and_is_verified(
    claude_bin: Path, model_api: FakeModelAPI, isolated_env: Path, db_target: Target
) -> None:
    api = model_api
    sandbox = Sandbox(isolated_env / "sandbox")
    workspace = git_workspace(sandbox.workspace)
    target = workspace / "hello.txt"
    api.enqueue(
        Text("Goal: hello.txt holds 'hello' and is committed."),  # Clarify
        Text("1. write hello.txt\n2. commit it"),  # Plan
        ToolCall("Write", {"file_path": str(target), "content": "hello\n"}),  # Execute
        ToolCall(
            "Bash",
            {"command": "git add hello.txt && git commit -q -m 'add hello'", "description": "c"},
        ),
        Text("Wrote and committed hello.txt."),
        Text("hello.txt is committed and the tree is clean.\nAUTO-MODE STATUS: COMPLETE"),
    )
    settings = load_settings(
        database=db_target,
        runs_dir=isolated_env / "runs",
        claude_bin=str(claude_bin),
        allowed_tools=("view", "create", "bash"),
    )
    async with open_database(settings) as db:
        spec = RunSpec(
            objective="create hello.txt containing hello and commit it",
            agent="claude",
            workdir=workspace,
            max_turns=4,
            env=AgentEnv(
                extra_env=sandbox.env({**api.claude_env(sandbox.config), **GIT_ENV}),
                config_dir=sandbox.config,
            ),
        )
        run = await start_auto_run(settings, db, spec)
        result = await run.task
        turns = await SqliteRunStore(db).turns(run.run_id)
    assert result.status is AutoStatus.COMPLETED, result.report
    assert result.exit_code == 0
    assert target.read_text() == "hello\n"
    assert [t.phase for t in turns] == ["clarify", "plan", "execute", "evaluate"]
    assert all(t.state is TurnState.FINISHED for t in turns)
    assert turns[2].output == "Wrote and committed hello.txt."
    assert result.report is not None
    assert "commits: yes (1 since the run started)" in result.report
    assert "clean tree: yes (clean)" in result.report
    # What each turn cost, as Claude Code reported it: kept with the turn, summed in the
    # report (the fake model's usage; Claude Code prices it itself).
    assert all(t.spend.cost_usd is not None and t.spend.cost_usd > 0 for t in turns)
    assert all(t.spend.output is not None and t.spend.output > 0 for t in turns)
    total = sum((t.spend for t in turns), Spend())
    assert total.unknown == 0
    assert total.line() in result.report
    assert f"Spend: {total.cost_text()} · " in result.report
    # One session, resumed: each later request carries the earlier conversation.
    requests = api.model_requests
    assert len(requests) == 6
    # The prompt reached the model verbatim: the recorded Clarify prompt is the user turn.
    assert ("user", turns[0].prompt) in requests[0].conversation()
    last = requests[-1].conversation()
    assert ("assistant", "Goal: hello.txt holds 'hello' and is committed.") in last
    assert api.unscripted == 0


async def test_a_run_stops_after_the_turn_that_spends_its_budget(
    claude_bin: Path, model_api: FakeModelAPI, isolated_env: Path, db_target: Target
) -> None:
    api = model_api
    sandbox = Sandbox(isolated_env / "sandbox")
    workspace = git_workspace(sandbox.workspace)
    api.enqueue(
        Text("Goal: count to three."),  # Clarify
        Text("1. count"),  # Plan
        Text("one"),  # Execute
        Text("two"),  # (never asked: the budget stops the run first)
    )
    settings = load_settings(
        database=db_target, runs_dir=isolated_env / "runs", claude_bin=str(claude_bin)
    )
    sink = EventSink()
    async with open_database(settings) as db:
        spec = RunSpec(
            objective="count to three",
            agent="claude",
            workdir=workspace,
            max_turns=6,
            env=AgentEnv(extra_env=sandbox.env(api.claude_env(sandbox.config))),
            # Each turn costs about $0.0002 on the fake model's usage: two turns reach 80 %,
            # the third spends it.
            budget=Budget(usd=0.00058),
        )
        run = await start_auto_run(settings, db, spec, sink=sink)
        result = await run.task
        turns = await SqliteRunStore(db).turns(run.run_id)
        record = await SqliteRunStore(db).get_run(run.run_id)
        # It goes on only under a larger budget; then one more turn spends that one too.
        with pytest.raises(ConfigError, match=r"stopped by its budget of \$0.0006: resume it"):
            await prepare_resume(settings, db, run.run_id)
        with pytest.raises(ConfigError, match="with a larger --budget"):
            await prepare_resume(settings, db, run.run_id, budget=Budget(usd=0.0005))
        again = await prepare_resume(
            settings, db, run.run_id, env=spec.env, budget=Budget(usd=0.0008)
        )
        resumed = await again.start()
        more = await SqliteRunStore(db).turns(run.run_id)
    assert resumed.status is AutoStatus.STOPPED
    assert len(more) == len(turns) + 1
    assert resumed.report is not None
    assert "Stopped by its budget: $0.0009 of $0.0008 spent" in resumed.report
    spent = sum((t.spend for t in turns), Spend())
    assert result.status is AutoStatus.STOPPED, result.report
    assert record.status.value == "stopped"
    # Stopped after the turn that reached it, never in one: every turn finished.
    assert all(t.state is TurnState.FINISHED for t in turns)
    assert spent.cost_usd is not None
    assert spent.cost_usd >= 0.00058
    before_last = sum((t.spend for t in turns[:-1]), Spend())
    assert before_last.cost_usd is not None
    assert before_last.cost_usd < 0.00058
    assert result.report is not None
    assert f"Stopped by its budget: {spent.cost_text()} of $0.0006 spent" in result.report
    # Told once, at 80 %, before it stopped.
    told = [t for t in sink.texts if "💰" in t]
    assert len(told) == 1
    assert "of its budget ($0.0006)" in told[0]
    assert len(api.model_requests) == len(more)  # no turn was started past a budget

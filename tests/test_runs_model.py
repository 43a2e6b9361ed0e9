"""One run model: every mode mints ids the same way and is listed by ``turnstile runs``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.runs import RUN_ID_PATTERN, AgentEnv, ChatPlace, RunMode, RunSpec, new_run_id
from engine.store.database import Database
from engine.store.runs import SqliteRunStore
from engine.workspace import SqliteWorkspaceStore
from tests.automode_support import CLARIFY, EVALUATE, EXECUTE, GIT_ENV, PLAN
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot, write_script
from tests.gates_support import agent_env, cli_env, make_settings, phase_rules, run_cli
from tests.gates_support import write_script as write_gate_script
from tests.test_workspace_git import git, make_remote

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(120)]


@pytest.mark.parametrize("mode", list(RunMode))
def test_every_mode_mints_ids_in_one_format(mode: RunMode) -> None:
    ids = {new_run_id(mode) for _ in range(50)}
    assert len(ids) == 50
    for run_id in ids:
        assert RUN_ID_PATTERN.match(run_id), run_id
        assert run_id.startswith(f"{mode.value}-")
        # a folder name, a branch part and a button's data all take it
        assert len(run_id.encode()) <= 40
        assert "/" not in run_id
        assert ":" not in run_id


def test_no_front_end_mints_run_ids() -> None:
    # Ids come from the run supervisor (open_run, or reserve when a worktree is named first).
    root = Path(__file__).resolve().parent.parent
    fronts = [*(root / "bot").rglob("*.py"), *(root / "engine" / "commands").rglob("*.py")]
    assert fronts
    minting = [str(p.relative_to(root)) for p in fronts if "new_run_id" in p.read_text()]
    assert minting == []


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="walk"):
        new_run_id("walk")


def test_a_run_spec_crosses_a_process_boundary_as_json(tmp_path: Path) -> None:
    spec = RunSpec(
        objective="add retries",
        agent="command",
        workdir=tmp_path,
        run_id=new_run_id(RunMode.AUTO),
        project="api",
        chat=ChatPlace("-100", "7"),
        max_turns=4,
        agent_cmd="agent {prompt}",
        passthrough=("--fast",),
        verify_cmd="pytest -q",
        prompts_dir=tmp_path / "prompts",
        env=AgentEnv(extra_env={"HOME": str(tmp_path)}, config_dir=tmp_path / "cfg"),
    )
    wire = json.dumps(spec.to_json())
    assert RunSpec.from_json(json.loads(wire)) == spec
    # frozen: a spec handed to a queue cannot change under it
    with pytest.raises(AttributeError):
        spec.objective = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.env.extra_env["X"] = "1"  # type: ignore[index]


def test_a_place_is_text_and_a_spec_queued_with_numbers_still_reads(tmp_path: Path) -> None:
    # Another messenger's ids are kept as given; a spec queued before ids were text (numbers,
    # a binding's topic 0 for "no topic") reads back as the same place in text.
    spec = RunSpec(objective="o", agent="command", workdir=tmp_path, chat=ChatPlace("room-a"))
    assert RunSpec.from_json(json.loads(json.dumps(spec.to_json()))).chat == ChatPlace("room-a")
    old = {"objective": "o", "agent": "command", "workdir": str(tmp_path)}
    chat = RunSpec.from_json({**old, "chat": {"chat_id": -100, "thread_id": 7}}).chat
    assert chat == ChatPlace("-100", "7")
    chat = RunSpec.from_json({**old, "chat": {"chat_id": -100, "thread_id": 0}}).chat
    assert chat == ChatPlace("-100", None)
    assert ChatPlace("room-a", "") == ChatPlace("room-a")
    with pytest.raises(ConfigError, match="as text"):
        ChatPlace(-100)  # type: ignore[arg-type]


def test_a_spec_missing_its_objective_is_refused() -> None:
    with pytest.raises(ConfigError, match="not a run spec"):
        RunSpec.from_json({"agent": "claude", "workdir": "/tmp"})


@pytest.fixture
def git_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.mark.usefixtures("git_env")
async def test_auto_from_the_chat_works_on_the_branch_named_after_its_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = make_remote(tmp_path)
    write_script(
        tmp_path,
        {
            "rules": [
                {"match": CLARIFY, "text": "Goal: result.txt committed."},
                {"match": PLAN, "text": "1. write result.txt"},
                {
                    "match": EXECUTE,
                    "text": "committed",
                    "files": {"result.txt": "done\n"},
                    "run": [
                        ["git", "add", "result.txt"],
                        ["git", "commit", "-q", "-m", "add result"],
                    ],
                },
                {"match": EVALUATE, "text": "ok\nAUTO-MODE STATUS: COMPLETE\n"},
            ]
        },
        monkeypatch,
    )
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, projects=f"demo={remote}#main")
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat demo")
            await api.wait_for_message(lambda m: "demo" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto write result.txt")
            started = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run"))
            run_id = started.text.split()[3]
            await api.wait_for_message(lambda m: "Objective achieved" in m.text, timeout=60)
            record = await rt.runs.get_run(run_id)
            workspace = await SqliteWorkspaceStore(rt.db).get(run_id)
    assert RUN_ID_PATTERN.match(run_id)
    assert workspace is not None
    assert workspace.branch == f"turnstile/{run_id}"
    assert record.workdir == str(workspace.path)
    assert git("symbolic-ref", "--short", "HEAD", cwd=workspace.path) == f"turnstile/{run_id}"

    rc, out, err = await run_cli("runs", "--json", env=cli_env(settings))
    assert rc == 0, err
    rows = {r["id"]: r for r in map(json.loads, out.splitlines())}
    assert rows[run_id]["mode"] == "auto"
    assert rows[run_id]["branch"] == f"turnstile/{run_id}"
    assert rows[run_id]["project"] == "demo"
    assert rows[run_id]["chat"] == {"id": str(CHAT), "topic": None}  # a place id: text
    for key in ("id", "mode", "status", "agent", "project", "branch", "chat"):
        assert key in rows[run_id]


async def test_autopilot_drives_from_the_terminal_and_the_chat_are_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # From the chat: /autopilot T1, parked at its first gate.
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path)
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T1 build it")
            await api.wait_for_message(lambda m: m.text.startswith("🛂 Gate:"), timeout=60)

    # From the terminal, on the same database: a drive of T2 that parks at its gate.
    script = write_gate_script(tmp_path, {"rules": phase_rules()}, name="terminal.json")
    env = cli_env(make_settings(tmp_path, database=settings.database), agent_env(tmp_path, script))
    args = ("autopilot", "--task", "T2", "--init", "--tool", "command", "--no-wait")
    rc, out, err = await run_cli(*args, env=env)
    assert rc == 3, (out, err)  # parked at the research gate

    rc, out, err = await run_cli("runs", "--mode", "autopilot", "--json", env=env)
    assert rc == 0, err
    rows = {r["task"]: r for r in map(json.loads, out.splitlines())}
    assert set(rows) == {"T1", "T2"}
    for row in rows.values():
        assert RUN_ID_PATTERN.match(row["id"]), row
        assert row["mode"] == "autopilot"
        assert row["agent"] == "command"
        assert row["status"] == "parked"
        assert row["phase"] == "research"
        assert row["turn"] == 1
    assert rows["T1"]["chat"] == {"id": str(CHAT), "topic": None}
    assert rows["T2"]["chat"] is None

    rc, text, err = await run_cli("runs", "--mode", "autopilot", env=env)
    assert rc == 0, err
    assert rows["T1"]["id"] in text
    assert rows["T2"]["id"] in text
    assert "no runs" not in text

    # The drive's turn is recorded with the run, under the phase it ran.
    async with Database(settings.database) as db:
        turns = await SqliteRunStore(db).turns(rows["T2"]["id"])
    assert [(t.seq, t.phase, t.state.value) for t in turns] == [(1, "research", "finished")]


async def test_a_resumed_drive_continues_its_parked_run(tmp_path: Path) -> None:
    script = write_gate_script(tmp_path, {"rules": phase_rules()})
    settings = make_settings(tmp_path)
    env = cli_env(settings, agent_env(tmp_path, script))
    args = ("autopilot", "--task", "k", "--init", "--tool", "command", "--no-wait")
    assert (await run_cli(*args, env=env))[0] == 3
    # approve the research gate, then drive again: the same run goes on
    rc, out, err = await run_cli(
        "status", "--task", "k", "--approve", "--by", str(settings.approvers[0]), env=env
    )
    assert rc == 0, (out, err)
    assert (await run_cli("autopilot", "--task", "k", "--tool", "command", "--no-wait", env=env))[
        0
    ] == 3
    rc, out, err = await run_cli("runs", "--mode", "autopilot", "--json", env=env)
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 1, rows
    assert rows[0]["phase"] == "decomposition"
    assert rows[0]["turn"] == 2

"""``turnstile auto`` and ``turnstile runs`` as real subprocesses: end to end, exit codes,
bad input, steering with --append, Ctrl-C, and crash recovery with --resume after SIGKILL.

What the store carries (runs crashed, steered, stopped, killed and resumed, listed, raced
for) runs on a SQLite file and on a fresh PostgreSQL database in turn (``db_target``,
tests/pg_support.py); the plain end to end run (its listing is also checked after the
SIGKILL), bad input and warnings that never reach the store run on SQLite only."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import db_support
from tests.automode_support import (
    AGENT_CMD,
    EVALUATE,
    EXECUTE,
    REPO,
    agent_log,
    cli_env,
    commit_step,
    evaluation,
    git_workspace,
    happy_rules,
    report_head,
    turnstile,
    write_script,
)
from tests.db_support import Target
from tests.fakes.realcli import alive

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    return git_workspace(tmp_path / "ws")


def logged(args: tuple[str, ...]) -> list[str]:
    """``auto`` with its log records on stderr: these tests read the run's log lines."""
    return ["--log-level", "INFO", *args] if args and args[0] == "auto" else list(args)


def run_cli(
    tmp: Path, env: dict[str, str], *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        turnstile(*logged(args)),
        cwd=tmp,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=90,
    )


def auto_args(ws: Path, *extra: str) -> list[str]:
    return ["auto", "--tool", "command", "--agent-cmd", AGENT_CMD, "--workdir", str(ws), *extra]


def on(target: Target, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the run's database at ``target``."""
    return {**env, "TURNSTILE_DATABASE": db_support.setting(target)}


def turns_of(target: Target, run_id: str) -> list[tuple[int, int, str, str]]:
    found = db_support.rows(
        target,
        "SELECT seq, attempt, phase, state FROM turns WHERE run_id = ? ORDER BY seq, attempt",
        run_id,
    )
    return [(int(a), int(b), str(c), str(d)) for a, b, c, d in found]


def run_row(target: Target, run_id: str) -> dict[str, Any]:
    found = db_support.row(target, "SELECT * FROM runs WHERE id = ?", run_id)
    assert found is not None, run_id
    return found


class Cli:
    """A ``turnstile`` subprocess whose stderr log is read line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    @classmethod
    async def start(cls, tmp: Path, env: dict[str, str], *args: str) -> Cli:
        proc = await asyncio.create_subprocess_exec(
            *turnstile(*logged(args)),
            cwd=tmp,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def wait_for(self, text: str) -> str:
        assert self.proc.stderr is not None
        while True:
            raw = await self.proc.stderr.readline()
            if not raw:
                raise AssertionError(f"{text!r} never logged:\n" + "".join(self.lines))
            line = raw.decode()
            self.lines.append(line)
            if text in line:
                return line

    async def finish(self) -> tuple[int, str, str]:
        out, err = await self.proc.communicate()
        return self.proc.returncode or 0, out.decode(), "".join(self.lines) + err.decode()


def run_id_from(line: str) -> str:
    return line.split("Auto run ", 1)[1].split()[0]


def test_end_to_end_through_the_cli(tmp_path: Path, ws: Path) -> None:
    script = write_script(tmp_path / "fake", rules=happy_rules())
    env = cli_env(tmp_path, script, log=tmp_path / "agent.log")
    done = run_cli(tmp_path, env, *auto_args(ws, "-p", "create result.txt"))
    assert done.returncode == 0, done.stderr
    run_id, status = report_head(done.stdout)
    assert status == "completed"
    for line in (
        "Turn 1, round 1/10: Clarifying objective",
        "Turn 2, round 2/10: Creating plan",
        "Turn 3, round 3/10: Executing",
        "Turn 4, round 3/10: Evaluating",
        "Evaluate exit code: 0 (stdout",
        "Completion score: 1.00 (threshold 0.80)",
        "Objective achieved",
    ):
        assert line in done.stderr
    assert (ws / "result.txt").read_text() == "done\n"
    listed = run_cli(tmp_path, env, "runs")
    assert listed.returncode == 0
    row = next(line for line in listed.stdout.splitlines() if line.startswith(run_id))
    assert row.split()[:9] == [
        run_id, "auto", "command", "completed", "evaluate", "4", "·", "round", "3/10"
    ]  # fmt: skip
    as_json = json.loads(run_cli(tmp_path, env, "runs", "--json").stdout.splitlines()[0])
    assert as_json["id"] == run_id
    assert as_json["status"] == "completed"
    assert Path(as_json["log_dir"], "transcript.md").exists()


def test_prompt_and_passthrough_after_double_dash(tmp_path: Path, ws: Path) -> None:
    script = write_script(tmp_path / "fake", rules=happy_rules())
    env = cli_env(tmp_path, script, log=tmp_path / "agent.log")
    done = run_cli(tmp_path, env, *auto_args(ws, "--max-turns", "2", "--", "-p", "goal", "xtra"))
    assert done.returncode == 0, done.stderr
    run_id = report_head(done.stdout)[0]
    state = json.loads(run_row(tmp_path / "turnstile.db", run_id)["state_json"])
    assert state["objective"] == "goal"
    assert state["config"]["passthrough"] == ["xtra"]
    assert "Reached the round limit without verified completion" in done.stderr
    turns = turns_of(tmp_path / "turnstile.db", run_id)
    assert [(s, p) for s, _, p, _ in turns] == [(1, "clarify"), (2, "plan")]


@pytest.mark.parametrize(
    ("failing", "code", "status", "crashed", "db_target"),
    [
        (EVALUATE, 5, "error", False, "sqlite"),
        (": clarify the objective\n", 3, "crashed", True, "sqlite"),
        (": clarify the objective\n", 3, "crashed", True, "postgresql"),
    ],
    indirect=["db_target"],
)
def test_exit_codes_follow_the_contract(
    tmp_path: Path,
    ws: Path,
    failing: str,
    code: int,
    status: str,
    crashed: bool,
    db_target: Target,
) -> None:
    rules = [{"match": failing, "text": "boom", "exit": code}, *happy_rules()]
    script = write_script(tmp_path / "fake", rules=rules)
    done = run_cli(tmp_path, on(db_target, cli_env(tmp_path, script)), *auto_args(ws, "-p", "x"))
    assert done.returncode == code
    run_id = report_head(done.stdout)[0]
    row = run_row(db_target, run_id)
    assert row["status"] == status
    assert row["exit_code"] == code
    assert (row["abort_reason"] is not None) is crashed
    assert ("run aborted" in done.stderr) is crashed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-rounds", "0", "-p", "x"], "--max-rounds must be at least 1"),
        (["--max-turns", "-3", "-p", "x"], "--max-rounds must be at least 1"),
        (["--workdir", "/no/such/dir", "-p", "x"], "does not exist"),
        ([], "give the objective"),
        (["-p", "x", "--", "-p", "y"], "given twice"),
        (["-p", "x", "--verify-cmd", "no-such-program-xyz"], "not found"),
    ],
)
def test_bad_input_exits_2(tmp_path: Path, ws: Path, extra: list[str], message: str) -> None:
    done = run_cli(tmp_path, cli_env(tmp_path, None), *auto_args(ws, *extra))
    assert done.returncode == 2
    assert message in done.stderr
    assert "Turn 1" not in done.stderr


def test_unknown_tool_exits_2(tmp_path: Path, ws: Path) -> None:
    done = run_cli(tmp_path, cli_env(tmp_path, None), "auto", "--tool", "gpt", "-p", "x")
    assert done.returncode == 2
    assert "invalid choice: 'gpt'" in done.stderr


def test_resume_refuses_unknown_and_finished_runs(tmp_path: Path, ws: Path) -> None:
    script = write_script(tmp_path / "fake", rules=happy_rules())
    env = cli_env(tmp_path, script)
    done = run_cli(tmp_path, env, *auto_args(ws, "-p", "x"))
    assert done.returncode == 0
    again = run_cli(tmp_path, env, "auto", "--resume", report_head(done.stdout)[0])
    assert again.returncode == 2
    assert "cannot be resumed" in again.stderr
    flags = run_cli(tmp_path, env, "auto", "--resume", "x", "--max-turns", "3", "-p", "y")
    assert flags.returncode == 2
    assert "drop -p, --max-rounds" in flags.stderr
    missing = run_cli(tmp_path, env, "auto", "--resume", "auto-nope")
    assert missing.returncode == 1
    assert "no run 'auto-nope'" in missing.stderr


async def test_append_steers_the_next_execute_turn(
    tmp_path: Path, ws: Path, db_target: Target
) -> None:
    gate = tmp_path / "go"
    replies = [
        {"text": "goal"},
        {"text": "plan"},
        {"text": "working", "wait_file": str(gate)},
        evaluation("IN PROGRESS"),
        commit_step("result.txt"),
        evaluation("COMPLETE"),
    ]
    script = write_script(tmp_path / "fake", replies=replies)
    env = on(db_target, cli_env(tmp_path, script, log=tmp_path / "agent.log"))
    cli = await Cli.start(tmp_path, env, *auto_args(ws, "-p", "x"))
    started = await cli.wait_for("Auto run ")
    await cli.wait_for("Turn 3, round 3/10: Executing")
    steer = await asyncio.to_thread(
        lambda: run_cli(tmp_path, env, "auto", "--append", "-", stdin="Please also write NOTES.md")
    )
    assert steer.returncode == 0, steer.stderr
    assert run_id_from(started) in steer.stdout
    gate.touch()
    code, _out, err = await cli.finish()
    assert code == 0, err
    executes = [e["prompt"] for e in agent_log(tmp_path / "agent.log") if EXECUTE in e["prompt"]]
    assert len(executes) == 2
    assert "NOTES.md" not in executes[0]
    assert executes[1].count("Please also write NOTES.md") == 1
    named = run_cli(tmp_path, env, "auto", "--append", "late", "--session", run_id_from(started))
    assert named.returncode == 2
    assert "has ended" in named.stderr
    nothing = run_cli(tmp_path, env, "auto", "--append", "x")
    assert nothing.returncode == 2
    assert "no auto run is running here" in nothing.stderr


@pytest.mark.parametrize(
    ("sig", "expected", "db_target"),
    [
        (signal.SIGINT, 130, "sqlite"),
        (signal.SIGTERM, 143, "sqlite"),
        (signal.SIGTERM, 143, "postgresql"),
    ],
    indirect=["db_target"],
)
async def test_ctrl_c_stops_the_run_and_the_agent(
    tmp_path: Path, ws: Path, sig: signal.Signals, expected: int, db_target: Target
) -> None:
    pids = tmp_path / "pids"
    rules = happy_rules(execute={"text": "slow", "grandchild": True, "sleep": 600})
    script = write_script(tmp_path / "fake", rules=rules)
    env = on(db_target, cli_env(tmp_path, script, extra={"FAKE_AGENT_PIDS": str(pids)}))
    cli = await Cli.start(tmp_path, env, *auto_args(ws, "-p", "x"))
    started = await cli.wait_for("Auto run ")
    await cli.wait_for("Turn 3, round 3/10: Executing")
    cli.proc.send_signal(sig)
    code, out, err = await cli.finish()
    assert code == expected, err
    assert report_head(out) == (run_id_from(started), "stopped")
    run_id = run_id_from(started)
    assert [t[3] for t in turns_of(db_target, run_id)] == ["finished", "finished", "interrupted"]
    assert run_row(db_target, run_id)["status"] == "stopped"
    for line in pids.read_text().splitlines() if pids.exists() else []:
        for pid in map(int, line.split()):
            # Gone: no such process, or a zombie the init process has not reaped yet.
            assert not alive(pid), pid


async def test_sigkill_mid_turn_then_resume(tmp_path: Path, ws: Path, db_target: Target) -> None:
    gate = tmp_path / "go"
    rules = happy_rules(execute={"text": "executed", "wait_file": str(gate)})
    rules[3] = {"match": EVALUATE, **commit_step("result.txt", text="AUTO-MODE STATUS: COMPLETE")}
    script = write_script(tmp_path / "fake", rules=rules)
    env = on(db_target, cli_env(tmp_path, script, log=tmp_path / "agent.log"))
    cli = await Cli.start(tmp_path, env, *auto_args(ws, "-p", "x"))
    run_id = run_id_from(await cli.wait_for("Auto run "))
    await cli.wait_for("Turn 3, round 3/10: Executing")
    cli.proc.kill()
    await cli.finish()
    gate.touch()  # lets an orphaned agent of the killed turn finish
    listed = await asyncio.to_thread(run_cli, tmp_path, env, "runs")
    assert f"{run_id}" in listed.stdout
    assert "running*" in listed.stdout
    resumed = await asyncio.to_thread(run_cli, tmp_path, env, "auto", "--resume", run_id)
    assert resumed.returncode == 0, resumed.stderr
    assert "Resuming auto run" in resumed.stderr
    assert "1 interrupted turn(s) re-run" in resumed.stderr
    assert report_head(resumed.stdout)[1] == "completed"
    assert turns_of(db_target, run_id) == [
        (1, 1, "clarify", "finished"),
        (2, 1, "plan", "finished"),
        (3, 1, "execute", "interrupted"),
        (3, 2, "execute", "finished"),
        (4, 1, "evaluate", "finished"),
    ]
    row = run_row(db_target, run_id)
    assert row["status"] == "completed"
    assert json.loads(Path(row["log_dir"], "state.json").read_text())["status"] == "completed"
    shown = await asyncio.to_thread(run_cli, tmp_path, env, "runs", run_id)
    assert "#3.1 execute   interrupted" in shown.stdout
    assert "the process stopped while this turn ran" in shown.stdout
    assert "#3.2 execute   finished" in shown.stdout
    detail = json.loads(
        (await asyncio.to_thread(run_cli, tmp_path, env, "runs", run_id, "--json")).stdout
    )
    assert [(t["seq"], t["attempt"], t["state"]) for t in detail["turns"]][2:4] == [
        (3, 1, "interrupted"),
        (3, 2, "finished"),
    ]


async def test_sigkill_between_turn_end_and_store_write_reruns_the_turn_once(
    tmp_path: Path, ws: Path, db_target: Target
) -> None:
    script = write_script(tmp_path / "fake", rules=happy_rules())
    env = on(db_target, cli_env(tmp_path, script, log=tmp_path / "agent.log"))
    killer = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.automode_support",
            "kill-after-turn",
            "3",
            db_support.setting(db_target),
            str(tmp_path / "runs"),
            str(ws),
            AGENT_CMD,
            "create result.txt",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert killer.returncode == -signal.SIGKILL, killer.stderr
    run_id = killer.stderr.split("RUN ", 1)[1].split()[0]
    # The execute turn ran (and committed) but its end was never recorded.
    assert turns_of(db_target, run_id)[-1] == (3, 1, "execute", "started")
    # --resume also takes the agent session id.
    resumed = run_cli(tmp_path, env, "auto", "--resume", run_row(db_target, run_id)["session_id"])
    assert resumed.returncode == 0, resumed.stderr
    turns = turns_of(db_target, run_id)
    assert turns == [
        (1, 1, "clarify", "finished"),
        (2, 1, "plan", "finished"),
        (3, 1, "execute", "interrupted"),
        (3, 2, "execute", "finished"),
        (4, 1, "evaluate", "finished"),
    ]
    finished = [seq for seq, _, _, state in turns if state == "finished"]
    assert len(finished) == len(set(finished))  # each turn recorded finished once
    assert run_row(db_target, run_id)["status"] == "completed"


async def test_two_resumes_at_once_one_drives_the_other_is_refused(
    tmp_path: Path, ws: Path, db_target: Target
) -> None:
    script = write_script(tmp_path / "fake", rules=happy_rules())
    env = on(db_target, cli_env(tmp_path, script, log=tmp_path / "agent.log"))
    killer = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "tests.automode_support",
            "kill-after-turn",
            "2",
            db_support.setting(db_target),
            str(tmp_path / "runs"),
            str(ws),
            AGENT_CMD,
            "create result.txt",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    run_id = killer.stderr.split("RUN ", 1)[1].split()[0]
    both = await asyncio.gather(
        asyncio.to_thread(run_cli, tmp_path, env, "auto", "--resume", run_id),
        asyncio.to_thread(run_cli, tmp_path, env, "auto", "--resume", run_id),
    )
    codes = sorted(done.returncode for done in both)
    assert codes == [0, 2], [d.stderr[-500:] for d in both]
    loser = next(d for d in both if d.returncode == 2)
    assert any(
        text in loser.stderr
        # ("… by process PID", or "… by another process" when its pid is not written yet)
        for text in ("is still driven by", "just resumed by another process", "has ended")
    ), loser.stderr
    finished = [seq for seq, _, _, state in turns_of(db_target, run_id) if state == "finished"]
    assert finished == [1, 2, 3, 4]


@pytest.mark.parametrize("verify", [False, True])
def test_a_workdir_that_is_no_git_repository_is_warned_about_first(
    tmp_path: Path, verify: bool
) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    script = write_script(tmp_path / "fake", rules=happy_rules())
    extra = ["--verify-cmd", "true"] if verify else []
    done = run_cli(
        tmp_path,
        cli_env(tmp_path, script),
        *auto_args(plain, "--max-turns", "1", "-p", "x", *extra),
    )
    assert done.returncode == 0, done.stderr
    warning = next(line for line in done.stderr.splitlines() if "not a git repository" in line)
    assert done.stderr.index(warning) < done.stderr.index("Turn 1")
    if verify:
        assert "only the verify command can confirm it" in warning
    else:
        assert "no claim of completion can be accepted" in warning
        assert "--verify-cmd" in warning

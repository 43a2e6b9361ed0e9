"""What a person sees of ``turnstile auto`` and ``turnstile chat``: the real command, run
under a pseudo-terminal (pexpect) and piped."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from tests.automode_support import (
    AGENT_CMD,
    REPO,
    cli_env,
    git_workspace,
    happy_rules,
    turnstile,
    write_script,
)
from tests.fakes.realcli import alive

pytestmark = pytest.mark.timeout(120)

STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
MODULE = re.compile(r"\bengine\.[a-z_.]+:")
ESCAPE = "\x1b["


def run_cli(tmp: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        turnstile(*args), cwd=tmp, env=env, capture_output=True, text=True, timeout=90
    )


def auto_args(ws: Path, *extra: str) -> list[str]:
    return ["auto", "--tool", "command", "--agent-cmd", AGENT_CMD, "--workdir", str(ws), *extra]


def spawn(tmp: Path, env: dict[str, str], *args: str) -> pexpect.spawn:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "engine.cli", *args],
        cwd=str(tmp),
        env={**env, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "30"},
        encoding="utf-8",
        dimensions=(30, 120),
        timeout=60,
    )
    child.logfile_read = open(tmp / "screen.log", "w")  # noqa: SIM115 - closed with the child
    return child


def finish(child: pexpect.spawn) -> tuple[int, str]:
    child.expect(pexpect.EOF)
    child.close()
    child.logfile_read.close()
    return child.exitstatus, str(child.before)


def plain(screen: str) -> str:
    """The screen's text without control sequences."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen).replace("\r", "")


def test_auto_piped_prints_plain_lines_and_the_report_on_stdout(tmp_path: Path) -> None:
    ws = git_workspace(tmp_path / "ws")
    env = cli_env(tmp_path, write_script(tmp_path / "fake", rules=happy_rules()))
    done = run_cli(tmp_path, env, *auto_args(ws, "-p", "create result.txt"))
    assert done.returncode == 0, done.stderr
    report = done.stdout.splitlines()
    assert re.fullmatch(r"Auto run auto-[\w-]+: completed", report[0]), report
    assert "Objective achieved" in report
    assert "Evidence (score 1.00, threshold 0.80):" in report
    assert "  - commits: yes (1 since the run started)" in report
    assert any(line.startswith("Commits since start: 1") for line in report)
    # Progress: one plain line per turn start and end, on stderr.
    progress = done.stderr.splitlines()
    assert progress[0].startswith(report[0].split(":")[0] + " · command · in ")
    for line in (
        "turn 1 · round 1/10 · Clarify …",
        "✓ turn 1 Clarify · round 1/10 · exit 0 · 0s · Goal: a file named result.txt exists "
        "and is committed.",
        "turn 3 · round 3/10 · Execute …",
        # Execute and Evaluate share a round; each is a turn of its own.
        "turn 4 · round 3/10 · Evaluate …",
        "✓ turn 4 Evaluate · round 3/10 · exit 0 · 0s · AUTO-MODE STATUS: COMPLETE",
    ):
        assert line in progress, done.stderr
    # A person's view: no log records, no control codes, nothing of the report twice.
    for stream in (done.stdout, done.stderr):
        assert not STAMP.search(stream), stream
        assert not MODULE.search(stream), stream
        assert "run_id=" not in stream
        assert ESCAPE not in stream
    assert "Evidence" not in done.stderr
    assert "applying migration" not in done.stderr


def test_log_level_brings_the_log_records_back_on_stderr_only(tmp_path: Path) -> None:
    ws = git_workspace(tmp_path / "ws")
    env = cli_env(tmp_path, write_script(tmp_path / "fake", rules=happy_rules()))
    info = run_cli(tmp_path, env, "--log-level", "INFO", *auto_args(ws, "-p", "x"))
    assert info.returncode == 0, info.stderr
    assert STAMP.search(info.stderr)
    assert "engine.automode.channel: Turn 1, round 1/10: Clarifying objective" in info.stderr
    assert "applying migration" not in info.stderr  # migrations are DEBUG
    assert not STAMP.search(info.stdout)
    assert info.stdout.startswith("Auto run ")
    debug = run_cli(
        tmp_path, {**env, "TURNSTILE_DATABASE": str(tmp_path / "other.db")}, "--log-level",
        "DEBUG", *auto_args(git_workspace(tmp_path / "ws2"), "-p", "x"),
    )  # fmt: skip
    assert "applying migration engine 0001_runs" in debug.stderr


def test_a_warning_reads_as_words_without_log_level(tmp_path: Path) -> None:
    ws = git_workspace(tmp_path / "ws")
    env = cli_env(tmp_path, write_script(tmp_path / "fake", rules=happy_rules()))
    done = run_cli(tmp_path, env, *auto_args(ws, "--max-turns", "2", "-p", "x"))
    assert done.returncode == 0, done.stderr
    assert "turnstile: warning: Reached the round limit without verified completion" in done.stderr
    assert not STAMP.search(done.stderr)
    assert done.stdout.splitlines()[0].endswith(": stopped at its round limit")


def test_auto_on_a_terminal_shows_a_live_status_line(tmp_path: Path) -> None:
    ws = git_workspace(tmp_path / "ws")
    gate = tmp_path / "go"
    rules = happy_rules()
    rules[2] = {
        **rules[2],
        "progress": "editing result.txt now\n",
        "wait_file": str(gate),
    }
    env = cli_env(tmp_path, write_script(tmp_path / "fake", rules=rules))
    child = spawn(tmp_path, env, *auto_args(ws, "-p", "create result.txt"))
    child.expect("Ctrl-C stops the run")
    # The live line: spinner, turn, phase, elapsed, and the agent's last line so far.
    child.expect(r"turn 3 · round 3/10 · Execute · \d+s")
    child.expect("editing result.txt now")
    gate.touch()
    code, _ = finish(child)
    assert code == 0
    screen = (tmp_path / "screen.log").read_text()
    assert ESCAPE in screen  # drawn and redrawn in place
    text = plain(screen)
    assert "✓ turn 3 Execute · round 3/10 · exit 0" in text
    assert "Evidence (score 1.00, threshold 0.80):" in text
    assert not STAMP.search(text)
    assert not MODULE.search(text)


def test_chat_on_a_terminal_banner_prompt_progress_and_ctrl_c(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = write_script(
        tmp_path / "fake",
        replies=[
            {"text": "hello there\nfirst answer\n"},
            {"progress": "thinking hard\n", "grandchild": True, "sleep": 600},
            {"text": "third answer\n"},
        ],
    )
    env = cli_env(tmp_path, script, extra={"FAKE_AGENT_PIDS": str(pids)})
    child = spawn(
        tmp_path, env, "chat", "--tool", "command", "--agent-cmd", AGENT_CMD,
        "--workdir", str(tmp_path), "--session", "term-7",
    )  # fmt: skip
    child.expect("turnstile chat · command · session term-7")
    child.expect(f"Folder: {re.escape(str(tmp_path))}")
    child.expect("Ctrl-C stops a running turn")
    child.expect("›")
    child.sendline("hi")
    child.expect("first answer")
    child.expect("›")
    child.sendline("do the slow thing")
    child.expect(r"command is working · \d+s · ")  # the live line: elapsed, last line
    child.expect("thinking hard")
    child.sendintr()  # first Ctrl-C: the turn stops, the chat stays
    child.expect("Turn stopped after")
    child.expect("›")
    agent_pid, grandchild = map(int, pids.read_text().split())
    assert not alive(agent_pid)
    assert not alive(grandchild)
    child.sendline("still there?")
    child.expect("third answer")  # the same session goes on
    child.expect("›")
    child.sendintr()  # Ctrl-C at the prompt quits
    code, _ = finish(child)
    assert code == 130
    text = plain((tmp_path / "screen.log").read_text())
    assert not STAMP.search(text)
    assert not MODULE.search(text)
    # The session is a run like any: listed, with its turns and its event log.
    (run,) = [
        json.loads(line) for line in run_cli(tmp_path, env, "runs", "--json").stdout.splitlines()
    ]
    assert (run["mode"], run["agent"], run["status"], run["turn"]) == (
        "chat",
        "command",
        "completed",
        3,
    )
    assert f"run {run['id']}" in text  # the banner names it
    shown = json.loads(run_cli(tmp_path, env, "runs", run["id"], "--json").stdout)
    assert [t["state"] for t in shown["turns"]] == ["finished", "interrupted", "finished"]
    events = run_cli(tmp_path, env, "runs", run["id"], "--events").stdout
    assert "chat run started with command" in events
    assert "turn 1 started: hi" in events
    assert "turn 2 was cut off: stopped by a person" in events
    assert "ended: completed" in events
    assert "(exit 130)" not in events


def test_chat_piped_prints_only_the_answers(tmp_path: Path) -> None:
    env = cli_env(tmp_path, None)
    done = subprocess.run(
        turnstile("chat", "--tool", "command", "--agent-cmd", AGENT_CMD, "--workdir", str(REPO)),
        input="one\ntwo\n",
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["echo: one", "echo: two"]
    (run,) = [
        json.loads(line) for line in run_cli(tmp_path, env, "runs", "--json").stdout.splitlines()
    ]
    assert (run["mode"], run["status"], run["turn"], run["exit_code"]) == (
        "chat",
        "completed",
        2,
        0,
    )
    assert "›" not in done.stdout + done.stderr
    assert ESCAPE not in done.stdout + done.stderr
    assert not STAMP.search(done.stderr)


def test_chat_second_ctrl_c_while_stopping_quits(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = write_script(
        tmp_path / "fake",
        replies=[{"progress": "busy\n", "grandchild": True, "ignore_term": True, "sleep": 600}],
    )
    env = cli_env(
        tmp_path, script, extra={"FAKE_AGENT_PIDS": str(pids), "TURNSTILE_PREEMPT_GRACE": "3"}
    )
    child = spawn(tmp_path, env, "chat", "--tool", "command", "--agent-cmd", AGENT_CMD)
    child.expect("›")
    child.sendline("slow")
    child.expect("busy")
    child.sendintr()
    child.expect("Ctrl-C again quits")
    child.sendintr()
    code, _ = finish(child)
    assert code == 130
    for pid in map(int, pids.read_text().split()):
        assert not alive(pid), pid
    # Quitting during the turn: the turn is on record as cut off, the session as ended.
    (run,) = [
        json.loads(line) for line in run_cli(tmp_path, env, "runs", "--json").stdout.splitlines()
    ]
    assert run["status"] == "completed"
    shown = json.loads(run_cli(tmp_path, env, "runs", run["id"], "--json").stdout)
    assert [t["state"] for t in shown["turns"]] == ["interrupted"]


FAILING = {"text": "half done", "exit": 3, "stderr": "warming up\nfatal: the model API said 401\n"}


def test_chat_says_the_exit_code_and_the_end_of_the_error_output(tmp_path: Path) -> None:
    env = cli_env(tmp_path, write_script(tmp_path / "fake", replies=[FAILING]))
    done = subprocess.run(
        turnstile("chat", "--tool", "command", "--agent-cmd", AGENT_CMD, "--workdir", str(REPO)),
        input="one\n",
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "half done",
        "⚠️ the agent exited with code 3",
        "Its error output ended with:",
        "warming up",
        "fatal: the model API said 401",
    ]


def test_autopilot_phase_that_fails_says_why_with_a_relative_path(tmp_path: Path) -> None:
    env = cli_env(
        tmp_path,
        write_script(tmp_path / "fake", rules=[{"match": "", **FAILING}]),
        extra={"TURNSTILE_TASKS_ROOT": str(tmp_path / "tasks"), "TURNSTILE_APPROVERS": "42"},
    )
    args = ["autopilot", "--task", "hf1", "--init", "--tool", "command", "--agent-cmd", AGENT_CMD]
    done = run_cli(tmp_path, env, *args)
    assert done.returncode == 4, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    at = lines.index(
        "[hf1 · research] problems: research.md was not written in the task folder hf1/"
    )
    assert lines[at + 1 : at + 5] == [
        "⚠️ the agent exited with code 3",
        "Its error output ended with:",
        "warming up",
        "fatal: the model API said 401",
    ]
    assert str(tmp_path) not in done.stdout

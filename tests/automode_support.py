"""Helpers for the auto-mode tests: scripts for the fake agent, git workspaces, a CLI runner.

Run as a script it starts an auto run whose agent session SIGKILLs this very process
right after turn N ended and before the channel records it (the crash window between
a turn's end and its store write)::

    python -m tests.automode_support kill-after-turn N DB RUNS_DIR WORKDIR AGENT_CMD OBJECTIVE
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support import clean_env

REPO = Path(__file__).resolve().parent.parent
FAKE_AGENT = REPO / "tests" / "fake_agent.py"
AGENT_CMD = f"{sys.executable} {FAKE_AGENT} --session {{session_id}} --prompt {{prompt}}"

# Substrings unique to each phase's built-in prompt (the heading line's end).
CLARIFY = ": clarify the objective\n"
PLAN = ": plan\n"
EXECUTE = ": execute\n"
EVALUATE = ": evaluate\n"
ADJUST = ": adjust the plan\n"

GIT_ENV = {
    "GIT_AUTHOR_NAME": "fake agent",
    "GIT_AUTHOR_EMAIL": "agent@example.invalid",
    "GIT_COMMITTER_NAME": "fake agent",
    "GIT_COMMITTER_EMAIL": "agent@example.invalid",
    "GIT_CONFIG_NOSYSTEM": "1",
}


def commit_step(name: str, content: str = "done\n", text: str = "committed") -> dict[str, Any]:
    """A fake-agent step that writes ``name`` and commits it."""
    return {
        "text": text,
        "files": {name: content},
        "run": [["git", "add", name], ["git", "commit", "-q", "-m", f"add {name}"]],
    }


def evaluation(verdict: str, body: str = "Checked the workspace.") -> dict[str, Any]:
    return {"text": f"{body}\nAUTO-MODE STATUS: {verdict}\n"}


def happy_rules(*, execute: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Clarify, plan, execute (commits a file), evaluate COMPLETE."""
    return [
        {"match": CLARIFY, "text": "Goal: a file named result.txt exists and is committed."},
        {"match": PLAN, "text": "1. write result.txt\n2. commit it"},
        {"match": EXECUTE, **(execute or commit_step("result.txt"))},
        {"match": EVALUATE, **evaluation("COMPLETE")},
        {"match": ADJUST, "text": "revised plan"},
    ]


def write_script(
    folder: Path,
    *,
    replies: Sequence[Mapping[str, Any]] = (),
    rules: Sequence[Mapping[str, Any]] = (),
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "script.json"
    path.write_text(json.dumps({"replies": list(replies), "rules": list(rules)}))
    return path


def git_workspace(path: Path) -> Path:
    """A git repository with one commit (the run's base)."""
    path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **GIT_ENV}
    subprocess.run(["git", "init", "-q", "-b", "main", str(path)], check=True, env=env)
    (path / "README").write_text("workspace\n")
    subprocess.run(["git", "-C", str(path), "add", "README"], check=True, env=env)
    subprocess.run(["git", "-C", str(path), "commit", "-q", "-m", "base"], check=True, env=env)
    return path


def agent_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cli_env(
    tmp: Path, script: Path | None, *, log: Path | None = None, extra: Mapping[str, str] = ()
) -> dict[str, str]:
    """The environment of a ``turnstile`` subprocess: isolated settings, fake agent, git id."""
    env = clean_env()
    env.update(GIT_ENV)
    env["TURNSTILE_DATABASE"] = str(tmp / "turnstile.db")
    env["TURNSTILE_RUNS_DIR"] = str(tmp / "runs")
    env["TURNSTILE_PREEMPT_GRACE"] = "1"
    env["PYTHONPATH"] = str(REPO)
    if script is not None:
        env["FAKE_AGENT_SCRIPT"] = str(script)
    if log is not None:
        env["FAKE_AGENT_LOG"] = str(log)
    env.update(dict(extra))
    return env


def report_head(stdout: str) -> tuple[str, str]:
    """The run id and status from the first line of ``turnstile auto``'s final report
    (``Auto run ID: STATUS``, ``… stopped at its round limit`` or ``… failed (exit N)``)."""
    first = stdout.splitlines()[0]
    match = re.fullmatch(
        r"Auto run (\S+): (\w+)(?: at its round limit)?(?: \(exit -?\d+\))?", first
    )
    assert match is not None, stdout
    return match.group(1), match.group(2)


def turnstile(*args: str) -> list[str]:
    return [sys.executable, "-m", "engine.cli", *args]


class _KillAfter:
    """An agent session that SIGKILLs this process once turn ``n`` has returned."""

    def __init__(self, inner: Any, n: int) -> None:
        self._inner = inner
        self._n = n
        self._count = 0

    @property
    def session_id(self) -> str:
        return str(self._inner.session_id)

    async def run_turn(self, prompt: str) -> Any:
        out = await self._inner.run_turn(prompt)
        self._count += 1
        if self._count == self._n:
            print(f"KILLING after turn {self._n}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return out


async def _kill_after_turn(argv: list[str]) -> None:
    from engine.automode import prepare_auto_run
    from engine.runs import RunSpec
    from engine.settings import load_settings
    from engine.store.backend import open_database

    # DB: a SQLite file or a postgresql:// URL.
    n, database, runs_dir, workdir, agent_cmd, objective = argv
    settings = load_settings(database=database, runs_dir=Path(runs_dir))
    async with open_database(settings) as db:
        spec = RunSpec(
            objective=objective, agent="command", workdir=Path(workdir), agent_cmd=agent_cmd
        )
        run = await prepare_auto_run(settings, db, spec)
        print(f"RUN {run.run_id}", file=sys.stderr, flush=True)
        run.runner = _KillAfter(run.runner, int(n))
        await run.wait()


if __name__ == "__main__":
    if sys.argv[1] == "kill-after-turn":
        asyncio.run(_kill_after_turn(sys.argv[2:]))

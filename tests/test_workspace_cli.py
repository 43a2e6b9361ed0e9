"""``--checkout-repo`` on ``turnstile auto`` and ``turnstile autopilot``, as subprocesses, on
a SQLite file and on a fresh PostgreSQL database in turn (``db_target``, tests/pg_support.py)."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from pathlib import Path

import psycopg
import pytest

from engine.store.location import PostgresURL
from tests.automode_support import (
    AGENT_CMD,
    agent_log,
    cli_env,
    happy_rules,
    report_head,
    turnstile,
    write_script,
)
from tests.test_workspace_git import git, git_test_env, make_remote

pytestmark = pytest.mark.timeout(120)

SECRET = "pw-9f8e7d6c5b4a"


def db_rows(target: Path | PostgresURL, sql: str, *params: object) -> list[tuple[object, ...]]:
    """What ``sql`` (``?`` placeholders) finds in the database the CLI wrote to."""
    if isinstance(target, PostgresURL):
        with psycopg.connect(target.conninfo()) as pg:
            return list(pg.execute(sql.replace("?", "%s").encode(), params).fetchall())
    with sqlite3.connect(target) as conn:
        return list(conn.execute(sql, params).fetchall())


def run_cli(tmp: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        turnstile(*args), cwd=tmp, env=env, capture_output=True, text=True, timeout=90
    )


@pytest.fixture
def setup(
    tmp_path: Path, db_target: Path | PostgresURL, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, dict[str, str]]:
    env_git = git_test_env(tmp_path / "home")
    for key, value in env_git.items():
        monkeypatch.setenv(key, value)
    remote = make_remote(tmp_path)
    script = write_script(tmp_path / "fake", rules=happy_rules())
    env = cli_env(
        tmp_path,
        script,
        log=tmp_path / "agent.log",
        extra={
            **env_git,
            "TURNSTILE_WORKSPACES": str(tmp_path / "ws"),
            "TURNSTILE_PROJECTS": f"demo={remote}#main",
            "TURNSTILE_DATABASE": (
                db_target.conninfo() if isinstance(db_target, PostgresURL) else str(db_target)
            ),
        },
    )
    return remote, env


def test_auto_runs_in_its_own_worktree(
    tmp_path: Path, setup: tuple[Path, dict[str, str]], db_target: Path | PostgresURL
) -> None:
    remote, env = setup
    before = git("rev-parse", "main", cwd=remote)

    done = run_cli(
        tmp_path,
        env,
        "auto",
        "--checkout-repo",
        "demo",
        "--tool",
        "command",
        "--agent-cmd",
        AGENT_CMD,
        "-p",
        "create result.txt",
    )

    assert done.returncode == 0, done.stderr
    run_id, status = report_head(done.stdout)
    assert status == "completed"
    worktree = tmp_path / "ws" / "worktrees" / "demo" / run_id
    [(workdir,)] = db_rows(db_target, "SELECT workdir FROM runs WHERE id = ?", run_id)
    assert Path(workdir) == worktree
    # Every turn ran in the worktree; the work is on the run's branch only.
    assert {entry["cwd"] for entry in agent_log(tmp_path / "agent.log")} == {str(worktree)}
    assert git("symbolic-ref", "--short", "HEAD", cwd=worktree) == f"turnstile/{run_id}"
    assert (worktree / "result.txt").read_text() == "done\n"
    assert git("rev-parse", "main", cwd=remote) == before
    assert git("status", "--porcelain", cwd=worktree) == ""
    # `turnstile runs ID` shows the branch and its disk usage.
    shown = run_cli(tmp_path, env, "runs", run_id)
    assert shown.returncode == 0, shown.stderr
    assert f"  worktree turnstile/{run_id} · " in shown.stdout
    # The list shows each run's branch and disk usage too; a run without a worktree "-".
    plain = tmp_path / "plain"
    plain.mkdir()
    other = run_cli(
        tmp_path, env, "auto", "--workdir", str(plain), "--tool", "command",
        "--agent-cmd", AGENT_CMD, "-p", "create result.txt",
    )  # fmt: skip
    assert other.returncode == 0, other.stderr
    other_id = report_head(other.stdout)[0]
    listed = run_cli(tmp_path, env, "runs")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split()[-1] == "WORKTREE"
    row = {line.split()[0]: line for line in rows}
    assert re.search(rf"  turnstile/{run_id} · \d+(\.\d)? (B|kB|MB)$", row[run_id]), row
    assert row[other_id].endswith("  -")
    as_json = run_cli(tmp_path, env, "runs", "--json")
    by_id = {r["id"]: r for r in map(json.loads, as_json.stdout.splitlines())}
    assert by_id[run_id]["worktree"].startswith(f"turnstile/{run_id} · ")
    assert by_id[other_id]["worktree"] is None


def test_auto_refuses_bad_projects(tmp_path: Path, setup: tuple[Path, dict[str, str]]) -> None:
    _, env = setup
    base = ["auto", "--tool", "command", "--agent-cmd", AGENT_CMD, "-p", "x"]

    unknown = run_cli(tmp_path, env, *base, "--checkout-repo", "nope")
    assert unknown.returncode == 2
    assert "unknown project 'nope' (known: demo)" in unknown.stderr

    both = run_cli(tmp_path, env, *base, "--checkout-repo", "demo", "--workdir", str(tmp_path))
    assert both.returncode == 2
    assert "exclude each other" in both.stderr

    bad = run_cli(tmp_path, env, *base, "--checkout-repo", "../demo")
    assert bad.returncode == 2
    assert f"{tmp_path.parent / 'demo'} is not a folder" in bad.stderr

    creds = {**env, "TURNSTILE_PROJECTS": f"web=http://bob:{SECRET}@127.0.0.1:1/x.git"}
    failed = run_cli(tmp_path, creds, *base, "--checkout-repo", "web")
    assert failed.returncode == 1
    assert "git clone failed" in failed.stderr
    assert SECRET not in failed.stderr + failed.stdout
    assert not (tmp_path / "ws" / "worktrees").exists()


def test_autopilot_init_checks_out_a_worktree_for_the_task(
    tmp_path: Path, setup: tuple[Path, dict[str, str]], db_target: Path | PostgresURL
) -> None:
    _, env = setup
    done = run_cli(
        tmp_path,
        env,
        "autopilot",
        "--task",
        "feature-x",
        "--init",
        "--checkout-repo",
        "demo",
        "--folder",
        str(tmp_path / "tasks" / "feature-x"),
        "--manual",
    )

    assert done.returncode == 0, done.stderr
    worktree = tmp_path / "ws" / "worktrees" / "demo" / "feature-x"
    [(workdir,)] = db_rows(db_target, "SELECT workdir FROM gate_tasks WHERE name = ?", "feature-x")
    assert Path(workdir) == worktree
    assert git("symbolic-ref", "--short", "HEAD", cwd=worktree) == "turnstile/feature-x"


def _auto(tmp: Path, env: dict[str, str], repo: str) -> subprocess.CompletedProcess[str]:
    return run_cli(
        tmp, env, "auto", "--checkout-repo", repo, "--tool", "command", "--agent-cmd",
        AGENT_CMD, "-p", "create result.txt",
    )  # fmt: skip


def test_checkout_repo_takes_a_file_url_or_a_path(
    tmp_path: Path, setup: tuple[Path, dict[str, str]], db_target: Path | PostgresURL
) -> None:
    _, env = setup
    env = {k: v for k, v in env.items() if k != "TURNSTILE_PROJECTS"}
    other = make_remote(tmp_path, name="widgets")
    before = git("rev-parse", "main", cwd=other)

    by_url = _auto(tmp_path, env, other.as_uri())
    assert by_url.returncode == 0, by_url.stderr
    run_id, status = report_head(by_url.stdout)
    assert status == "completed"
    # Named after the repository: its clone and worktree live under that name.
    worktree = tmp_path / "ws" / "worktrees" / "widgets" / run_id
    assert (worktree / "result.txt").read_text() == "done\n"
    assert git("symbolic-ref", "--short", "HEAD", cwd=worktree) == f"turnstile/{run_id}"
    assert (tmp_path / "ws" / "cache" / "widgets.git").is_dir()
    # Its branch went back to the repository it was given by, named in the report.
    assert f"Branch: turnstile/{run_id}, pushed to {other}" in by_url.stdout
    assert git("log", "-1", "--format=%s", f"turnstile/{run_id}", cwd=other) == "add result.txt"

    # A relative path to the same repository reuses its clone.
    by_path = _auto(tmp_path, env, "./widgets.git")
    assert by_path.returncode == 0, by_path.stderr
    second, _ = report_head(by_path.stdout)
    assert (tmp_path / "ws" / "worktrees" / "widgets" / second / "result.txt").exists()
    assert git("rev-parse", "main", cwd=other) == before  # work stays on the run branches
    assert f"Branch: turnstile/{second}, pushed to {other}" in by_path.stdout
    pushed = git("branch", "--list", "turnstile/*", "--format=%(refname:short)", cwd=other)
    assert pushed.split() == sorted([f"turnstile/{run_id}", f"turnstile/{second}"])
    projects = {p for (p,) in db_rows(db_target, "SELECT project FROM workspaces")}
    assert projects == {"widgets"}


def test_checkout_repo_refuses_bad_paths_clearly(
    tmp_path: Path, setup: tuple[Path, dict[str, str]]
) -> None:
    remote, env = setup
    missing = _auto(tmp_path, env, str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert f"{tmp_path / 'nowhere'} is not a folder" in missing.stderr
    plain = tmp_path / "notgit"
    plain.mkdir()
    not_git = _auto(tmp_path, env, "./notgit")
    assert not_git.returncode == 2
    assert f"{plain} is not a git repository" in not_git.stderr
    # Another repository that would take a configured project's name is refused.
    clash = tmp_path / "elsewhere"
    clash.mkdir()
    impostor = make_remote(clash, name="demo")
    taken = _auto(tmp_path, env, str(impostor))
    assert taken.returncode == 2
    assert "would be named 'demo', but project 'demo' is" in taken.stderr
    # The configured project's own repository, given by path, is that project.
    same = _auto(tmp_path, env, str(remote))
    assert same.returncode == 0, same.stderr
    run_id, _ = report_head(same.stdout)
    assert (tmp_path / "ws" / "worktrees" / "demo" / run_id).is_dir()
    assert not (tmp_path / "ws" / "worktrees").joinpath("notgit").exists()


def test_checkout_repo_url_credentials_are_never_printed(
    tmp_path: Path, setup: tuple[Path, dict[str, str]]
) -> None:
    _, env = setup
    url = f"http://bob:{SECRET}@127.0.0.1:1/team/site.git"
    failed = _auto(tmp_path, env, url)
    assert failed.returncode == 1
    assert "git clone failed" in failed.stderr
    assert SECRET not in failed.stderr + failed.stdout
    logged = run_cli(
        tmp_path, env, "--log-level", "DEBUG", "auto", "--checkout-repo", url, "--tool",
        "command", "--agent-cmd", AGENT_CMD, "-p", "x",
    )  # fmt: skip
    assert "cloning project site from http://" in logged.stderr
    assert SECRET not in logged.stderr + logged.stdout
    assert not (tmp_path / "ws" / "worktrees").exists()

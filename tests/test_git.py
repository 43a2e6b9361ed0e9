"""The git runner against real git repositories in tmp: hooks off, one typed result, a git
that cannot start is an error (also for auto mode's git facts and the gate fingerprint)."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from pathlib import Path

import pytest

from engine.automode.git import Git
from engine.errors import DiskFullError, GitError
from engine.gates.gitwatch import comparable, fingerprint
from engine.git import GitResult, GitRunner
from engine.redact import Redactor
from tests.fakes.bot_harness import wait_for_file
from tests.test_workspace_git import git, git_test_env


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for key, value in git_test_env(tmp_path / "home").items():
        monkeypatch.setenv(key, value)
    path = tmp_path / "repo"
    path.mkdir()
    git("init", "-q", "-b", "main", cwd=path)
    (path / "a.txt").write_text("one\n")
    git("add", "-A", cwd=path)
    git("commit", "-q", "-m", "first", cwd=path)
    return path


def _fake_git(tmp_path: Path, body: str) -> Path:
    """A stand-in ``git`` program (a real process) for what real git will not do on cue."""
    path = tmp_path / "fake-git"
    path.write_text(f"#!{sys.executable}\nimport os, sys, time\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


async def test_a_result_carries_code_and_output(repo: Path) -> None:
    runner = GitRunner()
    result = await runner.run(["log", "--format=%s"], cwd=repo)
    assert isinstance(result, GitResult)
    assert result.ok
    assert result.exit_code == 0
    assert result.lines == ["first"]
    assert result.raw_stdout == b"first\n"
    missing = await runner.run(["rev-parse", "--verify", "-q", "nosuch"], cwd=repo, check=False)
    assert not missing.ok
    assert missing.exit_code == 1
    assert missing.stdout == ""


async def test_a_failure_with_check_is_a_typed_redacted_error(repo: Path) -> None:
    secret = "ghp_" + "x" * 36
    runner = GitRunner(redactor=Redactor(secrets=(secret,)))
    with pytest.raises(GitError) as info:
        await runner.run(["checkout", f"no-branch-{secret}"], cwd=repo)
    error = info.value
    assert error.command == "checkout"
    assert error.exit_code == 1
    assert secret not in error.message
    assert secret not in error.stderr
    assert "did not match" in error.stderr
    assert not error.retryable


async def test_hooks_never_run(repo: Path) -> None:
    marker = repo.parent / "hook-ran"
    hook = repo / ".git" / "hooks" / "pre-commit"
    hook.write_text(f"#!/bin/sh\ntouch {marker}\n")
    hook.chmod(0o755)
    (repo / "b.txt").write_text("two\n")
    runner = GitRunner()
    await runner.run(["add", "b.txt"], cwd=repo)
    await runner.run(["commit", "-q", "-m", "second"], cwd=repo)
    assert not marker.exists()
    hooks = await runner.run(["config", "--get", "core.hooksPath"], cwd=repo)
    assert hooks.stdout.strip() == os.devnull
    # The same hook does run for a plain git: the test can tell.
    (repo / "c.txt").write_text("three\n")
    git("add", "c.txt", cwd=repo)
    git("commit", "-q", "-m", "third", cwd=repo)
    assert marker.exists()


async def test_git_that_cannot_start_is_an_error(tmp_path: Path) -> None:
    runner = GitRunner(binary=str(tmp_path / "no-such-git"))
    with pytest.raises(GitError, match="not found") as info:
        await runner.run(["status"], cwd=tmp_path, check=False)
    assert info.value.exit_code is None
    assert info.value.command == "status"
    with pytest.raises(GitError, match="does not exist"):
        await GitRunner().run(["status"], cwd=tmp_path / "gone", check=False)


async def test_auto_mode_facts_do_not_turn_a_missing_git_into_no(tmp_path: Path) -> None:
    facts = Git(tmp_path, runner=GitRunner(binary=str(tmp_path / "no-such-git")))
    with pytest.raises(GitError, match="not found"):
        await facts.is_repo()
    with pytest.raises(GitError, match="not found"):
        await facts.head()


async def test_auto_mode_facts_read_a_real_repository(repo: Path, tmp_path: Path) -> None:
    facts = Git(repo)
    assert await facts.is_repo()
    base = await facts.head()
    assert base is not None
    (repo / "a.txt").write_text("one\ntwo\n")
    assert await facts.dirty_paths([]) == ["a.txt"]
    git("commit", "-q", "-am", "more", cwd=repo)
    assert [line.split(" ", 1)[1] for line in await facts.commits_since(base)] == ["more"]
    assert await facts.diff_stat(base) == (1, 1, 0)
    assert not await facts.has_remote()
    plain = tmp_path / "plain"
    plain.mkdir()
    assert not await Git(plain).is_repo()


async def test_the_fingerprint_follows_edits_and_needs_git(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = await fingerprint(repo)
    assert before is not None
    assert await fingerprint(repo) == before
    (repo / "a.txt").write_bytes(b"\xff\xfe not utf-8\n")
    changed = await fingerprint(repo)
    assert changed not in (None, before)
    (repo / "new.txt").write_text("untracked\n")
    assert await fingerprint(repo) != changed
    assert await fingerprint(repo, exclude=repo / "new.txt") == changed
    assert await fingerprint(tmp_path) is None  # not a work tree: no git is asked
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(GitError, match="not found"):
        await fingerprint(repo)


async def test_the_fingerprint_is_the_code_not_the_commit(repo: Path) -> None:
    """Committing the task folder alone (a worker does after every step) changes no code;
    committing code does; an older form of fingerprint is not compared with this one."""
    folder = repo / ".turnstile" / "tasks" / "t"
    folder.mkdir(parents=True)
    before = await fingerprint(repo, exclude=folder)
    (folder / "research.md").write_text("findings\n")
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "the task folder", cwd=repo)
    assert await fingerprint(repo, exclude=folder) == before
    (repo / "code.py").write_text("x = 1\n")
    git("add", "code.py", cwd=repo)
    git("commit", "-q", "-m", "code", cwd=repo)
    after = await fingerprint(repo, exclude=folder)
    assert after != before
    assert comparable(before, after)
    assert not comparable("0123abcd" * 8, after)  # recorded by an older version
    assert not comparable(None, after)


async def test_disk_full_is_recognised(tmp_path: Path) -> None:
    fake = _fake_git(
        tmp_path,
        "sys.stderr.write('fatal: write error: No space left on device\\n'); sys.exit(128)",
    )
    with pytest.raises(DiskFullError, match="free some disk space") as info:
        await GitRunner(binary=str(fake)).run(["fetch"], cwd=tmp_path)
    assert info.value.retryable
    assert info.value.exit_code == 128


async def test_the_environment_is_non_interactive(tmp_path: Path) -> None:
    fake = _fake_git(
        tmp_path,
        "keys = ('GIT_TERMINAL_PROMPT', 'LC_ALL', 'GIT_OPTIONAL_LOCKS', 'GIT_CONFIG_COUNT')\n"
        "print(' '.join(f'{k}={os.environ.get(k)}' for k in keys))",
    )
    locking = await GitRunner(binary=str(fake)).run(["status"], cwd=tmp_path)
    assert locking.stdout.split() == [
        "GIT_TERMINAL_PROMPT=0",
        "LC_ALL=C",
        "GIT_OPTIONAL_LOCKS=None",
        "GIT_CONFIG_COUNT=2",  # no hooks, no file-system monitor
    ]
    reading = await GitRunner(binary=str(fake), optional_locks=False).run(["status"], cwd=tmp_path)
    assert "GIT_OPTIONAL_LOCKS=0" in reading.stdout.split()


async def test_cancelling_kills_the_git_process(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    fake = _fake_git(
        tmp_path,
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\nwhile True:\n    time.sleep(60)",
    )
    task = asyncio.create_task(GitRunner(binary=str(fake)).run(["fetch"], cwd=tmp_path))
    pid = int(await wait_for_file(pid_file))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped: the whole group was killed and waited for

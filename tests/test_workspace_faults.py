"""Workspaces under faults: a full disk, a failing checkout, two processes at once."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.workspace import DiskFullError, Project, WorkspaceManager
from tests.test_workspace_git import git, git_test_env, make_remote

REPO = Path(__file__).resolve().parent.parent
REAL_GIT = shutil.which("git") or "git"


@pytest.fixture
def git_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = git_test_env(tmp_path / "home")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def wrapper(tmp_path: Path, body: str) -> Path:
    """A ``git`` stand-in: ``body`` (sh) runs first, then the real git."""
    path = tmp_path / "bin" / "git"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\n{body}\nexec {REAL_GIT} "$@"\n')
    path.chmod(0o755)
    return path


# Writes a little into the clone's target folder, then fails the way a full disk does.
_FULL_DISK_CLONE = """
if [ "$1" = "clone" ]; then
  for last; do :; done
  mkdir -p "$last/objects" && head -c 4096 /dev/zero > "$last/objects/partial"
  echo "fatal: write error: No space left on device" >&2
  exit 128
fi
"""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A 1 MB tmpfs when we may mount one, else an injected failure of git clone."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = (
        os.geteuid() == 0
        and shutil.which("mount") is not None
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    if not mounted:
        yield mount, str(wrapper(tmp_path, _FULL_DISK_CLONE))
        return
    try:
        yield mount, "git"
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, check=False)


async def test_a_full_disk_while_cloning_leaves_no_partial_clone(
    tmp_path: Path, git_env: dict[str, str], small_disk: tuple[Path, str]
) -> None:
    root, git_binary = small_disk
    remote = make_remote(tmp_path, big=3 * 1024 * 1024)
    manager = WorkspaceManager(root / "ws", [Project("demo", str(remote), "main")], git=git_binary)

    with pytest.raises(DiskFullError, match="no space left on device") as info:
        await manager.provision("run1", "demo")

    assert info.value.retryable
    assert info.value.command == "clone"
    cache = manager.root / "cache"
    assert list(cache.iterdir()) == []
    assert not manager.worktree_path("demo", "run1").exists()


async def test_a_failed_checkout_is_undone_and_can_be_retried(
    tmp_path: Path, git_env: dict[str, str]
) -> None:
    remote = make_remote(tmp_path)
    failing = wrapper(
        tmp_path,
        'if [ "$1" = "worktree" ] && [ "$2" = "add" ]; then\n'
        '  echo "error: unable to write file: No space left on device" >&2; exit 128\nfi',
    )
    project = Project("demo", str(remote), "main")
    broken = WorkspaceManager(tmp_path / "ws", [project], git=str(failing))
    with pytest.raises(DiskFullError):
        await broken.provision("run1", "demo")
    cache = broken.cache_path("demo")
    assert not broken.worktree_path("demo", "run1").exists()
    assert git("branch", "--list", "turnstile/*", cwd=cache) == ""

    manager = WorkspaceManager(tmp_path / "ws", [project])
    ws = await manager.provision("run1", "demo")
    assert (ws.path / "README.md").exists()


_STARTER = """
import asyncio, pathlib, sys
from engine.workspace import Project, WorkspaceManager

async def main():
    root, remote, git_binary, run_id = sys.argv[1:5]
    manager = WorkspaceManager(
        pathlib.Path(root), [Project("demo", remote, "main")], git=git_binary
    )
    print("ready", flush=True)
    sys.stdin.readline()
    ws = await manager.provision(run_id, "demo")
    print(ws.path, flush=True)

asyncio.run(main())
"""


@pytest.mark.timeout(90)
async def test_two_processes_starting_at_once_clone_once(
    tmp_path: Path, git_env: dict[str, str]
) -> None:
    remote = make_remote(tmp_path)
    log = tmp_path / "git.log"
    logging_git = wrapper(tmp_path, f'echo "$1" >> {log}')
    root = tmp_path / "ws"
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _STARTER,
            str(root),
            str(remote),
            str(logging_git),
            run_id,
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        for run_id in ("run-a", "run-b")
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert await proc.stdout.readline() == b"ready\n"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
        paths = []
        for proc in procs:
            out, _ = await proc.communicate()
            assert proc.returncode == 0
            paths.append(Path(out.decode().strip()))
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    assert paths == [root / "worktrees" / "demo" / "run-a", root / "worktrees" / "demo" / "run-b"]
    assert log.read_text().splitlines().count("clone") == 1
    cache = root / "cache"
    assert sorted(p.name for p in cache.iterdir()) == ["demo.git"]
    for path, run_id in zip(paths, ("run-a", "run-b"), strict=True):
        assert git("symbolic-ref", "--short", "HEAD", cwd=path) == f"turnstile/{run_id}"


async def test_cancelling_a_clone_kills_git_and_removes_the_partial_clone(
    tmp_path: Path, git_env: dict[str, str]
) -> None:
    remote = make_remote(tmp_path)
    fifo = tmp_path / "started"
    os.mkfifo(fifo)
    slow = wrapper(
        tmp_path,
        'if [ "$1" = "clone" ]; then\n'
        "  for last; do :; done\n"
        '  mkdir -p "$last/objects"\n'
        f"  echo $$ > {fifo}\n"
        "  exec sleep 60\n"
        "fi",
    )
    manager = WorkspaceManager(
        tmp_path / "ws", [Project("demo", str(remote), "main")], git=str(slow)
    )
    task = asyncio.create_task(manager.provision("run1", "demo"))

    def read_pid() -> int:
        with open(fifo) as fh:
            return int(fh.readline())

    pid = await asyncio.to_thread(read_pid)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert list((manager.root / "cache").iterdir()) == []
    # Nothing is left locked: a working git provisions at once.
    fine = WorkspaceManager(manager.root, manager.projects)
    ws = await fine.provision("run1", "demo")
    assert (ws.path / "README.md").exists()

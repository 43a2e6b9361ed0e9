"""Workspaces against real git: a bare repository in tmp is the remote."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from engine.agents.factory import create_agent
from engine.settings import Settings
from engine.store import SqliteRunStore
from engine.store.backend import AnyDatabase, open_database
from engine.store.location import PostgresURL
from engine.workspace import (
    MergeOutcome,
    Project,
    SqliteWorkspaceStore,
    Workspace,
    WorkspaceBusyError,
    WorkspaceManager,
    WorkspaceStateError,
)
from tests.support import UNCONFINED

REPO = Path(__file__).resolve().parent.parent
FAKE_AGENT = REPO / "tests" / "fake_agent.py"


def git(*args: str, cwd: Path) -> str:
    """Run git in the test, failing loudly."""
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"git {args} failed: {done.stderr}"
    return done.stdout.strip()


def git_test_env(home: Path) -> dict[str, str]:
    """An isolated git environment: no system or user config, a fixed identity."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": str(home / ".gitconfig"),
    }
    for role in ("AUTHOR", "COMMITTER"):
        env[f"GIT_{role}_NAME"] = "Turnstile Test"
        env[f"GIT_{role}_EMAIL"] = "test@turnstile.invalid"
    return env


@pytest.fixture
def git_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    env = git_test_env(tmp_path / "home")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in list(os.environ):
        if key.startswith("TURNSTILE_") or key.lower().endswith("_proxy"):
            monkeypatch.delenv(key)
    for key, value in UNCONFINED.items():
        monkeypatch.setenv(key, value)
    return env


def make_remote(tmp_path: Path, name: str = "remote", big: int = 0) -> Path:
    """A bare repository with one commit on main (README.md, shared.txt)."""
    seed = tmp_path / f"{name}-seed"
    seed.mkdir()
    git("init", "-q", "-b", "main", cwd=seed)
    (seed / "README.md").write_text("# demo\n")
    (seed / "shared.txt").write_text("line 1\nline 2\nline 3\n")
    if big:
        (seed / "blob.bin").write_bytes(os.urandom(big))
    git("add", "-A", cwd=seed)
    git("commit", "-q", "-m", "initial", cwd=seed)
    bare = tmp_path / f"{name}.git"
    git("clone", "-q", "--bare", str(seed), str(bare), cwd=tmp_path)
    return bare


@pytest.fixture
def remote(tmp_path: Path, git_env: dict[str, str]) -> Path:
    return make_remote(tmp_path)


@pytest.fixture
async def db(db_target: Path | PostgresURL) -> AsyncIterator[AnyDatabase]:
    """The store on a SQLite file and on a fresh PostgreSQL database in turn."""
    async with open_database(db_target) as database:
        yield database


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def manager(tmp_path: Path, remote: Path, db: AnyDatabase, clock: Clock) -> WorkspaceManager:
    return WorkspaceManager(
        tmp_path / "workspaces",
        [Project("demo", str(remote), "main")],
        store=SqliteWorkspaceStore(db),
        clock=clock,
    )


def commit_file(path: Path, name: str, text: str, message: str) -> str:
    (path / name).write_text(text)
    git("add", name, cwd=path)
    git("commit", "-q", "-m", message, cwd=path)
    return git("rev-parse", "HEAD", cwd=path)


async def test_provision_clones_into_cache_and_cuts_a_branch(
    manager: WorkspaceManager, remote: Path
) -> None:
    ws = await manager.provision("run1", "demo")

    assert ws.path == manager.root / "worktrees" / "demo" / "run1"
    assert ws.branch == "turnstile/run1"
    assert ws.base == git("rev-parse", "main", cwd=remote)
    assert ws.base_ref == "origin/main"
    assert git("symbolic-ref", "--short", "HEAD", cwd=ws.path) == "turnstile/run1"
    assert (ws.path / "README.md").read_text() == "# demo\n"
    assert (manager.root / "cache" / "demo.git").is_dir()
    assert await manager.get("run1") == ws
    status = await manager.status(ws)
    assert (status.dirty, status.commits, status.branch) == (False, (), "turnstile/run1")


async def test_later_runs_fetch_new_commits(manager: WorkspaceManager, tmp_path: Path) -> None:
    first = await manager.provision("run1", "demo")
    # Someone pushes to the remote's main after the first clone.
    other = tmp_path / "other"
    git("clone", "-q", str(manager.projects[0].url), str(other), cwd=tmp_path)
    pushed = commit_file(other, "new.txt", "new\n", "pushed later")
    git("push", "-q", "origin", "main", cwd=other)

    second = await manager.provision("run2", "demo")

    assert second.base == pushed != first.base
    assert (second.path / "new.txt").exists()
    assert not (first.path / "new.txt").exists()


async def test_two_concurrent_fake_agent_runs_commit_to_their_own_branches(
    manager: WorkspaceManager, tmp_path: Path, remote: Path
) -> None:
    script = tmp_path / "script.json"
    rules = [
        {
            "match": f"write {name}",
            "text": f"wrote {name}",
            "files": {f"{name}.txt": f"from {name}\n"},
            "run": [["git", "add", f"{name}.txt"], ["git", "commit", "-q", "-m", f"add {name}"]],
        }
        for name in ("alpha", "beta")
    ]
    script.write_text(json.dumps({"rules": rules}))
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    template = f"{sys.executable} {FAKE_AGENT} --session {{session_id}} --prompt {{prompt}}"

    # Both runs start at once on a project that is not cloned yet.
    a, b = await asyncio.gather(
        manager.provision("run-a", "demo"), manager.provision("run-b", "demo")
    )
    assert a.path != b.path

    async def drive(ws_run: str, name: str) -> str:
        ws = await manager.get(ws_run)
        assert ws is not None
        async with manager.lock(ws):
            agent = create_agent(
                "command",
                settings,
                cwd=ws.path,
                session_id=f"session-{name}",
                agent_cmd=template,
                extra_env={"FAKE_AGENT_SCRIPT": str(script)},
            )
            out = await agent.run_turn(f"please write {name}")
        return out.text

    assert await asyncio.gather(drive("run-a", "alpha"), drive("run-b", "beta")) == [
        "wrote alpha",
        "wrote beta",
    ]
    cache = manager.cache_path("demo")
    files_a = git("ls-tree", "--name-only", "turnstile/run-a", cwd=cache).split()
    files_b = git("ls-tree", "--name-only", "turnstile/run-b", cwd=cache).split()
    assert "alpha.txt" in files_a
    assert "beta.txt" not in files_a
    assert "beta.txt" in files_b
    assert "alpha.txt" not in files_b
    # The remote's main is untouched; each worktree is clean and has one commit.
    assert git("rev-parse", "main", cwd=remote) == a.base == b.base
    for ws, subject in ((a, "add alpha"), (b, "add beta")):
        status = await manager.status(ws)
        assert not status.dirty
        assert [c.split(" ", 1)[1] for c in status.commits] == [subject]


async def test_a_worktree_is_never_shared(manager: WorkspaceManager) -> None:
    async with manager.checkout("run1", "demo") as ws:
        with pytest.raises(WorkspaceBusyError):
            async with manager.checkout("run1", "demo"):
                pass
        # A second manager (its own flock) is refused too.
        other = WorkspaceManager(manager.root, manager.projects)
        with pytest.raises(WorkspaceBusyError):
            async with other.lock(ws):
                pass
    async with other.lock(ws):
        pass


_HOLDER = """
import asyncio, pathlib, sys
from engine.store.backend import open_database
from engine.workspace import Project, SqliteWorkspaceStore, WorkspaceManager

async def main():
    root, db_path, remote = sys.argv[1:4]
    async with open_database(db_path) as db:
        manager = WorkspaceManager(
            pathlib.Path(root), [Project("demo", remote, "main")], store=SqliteWorkspaceStore(db)
        )
        async with manager.checkout("run-crash", "demo") as ws:
            (ws.path / "wip.txt").write_text("unsaved work\\n")
            print(ws.path, flush=True)
            await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.timeout(90)
async def test_resume_after_a_crash_finds_the_same_worktree(
    manager: WorkspaceManager, remote: Path, db_target: Path | PostgresURL
) -> None:
    where = db_target.conninfo() if isinstance(db_target, PostgresURL) else str(db_target)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _HOLDER,
        str(manager.root),
        where,
        str(remote),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        path = Path(line.decode().strip())
        ws = await manager.get("run-crash")
        assert ws is not None
        assert ws.path == path
        # Another process holds it: this one is refused.
        with pytest.raises(WorkspaceBusyError, match="in use by another run"):
            async with manager.lock(ws):
                pass
    finally:
        proc.kill()
        await proc.wait()

    resumed = await manager.provision("run-crash", "demo")

    assert resumed == ws
    assert (resumed.path / "wip.txt").read_text() == "unsaved work\n"
    async with manager.checkout("run-crash", "demo") as again:
        assert again.path == path


async def test_resume_recreates_a_missing_folder_from_the_branch(
    manager: WorkspaceManager,
) -> None:
    ws = await manager.provision("run1", "demo")
    head = commit_file(ws.path, "work.txt", "done\n", "work")
    removed = await manager.remove(ws)
    assert removed.removed_at is not None
    assert not ws.path.exists()

    again = await manager.provision("run1", "demo")

    assert again.path == ws.path
    assert again.base == ws.base
    assert again.removed_at is None
    assert git("rev-parse", "HEAD", cwd=again.path) == head


async def test_a_half_made_worktree_left_by_a_crash_is_replaced(
    manager: WorkspaceManager,
) -> None:
    await manager.provision("run0", "demo")  # the cache exists
    leftover = manager.worktree_path("demo", "run1")
    leftover.mkdir(parents=True)
    (leftover / "partial").write_text("x")

    ws = await manager.provision("run1", "demo")

    assert ws.path == leftover
    assert not (leftover / "partial").exists()
    assert (leftover / "README.md").exists()


async def test_a_recorded_folder_git_does_not_know_is_left_alone(
    manager: WorkspaceManager,
) -> None:
    ws = await manager.provision("run1", "demo")
    git("worktree", "remove", "--force", str(ws.path), cwd=manager.cache_path("demo"))
    ws.path.mkdir()
    (ws.path / "precious").write_text("x")

    with pytest.raises(WorkspaceStateError, match="inspect it by hand"):
        await manager.provision("run1", "demo")
    assert (ws.path / "precious").exists()


async def test_wave_two_subtasks_merge_and_one_conflicts(manager: WorkspaceManager) -> None:
    parent = await manager.provision("run1", "demo")
    commit_file(parent.path, "plan.md", "plan\n", "plan")
    subs = [await manager.provision_subtask(parent, n) for n in ("a", "b", "c")]
    assert [s.branch for s in subs] == [f"turnstile/run1--{n}" for n in "abc"]
    assert {s.base for s in subs} == {git("rev-parse", "HEAD", cwd=parent.path)}
    assert all((s.path / "plan.md").exists() for s in subs)

    a, b, c = subs
    commit_file(a.path, "shared.txt", "line 1\nline 2 from a\nline 3\n", "a edits line 2")
    commit_file(a.path, "a.txt", "a\n", "a adds a file")
    commit_file(b.path, "b.txt", "b\n", "b adds a file")
    commit_file(c.path, "shared.txt", "line 1\nline 2 from c\nline 3\n", "c edits line 2")
    (c.path / "scratch.txt").write_text("not committed\n")

    report = await manager.merge_wave(parent, subs)

    outcomes = {r.name: r.outcome for r in report.results}
    assert outcomes == {
        "a": MergeOutcome.MERGED,
        "b": MergeOutcome.MERGED,
        "c": MergeOutcome.CONFLICT,
    }
    conflict = report.conflicted[0]
    assert conflict.conflicts == ("shared.txt",)
    assert conflict.uncommitted
    assert [r.name for r in report.not_merged] == ["c"]
    # The parent holds a's and b's work, no trace of c, and is clean (merge aborted).
    assert (parent.path / "a.txt").exists()
    assert (parent.path / "b.txt").exists()
    assert "from a" in (parent.path / "shared.txt").read_text()
    assert git("status", "--porcelain", cwd=parent.path) == ""
    assert report.head == git("rev-parse", "HEAD", cwd=parent.path)
    parents = git("log", "--merges", "--format=%s", cwd=parent.path).splitlines()
    assert len(parents) == 2
    # Merged sub-tasks are released (cleanup may take them); the conflicting one is not.
    released = {w.id: w.released_at for w in await manager.workspaces("run1")}
    assert released["run1--a"] is not None
    assert released["run1--c"] is None

    # Merging again is a no-op for a and b.
    again = await manager.merge_wave(parent, subs[:2])
    assert {r.outcome for r in again.results} == {MergeOutcome.UP_TO_DATE}


async def test_wave_merge_skips_a_subtask_still_running(manager: WorkspaceManager) -> None:
    parent = await manager.provision("run1", "demo")
    sub = await manager.provision_subtask(parent, "slow")
    commit_file(sub.path, "s.txt", "s\n", "s")
    other = WorkspaceManager(manager.root, manager.projects)
    async with other.lock(sub):
        report = await manager.merge_wave(parent, [sub])
    assert report.results[0].outcome is MergeOutcome.BUSY


async def test_wave_merge_refuses_a_dirty_parent(manager: WorkspaceManager) -> None:
    parent = await manager.provision("run1", "demo")
    sub = await manager.provision_subtask(parent, "a")
    (parent.path / "README.md").write_text("edited\n")
    with pytest.raises(WorkspaceStateError, match="uncommitted"):
        await manager.merge_wave(parent, [sub])


async def test_cleanup_rescues_a_dirty_worktree_before_removing_it(
    manager: WorkspaceManager, clock: Clock
) -> None:
    dirty = await manager.provision("dirty", "demo")
    clean = await manager.provision("clean", "demo")
    young = await manager.provision("young", "demo")
    running = await manager.provision("running", "demo")
    (dirty.path / "README.md").write_text("# changed, never committed\n")
    (dirty.path / "notes").mkdir()
    (dirty.path / "notes" / "new.txt").write_text("untracked work\n")
    for ws in (dirty, clean):
        await manager.release(ws)
    clock.now += 7200
    await manager.release(young)
    await manager.release(running)

    other = WorkspaceManager(manager.root, manager.projects)
    async with other.lock(running):
        report = await manager.cleanup(retention=3600)

    assert sorted(report.removed) == ["clean", "dirty"]
    assert report.rescued == {"dirty": "turnstile/rescue/dirty"}
    assert sorted(report.kept) == ["running", "young"]
    assert report.busy == ()
    assert not dirty.path.exists()
    assert not clean.path.exists()
    assert young.path.exists()
    cache = manager.cache_path("demo")
    rescued = "turnstile/rescue/dirty"
    assert git("show", f"{rescued}:README.md", cwd=cache) == "# changed, never committed"
    assert git("show", f"{rescued}:notes/new.txt", cwd=cache) == "untracked work"
    assert git("rev-parse", f"{rescued}^", cwd=cache) == dirty.base
    # The run branches stay; records say removed.
    assert git("rev-parse", "--verify", "turnstile/clean", cwd=cache)
    record = await manager.get("dirty")
    assert record is not None
    assert record.removed_at is not None
    assert record.rescue_branch == rescued

    # The held one is only reported busy once its retention has passed.
    clock.now += 7200
    async with other.lock(running):
        later = await manager.cleanup(retention=3600)
    assert later.busy == ("running",)
    assert later.removed == ("young",)


async def test_cleanup_counts_retention_from_the_runs_table(
    manager: WorkspaceManager, db: AnyDatabase, clock: Clock
) -> None:
    runs = SqliteRunStore(db)
    await runs.create_run("run1", mode="auto", agent="command", session_id="s1")
    ws = await manager.provision("run1", "demo")
    first = await manager.cleanup(retention=60, now=clock.now + 3600)
    assert first.kept == ("run1",)
    await runs.update_run("run1", finished_at=clock.now, status="completed")

    report = await manager.cleanup(retention=60, now=clock.now + 3600)

    assert report.removed == ("run1",)
    assert not ws.path.exists()


async def test_usage_counts_the_run_and_its_subtasks(manager: WorkspaceManager) -> None:
    parent = await manager.provision("run1", "demo")
    before = await manager.usage("run1")
    sub = await manager.provision_subtask(parent, "a")
    (sub.path / "big.bin").write_bytes(b"x" * 200_000)

    after = await manager.usage("run1")

    assert before > 0
    assert after >= before + 200_000
    assert await manager.usage("nobody") == 0


async def test_summary_shows_branch_and_disk_usage(manager: WorkspaceManager) -> None:
    assert await manager.summary("run1") is None
    parent = await manager.provision("run1", "demo")
    assert (await manager.summary("run1") or "").startswith("turnstile/run1 · ")
    await manager.provision_subtask(parent, "a")
    (parent.path / "big.bin").write_bytes(b"x" * 2_000_000)
    summary = await manager.summary("run1")
    assert summary is not None
    assert summary.startswith("turnstile/run1 +1 sub-task · 2.")
    assert summary.endswith(" MB")


async def test_wave_merge_refuses_a_parent_on_another_branch(manager: WorkspaceManager) -> None:
    parent = await manager.provision("run1", "demo")
    sub = await manager.provision_subtask(parent, "a")
    git("checkout", "-q", "-b", "elsewhere", cwd=parent.path)
    with pytest.raises(WorkspaceStateError, match="not on turnstile/run1"):
        await manager.merge_wave(parent, [sub])


async def test_run_helpers_provision_and_hold_the_run_worktree(
    tmp_path: Path, remote: Path, db: AnyDatabase
) -> None:
    from engine.settings import load_settings
    from engine.workspace import (
        hold_run_workspace,
        provision_for_run,
        release_run_workspace,
        run_worktree_summary,
    )

    settings = load_settings(workspaces=tmp_path / "ws", projects=f"demo={remote}#main")
    ws = await provision_for_run(settings, db, "demo", "auto-1")
    assert ws.branch == "turnstile/auto-1"
    async with hold_run_workspace(settings, db, "auto-1") as held:
        assert held == ws
        with pytest.raises(WorkspaceBusyError):
            async with hold_run_workspace(settings, db, "auto-1"):
                pass
    async with hold_run_workspace(settings, db, "no-worktree") as none:
        assert none is None
    summary = await run_worktree_summary(settings, db, "auto-1")
    assert summary is not None
    assert summary.startswith("turnstile/auto-1 · ")
    assert await run_worktree_summary(settings, db, "no-worktree") is None
    # Resuming the run finds the same worktree.
    assert await provision_for_run(settings, db, "demo", "auto-1") == ws
    assert await release_run_workspace(settings, db, "auto-1")
    assert not await release_run_workspace(settings, db, "no-worktree")
    released = await SqliteWorkspaceStore(db).get("auto-1")
    assert released is not None
    assert released.released_at is not None


async def test_a_changed_url_in_the_settings_is_used_by_the_next_fetch(
    manager: WorkspaceManager, tmp_path: Path, remote: Path
) -> None:
    await manager.provision("run1", "demo")
    moved = tmp_path / "moved.git"
    git("clone", "-q", "--bare", str(remote), str(moved), cwd=tmp_path)
    work = tmp_path / "work"
    git("clone", "-q", str(moved), str(work), cwd=tmp_path)
    pushed = commit_file(work, "moved.txt", "moved\n", "only on the new remote")
    git("push", "-q", "origin", "main", cwd=work)

    relocated = WorkspaceManager(manager.root, [Project("demo", str(moved), "main")])
    ws = await relocated.provision("run2", "demo")

    assert ws.base == pushed


async def test_a_partial_clone_left_by_a_crash_is_cleared(
    manager: WorkspaceManager,
) -> None:
    stale = manager.root / "cache" / ".demo.partial-deadbeef"
    (stale / "objects").mkdir(parents=True)

    ws = await manager.provision("run1", "demo")

    assert not stale.exists()
    assert sorted(p.name for p in (manager.root / "cache").iterdir()) == ["demo.git"]
    assert (ws.path / "README.md").exists()


async def test_a_worktree_made_but_not_recorded_before_a_crash_is_adopted(
    tmp_path: Path, remote: Path, manager: WorkspaceManager
) -> None:
    parent = await manager.provision("run1", "demo")
    sub = await manager.provision_subtask(parent, "a")
    # Another manager with an empty store: as if the records were never written.
    forgetful = WorkspaceManager(manager.root, manager.projects)

    adopted = await forgetful.provision_subtask(parent, "a")

    assert adopted.path == sub.path
    assert adopted.branch == sub.branch
    assert adopted.parent_id == "run1"
    assert adopted.run_id == "run1"


async def test_checkout_for_run_removes_the_worktree_if_the_run_cannot_start(
    tmp_path: Path, remote: Path, db: AnyDatabase
) -> None:
    from engine.errors import ConfigError
    from engine.settings import load_settings
    from engine.workspace import checkout_for_run

    settings = load_settings(workspaces=tmp_path / "ws", projects=f"demo={remote}#main")
    async with checkout_for_run(settings, db, None, run_id="auto-0") as none:
        assert none is None
    with pytest.raises(ConfigError, match="exclude each other"):
        async with checkout_for_run(settings, db, "demo", run_id="auto-x", workdir=tmp_path):
            pass

    async with checkout_for_run(settings, db, "demo", run_id="auto-1") as kept:
        assert kept is not None
        assert kept.run_id == "auto-1"
    assert kept.path.is_dir()

    seen: list[Workspace] = []

    async def start_run_that_fails() -> None:
        async with checkout_for_run(settings, db, "demo", run_id="auto-2") as failed:
            assert failed is not None
            seen.append(failed)
            raise RuntimeError("recording failed")

    with pytest.raises(RuntimeError, match="recording failed"):
        await start_run_that_fails()
    assert not seen[0].path.exists()


async def test_cleanup_counts_a_completed_gated_task_as_finished(
    manager: WorkspaceManager, db: AnyDatabase, clock: Clock
) -> None:
    ws = await manager.provision("feature-x", "demo")

    async def set_phase(phase: str) -> None:
        await db.execute(
            "INSERT INTO gate_tasks (name, folder, workdir, phase, version, created_at,"
            " updated_at) VALUES (?, ?, ?, ?, 1, ?, ?) ON CONFLICT (name) DO UPDATE SET"
            " phase = excluded.phase",
            ("feature-x", "/tasks/feature-x", str(ws.path), phase, clock.now, clock.now),
        )

    await set_phase("implement")
    assert (await manager.cleanup(retention=60, now=clock.now + 3600)).kept == ("feature-x",)
    await set_phase("complete")

    report = await manager.cleanup(retention=60, now=clock.now + 3600)

    assert report.removed == ("feature-x",)


async def test_hooks_an_agent_plants_in_the_shared_clone_never_run(
    manager: WorkspaceManager, tmp_path: Path
) -> None:
    first = await manager.provision("run1", "demo")
    marker = tmp_path / "hook-ran"
    hooks = manager.cache_path("demo") / "hooks"
    for hook in ("post-checkout", "pre-merge-commit", "commit-msg", "prepare-commit-msg"):
        (hooks / hook).write_text(f"#!/bin/sh\necho {hook} >> {marker}\nexit 1\n")
        (hooks / hook).chmod(0o755)

    sub = await manager.provision_subtask(first, "a")
    await manager.provision("run2", "demo")
    git("-c", "core.hooksPath=/dev/null", "commit", "-q", "--allow-empty", "-m", "x", cwd=sub.path)
    report = await manager.merge_wave(first, [sub])

    assert report.results[0].outcome is MergeOutcome.MERGED
    assert not marker.exists()

"""Glue for commands that start runs: the ``--checkout-repo`` flag and the run's lock.

``turnstile auto`` and ``turnstile autopilot`` call these so that their own code only
grows by a few lines::

    add_checkout_argument(parser)
    ...
    run_id = supervisor.reserve(RunMode.AUTO)  # the worktree is named after the run
    async with checkout_for_run(settings, db, args.checkout_repo, run_id=run_id) as ws:
        # ws is None without --checkout-repo; else its cwd is ws.path.
        run = await prepare(..., workdir=ws.path if ws else workdir, run_id=...)
    async with hold_run_workspace(settings, db, run_id):
        ... drive the run ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError
from engine.workspace.store import SqliteWorkspaceStore, Workspace

if TYPE_CHECKING:
    from engine.settings import Settings
    from engine.store.backend import AnyDatabase
    from engine.workspace.manager import BranchPush

__all__ = [
    "add_checkout_argument",
    "checkout_for_run",
    "hold_run_workspace",
    "match_worktrees",
    "provision_for_run",
    "push_run_branch",
    "release_run_workspace",
    "run_worktree_summary",
    "worktree_summaries",
]


def add_checkout_argument(parser: argparse.ArgumentParser | Any) -> None:
    """Add ``--checkout-repo REPO`` to a command's parser."""
    parser.add_argument(
        "--checkout-repo",
        metavar="REPO",
        default=None,
        help="work in a fresh git worktree on branch turnstile/<run-id> of a project "
        "(its name in TURNSTILE_PROJECTS; see `turnstile projects`), a git URL, or a "
        "repository path such as ./web (named after the repository)",
    )


async def provision_for_run(
    settings: Settings, db: AnyDatabase, project: str, run_id: str
) -> Workspace:
    """The run's worktree of ``project`` (cloned or fetched as needed; the same on resume).

    Raises:
        ProjectError: unknown or misconfigured project (a ``ConfigError``).
        GitError: git failed.
        WorkspaceError: the worktree is damaged.
    """
    from engine.workspace.manager import WorkspaceManager  # start-up time: when used

    manager = WorkspaceManager.from_settings(settings, store=SqliteWorkspaceStore(db))
    return await manager.provision(run_id, project)


@contextlib.asynccontextmanager
async def checkout_for_run(
    settings: Settings,
    db: AnyDatabase,
    project: str | None,
    *,
    run_id: str,
    workdir: Path | None = None,
) -> AsyncIterator[Workspace | None]:
    """The new run's worktree of ``project`` for the body, or None without a project.

    ``project`` is a configured project's name, a git URL or a repository path (see
    :meth:`WorkspaceManager.project_for`).

    ``run_id`` keys the worktree (a run's id from the run supervisor's ``reserve``, or a
    task's name). If the body fails (the run could not be recorded), a worktree made here
    is removed again (rescued if dirty).

    Raises:
        ConfigError: both a project and an explicit ``workdir``; ``ProjectError``.
        GitError: git failed.
    """
    if project is None:
        yield None
        return
    if workdir is not None:
        raise ConfigError("--checkout-repo and --workdir exclude each other")
    from engine.workspace.manager import WorkspaceManager  # start-up time: when used

    manager = WorkspaceManager.from_settings(settings, store=SqliteWorkspaceStore(db))
    chosen = manager.project_for(project)
    existed = await manager.get(run_id) is not None
    workspace = await manager.provision(run_id, chosen)
    try:
        yield workspace
    except BaseException:
        if not existed:
            await asyncio.shield(manager.remove(workspace))
        raise


@contextlib.asynccontextmanager
async def hold_run_workspace(
    settings: Settings, db: AnyDatabase, run_id: str
) -> AsyncIterator[Workspace | None]:
    """Hold the run's worktree lock while the body runs; a run without one holds nothing.

    Raises:
        WorkspaceBusyError: another process (or holder) works in that worktree.
    """
    # Only the root is needed to lock: a malformed TURNSTILE_PROJECTS must not stop runs
    # that have no worktree.
    from engine.workspace.manager import WorkspaceManager  # start-up time: when used

    manager = WorkspaceManager(settings.workspaces, (), store=SqliteWorkspaceStore(db))
    workspace = await manager.get(run_id)
    if workspace is None or workspace.removed_at is not None:
        yield None
        return
    async with manager.lock(workspace):
        yield workspace


async def run_worktree_summary(settings: Settings, db: AnyDatabase, run_id: str) -> str | None:
    """``turnstile/<run> · 44.2 MB`` for ``turnstile runs`` and ``/status``, or None."""
    from engine.workspace.manager import WorkspaceManager  # start-up time: when used

    manager = WorkspaceManager(settings.workspaces, (), store=SqliteWorkspaceStore(db))
    return await manager.summary(run_id)


async def worktree_summaries(
    settings: Settings, db: AnyDatabase, runs: Mapping[str, str | Path | None]
) -> dict[str, str]:
    """Branch and disk usage (:func:`run_worktree_summary`) of these runs' worktrees.

    ``runs`` maps a run id to its working directory. A run is matched by its id (a run
    started with ``--checkout-repo``), else by its working directory: a chat session's
    turns and the runs started from a chat work in a worktree keyed by something else.
    Returns ``{run id: summary}`` for the runs that have one; runs without a worktree cost
    one query in all (their disk usage is never computed).
    """
    store = SqliteWorkspaceStore(db)
    matched = await match_worktrees(db, runs, store=store)
    if not matched:
        return {}
    from engine.workspace.manager import WorkspaceManager  # start-up time: when used

    manager = WorkspaceManager(settings.workspaces, (), store=store)
    out: dict[str, str] = {}
    cache: dict[str, str | None] = {}
    for run_id, workspace in matched.items():
        key = workspace.run_id
        if key not in cache:
            cache[key] = await manager.summary(key)
        summary = cache[key]
        if summary is not None:
            out[run_id] = summary
    return out


async def match_worktrees(
    db: AnyDatabase,
    runs: Mapping[str, str | Path | None],
    *,
    store: SqliteWorkspaceStore | None = None,
) -> dict[str, Workspace]:
    """The live worktree of each of these runs (by run id, else by working directory).

    ``runs`` maps a run id to its working directory, as for :func:`worktree_summaries`.
    One query in all; nothing is read from disk.
    """
    live = await (store or SqliteWorkspaceStore(db)).list()
    if not live:
        return {}
    by_id: dict[str, Workspace] = {}
    for w in live:
        # A run's own worktree wins over its sub-tasks' (which share its run id).
        if w.id == w.run_id or w.run_id not in by_id:
            by_id[w.run_id] = w
    by_path = {_path_key(w.path): w for w in live}
    out: dict[str, Workspace] = {}
    for run_id, workdir in runs.items():
        workspace = by_id.get(run_id)
        if workspace is None and workdir:
            workspace = by_path.get(_path_key(Path(workdir)))
        if workspace is not None:
            out[run_id] = workspace
    return out


def _path_key(path: Path) -> str:
    # Paths are stored absolute; normalise spelling only (no file-system access).
    return str(Path(path).absolute()).rstrip("/")


async def push_run_branch(settings: Settings, db: AnyDatabase, run_id: str) -> BranchPush | None:
    """Push the run's branch back to its project's repository (``TURNSTILE_PUSH_BRANCHES``).

    None when the run works in no worktree of its own (a chat's own folder): it has no
    branch to push. Never raises for a failed push: the result says why.
    """
    from engine.workspace.manager import BranchPush, WorkspaceManager  # start-up time

    store = SqliteWorkspaceStore(db)
    workspace = await store.get(run_id)
    if workspace is None:
        return None
    if not settings.push_branches:
        return BranchPush(workspace.branch)
    try:
        manager = WorkspaceManager.from_settings(settings, store=store)
    except ConfigError as exc:
        return BranchPush(workspace.branch, problem=exc.message)
    return await manager.push_back(workspace)


async def release_run_workspace(settings: Settings, db: AnyDatabase, run_id: str) -> bool:
    """Mark the run's worktree finished (cleanup may remove it after the retention).

    For runs without a row in the runs table (an autopilot task); auto runs are found
    finished through their ``finished_at``. Returns whether there was a worktree.
    """
    from engine.workspace.manager import WorkspaceManager  # start-up time: when used

    manager = WorkspaceManager(settings.workspaces, (), store=SqliteWorkspaceStore(db))
    workspace = await manager.get(run_id)
    if workspace is None:
        return False
    await manager.release(workspace)
    return True

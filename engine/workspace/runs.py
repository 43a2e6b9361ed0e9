"""Glue for commands that start runs: the ``--checkout-repo`` flag and the run's lock.

``turnstile auto`` and ``turnstile autopilot`` call these so that their own code only
grows by a few lines::

    add_checkout_argument(parser)
    ...
    workspace = await provision_for_run(settings, db, args.checkout_repo, run_id)
    ... start the run with cwd = workspace.path ...
    async with hold_run_workspace(settings, db, run_id):
        ... drive the run ...
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from engine.workspace.manager import WorkspaceManager
from engine.workspace.store import SqliteWorkspaceStore, Workspace

if TYPE_CHECKING:
    from engine.settings import Settings
    from engine.store.database import Database

__all__ = ["add_checkout_argument", "hold_run_workspace", "provision_for_run"]


def add_checkout_argument(parser: argparse.ArgumentParser | Any) -> None:
    """Add ``--checkout-repo PROJECT`` to a command's parser."""
    parser.add_argument(
        "--checkout-repo",
        metavar="PROJECT",
        default=None,
        help="work in a fresh git worktree of this project (TURNSTILE_PROJECTS) on branch "
        "turnstile/<run-id>; see `turnstile projects`",
    )


async def provision_for_run(
    settings: Settings, db: Database, project: str, run_id: str
) -> Workspace:
    """The run's worktree of ``project`` (cloned or fetched as needed; the same on resume).

    Raises:
        ProjectError: unknown or misconfigured project (a ``ConfigError``).
        WorkspaceError: git failed, or the worktree is damaged.
    """
    manager = WorkspaceManager.from_settings(settings, store=SqliteWorkspaceStore(db))
    return await manager.provision(run_id, project)


@contextlib.asynccontextmanager
async def hold_run_workspace(
    settings: Settings, db: Database, run_id: str
) -> AsyncIterator[Workspace | None]:
    """Hold the run's worktree lock while the body runs; a run without one holds nothing.

    Raises:
        WorkspaceBusyError: another process (or holder) works in that worktree.
    """
    # Only the root is needed to lock: a malformed TURNSTILE_PROJECTS must not stop runs
    # that have no worktree.
    manager = WorkspaceManager(settings.workspaces, (), store=SqliteWorkspaceStore(db))
    workspace = await manager.get(run_id)
    if workspace is None or workspace.removed_at is not None:
        yield None
        return
    async with manager.lock(workspace):
        yield workspace

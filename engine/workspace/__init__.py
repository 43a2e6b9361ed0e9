"""Workspaces: projects, a clone cache, and a git worktree per run and per sub-task.

Agents edit real repositories, several at once; each run gets its own worktree on its
own branch so that no two runs write into the same tree.

Layout under ``settings.workspaces`` (the manager's ``root``; front ends that put folders
of their own there ask :data:`RESERVED_FOLDERS` which names are taken)::

    cache/<project>.git          one bare clone per project (fetched by later runs)
    worktrees/<project>/<id>/    one worktree per run (id = run id) or sub-task
    locks/<id>.use.lock          flock held while a run works in the worktree

Branches: ``turnstile/<run-id>`` for a run, ``turnstile/<run-id>--<name>`` for a wave's
sub-task, ``turnstile/rescue/<id>`` for uncommitted changes saved before a removal.

The API (all async; errors in :mod:`engine.workspace.errors`, git's own failures as
:class:`~engine.errors.GitError`, and :class:`~engine.workspace.projects.ProjectError`)::

    manager = WorkspaceManager.from_settings(settings, store=SqliteWorkspaceStore(db))
    manager.projects                            # configured Project(name, url, branch)
    manager.resolve_project("web")              # ProjectError if unknown or malformed
    ws = await manager.provision(run_id, "web")  # Workspace(id, path, branch, base, ...)

    async with manager.checkout(run_id, "web") as ws:     # provision + exclusive lock
        agent = create_agent(tool, settings, cwd=ws.path)  # cwd pinned to the worktree
        ...
        subs = [await manager.provision_subtask(ws, n) for n in ("a", "b", "c")]
        # run each sub-task's agent with ``async with manager.lock(sub)`` and cwd=sub.path
        report = await manager.merge_wave(ws, subs)        # MergeReport
        for item in report.conflicted:                     # -> human_intervention
            print(item.name, item.conflicts)
        status = await manager.status(ws)   # head, dirty, changed files, commits since base
    await manager.release(ws)               # finished: retention starts
    await manager.usage(run_id)             # bytes on disk (run + sub-tasks)
    await manager.summary(run_id)           # "turnstile/<run> · 44.2 MB" for /status, runs
    await manager.cleanup()                 # CleanupReport(removed, rescued, busy, ...)

Ids: a run id is 1-128 letters, digits, ``.``, ``_``, ``-`` without ``--`` (that joins a
parent and a sub-task name, which follows the same rule up to 128 characters;
``subtask_workspace_id(parent_id, name)`` is the one place that joins them).

Commands that start runs use :mod:`engine.workspace.runs` (``add_checkout_argument``,
``checkout_for_run``, ``hold_run_workspace``) for ``--checkout-repo``.

``provision(run_id, project)`` is idempotent: called again after a crash it returns the
same worktree, untouched. Two runs never share a worktree: :meth:`WorkspaceManager.lock`
takes an ``flock`` (other processes and other holders in this process are refused), and
the kernel frees it when a process dies. Cloning and fetching hold a per-project lock, so
two runs starting at once clone once. Credentials in project URLs never appear in logs or
errors (:attr:`Project.display_url`, :attr:`WorkspaceManager.redact`).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.errors import DiskFullError, GitError
    from engine.workspace.errors import WorkspaceBusyError, WorkspaceError, WorkspaceStateError
    from engine.workspace.manager import (
        BRANCH_PREFIX,
        RESCUE_PREFIX,
        RESERVED_FOLDERS,
        BranchPush,
        CleanupReport,
        MergeOutcome,
        MergeReport,
        SubtaskMerge,
        WorkspaceManager,
        WorkspaceStatus,
        disk_usage,
        format_size,
        subtask_workspace_id,
    )
    from engine.workspace.projects import Project, ProjectError, parse_projects, redact_url
    from engine.workspace.runs import (
        add_checkout_argument,
        checkout_for_run,
        hold_run_workspace,
        provision_for_run,
        push_run_branch,
        release_run_workspace,
        run_worktree_summary,
    )
    from engine.workspace.store import (
        MemoryWorkspaceStore,
        SqliteWorkspaceStore,
        Workspace,
        WorkspaceStore,
    )

# Start-up time: a name is imported from its module when it is first asked for, so a
# listing that needs the store of worktrees does not load the manager and git.
_WHERE: dict[str, str] = {
    "DiskFullError": "engine.errors",
    "GitError": "engine.errors",
    "WorkspaceBusyError": "engine.workspace.errors",
    "WorkspaceError": "engine.workspace.errors",
    "WorkspaceStateError": "engine.workspace.errors",
    "BRANCH_PREFIX": "engine.workspace.manager",
    "RESCUE_PREFIX": "engine.workspace.manager",
    "RESERVED_FOLDERS": "engine.workspace.manager",
    "BranchPush": "engine.workspace.manager",
    "CleanupReport": "engine.workspace.manager",
    "MergeOutcome": "engine.workspace.manager",
    "MergeReport": "engine.workspace.manager",
    "SubtaskMerge": "engine.workspace.manager",
    "WorkspaceManager": "engine.workspace.manager",
    "WorkspaceStatus": "engine.workspace.manager",
    "disk_usage": "engine.workspace.manager",
    "format_size": "engine.workspace.manager",
    "subtask_workspace_id": "engine.workspace.manager",
    "Project": "engine.workspace.projects",
    "ProjectError": "engine.workspace.projects",
    "parse_projects": "engine.workspace.projects",
    "redact_url": "engine.workspace.projects",
    "add_checkout_argument": "engine.workspace.runs",
    "checkout_for_run": "engine.workspace.runs",
    "hold_run_workspace": "engine.workspace.runs",
    "provision_for_run": "engine.workspace.runs",
    "push_run_branch": "engine.workspace.runs",
    "release_run_workspace": "engine.workspace.runs",
    "run_worktree_summary": "engine.workspace.runs",
    "MemoryWorkspaceStore": "engine.workspace.store",
    "SqliteWorkspaceStore": "engine.workspace.store",
    "Workspace": "engine.workspace.store",
    "WorkspaceStore": "engine.workspace.store",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(where), name)


__all__ = [
    "BRANCH_PREFIX",
    "RESCUE_PREFIX",
    "RESERVED_FOLDERS",
    "BranchPush",
    "CleanupReport",
    "DiskFullError",
    "GitError",
    "MemoryWorkspaceStore",
    "MergeOutcome",
    "MergeReport",
    "Project",
    "ProjectError",
    "SqliteWorkspaceStore",
    "SubtaskMerge",
    "Workspace",
    "WorkspaceBusyError",
    "WorkspaceError",
    "WorkspaceManager",
    "WorkspaceStateError",
    "WorkspaceStatus",
    "WorkspaceStore",
    "add_checkout_argument",
    "checkout_for_run",
    "disk_usage",
    "format_size",
    "hold_run_workspace",
    "parse_projects",
    "provision_for_run",
    "push_run_branch",
    "redact_url",
    "release_run_workspace",
    "run_worktree_summary",
    "subtask_workspace_id",
]

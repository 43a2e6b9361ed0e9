"""``turnstile projects``: the configured projects, their worktrees, and cleanup."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

from engine.settings import Settings
from engine.store.backend import open_database
from engine.workspace import SqliteWorkspaceStore, WorkspaceManager, disk_usage, format_size

__all__ = ["register"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "projects",
        help="list projects (TURNSTILE_PROJECTS), their run worktrees, or clean them up",
        description=(
            "List the configured projects. 'worktrees' lists each run's worktree with its "
            "branch and disk usage; 'cleanup' removes worktrees of runs finished longer ago "
            "than the retention, committing uncommitted changes to turnstile/rescue/<run>."
        ),
    )
    parser.set_defaults(handler=_list_projects)
    sub = parser.add_subparsers(dest="projects_command", metavar="ACTION")
    worktrees = sub.add_parser("worktrees", help="worktrees of runs, with branch and disk usage")
    worktrees.add_argument("--run", default=None, help="only this run (and its sub-tasks)")
    worktrees.add_argument("--all", action="store_true", help="include removed worktrees")
    worktrees.set_defaults(handler=_list_worktrees)
    cleanup = sub.add_parser("cleanup", help="remove worktrees of finished runs")
    cleanup.add_argument(
        "--retention-hours",
        type=float,
        default=None,
        help="keep worktrees finished less than this long ago (default: the setting)",
    )
    cleanup.set_defaults(handler=_cleanup)


async def _list_projects(args: argparse.Namespace, settings: Settings) -> int:
    manager = WorkspaceManager.from_settings(settings)
    if not manager.projects:
        print("no projects configured: set TURNSTILE_PROJECTS (see docs/workspaces.md)")
        return 0
    rows = [("NAME", "BRANCH", "CACHED", "URL")]
    for project in manager.projects:
        cached = "yes" if manager.cache_path(project.name).is_dir() else "no"
        rows.append(
            (project.name, project.branch or "(remote default)", cached, project.display_url)
        )
    _print_table(rows)
    return 0


async def _list_worktrees(args: argparse.Namespace, settings: Settings) -> int:
    async with open_database(settings) as db:
        manager = WorkspaceManager.from_settings(settings, store=SqliteWorkspaceStore(db))
        found = await manager.workspaces(args.run, include_removed=args.all)
    if not found:
        print("no worktrees" + (f" for run {args.run}" if args.run else ""))
        return 0
    rows = [("ID", "PROJECT", "BRANCH", "STATE", "DISK", "PATH")]
    for ws in found:
        if ws.removed_at is not None:
            state = "removed" + (f" (rescue: {ws.rescue_branch})" if ws.rescue_branch else "")
            size = "-"
        else:
            state = "finished" if ws.released_at is not None else "active"
            size = format_size(await asyncio.to_thread(disk_usage, ws.path))
        rows.append((ws.id, ws.project, ws.branch, state, size, str(ws.path)))
    _print_table(rows)
    return 0


async def _cleanup(args: argparse.Namespace, settings: Settings) -> int:
    retention = None if args.retention_hours is None else args.retention_hours * 3600.0
    async with open_database(settings) as db:
        manager = WorkspaceManager.from_settings(settings, store=SqliteWorkspaceStore(db))
        report = await manager.cleanup(retention)
    for workspace_id in report.removed:
        rescue = report.rescued.get(workspace_id)
        print(f"removed {workspace_id}" + (f" (uncommitted changes on {rescue})" if rescue else ""))
    for workspace_id in report.busy:
        print(f"skipped {workspace_id}: in use")
    for workspace_id, error in report.errors.items():
        print(f"failed {workspace_id}: {error}")
    print(
        f"{len(report.removed)} removed, {len(report.rescued)} rescued, "
        f"{len(report.busy)} in use, {len(report.kept)} kept, {len(report.errors)} failed"
    )
    return 1 if report.errors else 0


def _print_table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )

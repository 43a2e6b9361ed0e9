"""``turnstile pause RUN`` and ``turnstile resume RUN``: pause a run wherever it runs.

A paused run finishes the tool call it is in (Claude Code with tool approvals or a
preset) or else the turn it is in, then waits, keeping its turn slot, until it is
resumed — from here, or from its chat (/resume, ▶ Go on). Exit status 0 when done, 1
when there was nothing to do (paused already, or not paused), 2 for an unknown or ended
run.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.errors import NotFoundError
from engine.settings import Settings

__all__ = ["register"]


def register(subparsers: Any) -> None:
    for name, what in (
        ("pause", "pause a run: it finishes what it is doing, then waits"),
        ("resume", "let a paused run go on"),
    ):
        parser = subparsers.add_parser(
            name,
            help=what,
            description=__doc__.strip().split("\n\n")[1] if __doc__ else None,
        )
        parser.add_argument("run", metavar="RUN_ID", help="the run")
        parser.set_defaults(handler=handle, pausing=name == "pause")


async def handle(args: argparse.Namespace, settings: Settings) -> int:
    from engine.humane import words
    from engine.runs.pause import Pauses
    from engine.store.backend import open_database
    from engine.store.runs import RunStatus, SqliteRunStore

    async with open_database(settings) as db:
        try:
            run = await SqliteRunStore(db).get_run(args.run)
        except NotFoundError:
            print(f"no run {args.run}")
            return 2
        pauses = Pauses(db)
        if args.pausing:
            if run.status not in (RunStatus.RUNNING, RunStatus.PARKED):
                print(f"run {args.run} has ended ({words(run.status.value)}): nothing to pause")
                return 2
            if not await pauses.pause(run.id, by=None):
                print(f"run {run.id} is paused already; turnstile resume {run.id} lets it go on")
                return 1
            print(
                f"run {run.id} pauses: it finishes what it is doing, then waits. "
                f"turnstile resume {run.id} lets it go on"
            )
            return 0
        if not await pauses.resume(run.id, by=None):
            print(f"run {run.id} is not paused")
            return 1
        print(f"run {run.id} goes on")
        return 0

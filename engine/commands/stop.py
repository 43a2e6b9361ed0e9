"""``turnstile stop RUN``: stop a run wherever it runs.

On the workers the running turn's job is aborted and a stop request recorded that the
worker also polls; the agent's process group is gone within the grace period and the run
ends stopped. A run driven by ``turnstile auto`` in another terminal sees the request and
stops the same way. Exit status 0 once the run has stopped, 1 if it has not within
``--wait`` seconds (it was asked; it may still stop), 2 for an unknown or ended run.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.settings import Settings

__all__ = ["register"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "stop",
        help="stop a run wherever it runs (its turn is pre-empted)",
        description=__doc__.strip().split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("run", metavar="RUN_ID", help="the run to stop")
    parser.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="wait this long for the run to stop (default 60; 0: do not wait)",
    )
    parser.set_defaults(handler=handle)


async def handle(args: argparse.Namespace, settings: Settings) -> int:
    # The job queue (procrastinate, psycopg) only when a stop is asked for: every other
    # command, the bot included, starts without it.
    from engine.workers.control import stop_run, wait_stopped

    print(await stop_run(settings, args.run), flush=True)
    if args.wait <= 0:
        return 0
    if await wait_stopped(settings, args.run, within=args.wait):
        print(f"run {args.run} stopped")
        return 0
    print(f"run {args.run} has not stopped yet (it was asked to)")
    return 1

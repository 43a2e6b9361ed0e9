"""``turnstile worker`` runs agent turns from the job queue; ``turnstile workers`` lists them.

::

    turnstile worker [--name N] [--concurrency K] [--queue Q ...]
    turnstile workers [--json]

Both need ``TURNSTILE_DATABASE=postgresql://…`` (the database every worker and the control
plane share). A worker keeps its worktrees under its own ``TURNSTILE_WORKSPACES`` and runs
the agent CLIs installed on its machine; the agent's environment has
``TURNSTILE_WORKER_NAME``. SIGTERM lets the running turns finish (a second one cuts them
off; they are re-run on another worker).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from engine.commands.runs import format_age
from engine.settings import Settings
from engine.store.backend import open_database
from engine.workers.store import WorkerStore

__all__ = ["register"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="run agent turns from the job queue (TURNSTILE_EXECUTION=workers)",
        description=__doc__.split("::")[0].strip() if __doc__ else None,
    )
    parser.add_argument("--name", metavar="N", help="this worker's name (default: host-pid)")
    parser.add_argument(
        "--concurrency", type=int, default=1, metavar="K", help="turns run at once (default 1)"
    )
    parser.add_argument(
        "--queue",
        action="append",
        default=[],
        metavar="Q",
        help="also take jobs from this queue (repeatable)",
    )
    parser.set_defaults(handler=handle_worker)
    listing = subparsers.add_parser(
        "workers",
        help="list workers: name, host, heartbeat age, running turns, capacity, agents",
    )
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.set_defaults(handler=handle_workers)


async def handle_worker(args: argparse.Namespace, settings: Settings) -> int:
    from engine.workers.worker import Worker  # procrastinate only when a worker runs

    worker = Worker(
        settings, name=args.name, concurrency=args.concurrency, queues=tuple(args.queue)
    )
    return await worker.run()


async def handle_workers(args: argparse.Namespace, settings: Settings) -> int:
    from engine.workers.queue import require_postgres  # the queue only when asked for

    require_postgres(settings.database)
    async with open_database(settings) as db:
        workers = await WorkerStore(db).workers()
    now = time.time()
    if args.json:
        for w in workers:
            print(
                json.dumps(
                    {
                        "name": w.name,
                        "host": w.host,
                        "pid": w.pid,
                        "status": w.status.value
                        if w.alive(now, settings.worker_timeout) or w.status.value != "alive"
                        else "silent",
                        "heartbeat_age_seconds": round(now - w.heartbeat_at, 1),
                        "running": w.running,
                        "capacity": w.capacity,
                        "agents": sorted(w.agents),
                    }
                )
            )
        return 0
    if not workers:
        print("no workers have started yet")
        return 0
    rows = [("NAME", "HOST", "STATUS", "HEARTBEAT", "RUNNING", "CAPACITY", "AGENTS")]
    for w in workers:
        alive = w.alive(now, settings.worker_timeout)
        status = "alive" if alive else ("silent" if w.status.value == "alive" else w.status.value)
        rows.append(
            (
                w.name,
                w.host,
                status,
                f"{format_age(now - w.heartbeat_at)} ago",
                str(w.running),
                str(w.capacity),
                ", ".join(sorted(w.agents)) or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0

"""``turnstile runs``: list runs with status, phase, turn, age and, for a run that works in
a git worktree, its branch and disk usage; ``turnstile runs ID``: one run and its turns
(each attempt, its state, exit code and duration).

A run recorded as running whose driving process is gone is shown as ``running*``:
it was cut off (a crash, a kill) and can be continued with ``turnstile auto --resume ID``.

A running run is *warm* when its agent process stays between turns and is still there:
the process recorded with its last finished turn still runs (same pid, same start time).
A per-turn process is gone when its turn ends, so only a resident one counts. A run on a
worker (another machine, where that pid says nothing) is warm when the live worker holding
it recorded its resident process in the database.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any, cast

from engine.commands._settings import ListingSettings, full_settings, listing_migrations
from engine.humane import turn_count
from engine.reaper import start_time
from engine.runs.owner import owner_alive
from engine.spend import Spend
from engine.store.backend import AnyDatabase, open_database
from engine.store.runs import RunRecord, RunStatus, SqliteRunStore, TurnRecord, TurnState

if TYPE_CHECKING:
    from engine.settings import Settings
    from engine.store.database import Database
    from engine.workers.views import WorkerView

__all__ = ["format_age", "register"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("runs", help="list runs: status, phase, turn, age")
    parser.add_argument(
        "--status", choices=[s.value for s in RunStatus], help="only runs with this status"
    )
    parser.add_argument("--mode", help="only runs of this mode (auto, chat, autopilot, ...)")
    parser.add_argument("--limit", type=int, default=20, metavar="N", help="newest N (0: all)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("run", nargs="?", metavar="RUN_ID", help="show one run and its turns")
    parser.add_argument(
        "--events",
        action="store_true",
        help="with RUN_ID: what happened in the run, an event a line (--json: JSON objects)",
    )
    parser.add_argument(
        "--follow", action="store_true", help="with --events: go on until the run ends"
    )
    # Start-up time: the whole settings are built only for a run on the workers or in a
    # worktree (their timeout, their folder); the rest needs only the database.
    parser.set_defaults(handler=handle, listing=lambda args: True)


def format_age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _status(record: RunRecord) -> str:
    if record.status is RunStatus.RUNNING:
        owner = record.state.get("owner")
        if isinstance(owner, str) and not owner_alive(owner):
            return "running*"
    return record.status.value


def _warm(record: RunRecord, turns: list[TurnRecord]) -> bool:
    """Whether the run's agent process outlived its last finished turn (a warm session)."""
    if record.status is not RunStatus.RUNNING:
        return False
    ended = [t for t in turns if t.finished_at is not None and t.proc_pgid is not None]
    if not ended:
        return False
    last = max(ended, key=lambda t: t.finished_at or 0.0)
    assert last.proc_pgid is not None
    return last.proc_start is not None and start_time(last.proc_pgid) == last.proc_start


def _turn(record: RunRecord) -> str:
    max_turns = record.state.get("max_turns")
    if max_turns and record.mode == "auto":
        # An auto run's limit counts rounds; its turns are its agent turns, as everywhere.
        turns = int(record.state.get("step", 1)) - 1
        return turn_count(turns, round_=record.turn, limit=max_turns, named=False)
    return f"{record.turn}/{max_turns}" if max_turns else str(record.turn)


async def _show(
    store: SqliteRunStore,
    run_id: str,
    as_json: bool,
    worktree: str | None = None,
    on_worker: WorkerView | None = None,
) -> int:
    record = await store.get_run(run_id)
    turns = await store.turns(run_id)
    total = sum((t.spend for t in turns if t.state is TurnState.FINISHED), Spend())
    warm = (
        _warm(record, turns)
        if on_worker is None
        else on_worker.warm and record.status is RunStatus.RUNNING
    )
    if as_json:
        print(
            json.dumps(
                {
                    "id": record.id,
                    "mode": record.mode,
                    "status": _status(record),
                    "phase": record.phase,
                    "turn": record.turn,
                    "warm": warm,
                    "exit_code": record.exit_code,
                    "abort_reason": record.abort_reason,
                    "log_dir": record.log_dir,
                    "worktree": worktree,
                    **total.to_json(),
                    "turns": [
                        {
                            "seq": t.seq,
                            "attempt": t.attempt,
                            "phase": t.phase,
                            "state": t.state.value,
                            "exit_code": t.exit_code,
                            "output_size": t.output_size,
                            "seconds": None
                            if t.finished_at is None
                            else round(t.finished_at - t.started_at, 3),
                            **t.spend.to_json(),
                        }
                        for t in turns
                    ],
                }
            )
        )
        return 0
    kept = ", warm (agent process kept between turns)" if warm else ""
    print(f"run {record.id}: {record.mode} {record.agent}, {_status(record)}{kept}")
    print(f"  phase {record.phase or '-'}, turn {_turn(record)}, exit {record.exit_code}")
    if record.abort_reason:
        print(f"  aborted: {record.abort_reason}")
    if record.workdir:
        print(f"  workdir {record.workdir}")
    if worktree:
        print(f"  worktree {worktree}")
    if record.log_dir:
        print(f"  log folder {record.log_dir}")
    if total.turns:
        print(f"  {total.line()}")
    for t in turns:
        took = "-" if t.finished_at is None else f"{t.finished_at - t.started_at:.1f}s"
        code = "-" if t.exit_code is None else str(t.exit_code)
        print(
            f"  #{t.seq}.{t.attempt} {t.phase or '-':<9} {t.state.value:<11} exit {code:<4}"
            f" {took}" + (f"  ({t.error})" if t.error else "")
        )
    return 0


async def _on_workers(given: Settings | ListingSettings, db: AnyDatabase) -> dict[str, WorkerView]:
    """The runs on the workers (their views need the settings: none without such runs)."""
    from engine.workers.store import WorkerStore
    from engine.workers.views import worker_views

    if not await WorkerStore(db).placements():
        return {}
    return await worker_views(full_settings(given), db)


async def handle(args: argparse.Namespace, settings: Settings | ListingSettings) -> int:
    from engine.workspace.runs import match_worktrees, run_worktree_summary, worktree_summaries

    events, follow = getattr(args, "events", False), getattr(args, "follow", False)
    if (events or follow) and args.run is None:
        print("turnstile runs: --events and --follow need a RUN_ID", file=sys.stderr)
        return 2
    if follow and not events:
        print("turnstile runs: --follow goes with --events", file=sys.stderr)
        return 2
    # One question at a time: one connection (no pool to start) does; only the engine's
    # tables are read, so the front ends' migrations are not looked up.
    async with open_database(settings, pooled=False, migrations=listing_migrations()) as db:
        if events:
            from engine.commands._events import print_events
            from engine.store.events import EventLog

            record = await SqliteRunStore(db).get_run(args.run)
            return await print_events(EventLog(db), record, as_json=args.json, follow=follow)
        if args.run is not None:
            full = full_settings(settings)
            # (The worktree helpers are typed for SQLite; their store runs on both.)
            worktree = await run_worktree_summary(full, cast("Database", db), args.run)
            on_worker = (await _on_workers(full, db)).get(args.run)
            return await _show(SqliteRunStore(db), args.run, args.json, worktree, on_worker)
        status = RunStatus(args.status) if args.status else None
        runs = await SqliteRunStore(db).list_runs(status=status)
        if args.mode:
            runs = [r for r in runs if r.mode == args.mode]
        if args.limit > 0:
            runs = runs[: args.limit]
        # Disk usage is computed only for the runs that have a worktree.
        workdirs = {r.id: r.workdir for r in runs}
        checkouts = await match_worktrees(db, workdirs)
        worktrees = (
            await worktree_summaries(full_settings(settings), db, workdirs) if checkouts else {}
        )
        store = SqliteRunStore(db)
        spend = await store.spend_of([r.id for r in runs])
        warm = {
            r.id: _warm(r, await store.turns(r.id)) for r in runs if r.status is RunStatus.RUNNING
        }
        on_workers = await _on_workers(settings, db)
    for run_id, view in on_workers.items():
        if run_id in warm:
            warm[run_id] = view.warm
    now = time.time()

    def shown(r: RunRecord) -> str:
        view = on_workers.get(r.id)
        if view is None:
            return _status(r)
        return view.waiting if view.waiting and r.status is RunStatus.RUNNING else r.status.value

    if args.json:
        for r in runs:
            print(
                json.dumps(
                    {
                        "id": r.id,
                        "mode": r.mode,
                        "agent": r.agent,
                        "status": shown(r),
                        "phase": r.phase,
                        "turn": r.turn,
                        "max_turns": r.state.get("max_turns"),
                        "warm": warm.get(r.id, False),
                        "worker": on_workers[r.id].worker if r.id in on_workers else None,
                        "age_seconds": round(now - r.created_at, 1),
                        "exit_code": r.exit_code,
                        "workdir": r.workdir,
                        "log_dir": r.log_dir,
                        "worktree": worktrees.get(r.id),
                        "project": checkouts[r.id].project if r.id in checkouts else None,
                        "branch": checkouts[r.id].branch if r.id in checkouts else None,
                        "task": r.task,
                        "chat": None
                        if r.chat_id is None
                        else {"id": r.chat_id, "topic": r.thread_id},
                        **spend.get(r.id, Spend()).to_json(),
                    }
                )
            )
        return 0
    if not runs:
        print("no runs")
        return 0
    rows = [
        (
            "RUN",
            "MODE",
            "AGENT",
            "STATUS",
            "PHASE",
            "TURN",
            "WARM",
            "AGE",
            "EXIT",
            "COST",
            "WORKTREE",
        )
    ]
    for r in runs:
        rows.append(
            (
                r.id,
                r.mode,
                r.agent,
                shown(r),
                r.phase or "-",
                _turn(r),
                "yes" if warm.get(r.id) else "-",
                format_age(now - r.created_at),
                "-" if r.exit_code is None else str(r.exit_code),
                spend[r.id].cost_text() if r.id in spend else "-",
                worktrees.get(r.id, "-"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if any(_status(r) == "running*" for r in runs):
        print("* its process is gone: continue it with `turnstile auto --resume RUN`")
    return 0

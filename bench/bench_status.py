#!/usr/bin/env python3
"""Benchmark: ``turnstile status --list`` over 10,000 tasks, and transitions per second.

Targets (issue 5): the whole command <= 300 ms; query + render inside it <= 50 ms.
Run: ``.venv/bin/python bench/bench_status.py [--tasks 10000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.gates import HUMAN_INTERVENTION, TaskStore, load_workflow  # noqa: E402
from engine.gates.listing import fetch_rows, render_rows  # noqa: E402
from engine.store.database import Database  # noqa: E402

PHASES = ["research", "decomposition", "design", "test_design", "implement", "complete"]


def populate_rows(root: Path, count: int) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """``count`` tasks: parents with 9 sub-tasks in 3 waves each, a mix of phases; the rows
    of ``gate_tasks`` and of their first ``gate_transitions``."""
    now = time.time()
    rows = []
    parents = max(1, count // 10)
    for p in range(parents):
        parent = f"task-{p:05d}"
        rows.append((parent, str(root / parent), str(root / parent), "design", None, None, None))
        for s in range(9):
            if len(rows) >= count:
                break
            name = f"{parent}.sub{s}"
            phase = PHASES[(p + s) % len(PHASES)]
            sub = "awaiting_approval" if phase in ("design", "test_design") and s % 2 else None
            rows.append((name, str(root / name), str(root / name), phase, sub, parent, s // 3 + 1))
    return [(*r, now, now) for r in rows], [(r[0], r[3], now) for r in rows]


async def populate(db: Database, root: Path, count: int) -> None:
    tasks, history = populate_rows(root, count)
    async with db.transaction() as conn:
        await conn.executemany(
            "INSERT INTO gate_tasks (name, folder, workdir, phase, sub_state, version, parent, "
            "wave, gate_round, created_at, updated_at) VALUES (?, ?, ?, ?, ?, 1, ?, ?, 0, ?, ?)",
            tasks,
        )
        await conn.executemany(
            "INSERT INTO gate_transitions (task, version, kind, to_phase, at) "
            "VALUES (?, 1, 'init', ?, ?)",
            history,
        )


async def query_and_render(db_path: Path, rounds: int) -> tuple[list[float], list[float], int]:
    """Wall and CPU seconds of the listing's query + grouping + rendering, in process."""
    timings = []
    cpu = []
    size = 0
    async with Database(db_path) as db:
        for _ in range(rounds):
            start = time.perf_counter()
            cpu_start = time.process_time()
            text = render_rows(await fetch_rows(db))
            timings.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
            size = len(text)
    return timings, cpu, size


def whole_command(
    db_path: Path, root: Path, rounds: int, argv: list[str]
) -> tuple[list[float], list[float]]:
    """Wall and CPU (user + sys of the child) seconds of one whole command run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.update(TURNSTILE_DATABASE=str(db_path), TURNSTILE_TASKS_ROOT=str(root))
    timings = []
    cpu = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, check=True)
        timings.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return timings, cpu


async def transitions_per_second(tmp: Path, seconds: float) -> tuple[float, int]:
    async with Database(tmp / "tps.db") as db:
        store = TaskStore(db, load_workflow(), tasks_root=tmp / "tps", track_git=False)
        await store.init_task("t")
        count = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            await store.transition("t", HUMAN_INTERVENTION)
            await store.transition("t", "research")
            count += 2
        elapsed = time.perf_counter() - start
    return count / elapsed, count


def ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:.1f} ms, best {min(values) * 1000:.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-status-") as raw:
        tmp = Path(raw)
        db_path = tmp / "bench.db"
        root = tmp / "tasks"

        async def setup() -> None:
            async with Database(db_path) as db:
                await populate(db, root, args.tasks)

        asyncio.run(setup())
        inner, inner_cpu, size = asyncio.run(query_and_render(db_path, args.rounds))
        module = [sys.executable, "-m", "engine.cli"]
        python, python_cpu = whole_command(
            db_path, root, args.rounds, [*module, "status", "--list"]
        )
        base, base_cpu = whole_command(db_path, root, args.rounds, [*module, "status", "--help"])
        tps, count = asyncio.run(transitions_per_second(tmp, 3.0))
    load = os.getloadavg()[0]
    print(f"tasks: {args.tasks}  (listing: {size / 1024:.0f} KiB of text)  load average {load:.1f}")
    print(f"query + render   wall {ms(inner)}; cpu {ms(inner_cpu)}   target <= 50 ms")
    print(f"whole command    wall {ms(python)}; cpu {ms(python_cpu)}   target <= 300 ms")
    print(f"  start-up alone (`turnstile status --help`): wall {ms(base)}; cpu {ms(base_cpu)}")
    print(
        f"transitions/s    {tps:.0f} ({count} in 3 s; SQLite synchronous=FULL, each with its "
        "history row, compare-and-set and an fsynced .state mirror under the folder lock)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Benchmark: ``turnstile status --list`` over 10,000 tasks, and transitions per second, on
a SQLite file and on PostgreSQL side by side.

Targets (issues 5 and 12): the whole command <= 300 ms; query + render inside it <= 50 ms,
on both databases. Also: transitions per second with 1, 4 and 16 writer processes.

Run: ``.venv/bin/python bench/bench_status.py [--tasks 10000] [--pg-url URL]``. Without
``--pg-url`` a throwaway PostgreSQL server is started in a temporary folder (as the tests
do, tests/pg_support.py) when its binaries are installed; otherwise only SQLite is measured.
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.gates import HUMAN_INTERVENTION, TaskStore, load_workflow  # noqa: E402
from engine.gates.listing import render_rows  # noqa: E402
from engine.gates.store import SqlGateStore  # noqa: E402
from engine.store.backend import AnyDatabase, open_database  # noqa: E402

PHASES = ["research", "decomposition", "design", "test_design", "implement", "complete"]
_CHUNK = 500  # rows per INSERT


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


async def populate(db: AnyDatabase, root: Path, count: int) -> None:
    tasks, history = populate_rows(root, count)
    async with db.transaction() as conn:
        # Multi-row INSERTs: the same SQL on both databases, few round trips.
        for start in range(0, len(tasks), _CHUNK):
            chunk = tasks[start : start + _CHUNK]
            await conn.execute(
                "INSERT INTO gate_tasks (name, folder, workdir, phase, sub_state, version, "
                "parent, wave, gate_round, created_at, updated_at) VALUES "
                + ", ".join(["(?, ?, ?, ?, ?, 1, ?, ?, 0, ?, ?)"] * len(chunk)),
                [value for r in chunk for value in r],
            )
            steps = history[start : start + _CHUNK]
            await conn.execute(
                "INSERT INTO gate_transitions (task, version, kind, to_phase, at) VALUES "
                + ", ".join(["(?, 1, 'init', ?, ?)"] * len(steps)),
                [value for r in steps for value in r],
            )
    # Statistics for the planner, as autovacuum gathers them on a live PostgreSQL database
    # within a minute of a change this size (SQLite's planner needs none to use the index).
    await db.execute("ANALYZE gate_tasks")


async def query_and_render(
    where: Any, rounds: int
) -> tuple[list[float], list[float], list[float], int]:
    """Wall and CPU seconds of the listing's query + rendering, in process (connected), and
    the wall seconds of the query alone."""
    timings = []
    cpu = []
    query = []
    size = 0
    async with open_database(where) as db:
        store = SqlGateStore(db)
        await store.listing_rows()  # warm: the first query also plans and caches
        for _ in range(rounds):
            start = time.perf_counter()
            cpu_start = time.process_time()
            rows = await store.listing_rows()
            query.append(time.perf_counter() - start)
            text = render_rows(rows)
            timings.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
            size = len(text)
    return timings, cpu, query, size


def whole_command(
    database: str, root: Path, rounds: int, argv: list[str]
) -> tuple[list[float], list[float]]:
    """Wall and CPU (user + sys of the child) seconds of one whole command run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.update(TURNSTILE_DATABASE=database, TURNSTILE_TASKS_ROOT=str(root))
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


async def transitions_per_second(where: Any, tasks_root: Path, seconds: float) -> float:
    async with open_database(where) as db:
        store = TaskStore(SqlGateStore(db), load_workflow(), tasks_root=tasks_root, track_git=False)
        await store.init_task("tps")
        count = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            await store.transition("tps", HUMAN_INTERVENTION)
            await store.transition("tps", "research")
            count += 2
        return count / (time.perf_counter() - start)


_WRITER = """
import asyncio, sys, time
from pathlib import Path
from engine.gates import HUMAN_INTERVENTION, SqlGateStore, TaskStore, load_workflow
from engine.store.backend import open_database

async def main(where, root, name, seconds):
    async with open_database(where) as db:
        store = TaskStore(SqlGateStore(db), load_workflow(), tasks_root=Path(root),
                          track_git=False)
        await store.init_task(name)
        print("ready", flush=True)
        sys.stdin.readline()
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            await store.transition(name, HUMAN_INTERVENTION)
            await store.transition(name, "research")
            count += 2
        print(count, time.perf_counter() - start, flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
"""


def concurrent_transitions(database: str, root: Path, writers: int, seconds: float) -> float:
    """Transitions per second of ``writers`` processes at once, each on its own task."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, database, str(root), f"w{writers}-{i}", str(seconds)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(writers)
    ]
    for proc in procs:  # every writer connected and its task made before any starts
        assert proc.stdout is not None
        if proc.stdout.readline() != "ready\n":
            raise SystemExit("a writer failed to start")
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    total = 0.0
    for proc in procs:
        out, _ = proc.communicate(timeout=seconds * 10 + 60)
        count, elapsed = out.split()
        total += int(count) / float(elapsed)
    return total


def ms(values: list[float]) -> str:
    return (
        f"p50 {statistics.median(values) * 1000:.1f} ms, best {min(values) * 1000:.1f} ms "
        f"({len(values)} runs)"
    )


@contextmanager
def postgres(url: str | None, tmp: Path) -> Iterator[str | None]:
    """``url``, or a throwaway server's fresh database; None without server binaries."""
    if url is not None:
        yield url
        return
    from tests.pg_support import PgCluster, find_bindir

    bindir = find_bindir()
    if bindir is None:
        print("PostgreSQL: server binaries not found, measuring SQLite only")
        yield None
        return
    folder = tmp / "pg"
    folder.mkdir()
    cluster = PgCluster(bindir, folder)
    cluster.start()
    try:
        yield cluster.new_database(template="template0")
    finally:
        cluster.stop()


def measure(name: str, where: str, tmp: Path, args: argparse.Namespace) -> list[str]:
    root = tmp / f"tasks-{name}"
    target: Any = Path(where) if name == "sqlite" else where

    async def setup() -> None:
        async with open_database(target) as db:
            await populate(db, root, args.tasks)

    asyncio.run(setup())
    inner, inner_cpu, query, size = asyncio.run(query_and_render(target, args.rounds))
    module = [sys.executable, "-m", "engine.cli"]
    whole, whole_cpu = whole_command(where, root, args.rounds, [*module, "status", "--list"])
    lines = []
    if args.writers:
        tps = asyncio.run(transitions_per_second(target, root, 3.0))
        scaling = "  ".join(
            f"{n} writers {concurrent_transitions(where, root, n, 3.0):.0f}/s" for n in args.writers
        )
        lines = [
            f"  transitions/s    {tps:.0f} (one writer; each with its history row, "
            "compare-and-set and an fsynced .state mirror under the folder lock)",
            f"  concurrent       {scaling} (processes, each on its own task)",
        ]
    return [
        f"{name}: {args.tasks} tasks (listing: {size / 1024:.0f} KiB of text)",
        f"  query + render   wall {ms(inner)}; cpu {ms(inner_cpu)}   target <= 50 ms",
        f"  of which query   wall {ms(query)}",
        f"  whole command    wall {ms(whole)}; cpu {ms(whole_cpu)}   target <= 300 ms",
        *lines,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--pg-url", help="an empty PostgreSQL database to fill (default: own)")
    parser.add_argument(
        "--writers",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[1, 4, 16],
        help="concurrent writer processes to measure, e.g. 1,4,16 ('' for the listing only)",
    )
    args = parser.parse_args()
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-status-") as raw:
        tmp = Path(raw)
        os.chmod(tmp, 0o755)  # a server run as another user reaches its folder below
        lines += measure("sqlite", str(tmp / "bench.db"), tmp, args)
        with postgres(args.pg_url, tmp) as url:
            if url is not None:
                lines += measure("postgresql", url, tmp, args)
        module = [sys.executable, "-m", "engine.cli"]
        base, base_cpu = whole_command(
            str(tmp / "bench.db"), tmp, args.rounds, [*module, "status", "--help"]
        )
    print(f"load average {os.getloadavg()[0]:.1f}")
    print("\n".join(lines))
    print(f"start-up alone (`turnstile status --help`): wall {ms(base)}; cpu {ms(base_cpu)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Benchmark: ``turnstile status --list`` and ``turnstile runs --json`` over 10,000 tasks
(and some runs), and transitions per second, on a SQLite file and on PostgreSQL side by side.

Targets: each whole command (process start to exit) <= 200 ms; the listing's query +
render inside it <= 50 ms, on both databases. For reference, the bare start of this
interpreter (``python -c pass``): no command can start faster. Also: transitions per second
with 1, 4 and 16 writer processes.

Each command runs as a person runs it, compiled modules written once (a first, unmeasured
run writes them even when PYTHONDONTWRITEBYTECODE is set here), then timed ``--rounds``
times; the median is the figure held against the target.

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

WHOLE_TARGET_MS = 200
COMMANDS = ("status --list", "runs --json")  # each timed whole, on each database
RUNS = 40  # runs recorded: a quarter still running (their owner gone), three turns each
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


async def populate_runs(db: AnyDatabase, count: int) -> None:
    """``count`` runs of three finished turns each; every fourth still recorded running."""
    from engine.store.runs import RunStatus, SqliteRunStore
    from engine.turn import TurnOutput

    store = SqliteRunStore(db)
    for i in range(count):
        run_id = f"auto-bench-{i:04d}"
        running = i % 4 == 0
        await store.create_run(
            run_id,
            mode="auto",
            agent="claude",
            session_id=f"session-{i}",
            objective="benchmark",
            # A process id no process has: shown as cut off (``running*``).
            state={"owner": "999999999:1", "max_turns": 10} if running else {"max_turns": 10},
        )
        for seq in range(1, 4):
            turn = await store.start_turn(run_id, seq, "prompt", "execute")
            await store.finish_turn(turn, TurnOutput(text="done", exit_code=0))
        if not running:
            await store.update_run(run_id, status=RunStatus.COMPLETED, turn=3, exit_code=0)


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
    """Wall and CPU (user + sys of the child) seconds of ``rounds`` whole command runs,
    each from process start to exit, after one unmeasured run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package has its compiled modules
    env.update(TURNSTILE_DATABASE=database, TURNSTILE_TASKS_ROOT=str(root))
    # In a folder of its own: no stray .env, and ``-m engine.cli`` still finds this tree.
    env["PYTHONPATH"] = str(REPO)
    cwd = root.parent
    subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, check=True)
    timings = []
    cpu = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, check=True)
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


def against_target(values: list[float]) -> str:
    median = statistics.median(values) * 1000
    verdict = "within" if median <= WHOLE_TARGET_MS else "over"
    return f"{verdict} {WHOLE_TARGET_MS} ms"


def measure(
    name: str, where: str, tmp: Path, args: argparse.Namespace
) -> tuple[list[str], dict[str, list[float]]]:
    root = tmp / f"tasks-{name}"
    target: Any = Path(where) if name == "sqlite" else where

    async def setup() -> None:
        async with open_database(target) as db:
            await populate(db, root, args.tasks)
            await populate_runs(db, RUNS)

    asyncio.run(setup())
    inner, inner_cpu, query, size = asyncio.run(query_and_render(target, args.rounds))
    module = [sys.executable, "-m", "engine.cli"]
    whole: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for command in COMMANDS:
        whole[command], cpu[command] = whole_command(
            where, root, args.rounds, [*module, *command.split()]
        )
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
        f"{name}: {args.tasks} tasks, {RUNS} runs (listing: {size / 1024:.0f} KiB of text)",
        f"  query + render   wall {ms(inner)}; cpu {ms(inner_cpu)}   target <= 50 ms",
        f"  of which query   wall {ms(query)}",
        *(
            f"  {command:<16} wall {ms(whole[command])}; cpu {ms(cpu[command])}   "
            + against_target(whole[command])
            for command in COMMANDS
        ),
        *lines,
    ], whole


def table(results: dict[str, dict[str, list[float]]], floor: list[float]) -> list[str]:
    """The whole-command medians side by side, with the interpreter's own start."""
    names = list(results)
    lines = [
        f"whole command, median wall ms (target <= {WHOLE_TARGET_MS})  "
        + "  ".join(f"{n:>10}" for n in names),
    ]
    for command in COMMANDS:
        cells = "  ".join(f"{statistics.median(results[n][command]) * 1000:>10.0f}" for n in names)
        lines.append(f"  turnstile {command:<36}{cells}")
    lines.append(f"  {'python -c pass (the floor)':<46}{statistics.median(floor) * 1000:>10.0f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=15, help="timed runs of each command")
    parser.add_argument("--pg-url", help="an empty PostgreSQL database to fill (default: own)")
    parser.add_argument(
        "--writers",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[1, 4, 16],
        help="concurrent writer processes to measure, e.g. 1,4,16 ('' for the listing only)",
    )
    args = parser.parse_args()
    lines: list[str] = []
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-status-") as raw:
        tmp = Path(raw)
        os.chmod(tmp, 0o755)  # a server run as another user reaches its folder below
        found, results["sqlite"] = measure("sqlite", str(tmp / "bench.db"), tmp, args)
        lines += found
        with postgres(args.pg_url, tmp) as url:
            if url is not None:
                found, results["postgresql"] = measure("postgresql", url, tmp, args)
                lines += found
        module = [sys.executable, "-m", "engine.cli"]
        root = tmp / "tasks-sqlite"
        base, base_cpu = whole_command(
            str(tmp / "bench.db"), root, args.rounds, [*module, "status", "--help"]
        )
        floor, floor_cpu = whole_command(
            str(tmp / "bench.db"), root, args.rounds, [sys.executable, "-c", "pass"]
        )
    print(f"load average {os.getloadavg()[0]:.1f}")
    print("\n".join(lines))
    print(f"start-up alone (`turnstile status --help`): wall {ms(base)}; cpu {ms(base_cpu)}")
    print(f"python -c pass: wall {ms(floor)}; cpu {ms(floor_cpu)}")
    print("\n".join(table(results, floor)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

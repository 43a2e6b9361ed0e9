#!/usr/bin/env python3
"""SQLite and PostgreSQL side by side, in one run.

1. Engine time per auto-mode turn, store writes included (agent answers at once; the
   channel's ``next_prompt`` + ``publish_output``, as in bench_automode.py). Target:
   PostgreSQL's median <= 2x SQLite's.
2. Gate transitions per second with 1, 4 and 16 concurrent writers: each writer is a
   process of its own (its own connection or pool) driving its own task through the gates
   facade (``Gates.transition``: compare-and-set, history row, fsynced ``.state`` mirror
   under the folder lock), back and forth, for a fixed time after a common start.
3. ``status --list`` over 10,000 tasks: query + render in process (target <= 50 ms on
   both), and the whole command as a subprocess.

The PostgreSQL server is a throwaway cluster started here (initdb + pg_ctl into a temporary
folder, loopback, as tests/pg_support.py does) with its durable defaults (fsync on,
synchronous_commit on), against SQLite's synchronous=FULL: both commit to disk.

Run: ``.venv/bin/python bench/bench_backends.py [--turns N] [--tasks N] [--seconds S]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_automode import InstantAgent, TimedChannel  # noqa: E402
from bench_status import populate_rows  # noqa: E402

from engine.automode import AutoStatus, prepare_auto_run  # noqa: E402
from engine.gates import HUMAN_INTERVENTION  # noqa: E402
from engine.gates.listing import render_rows  # noqa: E402
from engine.gates.service import Gates  # noqa: E402
from engine.gates.store import SqlGateStore  # noqa: E402
from engine.runs import RunSpec  # noqa: E402
from engine.settings import load_settings  # noqa: E402
from engine.sink import NullSink  # noqa: E402
from engine.store.backend import open_database  # noqa: E402
from engine.store.dialect import postgres_query  # noqa: E402
from engine.turn import run_session_loop  # noqa: E402
from tests.automode_support import AGENT_CMD, GIT_ENV, git_workspace  # noqa: E402
from tests.pg_support import PgCluster, find_bindir  # noqa: E402

WRITERS = (1, 4, 16)


class DurableCluster(PgCluster):
    """The test cluster's set-up, but with the server's durable defaults."""

    def start(self) -> None:
        data = self.folder / "data"
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
        self._run(str(self.bindir / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres")
        from tests.pg_support import _free_port

        self.port = _free_port()
        options = (
            f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c max_connections=200"
        )
        log = str(self.folder / "log")
        self._run(
            str(self.bindir / "pg_ctl"), "-D", str(data), "-w", "-l", log, "-o", options, "start"
        )


# --- 1. engine time per auto turn ------------------------------------------------------------


async def engine_time(target: str, root: Path, turns: int) -> list[float]:
    ws = git_workspace(root / "ws")
    settings = load_settings(database=target, runs_dir=root / "runs")
    async with open_database(settings) as db:
        spec = RunSpec(
            objective="benchmark objective",
            agent="command",
            workdir=ws,
            agent_cmd=AGENT_CMD,
            max_turns=turns,
        )
        run = await prepare_auto_run(settings, db, spec, sink=NullSink())
        for i in range(turns // 5):
            run.append_instruction(f"note {i}: keep going")
        timed = TimedChannel(run.channel)
        await run_session_loop(InstantAgent(), timed)  # type: ignore[arg-type]
        assert run.channel.state.status is AutoStatus.STOPPED
    return timed.samples


# --- 2. transitions per second, N writer processes ----------------------------------------


async def _writer(target: str, root: str, name: str, go: str, seconds: float) -> None:
    settings = load_settings(database=target, tasks_root=root)
    async with open_database(settings) as db:
        gates = Gates(db, settings, track_git=False)  # type: ignore[arg-type]
        await gates.init_task(name)
        print("ready", flush=True)
        while not os.path.exists(go):
            await asyncio.sleep(0.005)
        count = 0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            await gates.transition(name, HUMAN_INTERVENTION)
            await gates.transition(name, "research")
            count += 2
    print(count, flush=True)


def transitions(target: str, root: Path, writers: int, seconds: float) -> float:
    go = root / f"go-{writers}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "writer",
                target,
                str(root / "tasks"),
                f"w{writers}-{i}",
                str(go),
                str(seconds),
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for i in range(writers)
    ]
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", line
    go.touch()
    total = 0
    for proc in procs:
        out, _ = proc.communicate(timeout=seconds + 120)
        assert proc.returncode == 0
        total += int(out.strip().splitlines()[-1])
    return total / seconds


# --- 3. status --list over many tasks --------------------------------------------------------


async def fill_tasks(target: str, root: Path, count: int) -> None:
    tasks, history = populate_rows(root, count)
    async with open_database(target) as db:
        task_sql = (
            "INSERT INTO gate_tasks (name, folder, workdir, phase, sub_state, version, parent, "
            "wave, gate_round, created_at, updated_at) VALUES (?, ?, ?, ?, ?, 1, ?, ?, 0, ?, ?)"
        )
        history_sql = (
            "INSERT INTO gate_transitions (task, version, kind, to_phase, at) "
            "VALUES (?, 1, 'init', ?, ?)"
        )
        if db.dialect == "sqlite":
            async with db.transaction() as conn:
                await conn.executemany(task_sql, tasks)  # type: ignore[union-attr]
                await conn.executemany(history_sql, history)  # type: ignore[union-attr]
            return
        async with db.pool.connection() as raw, raw.transaction():  # type: ignore[union-attr]
            cursor = raw.cursor()
            await cursor.executemany(postgres_query(task_sql), tasks)
            await cursor.executemany(postgres_query(history_sql), history)
        # The planner's statistics, as autovacuum gathers them within a minute on a live
        # database after a change this size: without them it sorts instead of reading the
        # listing's index.
        await db.execute("ANALYZE gate_tasks")


async def listing(target: str, rounds: int) -> list[float]:
    timings = []
    async with open_database(target) as db:
        for _ in range(rounds):
            start = time.perf_counter()
            render_rows(await SqlGateStore(db).listing_rows())
            timings.append(time.perf_counter() - start)
    return timings


def whole_listing(target: str, root: Path, rounds: int) -> list[float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.update(TURNSTILE_DATABASE=target, TURNSTILE_TASKS_ROOT=str(root))
    timings = []
    for _ in range(rounds):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "engine.cli", "status", "--list"],
            env=env,
            stdout=subprocess.DEVNULL,
            check=True,
            cwd=REPO,
        )
        timings.append(time.perf_counter() - start)
    return timings


# --- the table ---------------------------------------------------------------------------


def med_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def run(args: argparse.Namespace) -> int:
    bindir = find_bindir()
    if bindir is None:
        print("PostgreSQL server binaries not found (apt-get install postgresql)")
        return 1
    for key, value in GIT_ENV.items():
        os.environ[key] = value
    tmp = Path(tempfile.mkdtemp(prefix="bench-backends-"))
    pg_folder = Path(tempfile.mkdtemp(prefix="bench-backends-pg-"))  # postgres must reach it
    cluster = DurableCluster(bindir, pg_folder)
    results: dict[str, dict[str, Any]] = {"SQLite": {}, "PostgreSQL": {}}
    try:
        cluster.start()
        counter = iter(range(1000))

        def target(backend: str) -> str:
            n = next(counter)
            if backend == "SQLite":
                return str(tmp / f"b{n}.db")
            cluster.admin(f'CREATE DATABASE "b{n}"')
            return cluster.url(f"b{n}")

        for backend, row in results.items():
            root = tmp / f"engine-{backend}"
            samples = asyncio.run(engine_time(target(backend), root, args.turns))
            row["turn"] = (med_ms(samples), statistics.quantiles(samples, n=20)[-1] * 1000)
            for writers in WRITERS:
                where = target(backend)
                asyncio.run(_prepare(where))
                row[f"tps{writers}"] = transitions(
                    where, tmp / f"tps-{backend}-{writers}", writers, args.seconds
                )
            where = target(backend)
            asyncio.run(fill_tasks(where, tmp / "tasks", args.tasks))
            row["list"] = med_ms(asyncio.run(listing(where, args.rounds)))
            row["list_cmd"] = med_ms(whole_listing(where, tmp / "tasks", args.rounds))
        server = subprocess.run(
            [str(bindir / "postgres"), "--version"], capture_output=True, text=True, check=False
        ).stdout.strip()
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(pg_folder, ignore_errors=True)

    sqlite, pg = results["SQLite"], results["PostgreSQL"]
    print(
        f"{server}, loopback, fsync on; SQLite synchronous=FULL; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(f"{'':44}{'SQLite':>12}{'PostgreSQL':>12}{'ratio':>8}")

    def line(label: str, a: float, b: float, unit: str, note: str = "") -> None:
        print(f"{label:44}{a:>10.1f}{unit:2}{b:>10.1f}{unit:2}{b / a:>7.2f}x  {note}")

    line(
        f"engine time per auto turn, median ({args.turns} turns)",
        sqlite["turn"][0],
        pg["turn"][0],
        "ms",
        "target: PostgreSQL <= 2x",
    )
    line("  95th percentile", sqlite["turn"][1], pg["turn"][1], "ms")
    for writers in WRITERS:
        line(
            f"transitions/s, {writers} writer process(es)",
            sqlite[f"tps{writers}"],
            pg[f"tps{writers}"],
            "/s",
        )
    line(
        f"status --list, {args.tasks} tasks: query + render",
        sqlite["list"],
        pg["list"],
        "ms",
        "target <= 50 ms",
    )
    line("  the whole command (a subprocess)", sqlite["list_cmd"], pg["list_cmd"], "ms")
    return 0


async def _prepare(target: str) -> None:
    async with open_database(target):
        pass  # migrated once, before the writers race to open it


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "writer":
        target, root, name, go, seconds = sys.argv[2:7]
        asyncio.run(_writer(target, root, name, go, float(seconds)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=7)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())

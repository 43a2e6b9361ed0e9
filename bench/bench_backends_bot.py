#!/usr/bin/env python3
"""Benchmark: bot prompts queued + taken per second, 1, 4 and 16 writers, on both backends.

Each writer is a process of its own with its own connection, driving one chat's queue:
``queue_prompt`` then ``take_prompt`` (which records the turn), ``--prompts`` times. The
figure is all prompts over the wall time from "go" to the last writer done. SQLite runs
as the bot runs it (WAL, ``synchronous=NORMAL``); PostgreSQL is a throwaway cluster
(tests/pg_support.py: ``fsync=off``, ``synchronous_commit=off``, as SQLite's NORMAL also
skips the fsync per commit). Target (issue 12): PostgreSQL scales with writers, SQLite
does not (one writer at a time).

Run: ``.venv/bin/python bench/bench_backends_bot.py [--prompts 200] [--writers 1 4 16]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chatfront.store import SqlBotStore  # noqa: E402
from engine.store import SqliteRunStore  # noqa: E402
from engine.store.backend import open_database  # noqa: E402


async def writer(target: str, index: int, prompts: int) -> None:
    """One writer: its own chat and run; waits for "go" on stdin."""
    async with open_database(target, synchronous="NORMAL") as db:
        store = SqlBotStore(db)
        chat = -1_000_000_000_000 - index
        run_id = f"bench-{index}"
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        start = time.perf_counter()
        for i in range(prompts):
            queued, _ = await store.queue_prompt(
                chat, 0, update_id=None, user_id=1, body=f"prompt {i}", depth=1_000_000
            )
            assert queued
            taken = await store.take_prompt(chat, 0, run_id, i + 1)
            assert taken is not None
        print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


async def prepare(target: str, writers: int) -> None:
    async with open_database(target, synchronous="NORMAL") as db:
        runs = SqliteRunStore(db)
        for index in range(writers):
            await runs.create_run(f"bench-{index}", mode="chat", agent="a", session_id="s")


async def round_(target: str, writers: int, prompts: int) -> float:
    """Prompts queued + taken per second with ``writers`` processes at once."""
    await prepare(target, writers)
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--writer",
            target,
            str(index),
            str(prompts),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=REPO,
        )
        for index in range(writers)
    ]
    for proc in procs:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        assert line == b"ready\n", line
    start = time.perf_counter()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
    for proc in procs:
        assert proc.stdout is not None
        json.loads(await proc.stdout.readline())
    # Done when the last writer says so (not when it has exited: closing is not writing).
    elapsed = time.perf_counter() - start
    for proc in procs:
        await proc.wait()
        assert proc.returncode == 0
    return writers * prompts / elapsed


async def main(args: argparse.Namespace) -> None:
    from tests.pg_support import PgCluster, find_bindir

    bindir = find_bindir()
    if bindir is None:
        raise SystemExit("PostgreSQL server binaries not found (apt-get install postgresql)")
    folder = Path(tempfile.mkdtemp(prefix="turnstile-bench-pg-"))
    cluster = PgCluster(bindir, folder)
    cluster.start()
    results: dict[str, dict[int, float]] = {"sqlite": {}, "postgresql": {}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for writers in args.writers:
                lite = str(Path(tmp) / f"bench-{writers}.db")
                results["sqlite"][writers] = await round_(lite, writers, args.prompts)
                cluster.admin(f"CREATE DATABASE bench_{writers} TEMPLATE template0")
                pg = cluster.url(f"bench_{writers}")
                results["postgresql"][writers] = await round_(pg, writers, args.prompts)
    finally:
        cluster.stop()
    print(f"prompts queued + taken per second ({args.prompts} per writer, one chat each)")
    print(f"{'writers':>8} {'SQLite':>10} {'PostgreSQL':>12} {'PG/SQLite':>10}")
    for writers in args.writers:
        lite_rate = results["sqlite"][writers]
        pg_rate = results["postgresql"][writers]
        print(f"{writers:>8} {lite_rate:>10.0f} {pg_rate:>12.0f} {pg_rate / lite_rate:>10.2f}")
    base = args.writers[0]
    for name, rates in results.items():
        scaling = ", ".join(f"{w}: {rates[w] / rates[base]:.2f}x" for w in args.writers[1:])
        print(f"{name} against {base} writer(s): {scaling}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--writer":
        asyncio.run(writer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    else:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--prompts", type=int, default=200)
        parser.add_argument("--writers", type=int, nargs="+", default=[1, 4, 16])
        asyncio.run(main(parser.parse_args()))

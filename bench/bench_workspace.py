"""Benchmark: provisioning a run's worktree vs a plain ``git worktree add``.

A repository with 10,000 files and 1,000 commits is generated with ``git fast-import``
and used as the remote. After one warm-up run has cloned it into the cache, each round
times ``WorkspaceManager.provision`` (fetch, base lookup, locks, worktree, record in
SQLite) against a plain ``git worktree add -b`` of the same commit from the same cache,
interleaved. Target: median ratio <= 1.2.

Usage: ``.venv/bin/python bench/bench_workspace.py [--files N] [--commits N] [--rounds N]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.store import Database
from engine.workspace import Project, SqliteWorkspaceStore, WorkspaceManager

TARGET = 1.2


def _stream(files: int, commits: int) -> bytes:
    """A fast-import stream: one commit adding ``files`` files, then small edits."""
    out: list[bytes] = []
    when = 1_700_000_000
    for n in range(commits):
        lines = [
            b"commit refs/heads/main",
            f"committer Bench <bench@example.invalid> {when + n} +0000".encode(),
        ]
        message = f"commit {n}\n".encode()
        lines.append(f"data {len(message)}".encode())
        lines.append(message.rstrip(b"\n"))
        # The first commit adds every file; each later one edits 10 spread over the tree.
        changed = range(files) if n == 0 else range(n * 7 % files, files, max(files // 10, 1))
        for f in changed:
            body = f"file {f} revision {n}\n".encode() + b"x" * (f % 200) + b"\n"
            lines.append(f"M 644 inline dir{f % 100:02d}/sub{f % 7}/file{f}.txt".encode())
            lines.append(f"data {len(body)}".encode())
            lines.append(body)
        out.append(b"\n".join(lines) + b"\n")
    return b"".join(out)


def make_repo(path: Path, files: int, commits: int) -> float:
    started = time.perf_counter()
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(path)], check=True)
    subprocess.run(
        ["git", "fast-import", "--quiet"],
        cwd=path,
        input=_stream(files, commits),
        check=True,
    )
    subprocess.run(["git", "gc", "-q"], cwd=path, check=True)
    return time.perf_counter() - started


async def bench(files: int, commits: int, rounds: int) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-workspace-") as tmp:
        base = Path(tmp)
        home = base / "home"
        home.mkdir()
        os.environ.update(
            HOME=str(home),
            GIT_CONFIG_NOSYSTEM="1",
            GIT_AUTHOR_NAME="Bench",
            GIT_AUTHOR_EMAIL="bench@example.invalid",
            GIT_COMMITTER_NAME="Bench",
            GIT_COMMITTER_EMAIL="bench@example.invalid",
        )
        remote = base / "remote.git"
        made = make_repo(remote, files, commits)
        count = subprocess.run(
            ["git", "rev-list", "--count", "main"], cwd=remote, capture_output=True, text=True
        ).stdout.strip()
        tracked = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", "main"],
            cwd=remote,
            capture_output=True,
            text=True,
        ).stdout.count("\n")
        print(f"repository: {tracked} files, {count} commits (fast-import + gc: {made:.2f} s)")

        async with Database(base / "bench.db") as db:
            manager = WorkspaceManager(
                base / "ws",
                [Project("bench", str(remote), "main")],
                store=SqliteWorkspaceStore(db),
            )
            started = time.perf_counter()
            first = await manager.provision("warmup", "bench")
            print(f"first run (clone into cache + worktree): {time.perf_counter() - started:.3f} s")
            cache = manager.cache_path("bench")
            ours: list[float] = []
            plain: list[float] = []

            async def ours_once(n: int) -> None:
                started = time.perf_counter()
                await manager.provision(f"run-{n}", "bench")
                ours.append(time.perf_counter() - started)

            async def plain_once(n: int) -> None:
                started = time.perf_counter()
                proc = await asyncio.create_subprocess_exec(
                    "git",
                    "worktree",
                    "add",
                    "--quiet",
                    "-b",
                    f"plain-{n}",
                    str(base / "plain" / str(n)),
                    first.base,
                    cwd=cache,
                )
                assert await proc.wait() == 0
                plain.append(time.perf_counter() - started)

            for n in range(rounds):
                # Alternate who goes first so that neither gains from a warmer cache.
                first_up, second_up = (ours_once, plain_once) if n % 2 else (plain_once, ours_once)
                await first_up(n)
                await second_up(n)

            started = time.perf_counter()
            again = await manager.provision("run-0", "bench")
            resume = time.perf_counter() - started
            assert again.path == manager.worktree_path("bench", "run-0")
            started = time.perf_counter()
            used = await manager.usage("run-0")
            usage_time = time.perf_counter() - started

    ours_med = statistics.median(ours)
    plain_med = statistics.median(plain)
    ratio = ours_med / plain_med
    print(f"provision (median of {rounds}): {ours_med * 1000:.1f} ms  (min {min(ours) * 1000:.1f})")
    print(
        f"git worktree add (median of {rounds}): {plain_med * 1000:.1f} ms"
        f"  (min {min(plain) * 1000:.1f})"
    )
    verdict = "OK" if ratio <= TARGET else "ABOVE TARGET"
    print(f"ratio: {ratio:.3f}  (target <= {TARGET})  {verdict}")
    print(f"resume of an existing worktree: {resume * 1000:.1f} ms")
    print(f"disk usage of one run: {used / 1e6:.1f} MB, measured in {usage_time * 1000:.1f} ms")
    return 0 if ratio <= TARGET else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--commits", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    return asyncio.run(bench(args.files, args.commits, args.rounds))


if __name__ == "__main__":
    sys.exit(main())

"""Workers benchmark (TURNSTILE_EXECUTION=workers), side by side with local execution.

1. Added latency per turn: the gap between one turn's end and the next turn's start
   (``turns.finished_at`` → next ``started_at``), for one auto run of an agent that answers
   at once, run locally (``turnstile auto --workdir``) and on one worker. Target: the
   median gap on the worker at most 50 ms above the local one.
2. Throughput: 16 auto runs of a fake agent that sleeps 2 s per turn (4 turns each), on 1,
   2 and 4 workers of capacity 2: wall time from the first enqueue to the last run's end.
   Targets: ≥ 1.8× faster at 2 workers and ≥ 3.3× at 4, against 1.
3. With ``--rss``: the resident memory of an idle worker (no target).

A throwaway PostgreSQL cluster (tests/pg_support.py) and real ``turnstile worker``
processes; nothing leaves 127.0.0.1.

Run: ``.venv/bin/python bench/bench_workers.py [--runs 16] [--sleep 2] [--workers 1,2,4]``
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.automode_support import (  # noqa: E402
    AGENT_CMD,
    CLARIFY,
    EVALUATE,
    EXECUTE,
    PLAN,
    cli_env,
    git_workspace,
    turnstile,
    write_script,
)
from tests.pg_support import PgCluster, find_bindir  # noqa: E402
from tests.test_workspace_git import git_test_env, make_remote  # noqa: E402

_names = itertools.count()


def _rules(sleep: float, *, complete: bool) -> list[dict[str, object]]:
    verdict = "COMPLETE" if complete else "IN PROGRESS"
    pause = {"sleep": sleep} if sleep else {}
    return [
        {"match": CLARIFY, "text": "Goal: result.txt", **pause},
        {"match": PLAN, "text": "1. write result.txt", **pause},
        {"match": EXECUTE, "text": "done", **pause},
        {"match": EVALUATE, "text": f"ok\nAUTO-MODE STATUS: {verdict}\n", **pause},
    ]


def _wait(check: object, *, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


class Setup:
    def __init__(self, tmp: Path, cluster: PgCluster) -> None:
        self.tmp = tmp
        self.cluster = cluster
        home = git_test_env(tmp / "home")
        os.environ.update(home)
        self.remote = make_remote(tmp)
        self.home = home

    def database(self) -> str:
        name = f"bench_{next(_names)}"
        self.cluster.admin(f'CREATE DATABASE "{name}"')
        return self.cluster.url(name)

    def env(self, url: str, script: Path, **extra: str) -> dict[str, str]:
        return cli_env(
            self.tmp,
            script,
            extra={
                **self.home,
                "TURNSTILE_DATABASE": url,
                "TURNSTILE_EXECUTION": "workers",
                "TURNSTILE_PROJECTS": f"demo={self.remote}#main",
                "TURNSTILE_WORKER_HEARTBEAT": "1",
                "TURNSTILE_WORKER_TIMEOUT": "5",
                **extra,
            },
        )

    @contextlib.contextmanager
    def workers(
        self, env: dict[str, str], count: int, capacity: int
    ) -> Iterator[list[subprocess.Popen[bytes]]]:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for i in range(count):
                root = self.tmp / f"w{next(_names)}"
                root.mkdir()
                log = (root / "log").open("wb")
                procs.append(
                    subprocess.Popen(
                        turnstile("worker", "--name", f"w{i}", "--concurrency", str(capacity)),
                        cwd=root,
                        env={
                            **env,
                            "TURNSTILE_WORKSPACES": str(root / "ws"),
                            "TURNSTILE_RUNS_DIR": str(root / "runs"),
                        },
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
                log.close()
                _wait(
                    lambda root=root: b"ready" in (root / "log").read_bytes(),
                    within=60,
                    what="a worker to start",
                )
            yield procs
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _cli(env: dict[str, str], cwd: Path, *args: str) -> str:
    done = subprocess.run(
        turnstile(*args), env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    if done.returncode not in (0,):
        raise SystemExit(f"turnstile {' '.join(args[:2])} failed: {done.stderr}")
    return done.stdout


def _pg_turns(url: str, run_id: str) -> list[tuple[float, float]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [
            (float(a), float(b))
            for a, b in conn.execute(
                "SELECT started_at, finished_at FROM turns WHERE run_id = %s ORDER BY id",
                (run_id,),
            ).fetchall()
        ]


def latency(setup: Setup, turns: int) -> tuple[float, float]:
    script = write_script(setup.tmp / "instant", rules=_rules(0, complete=False))
    # Locally: `turnstile auto` in this process, on a SQLite file.
    work = git_workspace(setup.tmp / "local-work")
    local_env = cli_env(setup.tmp / "local", script)
    (setup.tmp / "local").mkdir(exist_ok=True)
    subprocess.run(
        turnstile(
            "auto",
            "--tool",
            "command",
            "--agent-cmd",
            AGENT_CMD,
            "--workdir",
            str(work),
            "--max-turns",
            str(turns),
            "-p",
            "bench",
        ),
        env=local_env,
        cwd=setup.tmp / "local",
        capture_output=True,
        timeout=600,
        check=False,
    )
    import sqlite3

    with contextlib.closing(sqlite3.connect(setup.tmp / "local" / "turnstile.db")) as conn:
        local_rows = conn.execute(
            "SELECT started_at, finished_at FROM turns ORDER BY id"
        ).fetchall()
    local_gap = statistics.median(b[0] - a[1] for a, b in itertools.pairwise(local_rows))
    # On one worker.
    url = setup.database()
    env = setup.env(url, script)
    with setup.workers(env, 1, 1):
        run_id = _cli(
            env,
            setup.tmp,
            "auto",
            "--detach",
            "--checkout-repo",
            "demo",
            "--tool",
            "command",
            "--agent-cmd",
            AGENT_CMD,
            "--max-turns",
            str(turns),
            "-p",
            "bench",
        ).strip()
        _wait(lambda: _ended(url, [run_id]), within=600, what="the run to end")
    rows = _pg_turns(url, run_id)
    worker_gap = statistics.median(b[0] - a[1] for a, b in itertools.pairwise(rows))
    return local_gap, worker_gap


def _ended(url: str, run_ids: list[str]) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT count(*) FROM runs WHERE id = ANY(%s) AND status <> 'running'", (run_ids,)
        ).fetchone()
    return rows is not None and rows[0] == len(run_ids)


def throughput(setup: Setup, workers: int, runs: int, sleep: float) -> float:
    script = write_script(setup.tmp / f"sleepy{workers}", rules=_rules(sleep, complete=True))
    url = setup.database()
    env = setup.env(url, script)
    with setup.workers(env, workers, 2):
        began = time.monotonic()
        run_ids = [
            _cli(
                env,
                setup.tmp,
                "auto",
                "--detach",
                "--checkout-repo",
                "demo",
                "--tool",
                "command",
                "--agent-cmd",
                AGENT_CMD,
                "-p",
                f"bench {i}",
            ).strip()
            for i in range(runs)
        ]
        _wait(lambda: _ended(url, run_ids), within=1800, what="the runs to end")
        return time.monotonic() - began


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no VmRSS for pid {pid}")


def idle_worker_rss(setup: Setup) -> float:
    """The resident memory of one ``turnstile worker`` a few heartbeats after it is ready."""
    script = write_script(setup.tmp / "idle", rules=_rules(0, complete=True))
    env = setup.env(setup.database(), script)
    with setup.workers(env, 1, 2) as procs:
        time.sleep(3)  # a few heartbeats and sweeps: idle, not just started
        return _rss_mb(procs[0].pid)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=16)
    parser.add_argument("--sleep", type=float, default=2.0)
    parser.add_argument("--turns", type=int, default=12, help="turns of the latency run")
    parser.add_argument("--workers", default="1,2,4", help="worker counts (empty: latency only)")
    parser.add_argument("--rss", action="store_true", help="also the idle worker's memory")
    args = parser.parse_args()
    bindir = find_bindir()
    if bindir is None:
        print("PostgreSQL server binaries not found: apt-get install postgresql")
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    os.chmod(tmp, 0o755)
    pg_folder = tmp / "pg"
    pg_folder.mkdir()
    cluster = PgCluster(bindir, pg_folder)
    ok = True
    try:
        cluster.start()
        setup = Setup(tmp, cluster)
        local_gap, worker_gap = latency(setup, args.turns)
        added = (worker_gap - local_gap) * 1000
        print(
            f"gap between turns, median: local {local_gap * 1000:.1f} ms, "
            f"worker {worker_gap * 1000:.1f} ms, added {added:.1f} ms (target ≤ 50 ms)"
        )
        ok &= added <= 50
        if args.rss:
            print(f"idle worker RSS: {idle_worker_rss(setup):.1f} MB", flush=True)
        walls: dict[int, float] = {}
        for count in (int(x) for x in args.workers.split(",") if x.strip()):
            walls[count] = throughput(setup, count, args.runs, args.sleep)
            print(f"{args.runs} runs on {count} worker(s) × 2: {walls[count]:.1f} s", flush=True)
        base = walls.get(1)
        for count, target in ((2, 1.8), (4, 3.3)):
            if base is not None and count in walls:
                ratio = base / walls[count]
                print(f"speed-up at {count} workers: {ratio:.2f}× (target ≥ {target}×)")
                ok &= ratio >= target
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

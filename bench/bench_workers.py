"""Workers benchmark (TURNSTILE_EXECUTION=workers), side by side with local execution.

1. Added latency per turn: the gap between one turn's end and the next turn's start
   (``turns.finished_at`` → next ``started_at``), for one auto run of an agent that answers
   at once, run locally (``turnstile auto --workdir``) and on one worker. Target: the
   median gap on the worker at most 50 ms above the local one.
2. Throughput: 16 auto runs of a fake agent that sleeps 2 s per turn (4 turns each), on 1,
   2 and 4 workers of capacity 2: wall time from the first enqueue to the last run's end.
   Targets: ≥ 1.8× faster at 2 workers and ≥ 3.3× at 4, against 1.
3. With ``--rss``: the resident memory of an idle worker (no target), and the control
   plane's: ``turnstile bot`` (against the fake Bot API of tests/fakes) following 50 auto
   runs started with ``/auto`` (50 chats, one run each) on 4 workers of capacity 2, while
   all 50 are in flight (8 in an Execute turn that waits, 42 waiting for a worker); the
   peak of samples over a few seconds. Target: ≤ 100 MB.

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
    commit_step,
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
        # A finished run commits (the completion check wants a commit): 4 turns a run.
        {
            "match": EXECUTE,
            **(commit_step("result.txt") if complete else {"text": "done"}),
            **pause,
        },
        {"match": EVALUATE, "text": f"ok\nAUTO-MODE STATUS: {verdict}\n", **pause},
    ]


def _wait(check: object, *, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


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
        self, env: dict[str, str], count: int, capacity: int, *, kill: bool = False
    ) -> Iterator[list[subprocess.Popen[bytes]]]:
        """``count`` workers; stopped at the end (``kill``: kill -9, their turns with them)."""
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
                proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
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
        # All runs are queued by one process: the wall time is the workers', not that of
        # 16 `turnstile auto` start-ups one after the other.
        run_ids = _start_runs(env, setup.tmp, [f"bench {i}" for i in range(runs)])
        _wait(lambda: _ended(url, run_ids), within=1800, what="the runs to end")
        return time.monotonic() - began


_ENQUEUE = """
import asyncio, sys
from engine.settings import Settings
from engine.workers.control import new_spec, start_on_workers

async def main():
    settings = Settings()
    for objective in sys.argv[2:]:
        spec = new_spec(objective=objective, tool="command", project="demo",
                        agent_cmd=sys.argv[1], passthrough=(), max_turns=None, verify_cmd=None)
        await start_on_workers(settings, spec)
        print(spec.run_id, flush=True)

asyncio.run(main())
"""


def _start_runs(env: dict[str, str], cwd: Path, objectives: list[str]) -> list[str]:
    """Queue one auto run per objective from one process, the way ``turnstile auto
    --detach`` does (one control plane asked for them all); their ids."""
    done = subprocess.run(
        [sys.executable, "-c", _ENQUEUE, AGENT_CMD, *objectives],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"queueing the runs failed: {done.stderr}")
    return done.stdout.split()


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


def bot_rss(setup: Setup, runs: int, *, sample_for: float = 8.0) -> float:
    """The bot's peak RSS (MB) while it follows ``runs`` auto runs in flight on workers."""
    import asyncio

    from tests.bot_process import bot_env, spawn
    from tests.fakes.bot_api import FakeBotApi

    gate = setup.tmp / "never"  # the Execute turns wait for it: the runs stay in flight
    rules = _rules(0, complete=True)
    rules[2] = {"match": EXECUTE, "text": "done", "wait_file": str(gate)}
    script = write_script(setup.tmp / "bot-rss", rules=rules)
    url = setup.database()
    chats = [-2000 - i for i in range(runs)]
    projects = f"default={setup.remote}#main"
    env = setup.env(url, script, TURNSTILE_PROJECTS=projects)
    bot_root = setup.tmp / "bot"
    bot_root.mkdir()

    in_flight: list[int] = []

    async def measure() -> float:
        async with FakeBotApi() as api:
            benv = bot_env(
                bot_root,
                api,
                TURNSTILE_DATABASE=url,
                TURNSTILE_EXECUTION="workers",
                TURNSTILE_PROJECTS=projects,
                TURNSTILE_ALLOWED_CHATS=",".join(map(str, chats)),
                TURNSTILE_WORKER_HEARTBEAT="1",
                TURNSTILE_WORKER_TIMEOUT="5",
                TURNSTILE_STATUS_EDIT_INTERVAL="1",
                TURNSTILE_LOG_LEVEL="WARNING",
                FAKE_AGENT_SCRIPT=str(script),
                **setup.home,
            )
            bot = await spawn(bot_root, benv, "bot")
            try:
                await api.wait_until(lambda: bool(api.calls_of("deleteWebhook")), timeout=60)
                for chat in chats:
                    api.push_message(chat_id=chat, user_id=11, text="/auto make result.txt")
                with contextlib.suppress(TimeoutError):
                    await api.wait_until(
                        lambda: sum("is queued on the workers" in m.text for m in api.sent) >= runs,
                        timeout=240,
                    )
                queued = sum("is queued on the workers" in m.text for m in api.sent)
                await asyncio.to_thread(
                    _wait,
                    lambda: _count(url, "SELECT count(*) FROM turns WHERE state = 'started'") >= 8,
                    within=300,
                    what="the workers to be busy",
                )
                # Placed on the workers and not ended (a run waiting for a worker has no
                # run row yet).
                in_flight.append(
                    _count(
                        url,
                        "SELECT count(*) FROM worker_runs WHERE status IN ('waiting', 'running')",
                    )
                )
                other = [m.text for m in api.sent if "is queued on the workers" not in m.text]
                if queued < runs:
                    print(f"  the bot queued {queued} of {runs} runs; other replies: {other[:3]}")
                assert bot.proc.pid is not None
                peak = 0.0
                ends = time.monotonic() + sample_for
                while time.monotonic() < ends:
                    peak = max(peak, _rss_mb(bot.proc.pid))
                    await asyncio.sleep(0.5)
                return peak
            finally:
                await bot.kill()

    with setup.workers(env, 4, 2, kill=True):
        peak = asyncio.run(measure())
    print(f"  runs in flight while sampled: {in_flight[0] if in_flight else 0}")
    return peak


def _count(url: str, sql: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(sql).fetchone()
    return int(row[0]) if row is not None else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=16)
    parser.add_argument("--sleep", type=float, default=2.0)
    parser.add_argument("--turns", type=int, default=12, help="turns of the latency run")
    parser.add_argument("--workers", default="1,2,4", help="worker counts (empty: latency only)")
    parser.add_argument("--rss", action="store_true", help="also the memory figures")
    parser.add_argument("--bot-runs", type=int, default=50, help="runs the bot follows (--rss)")
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
            rss = bot_rss(setup, args.bot_runs)
            print(
                f"control plane (turnstile bot) RSS, {args.bot_runs} runs in flight on "
                f"4 workers: {rss:.1f} MB (target ≤ 100 MB)",
                flush=True,
            )
            ok &= rss <= 100
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

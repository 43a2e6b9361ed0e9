"""Auto-mode benchmark.

1. Engine time per auto-mode turn, excluding the agent process, store writes included
   (target: median <= 5 ms). An in-process agent answers at once; each agent turn's engine
   time is the channel's ``next_prompt`` (render, append intake, start_turn) plus its
   ``publish_output`` (detection, transition, one store transaction, state file,
   transcript, sink), on a real SQLite file with synchronous=FULL.
2. 20 concurrent auto runs of the scripted fake agent (real subprocesses) in one engine
   process: engine RSS (this process only, agents excluded) and lost turns (target 0).

Run: ``.venv/bin/python bench/bench_automode.py [--turns N] [--runs N]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.automode import AutoStatus, prepare_auto_run  # noqa: E402
from engine.runs import RunSpec  # noqa: E402
from engine.settings import load_settings  # noqa: E402
from engine.sink import NullSink  # noqa: E402
from engine.store.database import Database  # noqa: E402
from engine.store.runs import SqliteRunStore, TurnState  # noqa: E402
from engine.turn import NextPrompt, TurnOutput, run_session_loop  # noqa: E402
from tests.automode_support import (  # noqa: E402
    AGENT_CMD,
    CLARIFY,
    EVALUATE,
    EXECUTE,
    GIT_ENV,
    PLAN,
    git_workspace,
    write_script,
)


class InstantAgent:
    """Answers every phase at once, never claiming completion (so every turn is measured)."""

    session_id = "bench"

    async def run_turn(self, prompt: str) -> TurnOutput:
        if EVALUATE in prompt:
            return TurnOutput("Not yet.\nAUTO-MODE STATUS: IN PROGRESS\n", exit_code=0)
        return TurnOutput("ok " * 200, exit_code=0)


class TimedChannel:
    """Times the wrapped channel's work per agent turn."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.samples: list[float] = []
        self._pending = 0.0

    @property
    def id(self) -> object:
        return self.inner.id  # type: ignore[attr-defined]

    async def next_prompt(self) -> NextPrompt:
        start = time.perf_counter()
        result: NextPrompt = await self.inner.next_prompt()  # type: ignore[attr-defined]
        self._pending = time.perf_counter() - start
        return result

    async def publish_output(self, out: TurnOutput) -> None:
        start = time.perf_counter()
        await self.inner.publish_output(out)  # type: ignore[attr-defined]
        self.samples.append(self._pending + time.perf_counter() - start)

    async def wait_for_inbound(self) -> None:
        await self.inner.wait_for_inbound()  # type: ignore[attr-defined]


async def engine_time(root: Path, turns: int) -> list[float]:
    ws = git_workspace(root / "ws-engine")
    settings = load_settings(database=root / "engine.db", runs_dir=root / "runs-engine")
    async with Database(settings.database) as db:
        spec = RunSpec(
            objective="benchmark objective",
            agent="command",
            workdir=ws,
            agent_cmd=AGENT_CMD,
            max_turns=turns,
        )
        run = await prepare_auto_run(settings, db, spec, sink=NullSink())
        # Steering text every few turns exercises the append intake too.
        for i in range(turns // 5):
            run.append_instruction(f"note {i}: keep going")
        timed = TimedChannel(run.channel)
        await run_session_loop(InstantAgent(), timed)  # type: ignore[arg-type]
        assert run.channel.state.status is AutoStatus.STOPPED
    return timed.samples


def rss_mb() -> tuple[float, float]:
    current = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            current = int(line.split()[1]) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return current, peak


async def concurrent_runs(root: Path, runs: int, max_turns: int) -> dict[str, object]:
    for key, value in GIT_ENV.items():
        os.environ[key] = value
    rules = [
        {"match": CLARIFY, "text": "goal"},
        {"match": PLAN, "text": "plan"},
        {"match": EXECUTE, "text": "worked on it"},
        {"match": EVALUATE, "text": "not yet\nAUTO-MODE STATUS: IN PROGRESS"},
    ]
    script = write_script(root / "fake", rules=rules)
    os.environ["FAKE_AGENT_SCRIPT"] = str(script)
    log = root / "agent.log"
    os.environ["FAKE_AGENT_LOG"] = str(log)
    settings = load_settings(database=root / "concurrent.db", runs_dir=root / "runs")
    expected_per_run = 2 + 2 * (max_turns - 2)
    rss_before, _ = rss_mb()
    started = time.perf_counter()
    async with Database(settings.database) as db:
        autoruns = []
        for i in range(runs):
            ws = git_workspace(root / f"ws-{i}")
            autoruns.append(
                await prepare_auto_run(
                    settings,
                    db,
                    RunSpec(
                        objective=f"run {i}",
                        agent="command",
                        workdir=ws,
                        agent_cmd=AGENT_CMD,
                        max_turns=max_turns,
                    ),
                    sink=NullSink(),
                )
            )
        peak_during = 0.0

        async def sample() -> None:
            nonlocal peak_during
            while True:
                peak_during = max(peak_during, rss_mb()[0])
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample(), name="rss-sampler")
        results = await asyncio.gather(*(r.wait() for r in autoruns))
        sampler.cancel()
        elapsed = time.perf_counter() - started
        store = SqliteRunStore(db)
        lost = 0
        recorded = 0
        for run in autoruns:
            turns = await store.turns(run.run_id)
            recorded += len(turns)
            finished = [t.seq for t in turns if t.state is TurnState.FINISHED]
            if finished != list(range(1, expected_per_run + 1)):
                lost += expected_per_run - len(set(finished))
    agent_turns = sum(1 for line in log.read_text().splitlines() if json.loads(line))
    return {
        "runs": runs,
        "statuses": sorted({r.status.value for r in results}),
        "expected_turns": expected_per_run * runs,
        "recorded_turns": recorded,
        "agent_turns": agent_turns,
        "lost_turns": lost,
        "elapsed_s": elapsed,
        "rss_before_mb": rss_before,
        "rss_peak_during_mb": peak_during,
        "rss_peak_process_mb": rss_mb()[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=100, help="auto turns of the engine run")
    parser.add_argument("--runs", type=int, default=20, help="concurrent fake-agent runs")
    parser.add_argument("--max-turns", type=int, default=5, help="turn cap of each run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="bench-automode-") as tmp:
        root = Path(tmp)
        cpu0 = time.process_time()
        samples = asyncio.run(engine_time(root, args.turns))
        cpu = (time.process_time() - cpu0) / len(samples) * 1000
        ms = sorted(s * 1000 for s in samples)
        median = statistics.median(ms)
        p95 = ms[int(len(ms) * 0.95) - 1]
        print(f"engine time per agent turn ({len(ms)} turns, store writes included, disk):")
        print(f"  median {median:.2f} ms   p95 {p95:.2f} ms   max {ms[-1]:.2f} ms")
        print(f"  CPU of this process per turn (all threads): {cpu:.2f} ms")
        print(f"  target median <= 5 ms: {'PASS' if median <= 5 else 'FAIL'}")
        shm = Path("/dev/shm")
        if shm.is_dir():
            # The same on tmpfs: what is left is the engine, not the disk's fsync latency.
            with tempfile.TemporaryDirectory(prefix="bench-automode-", dir=shm) as mem:
                fast = sorted(s * 1000 for s in asyncio.run(engine_time(Path(mem), args.turns)))
            print(
                f"  same on tmpfs (no fsync latency): median {statistics.median(fast):.2f} ms"
                f"   p95 {fast[int(len(fast) * 0.95) - 1]:.2f} ms"
            )
        report = asyncio.run(concurrent_runs(root, args.runs, args.max_turns))
        print(f"{args.runs} concurrent auto runs of the fake agent (max_turns {args.max_turns}):")
        for key, value in report.items():
            shown = f"{value:.1f}" if isinstance(value, float) else value
            print(f"  {key}: {shown}")
        print(f"  target zero lost turns: {'PASS' if report['lost_turns'] == 0 else 'FAIL'}")


if __name__ == "__main__":
    main()

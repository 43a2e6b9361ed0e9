"""Warm sessions against one process per turn, side by side, real CLIs, instant fake model.

For Claude Code: one session driven per turn (:class:`ClaudeAgent`, a ``claude -p``
process each turn) and one warm session (:class:`WarmClaudeAgent`, one resident process),
their turns interleaved in the same run. Reports wall time of turns 2..N for each (the
first warm turn pays the start-up like any per-turn turn), the ratio (target: warm at
least 5x lower), the resident memory of one idle warm session (the CLI and its
descendants, VmRSS), and the total RSS of this process plus 10 warm sessions.
With ``--codex``, Codex the same way: ``codex exec`` per turn (:class:`CodexAgent`) against
one resident ``codex app-server`` (:class:`WarmCodexAgent`), and its resident memory (the
Node wrapper plus the native server); ``--only-codex`` skips Claude Code. No target for
Codex: the issue asks for its figures.

Usage: ``.venv/bin/python bench/bench_warm.py [--turns N] [--sessions 10] [--codex]
[--only-codex]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.agents.base import AgentOptions
from engine.agents.claude import ClaudeAgent
from engine.agents.codex import CodexAgent
from engine.agents.stream import JsonStreamAgent
from engine.agents.warm import WarmClaudeAgent, WarmPool
from engine.agents.warm_codex import WarmCodexAgent, codex_warm_support
from tests.agent_clis import ensure_cli
from tests.fakes.model_api import FakeModelAPI, Text

TARGET_RATIO = 5.0
PROMPT = "Reply with one short sentence."


def options(api: FakeModelAPI, root: Path, name: str = "claude") -> AgentOptions:
    workspace, config = root / "workspace", root / "config"
    workspace.mkdir(parents=True, exist_ok=True)
    config.mkdir(parents=True, exist_ok=True)
    env = api.codex_env(config) if name == "codex" else api.claude_env(config)
    return AgentOptions(
        binary=str(ensure_cli(name)), cwd=workspace, config_dir=config, extra_env=env
    )


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree(pid: int) -> list[int]:
    """``pid`` and every descendant (from /proc's parent links)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        frontier += children
    return found


def tree_rss_mib(pid: int) -> float:
    return sum(rss_kib(p) for p in tree(pid)) / 1024


async def timed(agent: JsonStreamAgent) -> float:
    started = time.perf_counter()
    out = await agent.run_turn(PROMPT)
    elapsed = time.perf_counter() - started
    if out.exit_code != 0:
        raise RuntimeError(f"turn failed: {out.text[:200]}")
    return elapsed


def summary(name: str, times: list[float]) -> str:
    return (
        f"{name:<26} median {statistics.median(times) * 1000:7.0f} ms"
        f"   mean {statistics.fmean(times) * 1000:7.0f} ms   (turns 2..{len(times) + 1})"
    )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--codex", action="store_true")
    parser.add_argument("--only-codex", action="store_true")
    args = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
        root = Path(tmp)
        async with FakeModelAPI(fallback=Text("Done.")) as api:
            if args.only_codex:
                await bench_codex(api, root, args.turns)
                return 0
            async with WarmPool(max_sessions=args.sessions + 1) as pool:
                cold = ClaudeAgent(options(api, root / "cold"))
                warm = WarmClaudeAgent(options(api, root / "warm"), pool=pool)
                cold_times: list[float] = []
                warm_times: list[float] = []
                first = (await timed(cold), await timed(warm))
                for _ in range(args.turns - 1):
                    cold_times.append(await timed(cold))
                    warm_times.append(await timed(warm))
                print(f"Claude Code, first turn: per turn {first[0]:.2f} s, warm {first[1]:.2f} s")
                print(summary("claude per-turn process", cold_times))
                print(summary("claude warm session", warm_times))
                ratio = statistics.median(cold_times) / statistics.median(warm_times)
                verdict = "ok" if ratio >= TARGET_RATIO else "BELOW TARGET"
                print(
                    f"warm is {ratio:.1f}x faster per turn "
                    f"(target >= {TARGET_RATIO:.0f}x): {verdict}"
                )
                ok = ok and ratio >= TARGET_RATIO
                assert warm.pid is not None
                print(f"resident memory of one idle warm session: {tree_rss_mib(warm.pid):.0f} MiB")
                await warm.aclose()

                sessions = [
                    WarmClaudeAgent(options(api, root / f"s{i}"), pool=pool)
                    for i in range(args.sessions)
                ]
                for agent in sessions:
                    await timed(agent)
                ours = rss_kib(os.getpid()) / 1024
                theirs = [tree_rss_mib(a.pid) for a in sessions if a.pid is not None]
                print(
                    f"{len(theirs)} warm sessions: {sum(theirs):.0f} MiB resident in agent "
                    f"processes (each {min(theirs):.0f}-{max(theirs):.0f} MiB) + "
                    f"{ours:.0f} MiB this process = {sum(theirs) + ours:.0f} MiB total"
                )
            if args.codex:
                await bench_codex(api, root, args.turns)
    return 0 if ok else 1


async def bench_codex(api: FakeModelAPI, root: Path, turns: int) -> None:
    """Codex per turn (``codex exec``) against one resident app-server, interleaved."""
    binary = str(ensure_cli("codex"))
    support = codex_warm_support(binary)
    if not support.supported:
        print(f"codex: no warm mode ({support.reason})")
        return
    async with WarmPool(max_sessions=2) as pool:
        cold = CodexAgent(options(api, root / "codex-cold", "codex"))
        warm_options = options(api, root / "codex-warm", "codex")
        warm = WarmCodexAgent(warm_options, pool=pool, support=support)
        first = (await timed(cold), await timed(warm))
        cold_times: list[float] = []
        warm_times: list[float] = []
        for _ in range(turns - 1):
            cold_times.append(await timed(cold))
            warm_times.append(await timed(warm))
        print(f"Codex, first turn: per turn {first[0]:.2f} s, warm {first[1]:.2f} s")
        print(summary("codex per-turn process", cold_times))
        print(summary("codex warm session", warm_times))
        ratio = statistics.median(cold_times) / statistics.median(warm_times)
        print(f"codex warm is {ratio:.1f}x faster per turn")
        assert warm.pid is not None
        print(
            f"resident memory of one idle warm Codex session: {tree_rss_mib(warm.pid):.0f} MiB"
            f" ({', '.join(f'{rss_kib(p) / 1024:.0f}' for p in tree(warm.pid))} MiB per process)"
        )
        await warm.aclose()


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))

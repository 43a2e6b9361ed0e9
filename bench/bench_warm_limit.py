"""A warm turn against the physical limit: the bare resident CLI, side by side in one run.

Real Claude Code on the instant fake model (tests/fakes/model_api.py), three ways,
their turns interleaved so the machine's noise hits all alike:

- **bare**: ``claude -p --input-format stream-json --output-format stream-json --verbose``
  spawned directly with the very argv and environment a warm session uses; a turn is one
  user line written to its stdin until its ``result`` line is read. No turnstile.
- **engine**: :class:`~engine.agents.warm.WarmClaudeAgent` ``run_turn`` (what ``turnstile
  chat`` and every front end drives), from the call to the returned answer.
- **bot**: a real ``turnstile bot`` process (python-telegram-bot on the fake Bot API,
  SQLite store, warm sessions, the agent in its sandbox where bubblewrap is installed),
  in a private chat, from the message pushed to the fake Bot API to the answer's
  ``sendMessage`` reaching it.

Targets: engine turns 2..N within 15 ms of bare (p50); the engine's first turn within
100 ms of bare's first turn; bot turns 2..N within 25 ms of bare (p50).

Usage: ``.venv/bin/python bench/bench_warm_limit.py [--turns N] [--rounds R] [--pause S]``
(R fresh sessions of each kind; first turns are the median over the rounds). A warm
session's next turn waits until the CLI has saved the previous one to its transcript
(about 85 ms after its answer): back to back (``--pause 0``) that wait shows; a person
takes longer than that to read an answer and type the next message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.agents.base import AgentOptions
from engine.agents.warm import WarmClaudeAgent, WarmPool
from tests.agent_clis import ensure_cli
from tests.bot_process import bot_env, start_polling
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import CHAT, OPERATOR
from tests.fakes.model_api import FakeModelAPI, Text

PROMPT = "Reply with one short sentence."
ENGINE_MARGIN = 0.015
FIRST_MARGIN = 0.100
BOT_MARGIN = 0.025


def options(api: FakeModelAPI, root: Path) -> AgentOptions:
    workspace, config = root / "workspace", root / "config"
    workspace.mkdir(parents=True, exist_ok=True)
    config.mkdir(parents=True, exist_ok=True)
    return AgentOptions(
        binary=str(ensure_cli("claude")),
        cwd=workspace,
        config_dir=config,
        extra_env=api.claude_env(config),
    )


class Bare:
    """The resident CLI with nothing around it."""

    def __init__(self, api: FakeModelAPI, root: Path) -> None:
        self.like = WarmClaudeAgent(options(api, root))
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        invocation = self.like.build_invocation("-")
        self.proc = await asyncio.create_subprocess_exec(
            *invocation.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            cwd=self.like.options.cwd,
            env=self.like.environment(invocation),
            limit=1 << 24,
        )

    async def turn(self) -> float:
        started = time.perf_counter()
        if self.proc is None:
            await self.start()
        assert self.proc is not None
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        line = {
            "type": "user",
            "message": {"role": "user", "content": PROMPT},
            "parent_tool_use_id": None,
            "session_id": self.like.session_id,
        }
        self.proc.stdin.write((json.dumps(line) + "\n").encode())
        while True:
            raw = await self.proc.stdout.readline()
            if not raw:
                raise RuntimeError("the bare CLI exited")
            if b'"result"' in raw and json.loads(raw).get("type") == "result":
                return time.perf_counter() - started

    async def close(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


class Engine:
    def __init__(self, api: FakeModelAPI, root: Path, pool: WarmPool) -> None:
        self.agent = WarmClaudeAgent(options(api, root), pool=pool)

    async def turn(self) -> float:
        started = time.perf_counter()
        out = await self.agent.run_turn(PROMPT)
        elapsed = time.perf_counter() - started
        if out.exit_code != 0:
            raise RuntimeError(f"turn failed: {out.text[:200]}")
        return elapsed

    async def close(self) -> None:
        await self.agent.aclose()


class Bot:
    """One chat in a real ``turnstile bot`` process (SQLite, warm sessions); a turn is a
    message pushed to the fake Bot API until the answer's ``sendMessage`` reaches it."""

    def __init__(self, api: FakeBotApi, model: FakeModelAPI, root: Path) -> None:
        self.api = api
        self.root = root
        self.model = model
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        config = self.root / "config"
        config.mkdir(parents=True, exist_ok=True)
        env = bot_env(
            self.root,
            self.api,
            **self.model.claude_env(config),
            TURNSTILE_DEFAULT_AGENT="claude",
            TURNSTILE_CLAUDE_BIN=str(ensure_cli("claude")),
            TURNSTILE_WARM_SESSIONS="claude",
            TURNSTILE_LOG_LEVEL="WARNING",
            # A private chat: a group's 20 messages a minute (Telegram's limit, which the
            # bot keeps) would be what this measured after the first few turns.
            TURNSTILE_ALLOWED_CHATS=f"{CHAT},{OPERATOR}",
        )
        self.root.mkdir(parents=True, exist_ok=True)
        self.proc = await start_polling(self.api, self.root, env)
        before = len(self.api.calls_of("sendMessage"))
        self.api.push_message(chat_id=OPERATOR, user_id=OPERATOR, text="/chat")
        await self.api.wait_until(
            lambda: any(
                "bound" in str(c.params.get("text"))
                for c in self.api.calls_of("sendMessage")[before:]
            ),
            timeout=60,
        )

    async def turn(self) -> float:
        if self.proc is None:
            await self.start()
        before = len(self.api.calls_of("sendMessage"))
        started = time.perf_counter()
        self.api.push_message(chat_id=OPERATOR, user_id=OPERATOR, text=PROMPT)

        def answered() -> bool:
            return any(
                c.params.get("text") == "Done." for c in self.api.calls_of("sendMessage")[before:]
            )

        await self.api.wait_until(answered, timeout=60)
        return time.perf_counter() - started

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def p50(values: list[float]) -> float:
    return statistics.median(values) * 1000


def line(name: str, firsts: list[float], later: list[float]) -> str:
    p90 = statistics.quantiles(later, n=10)[-1] * 1000
    return (
        f"{name:<8} first turn {p50(firsts):7.1f} ms   turns 2..N p50 {p50(later):7.1f} ms"
        f"   p90 {p90:7.1f} ms   mean {statistics.fmean(later) * 1000:7.1f} ms"
    )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="seconds between an answer and the next message of the same session (a "
        "person reading and typing; 0: back to back)",
    )
    args = parser.parse_args()
    firsts: dict[str, list[float]] = {"bare": [], "engine": [], "bot": []}
    later: dict[str, list[float]] = {"bare": [], "engine": [], "bot": []}
    with tempfile.TemporaryDirectory(prefix="bench-warm-limit-") as tmp:
        root = Path(tmp)
        async with (
            FakeModelAPI(fallback=Text("Done.")) as model,
            FakeBotApi() as tg,
            WarmPool(max_sessions=8) as pool,
        ):
            for r in range(args.rounds):
                kinds: dict[str, Any] = {
                    "bare": Bare(model, root / f"bare-{r}"),
                    "engine": Engine(model, root / f"engine-{r}", pool),
                    "bot": Bot(tg, model, root / f"bot-{r}"),
                }
                # Who goes first changes each round (a first turn is the noisiest figure).
                order = list(kinds.items())
                order = order[r % len(order) :] + order[: r % len(order)]
                try:
                    for t in range(args.turns):
                        for name, kind in order:
                            elapsed = await kind.turn()
                            (firsts if t == 0 else later)[name].append(elapsed)
                        await asyncio.sleep(args.pause)
                finally:
                    for kind in kinds.values():
                        await kind.close()
    bare_later = p50(later["bare"])
    version = subprocess.run(
        [str(ensure_cli("claude")), "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(
        f"Claude Code {version}: {args.rounds} rounds × {args.turns} turns, interleaved, "
        f"{args.pause:.2f} s between an answer and the next message"
    )
    for name in ("bare", "engine", "bot"):
        print(line(name, firsts[name], later[name]))
    checks = [
        ("engine turns 2..N vs bare", p50(later["engine"]) - bare_later, ENGINE_MARGIN),
        ("engine first turn vs bare", p50(firsts["engine"]) - p50(firsts["bare"]), FIRST_MARGIN),
        ("bot message → answer vs bare", p50(later["bot"]) - bare_later, BOT_MARGIN),
    ]
    ok = True
    for what, gap, margin in checks:
        good = gap <= margin * 1000
        ok = ok and good
        verdict = "ok" if good else "OVER"
        print(f"{what:<30} {gap:+7.1f} ms (target ≤ +{margin * 1000:.0f} ms): {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

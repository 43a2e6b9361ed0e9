"""The Telegram bot against the fake Bot API on loopback.

1. Inbound update → agent process spawned, p50 / p99, against a bare python-telegram-bot
   echo handler (``Updater.start_polling`` + one ``MessageHandler``; update → handler
   running) measured in the same run on the same fake server, interleaved in rounds.
   Target: our p50 ≤ bare p50 + 10 ms. Ours includes recording the update in SQLite
   (WAL, synchronous=FULL) before acting, queueing the prompt and recording the turn.
2. Messages sent per 100 KB of agent output: with the default document threshold (one
   document) and with documents disabled (text split at ≤ 4096). Target ≤ 27 or one document.
3. 20 concurrent chat sessions (the real ``turnstile bot`` process, the fake agent, five
   messages each): lost and duplicated answers (target zero) and the bot's peak RSS.

Usage: ``.venv/bin/python bench/bench_bot.py [--samples N]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
os.environ.setdefault("PTB_TIMEDELTA", "true")

from telegram import Update
from telegram.ext import AIORateLimiter, ApplicationBuilder, ContextTypes, MessageHandler, filters

from bot.app import BotRuntime
from engine.agents.factory import create_agent
from engine.process import PreemptHandle
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import FAKE_AGENT, OPERATOR, bot_settings

REPO = Path(__file__).resolve().parent.parent
CHAT = OPERATOR


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class SpawnClock(PreemptHandle):
    """Notes the moment each turn's process exists (``_attach`` follows the spawn)."""

    spawned: asyncio.Event
    at: float = 0.0

    def _attach(self, proc: asyncio.subprocess.Process) -> None:
        SpawnClock.at = time.perf_counter()
        SpawnClock.spawned.set()
        super()._attach(proc)


async def latency(samples: int) -> tuple[list[float], list[float]]:
    """(ours, bare) in milliseconds, interleaved in rounds of 10."""
    ours: list[float] = []
    bare: list[float] = []
    SpawnClock.spawned = asyncio.Event()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        async with FakeBotApi() as api_ours, FakeBotApi() as api_bare:
            settings = bot_settings(
                api_ours,
                root,
                allowed_chats=(CHAT,),
                agent_command="/bin/echo {prompt}",
                status_edit_interval=5.0,
            )

            def factory(*args: Any, **kwargs: Any) -> Any:
                kwargs["preempt"] = SpawnClock(grace=1.0)
                return create_agent(*args, **kwargs)

            handled = asyncio.Event()
            handled_at = 0.0

            async def echo(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
                nonlocal handled_at
                handled_at = time.perf_counter()
                handled.set()
                assert update.message is not None
                await update.message.reply_text(update.message.text or "")

            bare_app = (
                ApplicationBuilder()
                .token(api_bare.token)
                .base_url(api_bare.base_url)
                .base_file_url(api_bare.file_url)
                .build()
            )
            bare_app.add_handler(MessageHandler(filters.TEXT, echo))
            limiter = AIORateLimiter(max_retries=8)
            async with BotRuntime(settings, agent_factory=factory, rate_limiter=limiter) as rt:
                await rt.start()
                await bare_app.initialize()
                assert bare_app.updater is not None
                await bare_app.updater.start_polling(poll_interval=0.0, timeout=25)
                await bare_app.start()
                try:
                    api_ours.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
                    await api_ours.wait_for_message(lambda m: "bound" in m.text)
                    # warm-up
                    for api in (api_ours, api_bare):
                        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="warm")
                    await api_ours.wait_for_message(lambda m: m.text.strip() == "warm")
                    await api_bare.wait_for_message(lambda m: m.text == "warm")
                    n = 0
                    while n < samples:
                        for _ in range(10):
                            n += 1
                            text = f"sample {n}"
                            handled.clear()
                            t0 = time.perf_counter()
                            api_bare.push_message(chat_id=CHAT, user_id=OPERATOR, text=text)
                            await asyncio.wait_for(handled.wait(), 10)
                            bare.append((handled_at - t0) * 1000)
                            await api_bare.wait_for_message(lambda m, t=text: m.text == t)
                        for _ in range(10):
                            text = f"ours {len(ours)}"
                            SpawnClock.spawned.clear()
                            t0 = time.perf_counter()
                            api_ours.push_message(chat_id=CHAT, user_id=OPERATOR, text=text)
                            await asyncio.wait_for(SpawnClock.spawned.wait(), 10)
                            ours.append((SpawnClock.at - t0) * 1000)
                            await api_ours.wait_for_message(lambda m, t=text: m.text.strip() == t)
                finally:
                    await bare_app.updater.stop()
                    await bare_app.stop()
                    await bare_app.shutdown()
                    rt.request_shutdown()
                    await rt.shutdown()
    return ours, bare


async def messages_per_100kb() -> tuple[int, int, int]:
    """(calls with the default threshold, documents among them, calls with text only)."""
    line = "lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor\n"
    marker = "\nEND-OF-OUTPUT"
    output = (line * (100_000 // len(line) + 1))[: 100_000 - len(marker)] + marker
    results = []
    for threshold in (None, 10_000_000):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            out_file = root / "out.txt"
            out_file.write_text(output)
            async with FakeBotApi() as api:
                extra: dict[str, Any] = {
                    "allowed_chats": (CHAT,),
                    "agent_command": f"/bin/cat {out_file}",
                }
                if threshold is not None:
                    extra["document_threshold"] = threshold
                settings = bot_settings(api, root, **extra)
                async with BotRuntime(settings) as rt:
                    await rt.start()
                    api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
                    await api.wait_for_message(lambda m: "bound" in m.text)
                    before = len(api.sent)
                    # /bin/cat prints the file (the prompt goes to its stdin, unread).
                    api.push_message(chat_id=CHAT, user_id=OPERATOR, text="go")

                    def done(api: FakeBotApi = api, before: int = before) -> bool:
                        return any(
                            m.document is not None or m.text.rstrip().endswith("END-OF-OUTPUT")
                            for m in api.sent[before:]
                        )

                    await api.wait_until(done, timeout=30)
                    await asyncio.sleep(0.3)
                    sent = [
                        m for m in api.sent[before:] if not m.text.startswith("💬 chat session")
                    ]
                    rt.request_shutdown()
                    await rt.shutdown()
            results.append((len(sent), sum(m.document is not None for m in sent)))
    return results[0][0], results[0][1], results[1][0]


async def concurrent_sessions(chats: int = 20, per_chat: int = 5) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        async with FakeBotApi() as api:
            ids = [1000 + i for i in range(chats)]
            env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
            env.update(
                {
                    "TURNSTILE_TELEGRAM_TOKEN": api.token,
                    "TURNSTILE_TELEGRAM_BASE_URL": api.base_url,
                    "TURNSTILE_TELEGRAM_BASE_FILE_URL": api.file_url,
                    "TURNSTILE_DATABASE": str(root / "bot.db"),
                    "TURNSTILE_WORKSPACES": str(root / "ws"),
                    "TURNSTILE_RUNS_DIR": str(root / "runs"),
                    "TURNSTILE_ALLOWED_CHATS": ",".join(map(str, ids)),
                    "TURNSTILE_OPERATORS": ",".join(map(str, ids)),
                    "TURNSTILE_DEFAULT_AGENT": "command",
                    "TURNSTILE_AGENT_COMMAND": (
                        f"{sys.executable} {FAKE_AGENT} --session {{session_id}} "
                        "--prompt {prompt}"
                    ),
                    "TURNSTILE_MAX_CONCURRENT_TURNS": str(chats),
                    "FAKE_AGENT_STATE": str(root / "agent-state"),
                    "PYTHONPATH": str(REPO),
                }
            )
            with open(root / "bot.log", "wb") as log:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "engine.cli", "bot", cwd=root, env=env,
                    stdout=asyncio.subprocess.DEVNULL, stderr=log,
                )  # fmt: skip
            try:
                await api.wait_until(lambda: bool(api.calls_of("deleteWebhook")), timeout=30)
                for chat in ids:
                    api.push_message(chat_id=chat, user_id=chat, text="/chat")
                await api.wait_until(lambda: sum("bound" in t for t in api.texts()) == chats, 30)
                started = time.perf_counter()
                for j in range(per_chat):
                    for chat in ids:
                        api.push_message(chat_id=chat, user_id=chat, text=f"m{chat}-{j}")
                expected = {f"echo: m{chat}-{j}" for chat in ids for j in range(per_chat)}
                peak = 0
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    peak = max(peak, _rss_kb(proc.pid))
                    if expected <= set(api.texts()):
                        break
                    await asyncio.sleep(0.05)
                elapsed = time.perf_counter() - started
                peak = max(peak, _hwm_kb(proc.pid))
                answers = [t for t in api.texts() if t.startswith("echo: m")]
                proc.terminate()
                code = await asyncio.wait_for(proc.wait(), 60)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            lost = len(expected - set(answers))
            dup = len(answers) - len(set(answers))
            return {
                "messages": len(expected),
                "lost": lost,
                "duplicated": dup,
                "seconds": elapsed,
                "peak_rss_mb": peak / 1024,
                "exit": code,
            }


def _status_kb(pid: int, key: str) -> int:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _rss_kb(pid: int) -> int:
    return _status_kb(pid, "VmRSS")


def _hwm_kb(pid: int) -> int:
    return _status_kb(pid, "VmHWM")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    if shutil.which("cat") is None:
        raise SystemExit("needs /bin/cat and /bin/echo")

    ours, bare = await latency(args.samples)
    p50o, p99o, p50b, p99b = pct(ours, 0.5), pct(ours, 0.99), pct(bare, 0.5), pct(bare, 0.99)
    print(f"update → agent spawned (ours, n={len(ours)}): p50 {p50o:.2f} ms, p99 {p99o:.2f} ms")
    print(
        f"update → handler running (bare PTB echo, n={len(bare)}): "
        f"p50 {p50b:.2f} ms, p99 {p99b:.2f} ms"
    )
    verdict = "PASS" if p50o <= p50b + 10 else "FAIL"
    print(f"  target ours p50 ≤ bare p50 + 10 ms: {p50o:.2f} ≤ {p50b + 10:.2f} → {verdict}")
    print(f"  mean ours {statistics.mean(ours):.2f} ms, mean bare {statistics.mean(bare):.2f} ms")

    calls, docs, text_only = await messages_per_100kb()
    print(f"100 KB output, default threshold: {calls} message(s), {docs} document(s)")
    print(f"100 KB output, documents disabled: {text_only} message(s) (target ≤ 27)")

    result = await concurrent_sessions()
    print(
        f"20 concurrent chat sessions: {result['messages']} messages, lost {result['lost']}, "
        f"duplicated {result['duplicated']}, {result['seconds']:.1f} s, "
        f"bot peak RSS {result['peak_rss_mb']:.1f} MB, exit {result['exit']}"
    )


if __name__ == "__main__":
    asyncio.run(main())

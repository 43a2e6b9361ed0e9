"""A tool approval request: the agent CLI asks → the request message is visible in the chat.

The permission server is the real one (``python -m engine.approvals.mcp_server``), spoken
to over stdio through the MCP SDK's client the way Claude Code speaks to it: one session
for the whole run, one ``approve`` call per sample. The bot is the real one against the
fake Bot API on loopback. Each sample is timed from the moment the call is written to the
server's stdin until the fake Bot API holds the ``sendMessage`` with the request's buttons;
the request is then denied through the store so the next sample starts clean.

Target: p50 ≤ 100 ms.

Usage: ``.venv/bin/python bench/bench_tool_approval.py [--samples N]``
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
os.environ.setdefault("PTB_TIMEDELTA", "true")

from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from bot.tool_approvals import ToolApprovalExtension
from engine.approvals import ApprovalRoute, Decision, SqliteApprovalStore
from engine.store.runs import SqliteRunStore
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot

TARGET_MS = 100.0
RUN_ID = "rbench1"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(samples: int) -> list[float]:
    timings: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        async with FakeBotApi() as api:
            settings = bot_settings(api, root, tool_approval="unlisted")
            async with running_bot(api, settings) as rt:
                assert rt.handlers is not None
                ext = next(
                    e for e in rt.handlers.extensions if isinstance(e, ToolApprovalExtension)
                )
                await ext._started.wait()
                await SqliteRunStore(rt.db).create_run(
                    RUN_ID, mode="chat", agent="claude", session_id="s", workdir=tmp, chat_id=CHAT
                )
                route = ApprovalRoute(
                    database=settings.database,
                    run_id=RUN_ID,
                    policy=ext.policy,
                    starter=OPERATOR,
                    wake=ext.watcher.wake_path,
                )
                params = StdioServerParameters(
                    command=sys.executable,
                    args=["-P", "-m", "engine.approvals.mcp_server"],
                    env=route.server_env(),
                )
                store = SqliteApprovalStore(rt.db)
                async with (
                    stdio_client(params) as (read, write),
                    ClientSession(read, write) as session,
                ):
                    await session.initialize()
                    for i in range(samples + 3):
                        before = len(api.sent)
                        arguments: dict[str, Any] = {
                            "tool_name": "Bash",
                            "input": {"command": f"touch file{i}.txt"},
                            "tool_use_id": f"toolu_{i}",
                        }
                        start = time.perf_counter()
                        call = asyncio.create_task(session.call_tool("approve", arguments))
                        await api.wait_for_message(
                            lambda m, b=before: (
                                api.sent.index(m) >= b and "asks to use Bash" in m.text
                            )
                        )
                        elapsed = (time.perf_counter() - start) * 1000
                        if i >= 3:  # the first calls warm up the server and the bot
                            timings.append(elapsed)
                        [pending] = await store.pending(run_id=RUN_ID)
                        await store.decide(pending.id, Decision.DENIED, by=OPERATOR)
                        await call
    return timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    timings = asyncio.run(measure(args.samples))
    p50 = statistics.median(timings)
    print(
        f"tool request → chat message: n={len(timings)} p50={p50:.1f} ms "
        f"p90={pct(timings, 0.9):.1f} ms max={max(timings):.1f} ms "
        f"(target p50 ≤ {TARGET_MS:.0f} ms)"
    )
    ok = p50 <= TARGET_MS
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

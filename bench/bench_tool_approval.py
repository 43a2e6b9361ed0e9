"""A tool approval request, and an agent's question: the agent CLI asks → the message is
visible in the chat.

The permission server is the real one (an ``ApprovalListener`` in the bot's process, reached
through the relay Claude Code starts), spoken to over stdio through the MCP SDK's client
the way Claude Code speaks to it: one session for the whole run, one ``approve`` and one
``ask`` call per sample. The bot is the real one against the
fake Bot API on loopback. Each sample is timed from the moment the call is written to the
server's stdin until the fake Bot API holds the ``sendMessage`` with the request's buttons;
the request is then denied (the question answered) through the store so the next sample
starts clean.

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
from engine.approvals import ApprovalRoute, Decision, QuestionStore, SqliteApprovalStore
from engine.approvals.listener import ApprovalListener
from engine.store.runs import SqliteRunStore
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot

TARGET_MS = 100.0
RUN_ID = "rbench1"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(samples: int) -> dict[str, list[float]]:
    """Per tool (``approve``, ``ask``): the times from the call to its chat message."""
    timings: dict[str, list[float]] = {"approve": [], "ask": []}
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
                store = SqliteApprovalStore(rt.db)
                questions = QuestionStore(rt.db)
                # What Claude Code starts: the relay to the listener's socket.
                async with ApprovalListener(route, worktree=tmp) as listener:
                    spec = listener.mcp_config()["mcpServers"]
                    assert isinstance(spec, dict)
                    server = spec["turnstile"]
                    params = StdioServerParameters(
                        command=server["command"], args=server["args"], env={}
                    )
                    async with (
                        stdio_client(params) as (read, write),
                        ClientSession(read, write) as session,
                    ):
                        await session.initialize()
                        for i in range(samples + 3):
                            for tool in ("approve", "ask"):
                                elapsed, call = await _one(api, session, tool, i)
                                if i >= 3:  # the first calls warm up the server and the bot
                                    timings[tool].append(elapsed)
                                if tool == "approve":
                                    [pending] = await store.pending(run_id=RUN_ID)
                                    await store.decide(pending.id, Decision.DENIED, by=OPERATOR)
                                else:
                                    [asked] = await questions.pending(run_id=RUN_ID)
                                    await questions.answer(asked.id, "yes", by=OPERATOR)
                                await call
    return timings


async def _one(
    api: FakeBotApi, session: ClientSession, tool: str, i: int
) -> tuple[float, asyncio.Task[Any]]:
    """Call ``tool``; once its message is in the chat: the time it took, and the call."""
    before = len(api.sent)
    if tool == "approve":
        arguments: dict[str, Any] = {
            "tool_name": "Bash",
            "input": {"command": f"touch file{i}.txt"},
            "tool_use_id": f"toolu_{i}",
        }
        shown = "asks to use Bash"
    else:
        arguments = {"question": f"Go on with step {i}?", "options": ["yes", "no"]}
        shown = f"Go on with step {i}?"
    start = time.perf_counter()
    call = asyncio.create_task(session.call_tool(tool, arguments))
    await api.wait_for_message(lambda m: api.sent.index(m) >= before and shown in m.text)
    return (time.perf_counter() - start) * 1000, call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    timings = asyncio.run(measure(args.samples))
    ok = True
    for tool, what in (("approve", "tool request"), ("ask", "agent question")):
        values = timings[tool]
        p50 = statistics.median(values)
        print(
            f"{what} → chat message: n={len(values)} p50={p50:.1f} ms "
            f"p90={pct(values, 0.9):.1f} ms max={max(values):.1f} ms "
            f"(target p50 ≤ {TARGET_MS:.0f} ms)"
        )
        ok = ok and p50 <= TARGET_MS
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

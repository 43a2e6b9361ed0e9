"""How many messages a team gets, and how soon a turn shows progress (fake Bot API, fake agent).

1. A full autopilot (9 phases, every gate approved by its button): messages sent
   (``sendMessage`` + ``sendDocument``), documents among them, and edits.
2. A 10-turn auto run (``TURNSTILE_MAX_TURNS=10``): the fake agent claims completion at
   every turn and never commits, so every claim is checked and not accepted: the same
   counts, and how many of the messages were such a claim's refusal.
3. First-progress latency in a chat session: a person's message pushed to the fake Bot API
   → the bot's first message answering it (the progress message, or on code without one,
   whatever came first) seen by the fake. Target p50 < 100 ms.

Counts exclude the bot's start-up calls. The script runs on any checkout that has the
fake Bot API (``tests/fakes``): run it from another worktree for a "before" figure.

Measured on 2 shared cores, 40 samples (main before this branch → after):
autopilot 37 messages (4 documents) → 15 (4 documents); 10-turn auto run 21 → 3 (the live
message, the report, the turns document); first progress p50 50.7 ms, p95 105.3 ms (main
has no progress message: its first new message after a question is the answer, p50 273 ms).

With every claim of completion refused (h13more, 20 samples, lead before → after): 10-turn
auto run 11 messages (8 of them "🔎 Turn N claimed complete; not accepted") → 3 (the live
message, the report, the turns document; the refusals folded into them); autopilot 15 → 15
(the completed task's summary says more in the same message); first progress p50 43.9 →
48.0 ms, p95 96.4 → 93.1 ms.

Usage: ``.venv/bin/python bench/bench_messages.py [--samples N]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
os.environ.setdefault("PTB_TIMEDELTA", "true")

from engine.gates import COMPLETE, Gates
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import APPROVER, CHAT, OPERATOR, bot_settings, running_bot
from tests.gates_support import phase_rules

GIT_ENV = {
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@example.invalid",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@example.invalid",
}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _script(root: Path, script: dict[str, Any]) -> None:
    path = root / "agent-script.json"
    path.write_text(json.dumps(script))
    os.environ["FAKE_AGENT_SCRIPT"] = str(path)
    os.environ["FAKE_AGENT_STATE"] = str(root / "agent-state")
    os.environ["FAKE_AGENT_LOG"] = str(root / "agent-log.jsonl")


def _counts(api: FakeBotApi, since: int) -> dict[str, int]:
    calls = api.calls[since:]
    sent = [c for c in calls if c.method in ("sendMessage", "sendDocument") and c.status == 200]
    return {
        "messages": len(sent),
        "documents": sum(c.method == "sendDocument" for c in sent),
        "edits": sum(c.method == "editMessageText" for c in calls),
    }


async def autopilot(root: Path) -> dict[str, int]:
    _script(root, {"rules": phase_rules()})
    async with FakeBotApi() as api:
        settings = bot_settings(api, root / "ap", status_edit_interval=0.05)
        async with running_bot(api, settings) as rt:
            since = len(api.calls)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot B1 build it")
            pressed: set[str] = set()
            gates = Gates(rt.db, rt.settings)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                if (await gates.task("B1")).phase == COMPLETE if pressed else False:
                    break
                for m in list(api.sent):
                    for b in m.buttons:
                        data = b.get("callback_data", "")
                        if data.startswith("ap:") and data not in pressed:
                            pressed.add(data)
                            api.push_callback(
                                chat_id=CHAT, user_id=APPROVER, data=data, message_id=m.message_id
                            )
                await asyncio.sleep(0.05)
            else:
                raise SystemExit("autopilot did not complete")
            await rt.sender.drain(10)  # type: ignore[union-attr]
            counts = _counts(api, since)
            counts["approvals"] = len(pressed)
            return counts


async def auto_run(root: Path) -> dict[str, int]:
    ws = root / "auto" / "ws" / "default"
    ws.mkdir(parents=True)
    env = {**os.environ, **GIT_ENV}
    subprocess.run(["git", "init", "-q", str(ws)], check=True, env=env)
    subprocess.run(
        ["git", "-C", str(ws), "commit", "-q", "--allow-empty", "-m", "start"], check=True, env=env
    )
    os.environ.update(GIT_ENV)
    _script(
        root,
        {"rules": [{"match": "", "text": "working on it\nAUTO-MODE STATUS: COMPLETE\n"}]},
    )
    async with FakeBotApi() as api:
        settings = bot_settings(api, root / "auto", max_turns=10, status_edit_interval=0.05)
        async with running_bot(api, settings) as rt:
            since = len(api.calls)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto do ten turns")
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                runs = [r for r in await rt.runs.list_runs() if r.mode == "auto"]
                if runs and runs[0].finished_at is not None:
                    break
                await asyncio.sleep(0.1)
            else:
                raise SystemExit("auto run did not finish")
            await asyncio.sleep(0.5)  # the final report is committed after the run row
            await rt.sender.drain(10)  # type: ignore[union-attr]
            counts = _counts(api, since)
            counts["turns"] = runs[0].turn if hasattr(runs[0], "turn") else 0
            # Claims checked and not accepted that came as messages of their own.
            counts["claim_messages"] = sum(m.text.startswith("🔎 Turn") for m in api.sent)
            return counts


async def first_progress(root: Path, samples: int) -> list[float]:
    _script(root, {"rules": [{"match": "", "text": "done"}]})
    latencies: list[float] = []
    async with FakeBotApi() as api:
        # A private chat: the operator's own id.
        settings = bot_settings(api, root / "fp", allowed_chats=(OPERATOR,))
        async with running_bot(api, settings):
            api.push_message(chat_id=OPERATOR, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: m.chat_id == OPERATOR, timeout=20)
            for i in range(samples + 1):
                before = len(api.sent)
                await asyncio.sleep(0.3)
                start = time.perf_counter()
                api.push_message(chat_id=OPERATOR, user_id=OPERATOR, text=f"hello {i}")
                await api.wait_until(lambda b=before: len(api.sent) > b, timeout=20)  # type: ignore[misc]
                seen = time.perf_counter()
                if i:  # the first turn warms up caches
                    latencies.append((seen - start) * 1000)
                # the turn's answer, then the next sample
                await api.wait_until(
                    lambda b=before: any(m.text.strip() == "done" for m in api.sent[b:]),  # type: ignore[misc]
                    timeout=20,
                )
    return latencies


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ap = await autopilot(root)
        print(f"autopilot, 9 phases: {ap}")
        auto = await auto_run(root)
        print(f"auto run, 10 turns: {auto}")
        lat = await first_progress(root, args.samples)
        print(
            f"first progress (ms, n={len(lat)}): p50 {statistics.median(lat):.1f}, "
            f"p95 {pct(lat, 0.95):.1f}"
        )


if __name__ == "__main__":
    asyncio.run(main())

"""Runs turnstile's bot in-process against :class:`~tests.fakes.bot_api.FakeBotApi`.

The bot is the real one (``bot.app.BotRuntime``), the agent is the scripted fake agent
through the command agent, the database is a real SQLite file, or a real PostgreSQL
database when a test asks for the ``bot_backend`` fixture (tests/pg_support.py).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from telegram.ext import AIORateLimiter

from bot.app import BotRuntime
from engine.humane import words
from engine.settings import Settings
from engine.store.runs import RunStatus
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.support import alive, make_settings, wait_for_file, wait_until

__all__ = [
    "ADMIN",
    "APPROVER",
    "CHAT",
    "FAKE_AGENT",
    "OPERATOR",
    "STRANGER",
    "agent_log",
    "alive",
    "approved",
    "bot_settings",
    "running_bot",
    "runs_shown",
    "wait_for_file",
    "wait_for_run_status",
    "write_script",
]

FAKE_AGENT = Path(__file__).resolve().parent.parent / "fake_agent.py"
CHAT = -1001
OPERATOR = 11
APPROVER = 22
ADMIN = 33
STRANGER = 99
#: The database :func:`bot_settings` gives when a test names none: None is the SQLite
#: file under the test's folder; the ``bot_backend`` fixture sets a PostgreSQL URL here.
DATABASE: str | None = None


def bot_settings(api: FakeBotApi, root: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "telegram_token": api.token,
        "telegram_base_url": api.base_url,
        "telegram_base_file_url": api.file_url,
        "allowed_chats": (CHAT,),
        "operators": (OPERATOR,),
        "approvers": (APPROVER,),
        "admins": (ADMIN,),
        "default_agent": "command",
        "agent_command": (
            f"{sys.executable} {FAKE_AGENT} --session {{session_id}} --prompt {{prompt}}"
        ),
        "status_edit_interval": 0.05,
        "preempt_grace": 1.0,
        "shutdown_flush_seconds": 5.0,
    }
    if DATABASE is not None:
        values["database"] = DATABASE
    values.update(overrides)
    return make_settings(root, **values)


def runs_shown(status: str) -> list[str]:
    """The lines of a /status answer about runs (without the note that agents run
    unconfined, which the suites with the sandbox off get last)."""
    return [line for line in status.splitlines() if not line.startswith("⚠️ Agents run")]


def approved(task: str, phase: str = "") -> Callable[[SentMessage], bool]:
    """A gate of ``task`` (· ``phase``) approved: the gate message says so (a button press
    adds no message), or the answer to a typed approval does."""

    def match(m: SentMessage) -> bool:
        if m.text.startswith(f"✅ Approved {task} · {words(phase)}".rstrip(" ·")):
            return True
        return (
            m.text.startswith(f"🛂 Gate: task {task} · phase {words(phase)}".rstrip())
            and "✅ Approved by" in m.text
        )

    return match


def write_script(root: Path, script: dict[str, Any], monkeypatch: Any) -> dict[str, str]:
    """Write a fake-agent script and point the agent at it (through ``monkeypatch``)."""
    path = root / "agent-script.json"
    path.write_text(json.dumps(script))
    env = {
        "FAKE_AGENT_SCRIPT": str(path),
        "FAKE_AGENT_STATE": str(root / "agent-state"),
        "FAKE_AGENT_LOG": str(root / "agent-log.jsonl"),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


async def wait_for_run_status(
    rt: BotRuntime, run_id: str, status: RunStatus, timeout: float = 20.0
) -> None:
    """Wait until the bot recorded ``status`` for run ``run_id``."""

    async def reached() -> bool:
        run = await rt.runs.get_run(run_id)
        return run is not None and run.status is status

    await wait_until(reached, timeout=timeout, what=f"run {run_id} {status.value}")


def agent_log(root: Path) -> list[dict[str, Any]]:
    path = root / "agent-log.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# How long a graceful stop at the end of a test may take before its turns are pre-empted.
GRACEFUL_STOP = 30.0


@asynccontextmanager
async def running_bot(
    api: FakeBotApi, settings: Settings, *, fast_groups: bool = True
) -> AsyncIterator[BotRuntime]:
    """The started bot; shut down gracefully on exit."""
    # Telegram's 20-per-minute group limit would make every group scenario take minutes;
    # the flood-limit tests use the production limiter (private chats, real 429s).
    limiter = AIORateLimiter(group_max_rate=10_000, max_retries=8) if fast_groups else None
    async with BotRuntime(settings, rate_limiter=limiter) as runtime:
        await runtime.start()
        try:
            yield runtime
        except BaseException:
            # A failed test must not wait on a turn its fakes still hold: pre-empt them.
            runtime.request_shutdown()
            runtime.request_shutdown()
            await runtime.shutdown()
            raise
        runtime.request_shutdown()
        stopping = asyncio.create_task(runtime.shutdown())
        done, _ = await asyncio.wait({stopping}, timeout=GRACEFUL_STOP)
        if not done:
            # A turn the test left running (its fake agent never ends): what a second
            # SIGTERM does, so a test ends instead of hitting its timeout.
            runtime.request_shutdown()
        await stopping

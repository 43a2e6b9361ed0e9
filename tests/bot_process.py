"""``turnstile bot`` as a real child process, for tests that signal, kill or restart it.

:func:`bot_env` is the environment of a bot wired to a fake Bot API under ``root`` (the
fake agent as its command agent); ``extra`` overrides or adds variables.
:class:`BotProcess` reads its log (stderr) line by line, so a test can wait for a line;
:func:`start_polling` starts a bot that logs to a file and returns once it polls (for tests
that only kill and restart it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from tests.fakes.bot_api import FakeBotApi
from tests.support import agent_settings

__all__ = [
    "ADMIN",
    "CHAT",
    "FAKE_AGENT",
    "OPERATOR",
    "ROOT",
    "BotProcess",
    "bot_env",
    "spawn",
    "start_polling",
]

ROOT = Path(__file__).resolve().parent.parent
FAKE_AGENT = ROOT / "tests" / "fake_agent.py"
CHAT = -1001
OPERATOR = 11
ADMIN = 33


class BotProcess:
    """``python -m engine.cli ...`` with its stderr (the logs) read line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._changed = asyncio.Condition()
        self._reader = asyncio.create_task(self._read(), name="bot-stderr")

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:
            async with self._changed:
                self.lines.append(raw.decode("utf-8", errors="replace").rstrip("\n"))
                self._changed.notify_all()
        async with self._changed:
            self._changed.notify_all()

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def signal(self, sig: signal.Signals = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    async def wait_log(self, text: str, timeout: float = 30.0) -> None:
        def seen() -> bool:
            return text in self.log or self._reader.done()

        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(seen), timeout)
        assert text in self.log, f"{text!r} never logged:\n{self.log}"

    async def exit_code(self, timeout: float = 45.0) -> int:
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            raise AssertionError(f"no exit within {timeout} s; its log:\n{self.log}") from None
        await self._reader
        return code

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        await self._reader


def bot_env(root: Path, api: FakeBotApi, **extra: str) -> dict[str, str]:
    """The environment of a bot on ``api`` with everything under ``root``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TURNSTILE_", "FAKE_"))}
    env.update(agent_settings())
    env.update(
        PYTHONPATH=str(ROOT),
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        TURNSTILE_TELEGRAM_TOKEN=api.token,
        TURNSTILE_TELEGRAM_BASE_URL=api.base_url,
        TURNSTILE_TELEGRAM_BASE_FILE_URL=api.file_url,
        TURNSTILE_DATABASE=str(root / "turnstile.db"),
        TURNSTILE_WORKSPACES=str(root / "ws"),
        TURNSTILE_TASKS_ROOT=str(root / "tasks"),
        TURNSTILE_RUNS_DIR=str(root / "runs"),
        TURNSTILE_ALLOWED_CHATS=str(CHAT),
        TURNSTILE_OPERATORS=str(OPERATOR),
        TURNSTILE_ADMINS=str(ADMIN),
        TURNSTILE_DEFAULT_AGENT="command",
        TURNSTILE_AGENT_COMMAND=(
            f"{sys.executable} {FAKE_AGENT} --session {{session_id}} --prompt {{prompt}}"
        ),
        TURNSTILE_STATUS_EDIT_INTERVAL="0.05",
        TURNSTILE_SHUTDOWN_FLUSH_SECONDS="5",
        TURNSTILE_LOG_LEVEL="INFO",
        FAKE_AGENT_SCRIPT=str(root / "agent-script.json"),
        FAKE_AGENT_STATE=str(root / "agent-state"),
    )
    env.update(extra)
    return env


async def spawn(root: Path, env: dict[str, str], *args: str) -> BotProcess:
    """``python -m engine.cli ARGS`` in ``root`` (``bot``, ``doctor``, ...)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "engine.cli",
        *args,
        cwd=root,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    return BotProcess(proc)


async def start_polling(
    api: FakeBotApi, root: Path, env: dict[str, str], *, timeout: float = 60.0
) -> asyncio.subprocess.Process:
    """``turnstile bot`` logging to ``root/bot-N.log``, returned once it has started polling
    (its ``deleteWebhook`` call reached the fake Bot API)."""
    before = len(api.calls_of("deleteWebhook"))
    with open(root / f"bot-{before}.log", "wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "engine.cli",
            "bot",
            cwd=root,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log,
        )
    await api.wait_until(lambda: len(api.calls_of("deleteWebhook")) > before, timeout=timeout)
    return proc

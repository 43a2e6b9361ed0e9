"""Helpers every kind of test uses: settings, a process's liveness, waiting for a condition.

The one way to wait for something another process (or a background task that offers no
event) does: :func:`wait_until` checks a condition until it holds or a deadline passes.
A bare ``sleep`` is never a synchronization.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from engine.settings import Settings

__all__ = [
    "UNCONFINED",
    "agent_settings",
    "alive",
    "clean_env",
    "make_settings",
    "race_two",
    "wait_for_file",
    "wait_until",
]

T = TypeVar("T")

# The scripted fake agents live beside the test's database and report through FAKE_*
# variables: the suites that are not about the sandbox run them unconfined, with those
# variables passed on, as an operator would configure it. The real-CLI suites (marked
# ``realcli``) and tests/test_sandbox*.py run the agents in the sandbox.
UNCONFINED: dict[str, str] = {"TURNSTILE_SANDBOX": "off", "TURNSTILE_AGENT_ENV": "FAKE_*"}


def agent_settings() -> dict[str, str]:
    """:data:`UNCONFINED`, or the sandbox on where this test turned it on (realcli)."""
    return {**UNCONFINED, "TURNSTILE_SANDBOX": os.environ.get("TURNSTILE_SANDBOX", "off")}


def clean_env() -> dict[str, str]:
    """This process's environment without turnstile's settings, with :func:`agent_settings`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.update(agent_settings())
    return env


# A loaded machine (2 cores, several sessions) can be slow to start a python; a deadline
# is a bound on a hang, never a timing target.
DEFAULT_TIMEOUT = 20.0


def make_settings(root: Path, **overrides: Any) -> Settings:
    """Settings that read no ``.env`` and keep every path under ``root``; ``overrides`` win."""
    values: dict[str, Any] = {
        "database": root / "turnstile.db",
        "tasks_root": root / "tasks",
        "workspaces": root / "ws",
        "runs_dir": root / "runs",
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


async def wait_until(
    condition: Callable[[], T | Awaitable[T]],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = 0.01,
    what: str | None = None,
) -> T:
    """Check ``condition`` (a function, or a coroutine function) until it is truthy.

    Returns:
        The truthy value it returned.

    Raises:
        TimeoutError: it did not hold within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what or 'the condition'} did not hold within {timeout:g} s")
        await asyncio.sleep(interval)


async def wait_for_file(path: Path, timeout: float = DEFAULT_TIMEOUT) -> str:
    """Wait until another process wrote ``path`` (non-empty); returns its text."""

    def written() -> str:
        return path.read_text() if path.exists() and path.read_text().strip() else ""

    return await wait_until(written, timeout=timeout, interval=0.02, what=f"{path} written")


async def race_two(script: Path, *args: str, cwd: Path) -> list[dict[str, Any]]:
    """Run ``script ARGS childN`` as two processes that start a race together.

    Each child prints ``ready`` once connected and waits for ``go`` on stdin, so both set
    off at once; each prints a JSON object as its last line, returned in order.
    """
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            *args,
            f"child{i}",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
        )
        for i in range(2)
    ]
    for proc in procs:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line == b"ready\n", (line, await proc.stderr.read() if proc.stderr else b"")
    for proc in procs:  # both are connected: let them go at once
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
    results = []
    for proc in procs:
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    return results

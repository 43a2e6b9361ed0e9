"""Shared fixtures. Engineers add fixtures here with small targeted edits."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.fakes.model_api import FakeModelAPI
from tests.fakes.realcli import Sandbox
from tests.pg_support import (  # noqa: F401 - fixtures
    bot_backend,
    database,
    db_target,
    empty,
    pg_cluster,
    pg_url,
)
from tests.support import UNCONFINED, agent_settings

REPO = Path(__file__).resolve().parent.parent
FAKE_AGENT = REPO / "tests" / "fake_agent.py"

# Loopback only: httpx and aiohttp must never route test traffic through a proxy.
os.environ["NO_PROXY"] = "127.0.0.1,localhost"
os.environ["no_proxy"] = "127.0.0.1,localhost"
# The scripted fake agents run unconfined unless a test puts them in the sandbox.
os.environ.update(UNCONFINED)


@pytest.fixture(autouse=True)
def _real_clis_in_the_sandbox(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real agent CLI runs in the sandbox, as it does by default for a user."""
    if request.node.get_closest_marker("realcli") is not None:
        monkeypatch.setenv("TURNSTILE_SANDBOX", "on")


@pytest.fixture
def fake_agent_cmd() -> str:
    """A command-agent template running the scripted fake agent."""
    return f"{sys.executable} {FAKE_AGENT} --session {{session_id}} --prompt {{prompt}}"


@pytest.fixture
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No stray TURNSTILE_ settings or .env from the developer's machine."""
    for key in list(os.environ):
        if key.startswith("TURNSTILE_"):
            monkeypatch.delenv(key)
    for key, value in agent_settings().items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
async def model_api() -> AsyncIterator[FakeModelAPI]:
    """The fake model API a real agent CLI talks to (realcli tests)."""
    async with FakeModelAPI() as server:
        yield server


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    """A real agent CLI's workspace and config folder, its processes marked (realcli tests)."""
    return Sandbox(tmp_path)

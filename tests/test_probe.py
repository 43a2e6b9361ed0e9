"""What an agent CLI supports is asked once per binary and version, kept on disk, never
waited for on the event loop (engine.agents.probe): timeouts, cancellation, the loop.

The CLIs are fake scripts in ``tmp_path`` that log every run to a file (tests/probe_clis.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.agents.factory import (
    create_agent,
    probe_agents,
    probe_cache,
    probe_turn_mode,
    turn_mode,
)
from engine.agents.probe import Finished, Probe, ask, ask_async
from engine.agents.warm import WarmClaudeAgent, WarmSupport
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import bot_settings, running_bot
from tests.probe_clis import fake_cli, runs_of
from tests.support import alive, make_settings, wait_until

pytestmark = pytest.mark.timeout(60)


def _help_probe(timeout: float) -> Probe[WarmSupport]:
    def read(done: Finished) -> WarmSupport:
        return WarmSupport("--input-format" in done.stdout.decode(), "read from --help")

    return Probe(
        name="test-help",
        label="`fake --help`",
        answer_type=WarmSupport,
        args=lambda _folder: ["--help"],
        read=read,
        failed=lambda reason: WarmSupport(False, reason),
        timeout=timeout,
    )


def test_a_probe_that_hangs_is_bounded_by_its_timeout(tmp_path: Path) -> None:
    runs, cache = tmp_path / "runs.log", tmp_path / "cli-probes.json"
    cli = fake_cli(tmp_path / "bin" / "claude", runs, hang=True)
    support = ask(_help_probe(0.5), str(cli), cache=cache)
    assert not support.supported
    assert support.reason == "`fake --help` did not answer within 0.5 s"
    [(pid, child, _)] = runs_of(runs)
    # The CLI and what it started are gone (killed with its process group).
    assert not alive(int(pid))
    assert not alive(int(child))
    # No answer came from the CLI: nothing is kept, the next question asks again.
    assert not cache.exists()
    ask(_help_probe(0.5), str(cli), cache=cache)
    assert len(runs_of(runs)) == 2


async def test_cancelling_the_last_caller_stops_the_probe(tmp_path: Path) -> None:
    runs, cache = tmp_path / "runs.log", tmp_path / "cli-probes.json"
    cli = fake_cli(tmp_path / "bin" / "claude", runs, hang=True)
    probe = _help_probe(50)
    first = asyncio.create_task(ask_async(probe, str(cli), cache=cache))
    second = asyncio.create_task(ask_async(probe, str(cli), cache=cache))
    [(pid, child, _)] = await wait_until(lambda: runs_of(runs), what="the probe started")
    first.cancel()
    await asyncio.sleep(0.2)
    assert alive(int(pid))  # the other caller still waits for it
    second.cancel()
    for task in (first, second):
        with pytest.raises(asyncio.CancelledError):
            await task
    assert not alive(int(pid))
    assert not alive(int(child))
    assert len(runs_of(runs)) == 1


async def test_the_event_loop_keeps_running_while_a_slow_cli_is_asked(tmp_path: Path) -> None:
    runs = tmp_path / "runs.log"
    cli = fake_cli(tmp_path / "bin" / "claude", runs, sleep=1.0)
    settings = make_settings(tmp_path, claude_bin=str(cli), warm_sessions="claude")
    ticks = 0
    done = asyncio.Event()

    async def tick() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    # A sync caller on the loop (the factory) never waits for the CLI: not known yet.
    pending = turn_mode("claude", settings)
    assert not pending.warm
    assert "still being asked" in pending.reason
    assert not isinstance(create_agent("claude", settings, cwd=tmp_path), WarmClaudeAgent)
    # Async code waits for the one probe already running, and the loop goes on meanwhile.
    [_] = await wait_until(lambda: runs_of(runs), what="the probe started")
    started = ticks
    mode = await probe_turn_mode("claude", settings)
    done.set()
    await ticker
    assert mode.warm, mode.reason
    assert ticks - started >= 10
    assert len(runs_of(runs)) == 1
    # Known now: the sync callers get it at once, the factory makes a warm session.
    assert turn_mode("claude", settings).warm
    assert isinstance(create_agent("claude", settings, cwd=tmp_path), WarmClaudeAgent)
    assert probe_cache(settings).exists()


async def test_probing_ahead_asks_each_configured_cli_once(tmp_path: Path) -> None:
    runs = tmp_path / "runs.log"
    claude = fake_cli(tmp_path / "claude-bin" / "claude", runs)
    codex = fake_cli(tmp_path / "codex-bin" / "codex", runs)  # no app-server: per turn
    settings = make_settings(
        tmp_path, claude_bin=str(claude), codex_bin=str(codex), warm_sessions="claude,codex"
    )
    modes = await probe_agents(settings)
    assert modes["claude"].warm
    assert not modes["codex"].warm
    assert "schema" in modes["codex"].reason
    assert sorted(run[2] for run in runs_of(runs)) == ["--help", "app-server"]
    assert await probe_agents(settings) == modes
    assert len(runs_of(runs)) == 2


async def test_the_bot_asks_the_configured_cli_at_start_up(tmp_path: Path) -> None:
    runs = tmp_path / "runs.log"
    cli = fake_cli(tmp_path / "bin" / "claude", runs)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, claude_bin=str(cli), warm_sessions="claude")
        async with running_bot(api, settings):
            await wait_until(lambda: probe_cache(settings).exists(), what="the answer kept")
            assert turn_mode("claude", settings).warm
        assert len(runs_of(runs)) == 1

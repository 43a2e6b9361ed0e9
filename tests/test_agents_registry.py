"""The agent registry: every agent described once, and what reads it agrees with it."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from engine.agents.base import ProcessAgent
from engine.agents.factory import AGENT_NAMES, create_agent
from engine.agents.registry import AGENTS, agent_spec, ask_version
from engine.agents.stream import JsonStreamAgent
from engine.errors import ConfigError
from engine.settings import Settings
from tests.agent_clis import PINNED
from tests.fakes.bot_harness import wait_for_file


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\nimport os, sys, time\n{body}\n")
    path.chmod(0o755)
    return path


def test_every_agent_is_listed_once_in_order() -> None:
    assert AGENT_NAMES == ("claude", "copilot", "codex", "command")
    assert tuple(spec.name for spec in AGENTS.values()) == AGENT_NAMES


@pytest.mark.parametrize("name", AGENT_NAMES)
def test_each_agent_loads_its_adapter(name: str) -> None:
    spec = agent_spec(name)
    adapter = spec.load()
    assert issubclass(adapter, ProcessAgent)
    if spec.template:
        assert not issubclass(adapter, JsonStreamAgent)
        assert spec.version_args is None
        assert spec.npm_package is None
    else:
        assert issubclass(adapter, JsonStreamAgent)
        assert adapter.agent_name == name
        assert spec.credentials is not None
        assert spec.credentials.variables


@pytest.mark.parametrize("name", AGENT_NAMES)
def test_the_binary_setting_is_a_real_setting(
    name: str, monkeypatch: pytest.MonkeyPatch, isolated_env: Path
) -> None:
    spec = agent_spec(name)
    monkeypatch.setenv(spec.env_var, "my-agent-binary {prompt}")
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert spec.configured(settings) == "my-agent-binary {prompt}"


def test_npm_packages_are_the_ones_the_tests_install() -> None:
    for name, pinned in PINNED.items():
        assert agent_spec(name).npm_package == pinned.package


def test_an_unknown_agent_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown agent 'gpt'.*claude, copilot, codex, command"):
        agent_spec("gpt")


@pytest.mark.parametrize("name", [n for n in AGENT_NAMES if not agent_spec(n).template])
def test_the_factory_builds_the_registered_adapter(
    name: str, tmp_path: Path, isolated_env: Path
) -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    agent = create_agent(name, settings, cwd=tmp_path)
    assert type(agent) is agent_spec(name).load()
    assert agent.options.binary == agent_spec(name).configured(settings)


async def test_ask_version_reads_the_first_line(tmp_path: Path) -> None:
    good = _script(tmp_path, "good", "print('1.2.3 (Fake)'); print('more')")
    assert await ask_version(str(good), ("--version",), within=30) == ("1.2.3 (Fake)", None)
    quiet = _script(tmp_path, "quiet", "pass")
    assert await ask_version(str(quiet), ("--version",), within=30) == (None, None)
    bad = _script(tmp_path, "bad", "print('needs login', file=sys.stderr); sys.exit(3)")
    assert await ask_version(str(bad), ("--version",), within=30) == (
        None,
        "--version exited with code 3: needs login",
    )
    version, problem = await ask_version(str(tmp_path / "gone"), ("--version",), within=30)
    assert version is None
    assert problem is not None
    assert problem.startswith("cannot run")


async def test_a_hanging_version_command_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    hang = _script(
        tmp_path,
        "hang",
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\nwhile True:\n    time.sleep(60)",
    )
    task = asyncio.create_task(ask_version(str(hang), ("--version",), within=3))
    pid = int(await wait_for_file(pid_file))
    assert await task == (None, "--version did not answer within 3 s")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

"""ToolAllowlist, Copilot argv, and the command agent (any CLI from a template)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from engine.agents import (
    AgentOptions,
    CommandAgent,
    ToolAllowlist,
    build_turn_argv,
    parse_template,
)
from engine.agents.factory import create_agent
from engine.errors import ConfigError, InvalidPromptError, TurnExecError
from engine.settings import Settings
from engine.testing import RecordingChannel
from engine.turn import AgentSession, run_session_loop

ECHO_ARGS = f"{sys.executable} -c 'import sys, json; print(json.dumps(sys.argv[1:]))'"


def test_read_only_default() -> None:
    allow = ToolAllowlist.read_only_default()
    assert allow.tools == ("view", "grep", "glob")
    assert not allow.dangerous
    assert allow.to_copilot_args() == [
        "--allow-tool", "view", "--allow-tool", "grep", "--allow-tool", "glob",
    ]  # fmt: skip
    assert "read-only" in allow.describe()


def test_from_flags_keeps_order_and_drops_duplicates() -> None:
    allow = ToolAllowlist.from_flags(["write", "shell(git)", "write", " "])
    assert allow.tools == ("write", "shell(git)")
    assert allow.to_copilot_args() == ["--allow-tool", "write", "--allow-tool", "shell(git)"]


def test_no_flags_means_read_only() -> None:
    assert ToolAllowlist.from_flags([]) == ToolAllowlist.read_only_default()


def test_dangerous_maps_to_all_tools_never_allow_all() -> None:
    allow = ToolAllowlist.from_flags(["write"], dangerous=True)
    assert allow.dangerous
    args = allow.to_copilot_args()
    assert args == ["--allow-all-tools"]
    assert "--allow-all" not in args
    assert "--yolo" not in args
    assert "dangerous" in allow.describe()


def test_build_turn_argv_prompt_is_one_element() -> None:
    prompt = "-rf; $(evil) && echo"
    argv = build_turn_argv("sid-1", prompt, ToolAllowlist.read_only_default())
    assert argv[:6] == ["--session-id", "sid-1", "--no-color", "-s", "-p", prompt]
    assert argv.count(prompt) == 1
    assert argv[6:] == ToolAllowlist.read_only_default().to_copilot_args()


def test_template_placeholders_become_single_elements() -> None:
    words = parse_template("agent --flag 'two words' -p {prompt} --sid {session_id} {cwd}")
    assert words == [
        "agent", "--flag", "two words", "-p", "{prompt}", "--sid", "{session_id}", "{cwd}",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "template",
    ["", "   ", "agent 'unbalanced", "agent --msg={prompt}", "agent x{session_id}", "{prompt} x"],
)
def test_bad_templates_refused(template: str) -> None:
    with pytest.raises(ConfigError):
        parse_template(template)


async def test_command_agent_substitutes_without_a_shell(tmp_path: Path) -> None:
    agent = CommandAgent(
        ECHO_ARGS + " -p {prompt} --sid {session_id} --cwd {cwd}",
        cwd=tmp_path,
        session_id="s-9",
    )
    prompt = 'it\'s "quoted" $(touch x) ; rm -rf / `id`\nnext line'
    out = await agent.run_turn(prompt)
    assert out.exit_code == 0
    assert json.loads(out.text) == ["-p", prompt, "--sid", "s-9", "--cwd", str(tmp_path)]
    assert not (tmp_path / "x").exists()


async def test_prompt_starting_with_dash_stays_the_prompt(tmp_path: Path) -> None:
    agent = CommandAgent(ECHO_ARGS + " -p {prompt}", cwd=tmp_path)
    out = await agent.run_turn("--help me")
    assert json.loads(out.text) == ["-p", "--help me"]


async def test_without_prompt_placeholder_prompt_goes_to_stdin(tmp_path: Path) -> None:
    agent = CommandAgent(
        f"{sys.executable} -c 'import sys; d=sys.stdin.read(); print(len(d))'", cwd=tmp_path
    )
    out = await agent.run_turn("x" * 100_000)
    assert out.text.strip() == "100000"


async def test_command_agent_runs_in_its_pinned_cwd(tmp_path: Path) -> None:
    agent = CommandAgent(f"{sys.executable} -c 'import os; print(os.getcwd())'", cwd=tmp_path)
    for _ in range(2):
        assert (await agent.run_turn("p")).text.strip() == str(tmp_path)


async def test_empty_prompt_refused_before_spawn(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    agent = CommandAgent(f'{sys.executable} -c \'open("{marker}", "w")\' {{prompt}}', cwd=tmp_path)
    with pytest.raises(InvalidPromptError):
        await agent.run_turn("   ")
    assert not marker.exists()
    assert agent.turns_started == 0


async def test_missing_binary_named_in_error(tmp_path: Path) -> None:
    agent = CommandAgent("definitely-not-an-agent -p {prompt}", cwd=tmp_path)
    with pytest.raises(TurnExecError, match="definitely-not-an-agent"):
        await agent.run_turn("hi")


async def test_session_loop_over_fake_agent_resumes_same_session(
    tmp_path: Path, fake_agent_cmd: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("FAKE_AGENT_LOG", str(log))
    monkeypatch.setenv("FAKE_AGENT_STATE", str(tmp_path / "state"))
    options = AgentOptions(binary=sys.executable, cwd=tmp_path, pass_env=("FAKE_*",))
    agent = CommandAgent(fake_agent_cmd, cwd=tmp_path, options=options, session_id="chat-1")
    assert isinstance(agent, AgentSession)
    channel = RecordingChannel(["one", "two", "three"])
    await run_session_loop(agent, channel)
    assert [o.text for o in channel.published] == ["echo: one", "echo: two", "echo: three"]
    assert all(o.exit_code == 0 for o in channel.published)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["session"] for e in entries] == ["chat-1"] * 3
    assert [e["turn"] for e in entries] == [1, 2, 3]


def test_factory_builds_command_agent(tmp_path: Path, fake_agent_cmd: str) -> None:
    settings = Settings(agent_command=fake_agent_cmd, _env_file=None)  # type: ignore[call-arg]
    agent = create_agent("command", settings, cwd=tmp_path, session_id="f-1")
    assert isinstance(agent, CommandAgent)
    assert agent.session_id == "f-1"
    assert agent.options.allowlist == ToolAllowlist.read_only_default()


@pytest.mark.parametrize(
    ("tool", "kwargs", "message"),
    [
        ("gpt", {}, "unknown agent"),
        ("command", {}, "TURNSTILE_AGENT_COMMAND"),
    ],
)
def test_factory_refuses_bad_input(
    tmp_path: Path, tool: str, kwargs: dict[str, object], message: str
) -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=message):
        create_agent(tool, settings, cwd=tmp_path)


def test_factory_refuses_missing_cwd(tmp_path: Path) -> None:
    settings = Settings(agent_command="x {prompt}", _env_file=None)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="does not exist"):
        create_agent("command", settings, cwd=tmp_path / "nope")


def test_environment_is_inherited_plus_extra(tmp_path: Path) -> None:
    from engine.agents.base import AgentOptions, Invocation

    agent = CommandAgent(
        "x {prompt}",
        cwd=tmp_path,
        options=AgentOptions(binary="x", cwd=tmp_path, extra_env={"AGENT_HOME": "/h"}),
    )
    env = agent.environment(Invocation(argv=["x"], env={"TURN": "1"}))
    assert env["AGENT_HOME"] == "/h"
    assert env["TURN"] == "1"
    assert env.get("PATH") == os.environ.get("PATH")

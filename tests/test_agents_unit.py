"""The three CLI adapters without the real CLIs: argv, allowlists, parsing, errors.

The "CLI" here is a small script standing in for the binary: it records its argv, stdin
and environment, prints the lines it is told to, and exits with the code it is told to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import stat
import sys
from pathlib import Path

import aiohttp
import pytest

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import AgentOptions
from engine.agents.claude import (
    ClaudeAgent,
    claude_config_dir,
    claude_permission_args,
    claude_project_slug,
    claude_transcript_path,
)
from engine.agents.codex import CODEX_MAX_PROMPT_CHARS, CodexAgent, codex_sandbox_args
from engine.agents.copilot import CopilotAgent, copilot_allowlist
from engine.agents.factory import create_agent
from engine.agents.registry import AGENTS
from engine.agents.stream import (
    TURN_MARKER_VAR,
    AgentEvent,
    EventKind,
    EventStream,
    JsonLines,
    JsonStreamAgent,
    find_binary,
)
from engine.commands.agents import agent_statuses, handle
from engine.errors import ConfigError, InvalidPromptError, TurnExecError, TurnIOError
from engine.settings import Settings
from tests.agent_clis import PINNED, CliInstallError, cache_root, ensure_cli
from tests.fakes.model_api import FakeModelAPI, Hold, Status, Text, ToolCall

FAKE_CLI = """#!{python}
import json, os, sys
record = {{"argv": sys.argv[1:], "stdin": sys.stdin.read(),
          "env": {{k: v for k, v in os.environ.items()
                  if k.startswith(("CLAUDE_", "COPILOT_", "CODEX_", "IS_SANDBOX", "HOME",
                                   "DISABLE_", "TURNSTILE_", "EXTRA_"))}}}}
with open(os.environ["FAKE_RECORD"], "a") as fh:
    fh.write(json.dumps(record) + "\\n")
for line in json.loads(os.environ.get("FAKE_LINES", "[]")):
    print(line, flush=True)
sys.stderr.write(os.environ.get("FAKE_STDERR", ""))
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""

SID = "3f0b7a8e-1111-4222-8333-444455556666"


@pytest.fixture
def fake_cli(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "fake-cli"
    path.parent.mkdir()
    path.write_text(FAKE_CLI.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def claude_result(text: str = "ok", **extra: object) -> str:
    record = {
        "type": "result",
        "subtype": "success",
        "is_error": False,
        "result": text,
        "session_id": SID,
        "num_turns": 1,
        "total_cost_usd": 0.5,
        "usage": {"input_tokens": 1, "output_tokens": 2},
        "permission_denials": [],
        **extra,
    }
    return json.dumps(record)


def options(
    tmp_path: Path,
    fake_cli: Path,
    lines: list[str] = (),  # type: ignore[assignment]
    *,
    exit_code: int = 0,
    stderr: str = "",
    allowlist: ToolAllowlist | None = None,
    **kwargs: object,
) -> AgentOptions:
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    env = {
        "FAKE_RECORD": str(tmp_path / "record.jsonl"),
        "FAKE_LINES": json.dumps(list(lines)),
        "FAKE_EXIT": str(exit_code),
        "FAKE_STDERR": stderr,
    }
    env.update(kwargs.pop("extra_env", {}))  # type: ignore[arg-type]
    return AgentOptions(
        binary=str(fake_cli),
        cwd=workspace,
        extra_env=env,
        allowlist=allowlist or ToolAllowlist.read_only_default(),
        **kwargs,  # type: ignore[arg-type]
    )


def records(tmp_path: Path) -> list[dict[str, object]]:
    path = tmp_path / "record.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- Claude Code -------------------------------------------------------------------------


async def test_claude_first_turn_names_session_later_turns_resume(
    tmp_path: Path, fake_cli: Path
) -> None:
    agent = ClaudeAgent(
        options(
            tmp_path,
            fake_cli,
            [claude_result("hi")],
            model="opus",
            passthrough=("--x",),
            config_dir=tmp_path / "cfg",
        ),
        session_id=SID,
    )
    first = await agent.run_turn("-p --help")
    second = await agent.run_turn("again")
    one, two = records(tmp_path)
    head = ["-p", "--output-format", "stream-json", "--verbose", "--session-id", SID]
    assert one["argv"][:6] == head
    assert two["argv"][4:6] == ["--resume", SID]
    assert "--model" in one["argv"]
    assert one["argv"][-1] == "--x"
    # The prompt travels on stdin only: never in argv, never mistaken for a flag.
    assert one["stdin"] == "-p --help"
    assert "-p --help" not in one["argv"]
    assert first.text == second.text == "hi"
    assert first.metadata["cost_usd"] == 0.5
    assert first.metadata["num_turns"] == 1
    assert first.metadata["usage"] == {"input_tokens": 1, "output_tokens": 2}


def write_transcript(agent: ClaudeAgent, text: str = '{"type":"user"}\n') -> Path:
    """Stand in for the transcript the real CLI writes (the fake CLI writes none)."""
    path = agent.transcript_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def claude_agent(tmp_path: Path, fake_cli: Path, **kwargs: object) -> ClaudeAgent:
    opts = options(tmp_path, fake_cli, [claude_result()], config_dir=tmp_path / "cfg")
    return ClaudeAgent(opts, session_id=SID, **kwargs)  # type: ignore[arg-type]


async def test_resume_flag_resumes_from_the_first_turn(tmp_path: Path, fake_cli: Path) -> None:
    agent = claude_agent(tmp_path, fake_cli, resume=True)
    write_transcript(agent)
    await agent.run_turn("hello")
    assert records(tmp_path)[0]["argv"][4:6] == ["--resume", SID]


async def test_resume_flag_without_transcript_creates_the_session(
    tmp_path: Path, fake_cli: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The session was recorded, but its first turn never reached the CLI's store.
    agent = claude_agent(tmp_path, fake_cli, resume=True)
    with caplog.at_level("INFO", logger="engine.agents.claude"):
        await agent.run_turn("hello")
    assert records(tmp_path)[0]["argv"][4:6] == ["--session-id", SID]
    [log] = [r for r in caplog.records if r.name == "engine.agents.claude"]
    assert log.levelname == "INFO"
    assert SID in log.getMessage()
    assert "never finished" in log.getMessage()


async def test_existing_transcript_is_resumed_even_by_a_new_session_object(
    tmp_path: Path, fake_cli: Path
) -> None:
    # A first turn killed after the CLI wrote its transcript, then a restart that did
    # not pass resume=True: creating it again would fail with "already in use".
    agent = claude_agent(tmp_path, fake_cli)
    write_transcript(agent)
    await agent.run_turn("hello")
    assert records(tmp_path)[0]["argv"][4:6] == ["--resume", SID]


async def test_empty_transcript_is_removed_and_the_session_created(
    tmp_path: Path, fake_cli: Path
) -> None:
    # The CLI resumes only a non-empty transcript and refuses to create over any file.
    agent = claude_agent(tmp_path, fake_cli, resume=True)
    path = write_transcript(agent, "")
    await agent.run_turn("hello")
    assert records(tmp_path)[0]["argv"][4:6] == ["--session-id", SID]
    assert not path.exists()


async def test_finished_turn_then_missing_transcript_resumes_to_report_it(
    tmp_path: Path, fake_cli: Path
) -> None:
    # A turn finished, so the CLI wrote the transcript: gone now means removed, and
    # resuming lets the CLI say so (reported as "no longer knows"), never a silent restart.
    agent = claude_agent(tmp_path, fake_cli)
    await agent.run_turn("first")
    assert not agent.transcript_path().exists()
    await agent.run_turn("second")
    one, two = records(tmp_path)
    assert one["argv"][4:6] == ["--session-id", SID]
    assert two["argv"][4:6] == ["--resume", SID]


async def test_caller_that_knows_turns_finished_gets_the_missing_report_path(
    tmp_path: Path, fake_cli: Path
) -> None:
    # After a restart our store says turns finished, but the transcript is gone.
    agent = claude_agent(tmp_path, fake_cli, resume=True)
    agent.finished_turn = True
    await agent.run_turn("hello")
    assert records(tmp_path)[0]["argv"][4:6] == ["--resume", SID]


@pytest.mark.parametrize(("turns_finished", "flag"), [(True, "--resume"), (False, "--session-id")])
async def test_factory_passes_what_the_store_knows_about_finished_turns(
    tmp_path: Path, fake_cli: Path, turns_finished: bool, flag: str
) -> None:
    # The bot and auto mode rebuild a session after a restart through the factory; when
    # their store shows finished turns, a missing transcript must be reported, not replaced.
    from engine.agents.factory import create_agent
    from engine.settings import Settings

    settings = Settings(claude_bin=str(fake_cli), _env_file=None)  # type: ignore[call-arg]
    opts = options(tmp_path, fake_cli, [claude_result()])
    agent = create_agent(
        "claude",
        settings,
        cwd=opts.cwd,
        session_id=SID,
        extra_env={**opts.extra_env, "CLAUDE_CONFIG_DIR": str(tmp_path / "cfg")},
        resume=True,
        turns_finished=turns_finished,
    )
    await agent.run_turn("hello")
    assert records(tmp_path)[0]["argv"][4:6] == [flag, SID]


# Folder names the real Claude Code 2.1.197 created for these working directories.
MEASURED_SLUGS = [
    ("/tmp/slugexp/r1/plain", "-tmp-slugexp-r1-plain"),
    ("/tmp/slugexp/r1/with space.dot_under-dash", "-tmp-slugexp-r1-with-space-dot-under-dash"),
    ("/tmp/slugexp/r1/\u00fcn\u00ef c\u00f6d\u00e9", "-tmp-slugexp-r1--n--c-d-"),
    ("/tmp/slugexp/r2/\u00e9\U0001f600x", "-tmp-slugexp-r2----x"),
    # Longer than 200: cut, then the base-36 absolute value of the path's 32-bit hash
    # (negative for the first path, positive for the second).
    ("/tmp/slugexp/r1/" + "x" * 250, "-tmp-slugexp-r1-" + "x" * 184 + "-a3dkac"),
    ("/tmp/slugexp/r3/" + "y" * 250, "-tmp-slugexp-r3-" + "y" * 184 + "-y4snsa"),
]


@pytest.mark.parametrize(("cwd", "slug"), MEASURED_SLUGS)
def test_claude_project_slug_matches_the_cli(cwd: str, slug: str) -> None:
    assert claude_project_slug(cwd) == slug


def test_claude_transcript_path_resolves_the_cwd_and_config_dir(tmp_path: Path) -> None:
    real = tmp_path / "real dir"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    config = tmp_path / "cfg"
    expected = config / "projects" / claude_project_slug(str(real)) / f"{SID}.jsonl"
    assert claude_transcript_path(config, link, SID) == expected
    home = {"HOME": str(tmp_path / "home")}
    assert claude_config_dir(home, real) == tmp_path / "home" / ".claude"
    assert claude_config_dir({**home, "CLAUDE_CONFIG_DIR": str(config)}, real) == config
    assert claude_config_dir({"CLAUDE_CONFIG_DIR": "rel"}, real) == real / "rel"
    # NFC, as the CLI normalises it: "e" + combining acute becomes one "\u00e9".
    decomposed = str(tmp_path / "cfe\u0301")
    assert claude_config_dir({"CLAUDE_CONFIG_DIR": decomposed}, real) == tmp_path / "cf\u00e9"


def test_transcript_path_follows_the_turn_environment(tmp_path: Path, fake_cli: Path) -> None:
    # extra_env wins over config_dir, as it does in the turn's environment.
    other = tmp_path / "other"
    opts = options(
        tmp_path, fake_cli, config_dir=tmp_path / "cfg", extra_env={"CLAUDE_CONFIG_DIR": str(other)}
    )
    agent = ClaudeAgent(opts, session_id=SID)
    assert agent.transcript_path().is_relative_to(other / "projects")
    plain = ClaudeAgent(options(tmp_path, fake_cli, config_dir=tmp_path / "cfg"), session_id=SID)
    assert plain.transcript_path().is_relative_to(tmp_path / "cfg" / "projects")


def test_claude_session_ids_are_uuids(tmp_path: Path, fake_cli: Path) -> None:
    with pytest.raises(ConfigError, match="UUID"):
        ClaudeAgent(options(tmp_path, fake_cli), session_id="not-a-uuid")
    with pytest.raises(ConfigError, match="session id"):
        ClaudeAgent(options(tmp_path, fake_cli), resume=True)


def test_claude_tool_names_are_mapped() -> None:
    args, env = claude_permission_args(ToolAllowlist.read_only_default())
    assert args == ["--allowedTools=Read,Grep,Glob"]
    assert env == {}
    args, _ = claude_permission_args(ToolAllowlist.from_flags(["create", "shell(git)", "Task"]))
    assert args == ["--allowedTools=Write,Bash(git:*),Task"]


def test_claude_dangerous_skips_permissions_and_sets_sandbox_as_root() -> None:
    args, env = claude_permission_args(ToolAllowlist.from_flags([], dangerous=True))
    assert args == ["--dangerously-skip-permissions"]
    assert env == ({"IS_SANDBOX": "1"} if os.geteuid() == 0 else {})


async def test_isolation_env_and_user_env_win_over_defaults(tmp_path: Path, fake_cli: Path) -> None:
    config = tmp_path / "claude-config"
    opts = options(
        tmp_path,
        fake_cli,
        [claude_result()],
        config_dir=config,
        extra_env={"DISABLE_AUTOUPDATER": "0", "EXTRA_ONE": "1"},
    )
    await ClaudeAgent(opts).run_turn("hi")
    env = records(tmp_path)[0]["env"]
    assert isinstance(env, dict)
    assert env["CLAUDE_CONFIG_DIR"] == str(config)
    assert env["DISABLE_AUTOUPDATER"] == "0"
    assert env["EXTRA_ONE"] == "1"
    assert len(env[TURN_MARKER_VAR]) == 32


async def test_malformed_json_line_is_an_io_error_with_its_line_number(
    tmp_path: Path, fake_cli: Path
) -> None:
    lines = ['{"type":"system","subtype":"init"}', "", '{"type": "assistant", oops', "x"]
    agent = ClaudeAgent(options(tmp_path, fake_cli, lines))
    seen: list[AgentEvent] = []
    agent.on_event = seen.append
    with pytest.raises(TurnIOError, match="line 3") as caught:
        await agent.run_turn("hi")
    assert caught.value.line == 3
    assert [event.kind for event in seen] == [EventKind.SESSION, EventKind.TURN_END]


@pytest.mark.parametrize("cls", [ClaudeAgent, CopilotAgent, CodexAgent])
async def test_every_adapter_refuses_malformed_json(
    tmp_path: Path, fake_cli: Path, cls: type[JsonStreamAgent]
) -> None:
    agent = cls(options(tmp_path, fake_cli, ["[1, 2]"]))
    with pytest.raises(TurnIOError, match="not an object") as caught:
        await agent.run_turn("hi")
    assert caught.value.line == 1


def test_json_lines_counts_blank_lines() -> None:
    parser = JsonLines("x")
    assert parser.parse(b"") is None
    assert parser.parse(b'{"a": 1}\r') == {"a": 1}
    with pytest.raises(TurnIOError) as caught:
        parser.parse(b"nope sk-ant-abcdefghijklmnop")
    assert caught.value.line == 3
    assert "sk-ant" not in str(caught.value)


@pytest.mark.parametrize("cls", [ClaudeAgent, CopilotAgent, CodexAgent])
async def test_exit_zero_without_a_result_is_an_io_error(
    tmp_path: Path, fake_cli: Path, cls: type[JsonStreamAgent]
) -> None:
    agent = cls(options(tmp_path, fake_cli, ['{"type": "something"}']))
    with pytest.raises(TurnIOError, match="exited 0 but printed no"):
        await agent.run_turn("hi")


@pytest.mark.parametrize("cls", [ClaudeAgent, CopilotAgent, CodexAgent])
async def test_nonzero_exit_without_result_is_an_output_in_plain_words(
    tmp_path: Path, fake_cli: Path, cls: type[JsonStreamAgent]
) -> None:
    agent = cls(options(tmp_path, fake_cli, [], exit_code=3, stderr="boom: disk full"))
    out = await agent.run_turn("hi")
    assert out.exit_code == 3
    assert out.text == f"{cls.cli_name} exited with code 3: boom: disk full"
    assert out.metadata["is_error"] is True


@pytest.mark.parametrize(
    ("cls", "lines", "stderr"),
    [
        (
            ClaudeAgent,
            [
                json.dumps(
                    {
                        "type": "result",
                        "subtype": "error_during_execution",
                        "is_error": True,
                        "errors": [f"No conversation found with session ID: {SID}"],
                    }
                )
            ],
            f"No conversation found with session ID: {SID}",
        ),
        (CopilotAgent, [], f"Error: No session, task, or name matched '{SID}'.\n\nTo resume"),
        (CodexAgent, [], f"Error: thread/resume failed: no rollout found for thread id {SID}"),
    ],
)
async def test_unknown_session_is_reported_plainly(
    tmp_path: Path, fake_cli: Path, cls: type[JsonStreamAgent], lines: list[str], stderr: str
) -> None:
    agent = cls(options(tmp_path, fake_cli, lines, exit_code=1, stderr=stderr), session_id=SID)
    agent.started = True
    out = await agent.run_turn("hi")
    assert out.exit_code == 1
    assert out.text.startswith(f"{cls.cli_name} no longer knows session {SID}")
    assert "exited with code 1" in out.text
    assert out.metadata["session_missing"] is True


async def test_missing_binary_says_how_to_install(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    for cls, package in (
        (ClaudeAgent, "@anthropic-ai/claude-code"),
        (CopilotAgent, "@github/copilot"),
        (CodexAgent, "@openai/codex"),
    ):
        agent = cls(AgentOptions(binary="no-such-agent-cli-xyz", cwd=tmp_path / "ws"))
        with pytest.raises(TurnExecError, match=f"npm install -g {package}") as caught:
            await agent.run_turn("hi")
        assert caught.value.binary == "no-such-agent-cli-xyz"
        assert AGENTS[cls.agent_name].env_var in str(caught.value)


def test_find_binary(tmp_path: Path, fake_cli: Path) -> None:
    assert find_binary(str(fake_cli), None) == str(fake_cli)
    assert find_binary("fake-cli", str(fake_cli.parent)) == str(fake_cli)
    assert find_binary(str(tmp_path / "nope"), None) is None
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert find_binary(str(plain), None) is None


async def test_long_result_text_is_spilled_whole(tmp_path: Path, fake_cli: Path) -> None:
    text = "é" * 3000
    opts = options(
        tmp_path, fake_cli, [claude_result(text)], spill_limit=1024, spill_dir=tmp_path / "sp"
    )
    out = await ClaudeAgent(opts).run_turn("hi")
    assert out.spilled
    assert out.full_text() == text
    assert out.size == len(text.encode())
    assert len(out.text.encode()) <= 1024


async def test_event_stream_ends_with_the_turn(tmp_path: Path, fake_cli: Path) -> None:
    lines = [
        json.dumps({"type": "system", "subtype": "init", "session_id": SID}),
        json.dumps(
            {
                "type": "assistant",
                "message": {
                    "content": [
                        {"type": "text", "text": "let me look"},
                        {"type": "tool_use", "id": "t1", "name": "Read", "input": {"f": 1}},
                    ]
                },
            }
        ),
        json.dumps(
            {
                "type": "user",
                "message": {
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": "denied",
                            "is_error": True,
                        }
                    ]
                },
            }
        ),
        claude_result("done"),
    ]
    agent = ClaudeAgent(options(tmp_path, fake_cli, lines))
    stream = EventStream()
    agent.on_event = stream
    out = await agent.run_turn("hi")
    events = [event async for event in stream]
    assert [event.kind for event in events] == [
        EventKind.SESSION,
        EventKind.TEXT,
        EventKind.TOOL_USE,
        EventKind.TOOL_RESULT,
        EventKind.RESULT,
        EventKind.TURN_END,
    ]
    assert [event.line for event in events] == [1, 2, 2, 3, 4, 0]
    assert events[3].is_error
    assert events[3].tool_id == events[2].tool_id == "t1"
    assert out.text == "done"


# -- Copilot CLI -------------------------------------------------------------------------


def test_copilot_allowlist_uses_permission_kinds_and_never_allow_all() -> None:
    mapped = copilot_allowlist(ToolAllowlist.from_flags(["view", "create", "edit", "bash"]))
    assert mapped.to_copilot_args() == [
        "--allow-tool",
        "view",
        "--allow-tool",
        "write",
        "--allow-tool",
        "shell",
    ]
    dangerous = copilot_allowlist(ToolAllowlist.from_flags([], dangerous=True))
    assert dangerous.to_copilot_args() == ["--allow-all-tools"]
    assert "--allow-all" not in dangerous.to_copilot_args()


async def test_copilot_argv_and_result(tmp_path: Path, fake_cli: Path) -> None:
    lines = [
        json.dumps({"type": "user.message", "data": {"content": "hi"}}),
        json.dumps({"type": "assistant.message", "data": {"content": "first"}}),
        json.dumps({"type": "assistant.message", "data": {"content": "final"}}),
        json.dumps({"type": "result", "sessionId": SID, "exitCode": 0, "usage": {"x": 1}}),
    ]
    config = tmp_path / "copilot-home"
    agent = CopilotAgent(options(tmp_path, fake_cli, lines, config_dir=config), session_id=SID)
    first = await agent.run_turn("--version")
    await agent.run_turn("again")
    one, two = records(tmp_path)
    assert one["argv"][:6] == ["-s", "--no-color", "--output-format", "json", "--session-id", SID]
    assert two["argv"][4] == f"--resume={SID}"
    assert one["stdin"] == "--version"
    assert one["env"]["COPILOT_HOME"] == str(config)  # type: ignore[index]
    assert first.text == "final"
    assert first.metadata["num_turns"] == 2
    assert first.metadata["session_id"] == SID


# -- Codex -------------------------------------------------------------------------------


def test_codex_sandbox_follows_the_allowlist() -> None:
    assert codex_sandbox_args(ToolAllowlist.read_only_default()) == ["-s", "read-only"]
    assert codex_sandbox_args(ToolAllowlist.from_flags(["view", "edit"])) == [
        "-s",
        "workspace-write",
    ]
    dangerous = codex_sandbox_args(ToolAllowlist.from_flags([], dangerous=True))
    assert dangerous[:2] == ["-s", "workspace-write"]
    assert "danger-full-access" not in dangerous


async def test_codex_thread_id_becomes_the_session_id(tmp_path: Path, fake_cli: Path) -> None:
    thread = "01a22a77-ad09-7d63-92d5-cd92a8ff5aa9"
    lines = [
        json.dumps({"type": "thread.started", "thread_id": thread}),
        json.dumps({"type": "item.completed", "item": {"type": "agent_message", "text": "yo"}}),
        json.dumps({"type": "turn.completed", "usage": {"output_tokens": 3}}),
    ]
    home = tmp_path / "codex-home"
    agent = CodexAgent(options(tmp_path, fake_cli, lines, config_dir=home))
    first = await agent.run_turn("hello")
    assert agent.session_id == thread
    assert first.metadata["session_id"] == thread
    assert first.text == "yo"
    await agent.run_turn("-again")
    one, two = records(tmp_path)
    assert one["argv"][:3] == ["exec", "--json", "--skip-git-repo-check"]
    assert one["argv"][-1] == "-"
    assert "resume" not in one["argv"]
    assert two["argv"][-3:] == ["resume", thread, "-"]
    assert two["stdin"] == "-again"
    env = one["env"]
    assert isinstance(env, dict)
    assert env["HOME"] == str(home)
    assert env["CODEX_HOME"] == str(home / ".codex")


async def test_codex_refuses_an_oversized_prompt_before_spawning(
    tmp_path: Path, fake_cli: Path
) -> None:
    agent = CodexAgent(options(tmp_path, fake_cli))
    with pytest.raises(InvalidPromptError, match="at most"):
        await agent.run_turn("x" * (CODEX_MAX_PROMPT_CHARS + 1))
    assert not (tmp_path / "record.jsonl").exists()


async def test_codex_failed_turn_is_an_output(tmp_path: Path, fake_cli: Path) -> None:
    lines = [
        json.dumps({"type": "thread.started", "thread_id": SID}),
        json.dumps({"type": "error", "message": "bad request"}),
        json.dumps({"type": "turn.failed", "error": {"message": "bad request"}}),
    ]
    out = await CodexAgent(options(tmp_path, fake_cli, lines, exit_code=1)).run_turn("hi")
    assert out.exit_code == 1
    assert out.metadata["is_error"] is True
    assert "bad request" in out.text


# -- factory -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tool", "cls"), [("claude", ClaudeAgent), ("copilot", CopilotAgent), ("codex", CodexAgent)]
)
def test_factory_builds_each_adapter(tmp_path: Path, tool: str, cls: type[JsonStreamAgent]) -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    agent = create_agent(tool, settings, cwd=tmp_path, session_id=SID, resume=True)
    assert isinstance(agent, cls)
    assert agent.started
    assert agent.session_id == SID


# -- turnstile agents ----------------------------------------------------------------------


async def test_agents_command_reports_found_missing_and_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    versioned = tmp_path / "claude"
    versioned.write_text(f"#!{sys.executable}\nprint('9.9.9 (Claude Code)')\n")
    versioned.chmod(0o755)
    broken = tmp_path / "codex"
    broken.write_text(
        f"#!{sys.executable}\nimport sys\nprint('nope', file=sys.stderr)\nsys.exit(2)\n"
    )
    broken.chmod(0o755)
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        claude_bin=str(versioned),
        copilot_bin="no-such-copilot-xyz",
        codex_bin=str(broken),
        agent_command=f"{sys.executable} -c pass {{prompt}}",
    )
    by_name = {s.name: s for s in await agent_statuses(settings)}
    assert by_name["claude"].default
    assert by_name["claude"].version == "9.9.9 (Claude Code)"
    assert by_name["copilot"].path is None
    assert "npm install -g @github/copilot" in (by_name["copilot"].problem or "")
    assert by_name["codex"].problem == "--version exited with code 2: nope"
    assert by_name["command"].path == sys.executable

    assert await handle(argparse.Namespace(json=False), settings) == 0
    table = capsys.readouterr().out
    assert "9.9.9 (Claude Code)" in table
    assert "no-such-copilot-xyz" in table
    missing_default = Settings(_env_file=None, claude_bin="no-such-claude-xyz")  # type: ignore[call-arg]
    assert await handle(argparse.Namespace(json=True), missing_default) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["name"] for line in lines] == ["claude", "copilot", "codex", "command"]


# -- the fake model API ----------------------------------------------------------------------


def sse_events(body: str) -> list[tuple[str, dict[str, object]]]:
    events = []
    for chunk in body.strip().split("\n\n"):
        name, data = chunk.split("\n", 1)
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


async def test_fake_model_api_scripts_replies_and_records_requests() -> None:
    async with FakeModelAPI(fallback=Text("fallback")) as api, aiohttp.ClientSession() as http:
        api.enqueue(
            ToolCall("Write", {"file_path": "/x", "content": "y"}, call_id="toolu_1"),
            Status(400, "no"),
            Text("from responses"),
        )
        async with http.head(api.url + "/") as probe:
            assert probe.status == 200
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(api.url + "/v1/messages?beta=true", json=body) as resp:
            events = sse_events(await resp.text())
        names = [name for name, _ in events]
        assert names[0] == "message_start"
        assert names[-1] == "message_stop"
        block = next(d for n, d in events if n == "content_block_start")
        assert block["content_block"] == {
            "type": "tool_use",
            "id": "toolu_1",
            "name": "Write",
            "input": {},
        }
        delta = next(d for n, d in events if n == "message_delta")
        assert delta["delta"]["stop_reason"] == "tool_use"  # type: ignore[index]
        async with http.post(api.url + "/v1/messages", json=body) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["message"] == "no"
        responses_body = {"input": [{"type": "message", "role": "user", "content": "q"}]}
        async with http.post(api.url + "/v1/responses", json=responses_body) as resp:
            events = sse_events(await resp.text())
        assert events[0][0] == "response.created"
        assert events[-1][0] == "response.completed"
        done = next(d for n, d in events if n == "response.output_item.done")
        assert done["item"]["content"][0]["text"] == "from responses"  # type: ignore[index]
        async with http.post(api.url + "/v1/messages", json=body) as resp:
            assert "fallback" in await resp.text()
    assert api.unscripted == 1
    assert [r.path for r in api.requests] == [
        "/",
        *["/v1/messages"] * 2,
        "/v1/responses",
        "/v1/messages",
    ]
    assert api.model_requests[0].conversation() == [("user", "hi")]
    assert api.model_requests[2].conversation() == [("user", "q")]
    assert api.model_requests[0].query == {"beta": "true"}


async def test_fake_model_api_holds_a_response_until_released() -> None:
    async with FakeModelAPI() as api, aiohttp.ClientSession() as http:
        hold = Hold(text="finally")
        api.enqueue(hold)

        async def call() -> str:
            async with http.post(api.url + "/v1/messages", json={"messages": []}) as resp:
                return await resp.text()

        pending = asyncio.create_task(call())
        await hold.arrived.wait()
        await api.wait_for_model_requests(1)
        assert not pending.done()
        hold.release.set()
        events = sse_events(await pending)
    assert events[-1][0] == "message_stop"
    assert any(d.get("delta", {}).get("text") == "finally" for _, d in events)  # type: ignore[union-attr]


# -- the pinned CLI installer -----------------------------------------------------------------


def test_installer_fails_loudly_without_npm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TURNSTILE_CLI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    assert cache_root() == tmp_path / "cache"
    with pytest.raises(CliInstallError, match="npm is not on PATH"):
        ensure_cli("codex")


def test_installer_reuses_a_cached_pinned_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TURNSTILE_CLI_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # npm would not be found
    spec = PINNED["claude"]
    package = tmp_path / "claude" / "node_modules" / spec.package
    package.mkdir(parents=True)
    (package / "package.json").write_text(json.dumps({"version": spec.version}))
    binary = tmp_path / "claude" / "node_modules" / ".bin" / "claude"
    binary.parent.mkdir()
    binary.write_text("")
    assert ensure_cli("claude") == binary


async def test_error_texts_we_compose_are_redacted(tmp_path: Path, fake_cli: Path) -> None:
    secret = "sk-ant-api03-abcdefghijklmnopqrstuv"
    lines = [
        json.dumps({"type": "thread.started", "thread_id": SID}),
        json.dumps({"type": "turn.failed", "error": {"message": f"bad key {secret}"}}),
    ]
    out = await CodexAgent(options(tmp_path, fake_cli, lines, exit_code=1)).run_turn("hi")
    assert secret not in out.text
    assert "[REDACTED]" in out.text
    agent = CopilotAgent(options(tmp_path, fake_cli, [], exit_code=2, stderr=f"token={secret}"))
    out = await agent.run_turn("hi")
    assert secret not in out.text


async def test_claude_session_already_in_use_is_resumed_next_turn(
    tmp_path: Path, fake_cli: Path
) -> None:
    stderr = f"Error: Session ID {SID} is already in use.\n"
    opts = options(tmp_path, fake_cli, [], exit_code=1, stderr=stderr, config_dir=tmp_path / "cfg")
    agent = ClaudeAgent(opts, session_id=SID)
    out = await agent.run_turn("hi")
    assert out.exit_code == 1
    assert "already has session" in out.text
    assert "is already in use" in out.text
    assert agent.started
    # Another process created it between our look at the store and the spawn.
    write_transcript(agent)
    await agent.run_turn("again")
    assert records(tmp_path)[1]["argv"][4:6] == ["--resume", SID]

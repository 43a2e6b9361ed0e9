"""Tool approvals from the chat, end to end: the real bot and the real Claude Code CLI.

The bot talks to the fake Bot API over HTTP; Claude Code talks to the fake model API,
which scripts a ``Bash`` call; Claude Code asks turnstile's MCP permission server, whose
request the bot posts with buttons; the test presses them like a person would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pty
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine.approvals import Decision, SqliteApprovalStore
from tests.agent_clis import ensure_cli
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import (
    APPROVER,
    CHAT,
    OPERATOR,
    STRANGER,
    bot_settings,
    running_bot,
)
from tests.fakes.model_api import FakeModelAPI, Text, ToolCall
from tests.fakes.realcli import MARKER_VAR, Sandbox, cmdline, marked_processes
from tests.support import clean_env

pytestmark = [
    pytest.mark.realcli,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("isolated_env"),
]

TOUCH = ToolCall("Bash", {"command": "touch allowed.txt", "description": "make a file"})


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    return ensure_cli("claude")


@pytest.fixture
async def model() -> AsyncIterator[FakeModelAPI]:
    async with FakeModelAPI() as server:
        yield server


@pytest.fixture
def sandbox(tmp_path: Path, model: FakeModelAPI, monkeypatch: pytest.MonkeyPatch) -> Sandbox:
    box = Sandbox(tmp_path / "claude")
    for key, value in box.env(model.claude_env(box.config)).items():
        monkeypatch.setenv(key, value)
    return box


def settings_for(api: FakeBotApi, root: Path, claude_bin: Path, **overrides: Any) -> Any:
    values: dict[str, Any] = {
        "default_agent": "claude",
        "claude_bin": str(claude_bin),
        "tool_approval": "unlisted",
        # In the sandbox: the permission server is reached through its relay.
        "sandbox": "on",
    }
    values.update(overrides)
    return bot_settings(api, root, **values)


def workdir(root: Path) -> Path:
    """The own workspace of the test chat, where its chat sessions work."""
    return root / "ws" / "chats" / f"chat_{CHAT}"


def is_request(msg: SentMessage) -> bool:
    return "asks to use Bash" in msg.text


async def bind_and_ask(api: FakeBotApi, prompt: str = "make the file") -> SentMessage:
    api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
    await api.wait_for_message(lambda m: "bound to a new claude session" in m.text)
    api.push_message(chat_id=CHAT, user_id=OPERATOR, text=prompt)
    return await api.wait_for_message(lambda m: is_request(m) and bool(m.buttons), timeout=60)


def press(api: FakeBotApi, msg: SentMessage, label: str, user: int) -> int:
    button = next(b for b in msg.buttons if label in b["text"])
    return api.push_callback(
        chat_id=CHAT, user_id=user, data=button["callback_data"], message_id=msg.message_id
    )


def tool_results(model: FakeModelAPI) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for request in model.model_requests:
        for role, text in request.conversation():
            if role == "tool_result":
                found.append(json.loads(text))
    return found


async def test_allow_once_runs_the_command_and_a_strangers_press_is_refused(
    tmp_path: Path, claude_bin: Path, model: FakeModelAPI, sandbox: Sandbox
) -> None:
    model.enqueue(TOUCH, Text("file made"))
    async with FakeBotApi() as api, running_bot(api, settings_for(api, tmp_path, claude_bin)) as rt:
        ask = await bind_and_ask(api)
        assert "$ touch allowed.txt" in ask.text
        assert [b["text"] for b in ask.buttons] == [
            "✅ Allow once",
            "♾ Allow for this session",
            "⛔ Deny",
        ]
        press(api, ask, "Allow once", STRANGER)
        await api.wait_until(
            lambda: any("Needs the approver" in a.get("text", "") for a in api.callback_answers)
        )
        assert not (workdir(tmp_path) / "allowed.txt").exists()
        [waiting] = await SqliteApprovalStore(rt.db).pending()
        assert waiting.tool == "Bash"
        # the operator who bound the session may decide their own run's request
        press(api, ask, "Allow once", OPERATOR)
        await api.wait_for_message(lambda m: m.text == "file made", timeout=60)
        assert (workdir(tmp_path) / "allowed.txt").exists()
        await api.wait_until(lambda: "Allowed once by user11" in ask.text)
        assert ask.buttons == []
        entries = await rt.store.audit_entries()
        outcomes = [
            (e.action, e.outcome, e.user_id) for e in entries if e.action == "tool_approval"
        ]
        assert ("tool_approval", "refused", STRANGER) in outcomes
        assert ("tool_approval", "allowed", OPERATOR) in outcomes
    [result] = tool_results(model)
    assert result["is_error"] is False


async def test_deny_keeps_the_file_away_and_the_model_is_told(
    tmp_path: Path, claude_bin: Path, model: FakeModelAPI, sandbox: Sandbox
) -> None:
    model.enqueue(TOUCH, Text("understood"))
    async with FakeBotApi() as api, running_bot(api, settings_for(api, tmp_path, claude_bin)) as rt:
        ask = await bind_and_ask(api)
        press(api, ask, "Deny", APPROVER)
        await api.wait_for_message(lambda m: m.text == "understood", timeout=60)
        await api.wait_until(lambda: "Denied by user22" in ask.text)
        [request] = await SqliteApprovalStore(rt.db).history((await rt.runs.list_runs())[0].id)
        assert request.state is Decision.DENIED
        assert request.decided_by == APPROVER
    assert not (workdir(tmp_path) / "allowed.txt").exists()
    [result] = tool_results(model)
    assert result["is_error"] is True
    assert "A person denied this Bash call (user 22)" in json.dumps(result)


async def test_allow_for_this_session_covers_the_next_call_of_the_same_command(
    tmp_path: Path, claude_bin: Path, model: FakeModelAPI, sandbox: Sandbox
) -> None:
    second = ToolCall("Bash", {"command": "touch second.txt", "description": "another"})
    model.enqueue(TOUCH, second, Text("both made"))
    async with FakeBotApi() as api, running_bot(api, settings_for(api, tmp_path, claude_bin)) as rt:
        ask = await bind_and_ask(api)
        assert "Bash commands starting with “touch”" in ask.text
        press(api, ask, "for this session", APPROVER)
        await api.wait_for_message(lambda m: m.text == "both made", timeout=60)
        assert (workdir(tmp_path) / "allowed.txt").exists()
        assert (workdir(tmp_path) / "second.txt").exists()
        # one request message only: the second call was covered by the grant
        assert len([m for m in api.sent if is_request(m)]) == 1
        run_id = (await rt.runs.list_runs())[0].id
        history = await SqliteApprovalStore(rt.db).history(run_id)
        assert [(r.state.value, r.scope.value if r.scope else None) for r in history] == [
            ("allowed", "session"),
            ("allowed", "grant"),
        ]


async def test_stop_while_a_request_waits_ends_the_turn_and_removes_the_buttons(
    tmp_path: Path, claude_bin: Path, model: FakeModelAPI, sandbox: Sandbox
) -> None:
    model.enqueue(TOUCH, Text("never sent"))
    async with FakeBotApi() as api, running_bot(api, settings_for(api, tmp_path, claude_bin)) as rt:
        ask = await bind_and_ask(api)
        allow = ask.buttons[0]["callback_data"]
        waiting = marked_processes(sandbox.marker)
        # The CLI and the relay it started run in the sandbox; the server is the bot's.
        argvs = [cmdline(pid) for pid in waiting]
        assert any(Path(a[0]).name == "bwrap" for a in argvs if a), argvs
        assert any(a[-2].endswith("relay.py") for a in argvs if len(a) >= 2), argvs
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/stop")
        await api.wait_for_message(lambda m: "stopped during turn 1" in m.text, timeout=60)
        await api.wait_until(
            lambda: ask.buttons == [] and "the turn was stopped by user11" in ask.text
        )
        assert await SqliteApprovalStore(rt.db).pending() == []
        # the CLI and the permission server it started are gone
        assert marked_processes(sandbox.marker) == []
        # a press on the old message (a phone showing it stale) changes nothing
        api.push_callback(chat_id=CHAT, user_id=APPROVER, data=allow, message_id=ask.message_id)
        await api.wait_until(
            lambda: any("Already decided" in a.get("text", "") for a in api.callback_answers)
        )
    assert not (workdir(tmp_path) / "allowed.txt").exists()
    assert "never sent" not in api.texts()


async def test_a_restart_while_a_request_waits_runs_the_turn_again_and_asks_again(
    tmp_path: Path, claude_bin: Path, model: FakeModelAPI, sandbox: Sandbox
) -> None:
    """Decided behaviour: a graceful restart parks the waiting turn; after the restart it
    runs again and its request is asked (and answerable) again. The old request message
    says so and has no buttons."""
    model.enqueue(TOUCH)
    async with FakeBotApi() as api:
        settings = settings_for(api, tmp_path, claude_bin)
        async with running_bot(api, settings):
            first = await bind_and_ask(api)
        assert first.buttons == []
        assert "restarted while it waited; the turn runs again and asks again" in first.text
        assert marked_processes(sandbox.marker) == []
        model.enqueue(TOUCH, Text("made after the restart"))
        async with running_bot(api, settings):
            again = await api.wait_for_message(
                lambda m: is_request(m) and bool(m.buttons) and m is not first, timeout=60
            )
            press(api, again, "Allow once", APPROVER)
            await api.wait_for_message(lambda m: m.text == "made after the restart", timeout=60)
        assert (workdir(tmp_path) / "allowed.txt").exists()


# -- the terminal front end ------------------------------------------------------------


def _terminal_env(root: Path, claude_bin: Path) -> dict[str, str]:
    env = clean_env()
    env.update(
        {
            "TURNSTILE_TOOL_APPROVAL": "unlisted",
            "TURNSTILE_DEFAULT_AGENT": "claude",
            "TURNSTILE_CLAUDE_BIN": str(claude_bin),
            "TURNSTILE_DATABASE": str(root / "turnstile.db"),
            "TURNSTILE_SANDBOX": "on",
            MARKER_VAR: os.environ[MARKER_VAR],
        }
    )
    return env


async def test_turnstile_chat_asks_on_the_terminal(
    tmp_path: Path, claude_bin: Path, model: FakeModelAPI, sandbox: Sandbox
) -> None:
    model.enqueue(TOUCH, Text("made from the terminal"))
    work = tmp_path / "term"
    work.mkdir()
    master, slave = pty.openpty()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "engine.cli",
        "chat",
        "--workdir",
        str(work),
        stdin=slave,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_terminal_env(tmp_path, claude_bin),
        cwd=tmp_path,
    )
    os.close(slave)
    try:
        os.write(master, b"make the file\n")
        assert proc.stderr is not None
        seen = b""
        async with asyncio.timeout(120):
            while b"Allow? [y] once" not in seen:
                chunk = await proc.stderr.read(4096)
                assert chunk, seen
                seen += chunk
        assert b"$ touch allowed.txt" in seen
        assert not (work / "allowed.txt").exists()
        os.write(master, b"y\n")
        assert proc.stdout is not None
        async with asyncio.timeout(120):
            line = await proc.stdout.readline()
        assert line == b"made from the terminal\n"
        assert (work / "allowed.txt").exists()
        os.write(master, b"\x04")  # Ctrl-D: end of input
        async with asyncio.timeout(60):
            assert await proc.wait() == 0
    finally:
        os.close(master)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_turnstile_chat_without_a_terminal_denies_and_says_why(
    tmp_path: Path, claude_bin: Path, model: FakeModelAPI, sandbox: Sandbox
) -> None:
    model.enqueue(TOUCH, Text("could not make it"))
    work = tmp_path / "term"
    work.mkdir()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "engine.cli",
        "chat",
        "--workdir",
        str(work),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_terminal_env(tmp_path, claude_bin),
        cwd=tmp_path,
    )
    async with asyncio.timeout(180):
        out, err = await proc.communicate(b"make the file\n")
    assert proc.returncode == 0, err
    assert out == b"could not make it\n"
    assert b"denied \xe2\x80\x94 nobody can answer" in err
    assert b"TURNSTILE_TOOL_APPROVAL=off" in err
    assert not (work / "allowed.txt").exists()
    [result] = tool_results(model)
    assert result["is_error"] is True
    assert "stdin is not a TTY" in json.dumps(result)


async def _until_sent(db: Path, ref: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.closing(sqlite3.connect(db)) as conn:
            row = conn.execute("SELECT state FROM bot_outbox WHERE ref = ?", (ref,)).fetchone()
        if row is not None and row[0] == "sent":
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"{ref} was not recorded as sent within {timeout}s")


async def test_a_crash_while_a_request_waits_reports_it_after_the_restart(
    tmp_path: Path, claude_bin: Path, model: FakeModelAPI, sandbox: Sandbox
) -> None:
    """The bot is SIGKILLed while a request waits: after the restart the request is
    reported as not decided (no buttons; a press changes nothing) and the turn is reported
    cut off, as every turn a crash cut off is."""
    model.enqueue(TOUCH, Text("the orphan went on"))
    async with FakeBotApi() as api:
        env = clean_env()
        env.update(
            {
                "TURNSTILE_TELEGRAM_TOKEN": api.token,
                "TURNSTILE_TELEGRAM_BASE_URL": api.base_url,
                "TURNSTILE_TELEGRAM_BASE_FILE_URL": api.file_url,
                "TURNSTILE_DATABASE": str(tmp_path / "bot.db"),
                "TURNSTILE_WORKSPACES": str(tmp_path / "ws"),
                "TURNSTILE_RUNS_DIR": str(tmp_path / "runs"),
                "TURNSTILE_TASKS_ROOT": str(tmp_path / "tasks"),
                "TURNSTILE_ALLOWED_CHATS": str(CHAT),
                "TURNSTILE_OPERATORS": str(OPERATOR),
                "TURNSTILE_APPROVERS": str(APPROVER),
                "TURNSTILE_DEFAULT_AGENT": "claude",
                "TURNSTILE_CLAUDE_BIN": str(claude_bin),
                "TURNSTILE_TOOL_APPROVAL": "unlisted",
                "TURNSTILE_STATUS_EDIT_INTERVAL": "0.05",
                "TURNSTILE_SANDBOX": "on",
            }
        )

        async def start() -> asyncio.subprocess.Process:
            before = len(api.calls_of("deleteWebhook"))
            with open(tmp_path / f"bot-{before}.log", "wb") as log:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "engine.cli",
                    "bot",
                    cwd=tmp_path,
                    env=env,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=log,
                )
            await api.wait_until(lambda: len(api.calls_of("deleteWebhook")) > before, timeout=60)
            return proc

        bot = await start()
        try:
            ask = await bind_and_ask(api)
            allow = ask.buttons[0]["callback_data"]
            # Killed once the bot recorded the message as delivered (a kill between
            # Telegram's answer and that record sends it again after the restart).
            await _until_sent(tmp_path / "bot.db", "tool:1")
            bot.kill()
            await bot.wait()
            bot = await start()
            await api.wait_until(lambda: ask.buttons == [], timeout=60)
            assert "the bot restarted while it waited; the turn was cut off" in ask.text
            await api.wait_for_message(lambda m: "was cut off" in m.text and "Turn 1" in m.text)
            api.push_callback(chat_id=CHAT, user_id=APPROVER, data=allow, message_id=ask.message_id)
            await api.wait_until(
                lambda: any("Already decided" in a.get("text", "") for a in api.callback_answers)
            )
            bot.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(bot.wait(), 60) == 0
        finally:
            if bot.returncode is None:
                bot.kill()
                await bot.wait()
            for pid in marked_processes(sandbox.marker):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert not (workdir(tmp_path) / "allowed.txt").exists()
    assert "the orphan went on" not in api.texts()

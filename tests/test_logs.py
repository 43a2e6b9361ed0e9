"""Logs: text or JSON, context ids on every line where they apply, the token never present."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import shlex
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from engine.agents.factory import create_agent
from engine.logs import current_context, log_context, setup_logging
from engine.settings import Settings
from engine.store import Database
from engine.testing import RecordingChannel, ScriptedSession
from engine.turn import TurnOutput, run_session_loop
from tests.support import clean_env

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "123456789:AAEhBOweik6ad9r_QXMENQjcrGbqCr4K-Jc"
SECRET = "webhook-secret-0123456789"


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    hooks = (sys.excepthook, threading.excepthook)
    levels = {name: logging.getLogger(name).level for name in ("httpx", "httpcore")}
    try:
        yield
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        sys.excepthook, threading.excepthook = hooks
        logging.captureWarnings(False)
        for name, old in levels.items():
            logging.getLogger(name).setLevel(old)


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_text_lines_carry_context_from_extra_and_blocks(restore_logging: None) -> None:
    stream = io.StringIO()
    setup_logging(stream=stream)
    log = logging.getLogger("turnstile.test")
    log.info("plain")
    log.info("turn %d done", 3, extra={"run_id": "r-1", "session_id": "s-1"})
    with log_context(run_id="r-2", task="fix-login"), log_context(phase="design", chat_id=-100):
        log.info("inside")
        log.info("override", extra={"run_id": "r-3"})
    log.info("after")
    lines = _lines(stream)
    assert lines[0].endswith("INFO    turnstile.test: plain")
    assert lines[1].endswith("turn 3 done [run_id=r-1 session_id=s-1]")
    assert lines[2].endswith("inside [run_id=r-2 task=fix-login phase=design chat_id=-100]")
    assert "[run_id=r-3 task=fix-login" in lines[3]
    assert lines[4].endswith("after")
    assert current_context() == {}


async def test_context_follows_tasks_created_inside(restore_logging: None) -> None:
    stream = io.StringIO()
    setup_logging(stream=stream, fmt="json")
    log = logging.getLogger("turnstile.test")
    started = asyncio.Event()

    async def worker() -> None:
        started.set()
        log.info("from the task")

    with log_context(run_id="r-9"):
        task = asyncio.create_task(worker(), name="worker")
    await started.wait()
    await task
    log.info("outside")
    records = [json.loads(line) for line in _lines(stream)]
    assert records[0]["run_id"] == "r-9"
    assert "run_id" not in records[1]


def test_unknown_context_key_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown log context keys"), log_context(user="x"):
        pass


def test_json_lines(restore_logging: None) -> None:
    stream = io.StringIO()
    setup_logging(stream=stream, fmt="json", level="debug")
    log = logging.getLogger("turnstile.json")
    log.debug("débogage %s", "✓", extra={"task": "t", "phase": "implement", "chat_id": 5})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed", extra={"run_id": Path("not-json-native")})
    first, second = (json.loads(line) for line in _lines(stream))
    assert first["level"] == "DEBUG"
    assert first["logger"] == "turnstile.json"
    assert first["msg"] == "débogage ✓"
    assert (first["task"], first["phase"], first["chat_id"]) == ("t", "implement", 5)
    assert isinstance(first["ts"], float)
    assert second["run_id"] == "not-json-native"
    assert "RuntimeError: boom" in second["exc"]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_secrets_are_redacted_everywhere_in_a_line(restore_logging: None, fmt: str) -> None:
    stream = io.StringIO()
    setup_logging(stream=stream, fmt=fmt, secrets=(TOKEN, SECRET))  # type: ignore[arg-type]
    log = logging.getLogger("turnstile.secret")
    log.info("calling https://api.telegram.org/bot%s/getMe", TOKEN)
    log.warning("header %s", SECRET, extra={"session_id": f"s-{SECRET}"})
    log.info("env ANTHROPIC_API_KEY=sk-ant-abcdefghijklmnop and ghp_%s", "a" * 36)
    try:
        raise ValueError(f"bad token {TOKEN}")
    except ValueError:
        log.exception("crash")
    log.info("stack", stack_info=True, extra={"task": TOKEN})
    log.info("bad format %d", TOKEN)  # a wrong %-format still yields a redacted line
    text = stream.getvalue()
    for secret in (TOKEN, SECRET, "sk-ant-abcdefghijklmnop", "a" * 36):
        assert secret not in text
    assert text.count("[REDACTED]") >= 8
    assert "ValueError: bad token [REDACTED]" in text


async def test_http_library_logs_are_redacted(restore_logging: None) -> None:
    async def get_me(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "result": {"id": 1, "username": "b"}})

    app = web.Application()
    app.router.add_post("/bot{token}/getMe", get_me)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    stream = io.StringIO()
    setup_logging(stream=stream, level="DEBUG", secrets=(TOKEN,))
    # setup_logging quiets httpx; turn it up again to prove the filter, not the level, holds.
    logging.getLogger("httpx").setLevel(logging.DEBUG)
    try:
        async with httpx.AsyncClient() as client:
            response = await client.post(f"http://127.0.0.1:{port}/bot{TOKEN}/getMe")
        assert response.status_code == 200
    finally:
        await runner.cleanup()
    text = stream.getvalue()
    assert "HTTP Request: POST" in text
    assert "/bot[REDACTED]/getMe" in text
    assert TOKEN not in text


async def test_uncaught_exception_is_logged_redacted(tmp_path: Path) -> None:
    code = (
        "import sys; from engine.logs import setup_logging; "
        f"setup_logging(secrets=({TOKEN!r},)); "
        f"raise RuntimeError('token was ' + {TOKEN!r})"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 1
    assert b"CRITICAL turnstile.uncaught: uncaught exception" in err
    assert b"RuntimeError: token was [REDACTED]" in err
    assert TOKEN.encode() not in out + err


class _GetMe:
    def __init__(self) -> None:
        self.calls = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.calls += 1
        if request.match_info["token"] != TOKEN:
            return web.json_response({"ok": False, "description": "Unauthorized"}, status=401)
        user = {"id": 1, "is_bot": True, "first_name": "F", "username": "fake_bot"}
        return web.json_response({"ok": True, "result": user})


@pytest.fixture
async def get_me_url() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/bot{token}/{method}", _GetMe().handle)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/bot"
    finally:
        await runner.cleanup()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_full_command_scenario_never_prints_the_token(
    tmp_path: Path, get_me_url: str, fmt: str
) -> None:
    """Every command a user runs, at DEBUG, with the token configured: grep all output."""
    (tmp_path / ".env").write_text(
        f"TURNSTILE_TELEGRAM_TOKEN={TOKEN}\n"
        f"TURNSTILE_WEBHOOK_SECRET={SECRET}\n"
        f"TURNSTILE_TELEGRAM_BASE_URL={get_me_url}\n"
        "TURNSTILE_ALLOWED_CHATS=-1001\nTURNSTILE_ADMINS=42\n"
        f"TURNSTILE_LOG_FORMAT={fmt}\nTURNSTILE_LOG_LEVEL=DEBUG\n"
        f"TURNSTILE_DEFAULT_AGENT=command\n"
        f"TURNSTILE_AGENT_COMMAND={sys.executable} {ROOT}/tests/fake_agent.py --prompt {{prompt}}\n"
    )
    async with Database(tmp_path / "turnstile.db"):
        pass
    env = clean_env()
    env.update(PYTHONPATH=str(ROOT), NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1")
    commands = [
        ["--help"],
        ["doctor"],
        ["doctor", "--migrate"],
        ["--log-level", "DEBUG", "backup", str(tmp_path / "copy.db")],
        ["backup", str(tmp_path / "copy.db")],  # fails: exists
        ["no-such-command"],
    ]
    transcript = []
    for argv in commands:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "engine.cli",
            *argv,
            cwd=tmp_path,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        transcript.append((argv, proc.returncode, out + err))
    codes = [code for _, code, _ in transcript]
    assert codes == [0, 0, 0, 0, 2, 2], transcript
    assert b"@fake_bot" in transcript[1][2]
    everything = b"".join(output for _, _, output in transcript)
    assert TOKEN.encode() not in everything
    assert TOKEN.split(":")[1].encode() not in everything
    assert SECRET.encode() not in everything


@pytest.mark.parametrize("agent", ["command", "claude", "copilot", "codex"])
async def test_agents_never_inherit_the_bot_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, agent: str
) -> None:
    """In Docker and under systemd the token is in the environment; agents run tools."""
    monkeypatch.setenv("TURNSTILE_TELEGRAM_TOKEN", TOKEN)
    monkeypatch.setenv("TURNSTILE_WEBHOOK_SECRET", SECRET)
    monkeypatch.setenv("TURNSTILE_DATABASE", str(tmp_path / "kept.db"))
    show = "import os; print(*(os.environ.get(k, '-') for k in sys.argv[1:]))"
    names = "TURNSTILE_TELEGRAM_TOKEN TURNSTILE_WEBHOOK_SECRET TURNSTILE_DATABASE"
    template = f"{sys.executable} -c {shlex.quote('import sys; ' + show)} {names} {{prompt}}"
    fake_cli = tmp_path / "fake-cli"
    fake_cli.write_text("#!/bin/sh\n")
    fake_cli.chmod(0o755)
    bins = {f"{name}_bin": str(fake_cli) for name in ("claude", "copilot", "codex")}
    settings = Settings(_env_file=None, agent_command=template, **bins)  # type: ignore[call-arg]
    session = create_agent(agent, settings, cwd=tmp_path)
    env = session.environment(session.build_invocation("hello"))
    assert "TURNSTILE_TELEGRAM_TOKEN" not in env
    assert "TURNSTILE_WEBHOOK_SECRET" not in env
    # Nor where the store is: an agent's `turnstile status --approve` must find nothing.
    assert "TURNSTILE_DATABASE" not in env
    if agent == "command":
        out = await session.run_turn("hello")
        assert out.text.split()[:3] == ["-", "-", "-"]


async def test_lines_logged_inside_a_session_loop_carry_its_session_id(
    restore_logging: None,
) -> None:
    stream = io.StringIO()
    setup_logging(stream=stream, fmt="json")
    log = logging.getLogger("turnstile.adapter")

    def answer(prompt: str) -> TurnOutput:
        log.info("turn for %s", prompt)
        return TurnOutput(text="ok")

    await run_session_loop(
        ScriptedSession([answer, answer], session_id="s-42"), RecordingChannel(["a", "b"])
    )
    log.info("after the loop")
    records = [json.loads(line) for line in _lines(stream)]
    turns = [r for r in records if r["msg"].startswith("turn for")]
    assert [r.get("session_id") for r in turns] == ["s-42", "s-42"]
    assert "session_id" not in records[-1]

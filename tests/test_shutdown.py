"""Graceful shutdown of the real bot process (``turnstile bot``) on SIGTERM.

The bot runs as a child process against the fake Bot API server in this test's event loop;
its agent is the scripted fake agent. First SIGTERM: stop taking updates, let the running
turn finish (or park it, by setting), flush the outbox, exit 0. A second SIGTERM pre-empts
the running turn. The bot's logs (at DEBUG) are grepped for the token on the way.

The shutdown paths that write the store (a finished turn, a pre-empted or parked one, the
flushed outbox, a write cancelled mid-transaction) run on a SQLite file and on a fresh
PostgreSQL database in turn (``db_target``, ``database``); the quick start from
``.env.example`` and webhook mode (no store of their own) run on SQLite only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from chatfront.store import SqlBotStore
from engine.store import SqliteRunStore, open_database
from tests.bot_process import CHAT, FAKE_AGENT, OPERATOR, ROOT, BotProcess, bot_env, spawn
from tests.db_support import Target, setting
from tests.fakes.bot_api import FakeBotApi
from tests.support import UNCONFINED, alive, wait_for_file, wait_until


def _env(root: Path, api: FakeBotApi, **extra: str) -> dict[str, str]:
    return bot_env(
        root,
        api,
        TURNSTILE_PREEMPT_GRACE="1",
        TURNSTILE_SHUTDOWN_FLUSH_SECONDS="10",
        TURNSTILE_LOG_LEVEL="DEBUG",
        FAKE_AGENT_LOG=str(root / "agent-log.jsonl"),
        FAKE_AGENT_PIDS=str(root / "agent-pids"),
        **extra,
    )


async def _start(root: Path, env: dict[str, str], mode: str = "polling") -> BotProcess:
    bot = await spawn(root, env, "bot")
    await bot.wait_log(f"running ({mode})")
    return bot


@pytest.fixture
async def api() -> AsyncIterator[FakeBotApi]:
    async with FakeBotApi() as fake:
        yield fake


@pytest.fixture
def gate(tmp_path: Path) -> Path:
    """The fake agent's "slow" turn waits until this file exists."""
    path = tmp_path / "gate"
    script = {
        "rules": [
            {"match": "slow", "wait_file": str(path), "text": "finished: {prompt}"},
            {"match": "forever", "grandchild": True, "wait_file": str(path), "text": "late"},
            {"match": "", "text": "echo: {prompt}"},
        ]
    }
    (tmp_path / "agent-script.json").write_text(json.dumps(script))
    return path


def _agent_prompts(root: Path) -> list[str]:
    log = root / "agent-log.jsonl"
    if not log.exists():
        return []
    return [json.loads(line)["prompt"] for line in log.read_text().splitlines()]


async def _bind_and_start_turn(api: FakeBotApi, root: Path, text: str) -> None:
    api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
    await api.wait_for_message(lambda m: "bound to" in m.text)
    api.push_message(chat_id=CHAT, user_id=OPERATOR, text=text)
    await api.wait_for_message(lambda m: m.text.startswith("⏳ working"))
    # The agent process has started its turn once it counted it.
    await wait_until(lambda: any((root / "agent-state").glob("*.turns")), interval=0.02)


async def _pending_outbox(target: Target) -> int:
    async with open_database(target) as db:
        return await SqlBotStore(db).pending_outbox()


async def _turn_states(target: Target) -> list[str]:
    async with open_database(target) as db:
        runs = SqliteRunStore(db)
        return [t.state.value for r in await runs.list_runs() for t in await runs.turns(r.id)]


@pytest.mark.timeout(120)
async def test_sigterm_finishes_the_running_turn_flushes_and_exits_0(
    tmp_path: Path, api: FakeBotApi, gate: Path, db_target: Target
) -> None:
    env = _env(tmp_path, api, TURNSTILE_DATABASE=setting(db_target))
    on_sqlite = isinstance(db_target, Path)
    bot = await _start(tmp_path, env)
    try:
        await _bind_and_start_turn(api, tmp_path, "slow question")
        if on_sqlite:  # a PostgreSQL backup is pg_dump's (tests/test_backup.py)
            # `turnstile backup` while the bot runs a turn (docs/deploy.md: no need to stop it).
            backup = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "engine.cli",
                "backup",
                str(tmp_path / "copy.db"),
                cwd=tmp_path,
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            backup_out, backup_err = await backup.communicate()
            assert backup.returncode == 0, backup_err.decode()
            assert b"integrity check ok" in backup_out
        bot.signal()
        await bot.wait_log("shutdown requested")
        # Taken no more: this message is neither run now nor lost (still unconfirmed).
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="after the signal")
        gate.touch()
        code = await bot.exit_code()
    finally:
        await bot.kill()
    assert code == 0, bot.log
    assert "finished: slow question" in api.texts(CHAT)  # delivered before the exit
    assert _agent_prompts(tmp_path) == ["slow question"]
    assert await _pending_outbox(db_target) == 0
    assert await _turn_states(db_target) == ["finished"]
    assert api.token not in bot.log
    assert api.token.split(":")[1] not in bot.log
    assert "DEBUG" in bot.log  # the grep above looked at real, verbose logs
    if on_sqlite:
        copy = sqlite3.connect(f"{(tmp_path / 'copy.db').as_uri()}?mode=ro", uri=True)
        try:  # the copy taken mid-turn: the turn is in it, still running
            assert copy.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            assert copy.execute("SELECT state FROM turns").fetchall() == [("started",)]
        finally:
            copy.close()

    # The next start takes the message that arrived during the shutdown.
    bot = await _start(tmp_path, env)
    try:
        await api.wait_for_message(lambda m: "echo: after the signal" in m.text)
        bot.signal()
        code = await bot.exit_code()
    finally:
        await bot.kill()
    assert code == 0, bot.log
    assert _agent_prompts(tmp_path) == ["slow question", "after the signal"]
    assert api.token not in bot.log


@pytest.mark.timeout(120)
async def test_second_sigterm_preempts_a_long_turn(
    tmp_path: Path, api: FakeBotApi, gate: Path, db_target: Target
) -> None:
    bot = await _start(tmp_path, _env(tmp_path, api, TURNSTILE_DATABASE=setting(db_target)))
    try:
        await _bind_and_start_turn(api, tmp_path, "forever and ever")
        # The agent is another process: a file it writes is the only signal it can give.
        await wait_for_file(tmp_path / "agent-pids")
        pids = [int(p) for p in (tmp_path / "agent-pids").read_text().split()]
        assert all(alive(p) for p in pids)
        bot.signal()
        await bot.wait_log("shutdown requested")
        assert bot.proc.returncode is None  # the turn keeps running: it may take hours
        bot.signal()
        await bot.wait_log("pre-empting running turns")
        code = await bot.exit_code()
    finally:
        await bot.kill()
    assert code == 0, bot.log
    assert not any(alive(p) for p in pids)  # the agent and its grandchild are gone
    assert await _turn_states(db_target) == ["interrupted"]
    assert await _pending_outbox(db_target) == 0
    # the turn's progress message says it was parked, without its Stop button
    progress = next(m for m in api.sent if any(h.startswith("⏳ working") for h in m.history))
    assert progress.text.startswith("⏸ parked")
    assert not progress.buttons
    assert api.token not in bot.log


@pytest.mark.timeout(120)
async def test_park_setting_parks_at_the_first_sigterm_and_resumes_on_start(
    tmp_path: Path, api: FakeBotApi, gate: Path, db_target: Target
) -> None:
    env = _env(
        tmp_path,
        api,
        TURNSTILE_SHUTDOWN_TURNS="park",
        TURNSTILE_LOG_FORMAT="json",
        TURNSTILE_DATABASE=setting(db_target),
    )
    bot = await _start(tmp_path, env)
    try:
        await _bind_and_start_turn(api, tmp_path, "slow but parked")
        bot.signal()
        code = await bot.exit_code()
    finally:
        await bot.kill()
    assert code == 0, bot.log
    records = [json.loads(line) for line in bot.lines if line.strip()]  # every line is JSON
    about_runs = [r for r in records if r["msg"].startswith("chat run")]
    assert [r["msg"] for r in about_runs] == ["chat run started", "chat run ended parked"]
    assert all(r["run_id"] for r in about_runs)
    assert await _turn_states(db_target) == ["interrupted"]
    assert "finished: slow but parked" not in api.texts(CHAT)

    gate.touch()
    bot = await _start(tmp_path, env)
    try:
        await api.wait_for_message(lambda m: "finished: slow but parked" in m.text)
        bot.signal()
        code = await bot.exit_code()
    finally:
        await bot.kill()
    assert code == 0, bot.log
    assert _agent_prompts(tmp_path)[-1] == "slow but parked"
    assert api.token not in bot.log


async def test_a_write_cancelled_by_a_shutdown_never_wedges_the_database(database: Any) -> None:
    """Parking cancels tasks wherever they are, also inside ``BEGIN IMMEDIATE`` (or a pooled
    PostgreSQL connection's transaction).

    Found by the park test above: a cancelled BEGIN left the connection inside a
    transaction and every later write failed, so the bot exited 1.
    """
    db = database
    await db.execute("CREATE TABLE t (x INTEGER)")
    for i in range(50):
        task = asyncio.create_task(db.execute("INSERT INTO t VALUES (?)", (i,)))
        for _ in range(i % 5):  # cancel at every point of the transaction's life
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await db.execute("INSERT INTO t VALUES (-1)")
    row = await db.fetchone("SELECT count(*) FROM t WHERE x = -1")
    assert row is not None
    assert row[0] == 50


def _dotenv(root: Path, **values: str) -> None:
    """``cp .env.example .env``, then set ``values`` the way a user edits the file."""
    lines = (ROOT / ".env.example").read_text().splitlines()
    for key, value in values.items():
        name = f"TURNSTILE_{key.upper()}"
        found = [i for i, line in enumerate(lines) if line.startswith(f"{name}=")]
        assert found, name
        lines[found[0]] = f"{name}={value}"
    (root / ".env").write_text("\n".join(lines) + "\n")


@pytest.mark.timeout(180)
async def test_readme_quick_start_from_env_example_to_an_answer(
    tmp_path: Path, api: FakeBotApi, gate: Path
) -> None:
    """The README's quick start, step by step, with only .env edited (no TURNSTILE_ env)."""
    env = {k: v for k, v in _env(tmp_path, api).items() if not k.startswith("TURNSTILE_")}
    env.update(UNCONFINED)  # the fake agent's script lies beside the database
    command = f"{sys.executable} {FAKE_AGENT} --session {{session_id}} --prompt {{prompt}}"
    # Steps 1-3: a token (and, here, the fake server's URL) in .env; the lists stay empty.
    first = {"telegram_token": api.token, "telegram_base_url": api.base_url}
    _dotenv(tmp_path, **first)
    bot = await _start(tmp_path, env)
    try:
        # Step 4: a private message; the refusal tells the id. A group is ignored.
        api.push_message(chat_id=-1009, user_id=777, text="/help")
        api.push_message(chat_id=777, user_id=777, text="/help")
        reply = await api.wait_for_message(lambda m: m.chat_id == 777)
        bot.signal()
        code = await bot.exit_code()
    finally:
        await bot.kill()
    assert code == 0, bot.log
    assert "Your Telegram user id is 777" in reply.text
    assert api.texts(-1009) == []

    # Step 5: allow yourself; step 6: an agent (the scripted fake, as a command agent).
    _dotenv(
        tmp_path,
        **first,
        admins="777",
        allowed_chats="777",
        default_agent="command",
        agent_command=command,
    )
    # Step 7: the doctor passes.
    doctor = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "engine.cli",
        "doctor",
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await doctor.communicate()
    assert doctor.returncode == 0, out.decode() + err.decode()
    assert "0 failed" in out.decode()
    # Step 8: /chat, a question, an answer.
    bot = await _start(tmp_path, env)
    try:
        api.push_message(chat_id=777, user_id=777, text="/chat")
        await api.wait_for_message(lambda m: "bound to" in m.text)
        api.push_message(chat_id=777, user_id=777, text="what is this repository?")
        answer = await api.wait_for_message(lambda m: m.text.startswith("echo: "))
        bot.signal()
        code = await bot.exit_code()
    finally:
        await bot.kill()
    assert code == 0, bot.log
    assert answer.text == "echo: what is this repository?"
    assert api.token not in bot.log


async def _free_port() -> int:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    server.close()
    await server.wait_closed()
    return port


@pytest.mark.timeout(120)
async def test_webhook_mode_behind_a_proxy_path_and_sigterm(
    tmp_path: Path, api: FakeBotApi, gate: Path
) -> None:
    """docs/deploy.md: the listener serves the URL's path on LISTEN:PORT, checks the secret."""
    port = await _free_port()
    secret = "s3cret-for-the-proxy-0123456789"
    env = _env(
        tmp_path,
        api,
        TURNSTILE_WEBHOOK_URL="https://bot.example.org/telegram/webhook",
        TURNSTILE_WEBHOOK_SECRET=secret,
        TURNSTILE_WEBHOOK_LISTEN="127.0.0.1",
        TURNSTILE_WEBHOOK_PORT=str(port),
    )
    hook = f"http://127.0.0.1:{port}/telegram/webhook"
    bot = await _start(tmp_path, env, mode="webhook")
    try:
        assert api.webhook is not None
        assert api.webhook["url"] == "https://bot.example.org/telegram/webhook"
        assert api.webhook["secret_token"] == secret
        update = {
            "update_id": 501,
            "message": api.message_payload(chat_id=CHAT, user_id=OPERATOR, text="/chat"),
        }
        async with httpx.AsyncClient() as client:
            refused = await client.post(hook, json=update)
            wrong = await client.post(
                hook, json=update, headers={"X-Telegram-Bot-Api-Secret-Token": "nope"}
            )
            other_path = await client.post(
                f"http://127.0.0.1:{port}/",
                json=update,
                headers={"X-Telegram-Bot-Api-Secret-Token": secret},
            )
            accepted = await client.post(
                hook, json=update, headers={"X-Telegram-Bot-Api-Secret-Token": secret}
            )
        assert (refused.status_code, wrong.status_code) == (403, 403)
        assert other_path.status_code == 404
        assert accepted.status_code == 200
        await api.wait_for_message(lambda m: "bound to" in m.text)
        bot.signal()
        code = await bot.exit_code()
    finally:
        await bot.kill()
    assert code == 0, bot.log
    assert secret not in bot.log
    assert api.token not in bot.log
    with pytest.raises(httpx.ConnectError):  # the listener is gone
        async with httpx.AsyncClient() as client:
            await client.post(hook, json={})

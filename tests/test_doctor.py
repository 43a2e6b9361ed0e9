"""``turnstile doctor`` against a loopback Bot API server, real files and real processes."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from bot.doctor import check_bot_api, check_settings
from engine.commands.doctor import (
    Check,
    Status,
    check_agents,
    check_credentials,
    check_database,
    check_paths,
    check_setting_names,
    render,
    run_checks,
)
from engine.settings import Settings
from engine.store import Database
from tests.agent_clis import ensure_cli
from tests.fakes.bot_api import TOKEN as FAKE_API_TOKEN
from tests.fakes.bot_api import FakeBotApi
from tests.pg_support import PASSWORD, PASSWORD_ROLE, PgCluster
from tests.support import clean_env, make_settings

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "123456789:AAEhBOweik6ad9r_QXMENQjcrGbqCr4K-Jc"


class EchoingProxy:
    """A broken Bot API front that echoes the request path (token included) in its error."""

    def __init__(self) -> None:
        self.base_url = ""

    async def handle(self, request: web.Request) -> web.Response:
        token = request.match_info["token"]
        method = request.match_info["method"]
        return web.json_response(
            {"ok": False, "description": f"Bad Request: /bot{token}/{method} failed"},
            status=400,
        )


@pytest.fixture
async def bot_api() -> AsyncIterator[FakeBotApi]:
    async with FakeBotApi(token=TOKEN, username="fake_bot") as api:
        yield api


@pytest.fixture
async def echoing_proxy() -> AsyncIterator[EchoingProxy]:
    fake = EchoingProxy()
    app = web.Application()
    app.router.add_post("/bot{token}/{method}", fake.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.base_url = f"http://127.0.0.1:{runner.addresses[0][1]}/bot"
    try:
        yield fake
    finally:
        await runner.cleanup()


def _fake_cli(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _settings(tmp_path: Path, **overrides: object) -> Settings:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    codex = _fake_cli(bin_dir, "codex", 'echo "codex-cli 0.171.0"')
    values: dict[str, object] = {
        "telegram_token": TOKEN,
        "allowed_chats": (-1001,),
        "admins": (42,),
        "database": tmp_path / "data" / "turnstile.db",
        "tasks_root": tmp_path / "tasks",
        "workspaces": tmp_path / "workspaces",
        "runs_dir": tmp_path / "runs",
        "default_agent": "codex",
        "codex_bin": str(codex),
        "claude_bin": str(tmp_path / "missing" / "claude"),
        "copilot_bin": str(tmp_path / "missing" / "copilot"),
    }
    values.update(overrides)
    return make_settings(tmp_path, **values)


def _env(tmp_path: Path, base_url: str, token: str = TOKEN) -> dict[str, str]:
    env = clean_env()
    codex = _fake_cli(tmp_path, "codex", 'echo "codex-cli 0.171.0"')
    env.update(
        TURNSTILE_TELEGRAM_TOKEN=token,
        TURNSTILE_TELEGRAM_BASE_URL=base_url,
        TURNSTILE_ALLOWED_CHATS="-1001",
        TURNSTILE_ADMINS="42",
        TURNSTILE_OPERATORS="43, 44",
        TURNSTILE_DATABASE=str(tmp_path / "turnstile.db"),
        TURNSTILE_DEFAULT_AGENT="codex",
        TURNSTILE_CODEX_BIN=str(codex),
        TURNSTILE_CLAUDE_BIN=str(tmp_path / "nowhere" / "claude"),
        TURNSTILE_COPILOT_BIN=str(tmp_path / "nowhere" / "copilot"),
        PYTHONPATH=str(ROOT),
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    return env


async def _doctor(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "engine.cli",
        "doctor",
        *args,
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _line(out: str, name: str) -> str:
    for line in out.splitlines():
        if line[6:].startswith(name + " "):
            return line
    raise AssertionError(f"no {name!r} line in:\n{out}")


async def test_healthy_setup_passes_and_names_the_bot(tmp_path: Path, bot_api: FakeBotApi) -> None:
    async with Database(tmp_path / "turnstile.db"):
        pass
    code, out, err = await _doctor(tmp_path, _env(tmp_path, bot_api.base_url))
    assert code == 0, out + err
    assert _line(out, "bot api").startswith("ok")
    assert "@fake_bot via 127.0.0.1" in out
    assert "codex-cli 0.171.0" in _line(out, "agent codex")
    assert _line(out, "database").startswith("ok")
    assert _line(out, "agent claude").startswith("warn")
    assert "0 failed" in out.splitlines()[-1]
    assert [c.method for c in bot_api.calls] == ["getMe"]
    assert TOKEN not in out + err
    assert TOKEN.split(":")[1] not in out + err


async def test_wrong_token_fails_with_the_fix_and_exit_1(
    tmp_path: Path, bot_api: FakeBotApi
) -> None:
    other = "987654321:ZZEhBOweik6ad9r_QXMENQjcrGbqCr4K-Jc"
    code, out, err = await _doctor(tmp_path, _env(tmp_path, bot_api.base_url, token=other))
    assert code == 1
    line = _line(out, "bot api")
    assert line.startswith("FAIL")
    assert "rejected the token (401)" in line
    assert "BotFather" in line
    assert other not in out + err


async def test_offline_skips_the_bot_api(tmp_path: Path, bot_api: FakeBotApi) -> None:
    code, out, _ = await _doctor(tmp_path, _env(tmp_path, bot_api.base_url), "--offline")
    assert code == 0, out
    assert "bot api" not in out
    assert bot_api.calls == []  # the fake records only calls with the right token


async def test_echoed_token_in_an_error_is_redacted(
    tmp_path: Path, echoing_proxy: EchoingProxy
) -> None:
    check = await check_bot_api(_settings(tmp_path, telegram_base_url=echoing_proxy.base_url))
    assert check.status is Status.FAIL
    assert "answered getMe with 400" in check.detail
    assert TOKEN not in render(check)
    assert "[REDACTED]" in check.detail


async def test_bot_api_server_error_fails(tmp_path: Path, bot_api: FakeBotApi) -> None:
    bot_api.fail(["getMe"], 502)
    check = await check_bot_api(_settings(tmp_path, telegram_base_url=bot_api.base_url))
    assert check.status is Status.FAIL
    assert "answered getMe with 502" in check.detail
    assert (
        await check_bot_api(_settings(tmp_path, telegram_base_url=bot_api.base_url))
    ).status is Status.OK


async def test_unreachable_bot_api_fails(tmp_path: Path) -> None:
    # Bind then close: the port is free and nothing listens there.
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    check = await check_bot_api(
        _settings(tmp_path, telegram_base_url=f"http://127.0.0.1:{port}/bot")
    )
    assert check.status is Status.FAIL
    assert "cannot reach 127.0.0.1" in check.detail
    assert check.fix is not None
    assert "TURNSTILE_TELEGRAM_BASE_URL" in check.fix


async def test_base_url_with_token_placeholder(tmp_path: Path, bot_api: FakeBotApi) -> None:
    base = bot_api.base_url + "{token}"
    check = await check_bot_api(_settings(tmp_path, telegram_base_url=base))
    assert check.status is Status.OK, check


def test_empty_settings_fail_each_with_a_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a developer's own .env must not change the finding
    settings = _settings(tmp_path, telegram_token=None, allowed_chats=(), admins=())
    checks = {c.name: c for c in check_settings(settings)}
    for name in ("bot token", "allowed chats", "people"):
        assert checks[name].status is Status.FAIL, checks[name]
        assert checks[name].fix
        assert "-> fix:" in render(checks[name])
    assert "TURNSTILE_ALLOWED_CHATS" in checks["allowed chats"].detail
    assert "there is no .env in" in checks["bot token"].detail


async def test_missing_env_file_is_named(tmp_path: Path) -> None:
    env = clean_env()
    env["PYTHONPATH"] = str(ROOT)
    code, out, _ = await _doctor(tmp_path, env, "--offline")
    assert code == 1
    assert f"there is no .env in {tmp_path}" in _line(out, "bot token")
    (tmp_path / ".env").write_text("TURNSTILE_ADMINS=1\n")
    code, out, _ = await _doctor(tmp_path, env, "--offline")
    assert "no .env" not in _line(out, "bot token")
    assert _line(out, "people").startswith("ok")  # read from that .env


@pytest.mark.parametrize(
    ("token", "status"),
    [
        (TOKEN, Status.OK),
        ("123456789", Status.FAIL),
        ("bot123456789:AAEhBOweik6ad9r_QXMENQjcrGbqCr4K-Jc", Status.FAIL),
        ("123456789:short", Status.WARN),  # odd length: the Bot API check judges it
        (FAKE_API_TOKEN, Status.OK),
        ("123456789:with space_abcdefghijklmnopqrstuvwxyz", Status.FAIL),
        ('"123456789:AAEhBOweik6ad9r_QXMENQjcrGbqCr4K-Jc"', Status.FAIL),
    ],
)
def test_token_shape(tmp_path: Path, token: str, status: Status) -> None:
    checks = {c.name: c for c in check_settings(_settings(tmp_path, telegram_token=token))}
    assert checks["bot token"].status is status
    assert token not in render(checks["bot token"])


def test_operators_without_approvers_warn(tmp_path: Path) -> None:
    settings = _settings(tmp_path, admins=(), operators=(7,))
    checks = {c.name: c for c in check_settings(settings)}
    assert checks["people"].status is Status.OK
    assert checks["approvers"].status is Status.WARN


@pytest.mark.parametrize(
    ("url", "secret", "status", "words"),
    [
        ("http://bot.example.org/hook", "s3cret-token", Status.FAIL, "https"),
        ("https://bot.example.org/hook", None, Status.FAIL, "WEBHOOK_SECRET is not set"),
        ("https://bot.example.org/hook", "has space", Status.FAIL, "only A-Z"),
        ("https://bot.example.org/hook", "s3cret-token", Status.OK, "webhook at"),
    ],
)
def test_webhook_settings(
    tmp_path: Path, url: str, secret: str | None, status: Status, words: str
) -> None:
    settings = _settings(tmp_path, webhook_url=url, webhook_secret=secret)
    mode = {c.name: c for c in check_settings(settings)}["mode"]
    assert mode.status is status
    assert words in mode.detail
    if secret:
        assert secret not in render(mode)


def test_paths_writable_creatable_or_not(tmp_path: Path) -> None:
    (tmp_path / "tasks").write_text("a file where a folder belongs")
    (tmp_path / "workspaces").mkdir()
    settings = _settings(tmp_path)
    checks = {c.name: c for c in check_paths(settings)}
    assert checks["tasks folder"].status is Status.FAIL
    assert "is not a folder" in checks["tasks folder"].detail
    assert checks["workspaces"].status is Status.OK
    assert "writable" in checks["workspaces"].detail
    assert checks["runs folder"].status is Status.OK
    assert "will be created" in checks["runs folder"].detail
    assert not (tmp_path / "runs").exists()
    assert list((tmp_path / "workspaces").iterdir()) == []


async def test_database_states(tmp_path: Path) -> None:
    path = tmp_path / "db" / "turnstile.db"
    missing = await check_database(path)
    assert missing.status is Status.WARN
    assert not path.exists()

    path.parent.mkdir()
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE legacy (x)")
    behind = await check_database(path)
    assert behind.status is Status.FAIL
    assert "schema version 0" in behind.detail
    assert behind.fix is not None
    assert "--migrate" in behind.fix

    migrated = await check_database(path, migrate=True)
    assert migrated.status is Status.OK
    assert (await check_database(path)).status is Status.OK

    latest = Database(path).latest_version
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {latest + 5}")
    newer = await check_database(path)
    assert newer.status is Status.FAIL
    assert "newer than this turnstile" in newer.detail

    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 100)
    broken = await check_database(garbage)
    assert broken.status is Status.FAIL


async def test_agent_cli_found_missing_or_broken(tmp_path: Path) -> None:
    bad = _fake_cli(tmp_path, "copilot", "echo 'needs login' >&2; exit 3")
    settings = _settings(
        tmp_path, default_agent="claude", copilot_bin=str(bad), agent_command="no-such-agent -p"
    )
    checks = {c.name: c for c in await check_agents(settings)}
    assert checks["agent claude"].status is Status.FAIL  # the default agent is missing
    assert "npm install" in (checks["agent claude"].fix or "")
    assert checks["agent copilot"].status is Status.FAIL
    assert "--version exited with code 3: needs login" in checks["agent copilot"].detail
    assert checks["agent codex"].status is Status.OK
    assert "codex-cli 0.171.0" in checks["agent codex"].detail
    assert checks["agent command"].status is Status.FAIL
    assert "'no-such-agent' not found" in checks["agent command"].detail


async def test_command_agent_found(tmp_path: Path) -> None:
    template = f"{sys.executable} tests/fake_agent.py --session {{session_id}} --prompt {{prompt}}"
    settings = _settings(tmp_path, default_agent="command", agent_command=template)
    checks = {c.name: c for c in await check_agents(settings)}
    assert checks["agent command"].status is Status.OK
    assert checks["agent claude"].status is Status.WARN


async def test_env_example_copied_as_is_gives_the_readme_first_run(tmp_path: Path) -> None:
    """README command 1 on a fresh machine: `cp -n .env.example .env`, then `turnstile bot`."""
    (tmp_path / ".env").write_text((ROOT / ".env.example").read_text())
    env = clean_env()
    env["PYTHONPATH"] = str(ROOT)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "engine.cli",
        "bot",
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    assert proc.returncode == 2
    assert "invalid settings" not in err.decode()
    assert "TURNSTILE_TELEGRAM_TOKEN is not set: put the token BotFather gave you in .env" in (
        err.decode()
    )
    code, out, err_text = await _doctor(tmp_path, env, "--offline")
    assert code == 1, out + err_text
    assert _line(out, "bot token").startswith("FAIL")
    assert "no .env" not in out


def test_agent_credentials(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env_file = tmp_path / ".env"
    env_file.write_text("TURNSTILE_ADMINS=1\nANTHROPIC_API_KEY=sk-ant-in-the-wrong-place\n")
    base = {"HOME": str(home)}

    found = check_credentials("claude", {**base, "ANTHROPIC_API_KEY": "sk-ant-secret"}, env_file)
    assert found.status is Status.OK
    assert found.detail == "ANTHROPIC_API_KEY is set"
    assert "sk-ant-secret" not in render(found)

    slip = check_credentials("claude", base, env_file)
    assert slip.status is Status.WARN
    assert "is in .env, but .env only sets TURNSTILE_ settings" in slip.detail
    assert "sk-ant-in-the-wrong-place" not in render(slip)

    nothing = check_credentials("codex", base, env_file)
    assert nothing.status is Status.WARN
    assert "CODEX_API_KEY" in nothing.detail
    (home / ".codex").mkdir()
    (home / ".codex" / "auth.json").write_text("{}")
    assert check_credentials("codex", base, env_file).status is Status.OK

    config = tmp_path / "claude-config"
    config.mkdir()
    (config / ".credentials.json").write_text("{}")
    saved = check_credentials("claude", {**base, "CLAUDE_CONFIG_DIR": str(config)}, env_file)
    assert saved.status is Status.OK
    assert "saved login" in saved.detail
    assert check_credentials("copilot", {**base, "GH_TOKEN": "x"}, env_file).status is Status.OK


class WebhookInfoServer:
    """getMe plus getWebhookInfo with a state the test sets."""

    def __init__(self) -> None:
        self.info: dict[str, object] = {"url": "", "pending_update_count": 0}
        self.base_url = ""

    async def handle(self, request: web.Request) -> web.Response:
        if request.match_info["token"] != TOKEN:
            return web.json_response({"ok": False, "description": "Unauthorized"}, status=401)
        if request.match_info["method"] == "getMe":
            user = {"id": 1, "is_bot": True, "first_name": "F", "username": "fake_bot"}
            return web.json_response({"ok": True, "result": user})
        return web.json_response({"ok": True, "result": self.info})


@pytest.fixture
async def webhook_api() -> AsyncIterator[WebhookInfoServer]:
    fake = WebhookInfoServer()
    app = web.Application()
    app.router.add_post("/bot{token}/{method}", fake.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.base_url = f"http://127.0.0.1:{runner.addresses[0][1]}/bot"
    try:
        yield fake
    finally:
        await runner.cleanup()


async def test_webhook_delivery_state(tmp_path: Path, webhook_api: WebhookInfoServer) -> None:
    url = "https://bot.example.org/telegram/webhook"
    settings = _settings(
        tmp_path,
        telegram_base_url=webhook_api.base_url,
        webhook_url=url,
        webhook_secret="s3cret-token",
    )

    async def webhook_line() -> Check:
        checks = {c.name: c for c in await run_checks(settings)}
        assert checks["bot api"].status is Status.OK
        return checks["webhook"]

    assert (await webhook_line()).status is Status.WARN  # not registered yet
    webhook_api.info = {"url": "https://elsewhere.example.org/x", "pending_update_count": 0}
    other = await webhook_line()
    assert other.status is Status.WARN
    assert "elsewhere.example.org" in other.detail
    webhook_api.info = {
        "url": url,
        "pending_update_count": 7,
        "last_error_date": int(time.time()) - 120,
        "last_error_message": "Wrong response from the webhook: 502 Bad Gateway",
    }
    failing = await webhook_line()
    assert failing.status is Status.FAIL
    assert "2 min ago: Wrong response from the webhook: 502 Bad Gateway" in failing.detail
    assert "7 update(s) waiting" in failing.detail
    webhook_api.info["last_error_date"] = int(time.time()) - 7200  # long recovered
    assert (await webhook_line()).status is Status.OK
    polling = _settings(tmp_path, telegram_base_url=webhook_api.base_url)
    assert "webhook" not in {c.name for c in await run_checks(polling)}


@pytest.mark.realcli
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("agent", "version_text"),
    [("claude", "2.1.197 (Claude Code)"), ("copilot", "1.0.102"), ("codex", "codex-cli 0.171.0")],
)
async def test_real_agent_clis_are_found_with_their_versions(
    tmp_path: Path, agent: str, version_text: str
) -> None:
    binary = ensure_cli(agent)
    settings = _settings(tmp_path, default_agent=agent, **{f"{agent}_bin": str(binary)})
    checks = {c.name: c for c in await check_agents(settings)}
    assert checks[f"agent {agent}"].status is Status.OK, checks[f"agent {agent}"]
    assert version_text in checks[f"agent {agent}"].detail
    assert f"{agent} key" in checks


class _RecordingFront:
    """A front end of the test's own: one settings check and one network check."""

    def __init__(self) -> None:
        self.network_calls = 0

    def settings_checks(self, settings: Settings) -> list[Check]:
        return [Check("front setting", Status.OK, "fine")]

    async def network_checks(self, settings: Settings, *, transport: object = None) -> list[Check]:
        self.network_calls += 1
        return [Check("front network", Status.WARN, "slow")]


async def test_front_end_checks_are_discovered_not_built_in(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    # Registered through the entry point: the bot's checks, found without the engine naming it.
    names = [c.name for c in await run_checks(settings, network=False)]
    assert names[:4] == ["bot token", "allowed chats", "people", "mode"]
    # Without a front end the engine's doctor has no Telegram check at all.
    bare = [c.name for c in await run_checks(settings, network=True, front_ends=[])]
    assert bare[0] in ("setting names", "unknown setting")  # the engine's own first check
    assert "database folder" in bare
    assert not {"bot token", "allowed chats", "people", "mode", "bot api"} & set(bare)
    front = _RecordingFront()
    ordered = [c.name for c in await run_checks(settings, network=True, front_ends=[front])]
    assert ordered[0] == "front setting"
    assert ordered[-1] == "front network"
    assert front.network_calls == 1
    await run_checks(settings, network=False, front_ends=[front])
    assert front.network_calls == 1  # --offline skips a front end's network checks


@pytest.mark.parametrize("token", [FAKE_API_TOKEN, "123456:test-token"])
async def test_token_shape_agrees_with_the_bot_api(tmp_path: Path, token: str) -> None:
    async with FakeBotApi(token=token, username="fake_bot") as api:
        code, out, err = await _doctor(tmp_path, _env(tmp_path, api.base_url, token=token))
    assert _line(out, "bot api").startswith("ok"), out
    assert not _line(out, "bot token").startswith("FAIL"), out
    assert code == 0, out + err
    assert token not in out + err


async def test_misspelled_settings_are_named_with_the_closest_name(tmp_path: Path) -> None:
    env = _env(tmp_path, "http://127.0.0.1:9/bot")
    env["TURNSTILE_ALLOWED_CHAT"] = "-1001"
    env["TURNSTILE_WHATEVER_ZZZ"] = "1"
    (tmp_path / ".env").write_text("# comment\nTURNSTILE_DEFAULT_AGNET=codex\nOTHER=1\n")
    code, out, _ = await _doctor(tmp_path, env, "--offline")
    unknown = [line for line in out.splitlines() if line[6:].startswith("unknown setting ")]
    assert len(unknown) == 3, out
    by_name = {next(w for w in x.split() if w.startswith("TURNSTILE_")): x for x in unknown}
    assert "(in the environment)" in by_name["TURNSTILE_ALLOWED_CHAT"]
    assert "did you mean TURNSTILE_ALLOWED_CHATS?" in by_name["TURNSTILE_ALLOWED_CHAT"]
    assert "(in the .env)" in by_name["TURNSTILE_DEFAULT_AGNET"]
    assert "did you mean TURNSTILE_DEFAULT_AGENT?" in by_name["TURNSTILE_DEFAULT_AGNET"]
    assert "no setting has a similar name" in by_name["TURNSTILE_WHATEVER_ZZZ"]
    assert all(line.startswith("warn") for line in unknown)
    assert code == 0  # a hint, not a failure


def test_known_and_internal_names_are_not_reported(tmp_path: Path) -> None:
    environ = {
        "TURNSTILE_ALLOWED_CHATS": "1",
        "turnstile_admins": "2",  # settings names are matched regardless of case
        "TURNSTILE_TURN_ID": "x",
        "PATH": "/bin",
    }
    (checks,) = check_setting_names(environ, tmp_path / "missing.env")
    assert checks.status is Status.OK
    assert checks.detail == "all 3 TURNSTILE_ variables are settings"


async def test_doctor_on_a_postgres_url_shows_the_server_and_migrates_on_request(
    tmp_path: Path, pg_cluster: PgCluster
) -> None:
    pg_cluster.admin(f'CREATE DATABASE doctor_pw OWNER "{PASSWORD_ROLE}" TEMPLATE template0')
    env = _env(tmp_path, "http://127.0.0.1:9/bot")
    env["TURNSTILE_DATABASE"] = pg_cluster.url("doctor_pw", user=PASSWORD_ROLE, password=PASSWORD)
    code, out, err = await _doctor(tmp_path, env, "--offline")
    line = _line(out, "database")
    assert line.startswith("FAIL"), out
    assert "PostgreSQL 1" in line
    assert "pending" in line
    assert PASSWORD not in out + err
    # Hidden twice: the URL shows no password, and the doctor's redactor masks URL credentials.
    assert f"{PASSWORD_ROLE}:[REDACTED]@127.0.0.1" in line
    assert "database folder" not in out  # a server has no folder here
    code, out, err = await _doctor(tmp_path, env, "--offline", "--migrate")
    assert _line(out, "database").startswith("ok"), out + err
    assert "no migration pending" in _line(out, "database")
    assert PASSWORD not in out + err
    env["TURNSTILE_DATABASE"] = pg_cluster.url("doctor_pw", user=PASSWORD_ROLE, password="nope-x")
    code, out, err = await _doctor(tmp_path, env, "--offline")
    assert code == 1
    assert "password authentication failed" in _line(out, "database")
    assert "nope-x" not in out + err

"""``turnstile doctor``: check the set-up, one line per check, each failure with its fix.

Checks the settings (token shape, allowlists, webhook), the paths (writable), the database
(reachable, migrated), each agent CLI (found, ``--version``, a key) and the Bot API
(``getMe`` through the configured base URL; in webhook mode also ``getWebhookInfo``).
Exits 1 when any check fails. The token is never printed: every line goes through a
redactor that knows it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TextIO

import httpx

from engine.agents.command import parse_template
from engine.agents.factory import turn_mode
from engine.errors import ConfigError, StoreError
from engine.redact import Redactor
from engine.settings import Settings
from engine.store import Database

__all__ = [
    "Check",
    "Status",
    "check_credentials",
    "check_webhook_delivery",
    "register",
    "render",
    "run_checks",
]

_TOKEN_SHAPE = re.compile(r"^\d{5,16}:[A-Za-z0-9_-]{30,64}$")
_SECRET_SHAPE = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
VERSION_TIMEOUT = 20.0
HTTP_TIMEOUT = 10.0
_FIX_ENV = "put it in .env (copy .env.example) or the service's environment"


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "FAIL"


@dataclass(frozen=True, slots=True)
class Check:
    """The outcome of one check: what was checked, what was found, and how to fix it."""

    name: str
    status: Status
    detail: str
    fix: str | None = None


def _ok(name: str, detail: str) -> Check:
    return Check(name, Status.OK, detail)


def _warn(name: str, detail: str, fix: str | None = None) -> Check:
    return Check(name, Status.WARN, detail, fix)


def _fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, Status.FAIL, detail, fix)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check settings, paths, database, agent CLIs and the Bot API",
        description=(
            "Check the set-up and print one line per check; a failed check says how to "
            "fix it. Exits 1 when any check fails."
        ),
    )
    parser.add_argument(
        "--offline", action="store_true", help="skip the Bot API check (no network)"
    )
    parser.add_argument(
        "--migrate",
        action="store_true",
        help="create the database or apply pending migrations before checking it",
    )
    parser.set_defaults(handler=run_doctor)


async def run_doctor(args: argparse.Namespace, settings: Settings) -> int:
    checks = await run_checks(settings, network=not args.offline, migrate=args.migrate)
    return report(checks, settings, sys.stdout)


def report(checks: Iterable[Check], settings: Settings, out: TextIO) -> int:
    """Print ``checks`` (redacted) and a summary; return the exit code."""
    redactor = Redactor(_secrets(settings))
    counts = dict.fromkeys(Status, 0)
    for check in checks:
        counts[check.status] += 1
        print(redactor(render(check)), file=out)
    failed = counts[Status.FAIL]
    print(
        f"{sum(counts.values())} checks: {counts[Status.OK]} ok, "
        f"{counts[Status.WARN]} warnings, {failed} failed",
        file=out,
    )
    return 1 if failed else 0


def render(check: Check) -> str:
    """One line: status, name, what was found, and the fix when there is one."""
    # No colon after the name: "token: X" would read as a credential to the redactor.
    line = f"{check.status.value:<4}  {check.name:<16} {check.detail}"
    if check.fix and check.status is not Status.OK:
        line += f" -> fix: {check.fix}"
    return line


def _secrets(settings: Settings) -> tuple[str, ...]:
    return tuple(
        s.get_secret_value()
        for s in (settings.telegram_token, settings.webhook_secret)
        if s is not None and s.get_secret_value()
    )


async def run_checks(
    settings: Settings,
    *,
    network: bool = True,
    migrate: bool = False,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[Check]:
    """Run every check in a fixed order and return their outcomes."""
    checks = [
        *check_settings(settings),
        *check_paths(settings),
        await check_database(settings.database, migrate=migrate),
        *await check_agents(settings),
    ]
    if network:
        api = await check_bot_api(settings, transport=transport)
        checks.append(api)
        if api.status is Status.OK and settings.webhook_url:
            checks.append(await check_webhook_delivery(settings, transport=transport))
    return checks


# --- settings ------------------------------------------------------------------------


def check_settings(settings: Settings) -> list[Check]:
    """Token shape, allowlists and webhook settings; nothing leaves the process."""
    checks: list[Check] = []
    token = settings.telegram_token.get_secret_value() if settings.telegram_token else ""
    if not token:
        where = "" if Path(".env").is_file() else f" (and there is no .env in {Path.cwd()})"
        checks.append(
            _fail(
                "bot token",
                "TURNSTILE_TELEGRAM_TOKEN is not set" + where,
                "create a bot with @BotFather (/newbot) and " + _FIX_ENV,
            )
        )
    elif not _TOKEN_SHAPE.match(token.strip()):
        checks.append(
            _fail(
                "bot token",
                "TURNSTILE_TELEGRAM_TOKEN does not look like a bot token "
                "(digits, a colon, then 35 or so letters)",
                "copy it again from @BotFather (/mybots -> API Token), without quotes or spaces",
            )
        )
    else:
        checks.append(_ok("bot token", "set, looks like a bot token"))

    if settings.allowed_chats:
        checks.append(_ok("allowed chats", f"{len(settings.allowed_chats)} chat(s)"))
    else:
        checks.append(
            _fail(
                "allowed chats",
                "TURNSTILE_ALLOWED_CHATS is empty: the bot ignores every chat",
                "add your group's id (negative, e.g. -1001234567890) or your own user id "
                "for a private chat, comma separated",
            )
        )
    people = set(settings.admins) | set(settings.operators)
    if people:
        checks.append(
            _ok(
                "people",
                f"{len(settings.admins)} admin(s), {len(settings.operators)} operator(s), "
                f"{len(settings.approvers)} approver(s)",
            )
        )
    else:
        checks.append(
            _fail(
                "people",
                "TURNSTILE_ADMINS and TURNSTILE_OPERATORS are empty: nobody may use the bot",
                "add your numeric user id to TURNSTILE_ADMINS (the bot's refusal message "
                "tells it, so does @userinfobot)",
            )
        )
    if people and not (set(settings.admins) | set(settings.approvers)):
        checks.append(
            _warn(
                "approvers",
                "no admin or approver: nobody can approve a gate",
                "add a user id to TURNSTILE_APPROVERS or TURNSTILE_ADMINS",
            )
        )
    checks.append(_check_webhook(settings))
    return checks


def _check_webhook(settings: Settings) -> Check:
    if not settings.webhook_url:
        if "api.telegram.org" not in settings.telegram_base_url:
            return _ok("mode", f"long polling via a custom Bot API server ({_host(settings)})")
        return _ok("mode", "long polling (no public URL needed)")
    url = httpx.URL(settings.webhook_url)
    secret = settings.webhook_secret.get_secret_value() if settings.webhook_secret else ""
    if url.scheme != "https":
        return _fail(
            "mode",
            "webhook: TURNSTILE_WEBHOOK_URL must be an https:// URL",
            "put a reverse proxy with a certificate in front (docs/deploy.md)",
        )
    if not secret:
        return _fail(
            "mode",
            "webhook: TURNSTILE_WEBHOOK_SECRET is not set",
            "set 1-256 characters of A-Z a-z 0-9 _ - (e.g. `openssl rand -hex 32`)",
        )
    if not _SECRET_SHAPE.match(secret):
        return _fail(
            "mode",
            "webhook: TURNSTILE_WEBHOOK_SECRET may hold only A-Z a-z 0-9 _ - (1-256 chars)",
            "generate one with `openssl rand -hex 32`",
        )
    return _ok(
        "mode",
        f"webhook at {url.host}{url.path}, listening on "
        f"{settings.webhook_listen}:{settings.webhook_port}",
    )


def _host(settings: Settings) -> str:
    try:
        return httpx.URL(settings.telegram_base_url).host or settings.telegram_base_url
    except httpx.InvalidURL:
        return "an invalid URL"


# --- paths ---------------------------------------------------------------------------


def check_paths(settings: Settings) -> list[Check]:
    """Every folder turnstile writes to exists and is writable, or can be created."""
    folders = {
        "database folder": (settings.database.parent, "TURNSTILE_DATABASE"),
        "tasks folder": (settings.tasks_root, "TURNSTILE_TASKS_ROOT"),
        "workspaces": (settings.workspaces, "TURNSTILE_WORKSPACES"),
        "runs folder": (settings.runs_dir, "TURNSTILE_RUNS_DIR"),
    }
    return [_check_folder(name, path, setting) for name, (path, setting) in folders.items()]


def _check_folder(name: str, path: Path, setting: str) -> Check:
    shown = str(path.absolute())
    if path.exists():
        if not path.is_dir():
            return _fail(name, f"{shown} is not a folder", f"point {setting} somewhere else")
        problem = _try_write(path)
        if problem is None:
            return _ok(name, f"{shown} is writable")
        return _fail(
            name,
            f"{shown} is not writable ({problem})",
            f"`chown` it to the user running turnstile, or point {setting} elsewhere "
            "(under systemd: add it to ReadWritePaths)",
        )
    ancestor = path.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if ancestor.is_dir() and os.access(ancestor, os.W_OK | os.X_OK):
        return _ok(name, f"{shown} will be created")
    return _fail(
        name,
        f"{shown} does not exist and {ancestor} is not writable",
        f"create it (`mkdir -p {shown}`) for the user running turnstile, or change {setting}",
    )


def _try_write(folder: Path) -> str | None:
    # os.access says yes to root on a read-only mount; only a real write tells.
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".turnstile-doctor-"):
            pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


# --- database ------------------------------------------------------------------------


async def check_database(path: Path, *, migrate: bool = False) -> Check:
    """The database opens and is at the latest schema version (never changed unless asked)."""
    name = "database"
    latest = Database(path).latest_version
    if migrate:
        try:
            async with Database(path) as db:
                version = await db.schema_version()
        except (StoreError, sqlite3.Error, OSError) as exc:
            return _fail(name, f"cannot open {path}: {exc}", "check the path and permissions")
        return _compare(name, path, version, latest)
    if not await asyncio.to_thread(path.exists):
        return _warn(
            name,
            f"{path} does not exist yet",
            "it is created on the first start, or now with `turnstile doctor --migrate`",
        )
    try:
        version = await asyncio.to_thread(_read_version, path)
    except sqlite3.Error as exc:
        return _fail(
            name,
            f"cannot read {path}: {exc}",
            "is it a turnstile database? restore one with your last `turnstile backup` copy",
        )
    return _compare(name, path, version, latest)


def _compare(name: str, path: Path, version: int, latest: int) -> Check:
    if version == latest:
        return _ok(name, f"{path} at schema version {version} (latest)")
    if version < latest:
        return _fail(
            name,
            f"{path} at schema version {version}, this turnstile needs {latest}",
            "back it up (`turnstile backup FILE`), then `turnstile doctor --migrate` "
            "(the bot also migrates on start)",
        )
    return _fail(
        name,
        f"{path} at schema version {version}, newer than this turnstile ({latest})",
        "upgrade turnstile (`git pull && pip install -e .`) or restore an older backup",
    )


def _read_version(path: Path) -> int:
    # Read-only: the doctor must not create, migrate or lock what the bot is using.
    conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=5.0)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        row = conn.execute("PRAGMA user_version").fetchone()
        return int(row[0])
    finally:
        conn.close()


# --- agents --------------------------------------------------------------------------


async def check_agents(settings: Settings) -> list[Check]:
    """The default agent's CLI must be found; the others are reported when present."""
    binaries = {
        "claude": (settings.claude_bin, "TURNSTILE_CLAUDE_BIN", "@anthropic-ai/claude-code"),
        "copilot": (settings.copilot_bin, "TURNSTILE_COPILOT_BIN", "@github/copilot"),
        "codex": (settings.codex_bin, "TURNSTILE_CODEX_BIN", "@openai/codex"),
    }
    checks: list[Check] = []
    for agent, (binary, setting, package) in binaries.items():
        required = settings.default_agent == agent
        check = await _check_cli(
            f"agent {agent}",
            binary,
            required=required,
            fix=f"`npm install -g {package}` or set {setting} to its path",
        )
        checks.append(check)
        if check.status is Status.OK:
            checks.append(check_credentials(agent, os.environ, Path(".env")))
    if settings.agent_command or settings.default_agent == "command":
        checks.append(await _check_command_agent(settings))
    checks += check_turn_modes(settings)
    return checks


def check_turn_modes(settings: Settings) -> list[Check]:
    """For each agent ``TURNSTILE_WARM_SESSIONS`` names: warm, or why it runs per turn."""
    checks: list[Check] = []
    for agent in settings.warm_sessions:
        mode = turn_mode(agent, settings)
        name = f"{agent} turns"
        if mode.warm:
            checks.append(_ok(name, f"warm: {mode.reason}"))
        else:
            checks.append(_warn(name, f"one process per turn: {mode.reason}"))
    return checks


@dataclass(frozen=True, slots=True)
class _Credentials:
    keys: tuple[str, ...]  # environment variables that carry a key or token
    files: tuple[tuple[str, str], ...]  # (variable naming a config folder, or "", path in it)
    default_dir: str  # the config folder under HOME when the variable is unset
    fix: str


_CREDENTIALS: dict[str, _Credentials] = {
    "claude": _Credentials(
        (
            "ANTHROPIC_API_KEY",
            "CLAUDE_CODE_OAUTH_TOKEN",
            "ANTHROPIC_AUTH_TOKEN",
            "CLAUDE_CODE_USE_BEDROCK",
            "CLAUDE_CODE_USE_VERTEX",
        ),
        (("CLAUDE_CONFIG_DIR", ".credentials.json"),),
        ".claude",
        "export ANTHROPIC_API_KEY (or CLAUDE_CODE_OAUTH_TOKEN from `claude setup-token`)",
    ),
    "copilot": _Credentials(
        ("COPILOT_GITHUB_TOKEN", "GH_TOKEN", "GITHUB_TOKEN", "COPILOT_PROVIDER_API_KEY"),
        (("COPILOT_HOME", "config.json"),),
        ".copilot",
        "export COPILOT_GITHUB_TOKEN (a token of an account with Copilot)",
    ),
    "codex": _Credentials(
        ("CODEX_API_KEY", "OPENAI_API_KEY"),
        (("CODEX_HOME", "auth.json"),),
        ".codex",
        "export CODEX_API_KEY, or run `codex login` as the user turnstile runs as",
    ),
}


def check_credentials(agent: str, environ: Mapping[str, str], env_file: Path) -> Check:
    """Whether ``agent``'s CLI can find a key: in the environment, or a saved login.

    A warning, not a failure: a CLI may have other ways in (a helper, a proxy). The
    classic slip is a key written in ``.env``, which sets turnstile's settings only.
    """
    name = f"{agent} key"
    spec = _CREDENTIALS[agent]
    present = [k for k in spec.keys if environ.get(k)]
    if present:
        return _ok(name, f"{present[0]} is set")
    for variable, filename in spec.files:
        folder = environ.get(variable) or str(Path(environ.get("HOME", "~")) / spec.default_dir)
        path = Path(folder).expanduser() / filename
        if path.is_file():
            return _ok(name, f"saved login in {path}")
    in_env_file = [k for k in spec.keys if k in _env_file_keys(env_file)]
    if in_env_file:
        return _warn(
            name,
            f"{in_env_file[0]} is in .env, but .env only sets TURNSTILE_ settings: "
            f"{agent} never sees it",
            "export it in the environment turnstile runs in (systemd EnvironmentFile, "
            "compose env_file, or your shell)",
        )
    return _warn(name, f"no {' / '.join(spec.keys[:2])} and no saved login", spec.fix)


def _env_file_keys(path: Path) -> set[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return set()
    keys = set()
    for line in lines:
        key, sep, value = line.strip().removeprefix("export ").partition("=")
        if sep and value.strip() and not key.startswith("#"):
            keys.add(key.strip())
    return keys


async def _check_command_agent(settings: Settings) -> Check:
    name = "agent command"
    if not settings.agent_command:
        return _fail(
            name,
            "TURNSTILE_DEFAULT_AGENT=command but TURNSTILE_AGENT_COMMAND is empty",
            "set it, e.g. TURNSTILE_AGENT_COMMAND=my-agent --session {session_id} -p {prompt}",
        )
    try:
        words = parse_template(settings.agent_command)
    except ConfigError as exc:
        return _fail(name, exc.message, "fix TURNSTILE_AGENT_COMMAND")
    found = shutil.which(words[0])
    if found is None:
        return _fail(
            name,
            f"{words[0]!r} not found on PATH",
            "install it or use its full path in TURNSTILE_AGENT_COMMAND",
        )
    # An arbitrary program may not know --version: finding it is the whole check.
    return _ok(name, f"{found}")


async def _check_cli(name: str, binary: str, *, required: bool, fix: str) -> Check:
    found = shutil.which(binary)
    if found is None:
        detail = f"{binary!r} not found on PATH"
        if required:
            return _fail(name, detail + " (it is the default agent)", fix)
        return _warn(name, detail + " (needed only if you use it)", fix)
    version, problem = await _version(found)
    if problem is not None:
        return _fail(name, f"{found} does not run: {problem}", fix)
    return _ok(name, f"{found} {version}")


async def _version(binary: str) -> tuple[str, str | None]:
    """``binary --version``'s first line, or the problem that prevented it."""
    try:
        proc = await asyncio.create_subprocess_exec(
            binary,
            "--version",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        return "", exc.strerror or type(exc).__name__
    try:
        # Not an agent turn: a --version that hangs (a login prompt, a lock) is the finding.
        stdout, stderr = await asyncio.wait_for(proc.communicate(), VERSION_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return "", f"`--version` did not answer within {VERSION_TIMEOUT:.0f} s"
    text = (stdout or stderr).decode("utf-8", errors="replace").strip()
    first = text.splitlines()[0][:120] if text else ""
    if proc.returncode != 0:
        return "", f"`--version` exited {proc.returncode}" + (f": {first}" if first else "")
    return first or "(no version printed)", None


# --- Bot API -------------------------------------------------------------------------


def bot_api_url(settings: Settings, method: str) -> str:
    """The URL python-telegram-bot would call: ``{base}{token}/{method}``, or ``{token}``
    substituted when the base URL contains it."""
    token = settings.telegram_token.get_secret_value() if settings.telegram_token else ""
    base = settings.telegram_base_url
    if "{token}" in base:
        return base.replace("{token}", token) + f"/{method}"
    return f"{base}{token}/{method}"


async def check_bot_api(
    settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None
) -> Check:
    """``getMe`` through the configured base URL: proves the token and the network path."""
    name = "bot api"
    token = settings.telegram_token.get_secret_value() if settings.telegram_token else ""
    if not token:
        return _fail(name, "skipped: no token", "set TURNSTILE_TELEGRAM_TOKEN first")
    redactor = Redactor([token])
    host = _host(settings)
    try:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, transport=transport) as client:
            response = await client.post(bot_api_url(settings, "getMe"))
    except httpx.InvalidURL:
        return _fail(
            name, "TURNSTILE_TELEGRAM_BASE_URL is not a valid URL", "fix it or remove the line"
        )
    except httpx.HTTPError as exc:
        reason = redactor(str(exc)) or type(exc).__name__
        return _fail(
            name,
            f"cannot reach {host}: {reason}",
            "check the network, HTTPS_PROXY and TURNSTILE_TELEGRAM_BASE_URL",
        )
    if response.status_code in (401, 404):
        return _fail(
            name,
            f"{host} rejected the token ({response.status_code})",
            "the token is wrong or was revoked: copy the current one from @BotFather "
            "(/mybots -> API Token)",
        )
    try:
        payload = response.json()
    except ValueError:
        payload = None
    if response.status_code != 200 or not isinstance(payload, dict) or not payload.get("ok"):
        description = payload.get("description") if isinstance(payload, dict) else None
        return _fail(
            name,
            f"{host} answered getMe with {response.status_code}"
            + (f": {redactor(str(description))}" if description else ""),
            "is TURNSTILE_TELEGRAM_BASE_URL a Bot API server (ending in /bot)?",
        )
    me = payload.get("result") or {}
    username = me.get("username") if isinstance(me, dict) else None
    if not username:
        return _fail(name, f"{host} getMe has no username", "is this a Bot API server?")
    return _ok(name, f"@{username} via {host}")


async def check_webhook_delivery(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    now: float | None = None,
) -> Check:
    """``getWebhookInfo``: what Telegram has registered and whether its deliveries fail."""
    name = "webhook"
    token = settings.telegram_token.get_secret_value() if settings.telegram_token else ""
    redactor = Redactor([token, *_secrets(settings)])
    try:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, transport=transport) as client:
            response = await client.post(bot_api_url(settings, "getWebhookInfo"))
        payload = response.json()
        info = payload["result"]
        if response.status_code != 200 or not isinstance(info, dict):
            raise ValueError(response.status_code)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return _warn(name, f"could not read the webhook's state: {redactor(str(exc))}")
    registered = str(info.get("url") or "")
    pending = int(info.get("pending_update_count") or 0)
    if not registered:
        return _warn(name, "no webhook registered yet", "the bot registers it when it starts")
    if registered != settings.webhook_url:
        return _warn(
            name,
            f"Telegram delivers to {registered}, not TURNSTILE_WEBHOOK_URL",
            "the bot registers its own URL when it starts; is another deployment running?",
        )
    error = info.get("last_error_message")
    when = info.get("last_error_date")
    age = (now if now is not None else time.time()) - float(when) if when else None
    if error and age is not None and age < 3600:
        return _fail(
            name,
            f"Telegram's last delivery failed {age / 60:.0f} min ago: "
            f"{redactor(str(error))} ({pending} update(s) waiting)",
            "check that the proxy serves the URL's path with a valid certificate and "
            "forwards it to TURNSTILE_WEBHOOK_LISTEN:PORT (docs/deploy.md)",
        )
    return _ok(name, f"registered, {pending} update(s) waiting")

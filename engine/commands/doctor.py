"""``turnstile doctor``: check the set-up, one line per check, each failure with its fix.

Checks the paths (writable), the database (reachable, migrated) and each agent CLI (found,
``--version``, a key). A front end adds its own checks through the ``turnstile.doctor``
entry-point group (the bot adds its settings and the Bot API that way, so the engine never
knows Telegram): its settings checks come first, its network checks last (skipped with
``--offline``). Exits 1 when any check fails. Secrets are never printed: every line goes
through a redactor that knows them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sqlite3
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol, TextIO

import httpx

from engine.agents.command import parse_template
from engine.errors import ConfigError, SchemaTooNewError, StoreError, StoreUnreachableError
from engine.redact import Redactor
from engine.settings import Settings
from engine.store import Database
from engine.store.database import ENGINE, discover_migrations, read_schema_versions
from engine.store.location import PostgresURL

__all__ = [
    "Check",
    "FrontEndChecks",
    "Status",
    "check_credentials",
    "front_end_checks",
    "register",
    "render",
    "run_checks",
]

VERSION_TIMEOUT = 20.0
ENTRY_POINT_GROUP = "turnstile.doctor"


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


class FrontEndChecks(Protocol):
    """What a front end adds to the doctor (registered under ``turnstile.doctor``)."""

    def settings_checks(self, settings: Settings) -> list[Check]:
        """Its settings, offline; reported before everything else."""
        ...

    async def network_checks(
        self, settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> list[Check]:
        """What it reaches over the network; reported last, skipped with ``--offline``."""
        ...


def front_end_checks() -> list[FrontEndChecks]:
    """Every front end's checks, in the order of their entry-point names."""
    points = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda p: p.name)
    return [point.load()() for point in points]


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
    front_ends: Sequence[FrontEndChecks] | None = None,
) -> list[Check]:
    """Run every check in a fixed order and return their outcomes.

    Args:
        front_ends: the front ends' checks; by default those registered under
            ``turnstile.doctor``.
    """
    fronts = front_end_checks() if front_ends is None else front_ends
    checks = [
        *(check for front in fronts for check in front.settings_checks(settings)),
        *check_paths(settings),
        await check_database(settings.database, migrate=migrate),
        *await check_agents(settings),
    ]
    if network:
        for front in fronts:
            checks.extend(await front.network_checks(settings, transport=transport))
    return checks


# --- paths ---------------------------------------------------------------------------


def check_paths(settings: Settings) -> list[Check]:
    """Every folder turnstile writes to exists and is writable, or can be created."""
    folders = {
        "tasks folder": (settings.tasks_root, "TURNSTILE_TASKS_ROOT"),
        "workspaces": (settings.workspaces, "TURNSTILE_WORKSPACES"),
        "runs folder": (settings.runs_dir, "TURNSTILE_RUNS_DIR"),
    }
    if isinstance(settings.database, Path):  # a server (PostgreSQL) has no folder here
        folders = {"database folder": (settings.database.parent, "TURNSTILE_DATABASE"), **folders}
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


def _write_problem(path: Path) -> str | None:
    """Why the database refuses writes, or None when it takes them.

    SQLite opens a file it may not write read-only without a word, and root passes every
    permission check: only a real write tells. The schema version is rewritten inside a
    transaction that is rolled back, so nothing changes.
    """
    try:
        conn = sqlite3.connect(
            f"{path.absolute().as_uri()}?mode=rw", uri=True, timeout=5.0, isolation_level=None
        )
    except sqlite3.Error as exc:
        return str(exc)
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            conn.execute(f"PRAGMA user_version = {version}")
        finally:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
    except sqlite3.OperationalError as exc:
        if getattr(exc, "sqlite_errorname", "") in ("SQLITE_BUSY", "SQLITE_LOCKED"):
            return None  # somebody is writing to it right now: it takes writes
        return str(exc)
    except sqlite3.Error as exc:
        return str(exc)
    finally:
        conn.close()
    return None


def _try_write(folder: Path) -> str | None:
    # os.access says yes to root on a read-only mount; only a real write tells.
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".turnstile-doctor-"):
            pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


# --- database ------------------------------------------------------------------------


async def check_database(path: Path | PostgresURL, *, migrate: bool = False) -> Check:
    """The database opens and is at the latest schema version (never changed unless asked)."""
    name = "database"
    if isinstance(path, PostgresURL):
        return await _check_postgres(name, path, migrate=migrate)
    latest = Database(path).latest_versions
    if migrate:
        try:
            async with Database(path) as db:
                await db.ensure_writable()
                versions = await db.schema_versions()
        except (StoreError, sqlite3.Error, OSError) as exc:
            return _fail(name, f"cannot open {path}: {exc}", "check the path and permissions")
        return _compare(name, path, versions, latest)
    if not await asyncio.to_thread(path.exists):
        return _warn(
            name,
            f"{path} does not exist yet",
            "it is created on the first start, or now with `turnstile doctor --migrate`",
        )
    try:
        versions = await asyncio.to_thread(read_schema_versions, path)
    except sqlite3.Error as exc:
        return _fail(
            name,
            f"cannot read {path}: {exc}",
            "is it a turnstile database? restore one with your last `turnstile backup` copy",
        )
    problem = await asyncio.to_thread(_write_problem, path)
    if problem is not None:
        return _fail(
            name,
            f"{path} can be read but not written ({problem})",
            "make the file (and its folder, for the -wal and -shm files) writable for the "
            "user running turnstile: `chmod`/`chown` it, `chattr -i` it, or remount it "
            "read-write",
        )
    return _compare(name, path, versions, latest)


async def _check_postgres(name: str, url: PostgresURL, *, migrate: bool) -> Check:
    """The server answers, with its version, and no migration is pending (or, asked, none is
    left after migrating)."""
    from engine.store.postgres import PostgresDatabase, read_pending

    fix_reach = (
        "check the host, port, user, password and database name in TURNSTILE_DATABASE, "
        "and that the server is running and accepts connections from this machine"
    )
    try:
        if migrate:
            async with PostgresDatabase(url):
                pass  # opening migrates
        server, versions, pending = await read_pending(url)
    except StoreUnreachableError as exc:
        return _fail(name, str(exc), fix_reach)
    except SchemaTooNewError as exc:
        return _fail(name, str(exc), "upgrade turnstile, or use a database of this version")
    except StoreError as exc:
        return _fail(name, str(exc), fix_reach)
    latest = {schema.owner: schema.latest for schema in discover_migrations()}
    where = f"PostgreSQL {server} at {url}"
    for owner, want in latest.items():
        if versions.get(owner, 0) > want:
            return _fail(
                name,
                f"{where}: {owner} schema version {versions[owner]}, newer than this "
                f"turnstile ({want})",
                "upgrade turnstile, or use a database of this version",
            )
    waiting = [f"{owner} {step}" for owner, steps in pending.items() for step in steps]
    if waiting:
        return _fail(
            name,
            f"{where}: {len(waiting)} migration(s) pending: {', '.join(waiting)}",
            "back it up (`pg_dump -Fc`), then `turnstile doctor --migrate` "
            "(the bot also migrates on start)",
        )
    shown = ", ".join(
        f"{'' if owner == ENGINE else owner + ' '}schema version {want}"
        for owner, want in latest.items()
    )
    return _ok(name, f"{where}, {shown} (latest), no migration pending")


def _compare(
    name: str, path: Path, versions: Mapping[str, int], latest: Mapping[str, int]
) -> Check:
    # The engine's version reads as before; a front end's tables have their own numbers.
    def label(owner: str) -> str:
        return "" if owner == ENGINE else f"{owner} "

    for owner, want in latest.items():
        version = versions.get(owner, 0)
        if version < want:
            return _fail(
                name,
                f"{path} at {label(owner)}schema version {version}, this turnstile needs {want}",
                "back it up (`turnstile backup FILE`), then `turnstile doctor --migrate` "
                "(the bot also migrates on start)",
            )
        if version > want:
            return _fail(
                name,
                f"{path} at {label(owner)}schema version {version}, newer than this "
                f"turnstile ({want})",
                "upgrade turnstile (`git pull && pip install -e .`) or restore an older backup",
            )
    shown = ", ".join(f"{label(owner)}schema version {latest[owner]}" for owner in latest)
    return _ok(name, f"{path} at {shown} (latest)")


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

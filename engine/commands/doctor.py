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
import difflib
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
from engine.agents.factory import probe_agents, turn_mode
from engine.agents.registry import AGENTS, AgentSpec, agent_spec, ask_version
from engine.agents.stream import TURN_MARKER_VAR
from engine.errors import ConfigError, SchemaTooNewError, StoreError, StoreUnreachableError
from engine.redact import Redactor
from engine.sandbox import sandbox_state
from engine.settings import Settings
from engine.store import Database
from engine.store.database import ENGINE, discover_migrations, read_schema_versions
from engine.store.location import PostgresURL

__all__ = [
    "Check",
    "FrontEndChecks",
    "Status",
    "check_credentials",
    "check_setting_names",
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
        *check_setting_names(os.environ, Path(".env")),
        *check_paths(settings),
        await check_database(settings.database, migrate=migrate),
        check_sandbox(settings),
        *await check_agents(settings),
    ]
    if network:
        for front in fronts:
            checks.extend(await front.network_checks(settings, transport=transport))
    return checks


# --- setting names ---------------------------------------------------------------------

PREFIX = "TURNSTILE_"
# TURNSTILE_ variables that are not settings but are ours all the same: set by turnstile
# for the processes it starts (an agent turn's marker), and the test suite's cache of
# real agent CLIs.
_NOT_SETTINGS = frozenset({TURN_MARKER_VAR, "TURNSTILE_CLI_CACHE"})


def known_setting_names() -> list[str]:
    """Every ``TURNSTILE_`` variable turnstile reads as a setting."""
    return sorted(PREFIX + name.upper() for name in Settings.model_fields)


def check_setting_names(environ: Mapping[str, str], env_file: Path) -> list[Check]:
    """``TURNSTILE_`` variables that no setting reads (a typo is otherwise silently
    ignored), from the environment and the ``.env`` file, each with the closest name."""
    known = known_setting_names()
    allowed = {*known, *_NOT_SETTINGS}
    found: dict[str, str] = {}
    for key in _env_file_names(env_file):
        found.setdefault(key, ".env")
    for key in environ:
        found[key] = "environment" if key not in found else "environment and .env"
    checks = []
    for key, where in sorted(found.items()):
        # Settings names are matched without regard to case, as pydantic-settings does.
        if not key.upper().startswith(PREFIX) or key.upper() in allowed:
            continue
        # Compared without the prefix, which every name shares.
        stems = [name.removeprefix(PREFIX) for name in known]
        close = [
            PREFIX + stem
            for stem in difflib.get_close_matches(
                key.upper().removeprefix(PREFIX), stems, n=1, cutoff=0.6
            )
        ]
        hint = f"did you mean {close[0]}?" if close else "no setting has a similar name"
        checks.append(
            _warn(
                "unknown setting",
                f"{key} (in the {where}) is not a turnstile setting and is ignored; {hint}",
                f"rename it to {close[0]}" if close else "remove it (see .env.example)",
            )
        )
    if not checks:
        count = sum(1 for key in found if key.upper().startswith(PREFIX))
        checks.append(_ok("setting names", f"all {count} TURNSTILE_ variables are settings"))
    return checks


def _env_file_names(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    names = []
    for line in lines:
        key, sep, _ = line.strip().removeprefix("export ").partition("=")
        if sep and key.strip() and not key.startswith("#"):
            names.append(key.strip())
    return names


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
    low, high = PostgresDatabase(url).pool_size
    return _ok(
        name,
        f"{where}, {shown} (latest), no migration pending; each turnstile process keeps "
        f"{low} to {high} connections open",
    )


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


def check_sandbox(settings: Settings) -> Check:
    """Whether agent turns run in their sandbox (off is an operator's choice, shown)."""
    state = sandbox_state(settings)
    if state.confined:
        return _ok("agent sandbox", state.detail)
    if settings.sandbox == "off":
        return _warn("agent sandbox", state.detail, state.fix)
    return _fail("agent sandbox", f"{state.detail}: agents will not start", state.fix or "")


async def check_agents(settings: Settings) -> list[Check]:
    """The default agent's CLI must be found; the others are reported when present."""
    checks: list[Check] = []
    for spec in AGENTS.values():
        if spec.template:
            if spec.configured(settings) or settings.default_agent == spec.name:
                checks.append(await _check_command_agent(spec, settings))
            continue
        check = await _check_cli(spec, settings, required=settings.default_agent == spec.name)
        checks.append(check)
        if check.status is Status.OK and spec.credentials is not None:
            checks.append(check_credentials(spec.name, os.environ, Path(".env")))
    await probe_agents(settings)  # the CLIs are asked off the event loop, then known
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


def check_credentials(agent: str, environ: Mapping[str, str], env_file: Path) -> Check:
    """Whether ``agent``'s CLI can find a key: in the environment, or a saved login.

    A warning, not a failure: a CLI may have other ways in (a helper, a proxy). The
    classic slip is a key written in ``.env``, which sets turnstile's settings only.

    Raises:
        ConfigError: ``agent`` is unknown, or has no known place for a key (``command``).
    """
    name = f"{agent} key"
    spec = agent_spec(agent).credentials
    if spec is None:
        raise ConfigError(f"turnstile does not know where {agent} keeps its key")
    present = [k for k in spec.variables if environ.get(k)]
    if present:
        return _ok(name, f"{present[0]} is set")
    for variable, filename in spec.files:
        folder = environ.get(variable) or str(Path(environ.get("HOME", "~")) / spec.default_dir)
        path = Path(folder).expanduser() / filename
        if path.is_file():
            return _ok(name, f"saved login in {path}")
    in_env_file = [k for k in spec.variables if k in _env_file_keys(env_file)]
    if in_env_file:
        return _warn(
            name,
            f"{in_env_file[0]} is in .env, but .env only sets TURNSTILE_ settings: "
            f"{agent} never sees it",
            "export it in the environment turnstile runs in (systemd EnvironmentFile, "
            "compose env_file, or your shell)",
        )
    return _warn(name, f"no {' / '.join(spec.variables[:2])} and no saved login", spec.fix)


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


async def _check_command_agent(spec: AgentSpec, settings: Settings) -> Check:
    name = "agent command"
    template = spec.configured(settings)
    if not template:
        return _fail(
            name,
            f"TURNSTILE_DEFAULT_AGENT={spec.name} but {spec.env_var} is empty",
            f"set it, e.g. {spec.env_var}=my-agent --session {{session_id}} -p {{prompt}}",
        )
    try:
        words = parse_template(template)
    except ConfigError as exc:
        return _fail(name, exc.message, f"fix {spec.env_var}")
    found = shutil.which(words[0])
    if found is None:
        return _fail(name, f"{words[0]!r} not found on PATH", spec.install_hint())
    # An arbitrary program may not know --version: finding it is the whole check.
    return _ok(name, f"{found}")


async def _check_cli(spec: AgentSpec, settings: Settings, *, required: bool) -> Check:
    name = f"agent {spec.name}"
    binary = spec.configured(settings)
    fix = spec.install_hint()
    found = shutil.which(binary)
    if found is None:
        detail = f"{binary!r} not found on PATH"
        if required:
            return _fail(name, detail + " (it is the default agent)", fix)
        return _warn(name, detail + " (needed only if you use it)", fix)
    if spec.version_args is None:
        return _ok(name, found)
    version, problem = await ask_version(found, spec.version_args, within=VERSION_TIMEOUT)
    if problem is not None:
        return _fail(name, f"{found}: {problem}", fix)
    return _ok(name, f"{found} {version or '(no version printed)'}")

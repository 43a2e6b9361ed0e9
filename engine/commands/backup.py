"""``turnstile backup PATH``: a consistent copy of the database, safe while the bot runs.

On PostgreSQL it runs ``pg_dump --format=custom`` (one snapshot of the whole database, it
never blocks writers), checks the archive with ``pg_restore --list`` and renames it into
place; restore with ``pg_restore --dbname=URL --clean --if-exists PATH`` (docs/deploy.md).
The password goes to ``pg_dump`` in its environment, never on its command line. Without
``pg_dump`` installed the backup is refused with one line.

On SQLite it uses SQLite's online backup in one step inside a read transaction: in WAL
mode that is a snapshot that never blocks the bot's writers. The source is opened
read-only, so a backup never creates or migrates the database it copies. The copy is
written beside its target, checked with ``PRAGMA integrity_check``, turned into a single
self-contained file (``journal_mode=DELETE``), flushed to disk and only then renamed into
place.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from engine.errors import ConfigError, StoreError
from engine.settings import Settings
from engine.store.location import PostgresURL

__all__ = ["BackupResult", "backup_database", "backup_postgres", "find_pg_tool", "register"]

#: Where Debian's (and Ubuntu's) server packages put pg_dump when it is not on PATH.
PG_ROOTS: Final = ("/usr/lib/postgresql",)


@dataclass(frozen=True, slots=True)
class BackupResult:
    """What was copied where."""

    source: Path | PostgresURL
    target: Path
    schema_version: int
    size: int
    seconds: float


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "backup",
        help="copy the database consistently, even while the bot runs",
        description=(
            "Write a consistent, self-contained copy of TURNSTILE_DATABASE to PATH "
            "(SQLite online backup; the bot can keep running). PATH may be a folder (an "
            "existing one, or any path ending in /): the copy is then named "
            "turnstile-YYYYMMDD-HHMMSS.db (.dump on PostgreSQL). Restore by stopping the bot "
            "and copying the file back over the database (remove its -wal and -shm files). "
            "On PostgreSQL it runs pg_dump --format=custom; restore with "
            "pg_restore --dbname=URL --clean --if-exists PATH."
        ),
    )
    parser.add_argument("path", metavar="PATH", help="file or folder to write to")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    parser.set_defaults(handler=run_backup)


async def run_backup(args: argparse.Namespace, settings: Settings) -> int:
    into_folder = args.path.endswith(("/", os.sep))
    if isinstance(settings.database, PostgresURL):
        result = await backup_postgres(
            settings.database, Path(args.path), overwrite=args.force, into_folder=into_folder
        )
        check = "archive readable by pg_restore"
    else:
        result = await backup_database(
            settings.database, Path(args.path), overwrite=args.force, into_folder=into_folder
        )
        check = "integrity check ok"
    print(
        f"backed up {result.source} (schema version {result.schema_version}, "
        f"{result.size / 1_048_576:.1f} MB) to {result.target} in {result.seconds:.2f} s; " + check
    )
    return 0


def find_pg_tool(
    name: str, *, search_path: str | None = None, roots: Sequence[str] = PG_ROOTS
) -> Path | None:
    """``name`` (``pg_dump``, ``pg_restore``) on ``PATH``, else the newest under ``roots``."""
    found = shutil.which(name, path=search_path)
    if found:
        return Path(found)
    candidates = [p for root in roots for p in Path(root).glob(f"*/bin/{name}") if p.is_file()]
    if not candidates:
        return None
    return max(candidates, key=lambda p: (p.parent.parent.name.isdigit(), p.parent.parent.name))


async def backup_postgres(
    url: PostgresURL,
    target: Path,
    *,
    overwrite: bool = False,
    into_folder: bool = False,
    search_path: str | None = None,
    roots: Sequence[str] = PG_ROOTS,
) -> BackupResult:
    """Dump the database at ``url`` to ``target`` with ``pg_dump --format=custom``.

    Raises:
        ConfigError: ``pg_dump`` is not installed, or ``target`` exists and ``overwrite``
            is off.
        StoreUnreachableError: the server cannot be reached (to read the schema version).
        StoreError: ``pg_dump`` failed, or its archive cannot be read back.
    """
    from engine.store.database import ENGINE
    from engine.store.postgres import read_pending

    pg_dump = find_pg_tool("pg_dump", search_path=search_path, roots=roots)
    if pg_dump is None:
        raise ConfigError(
            "turnstile backup on PostgreSQL runs pg_dump, which is not installed here "
            "(Debian: apt-get install postgresql-client)"
        )
    pg_restore = pg_dump.with_name("pg_restore")
    _, versions, _ = await read_pending(url)
    return await asyncio.to_thread(
        _write_dump, url, target, overwrite, into_folder, (pg_dump, pg_restore), versions[ENGINE]
    )


def _write_dump(
    url: PostgresURL,
    target: Path,
    overwrite: bool,
    into_folder: bool,
    tools: tuple[Path, Path],
    version: int,
) -> BackupResult:
    started = time.monotonic()
    if into_folder:
        target.mkdir(parents=True, exist_ok=True)
    if target.is_dir():
        target = target / time.strftime("turnstile-%Y%m%d-%H%M%S.dump")
    if target.exists() and not overwrite:
        raise ConfigError(f"{target} exists: pass --force to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        _dump(url, *tools, tmp)
        _fsync(tmp)
        tmp.replace(target)
        _fsync_dir(target.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return BackupResult(
        source=url,
        target=target,
        schema_version=version,
        size=target.stat().st_size,
        seconds=time.monotonic() - started,
    )


def _dump(url: PostgresURL, pg_dump: Path, pg_restore: Path, tmp: Path) -> None:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(url.conninfo())
    password = params.pop("password", None)
    env = dict(os.environ)  # PGPASSFILE, PGSSLROOTCERT ... still apply
    if password is not None:
        env["PGPASSWORD"] = str(password)
    dbname = make_conninfo(**{k: str(v) for k, v in params.items()})
    argv = [str(pg_dump), "--format=custom", "--no-password", f"--file={tmp}", "--dbname", dbname]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise StoreError(f"pg_dump of {url} failed: {_tail(done.stderr, password)}")
    if pg_restore.is_file():
        listed = subprocess.run(
            [str(pg_restore), "--list", str(tmp)], capture_output=True, text=True, check=False
        )
        if listed.returncode != 0 or "TABLE DATA" not in listed.stdout:
            raise StoreError(
                f"the dump of {url} cannot be read back: {_tail(listed.stderr, password)}"
            )


def _tail(text: str, password: object) -> str:
    text = " ".join(text.strip().splitlines()[-3:])[-500:] or "no message"
    return text.replace(str(password), "***") if password else text


async def backup_database(
    source: Path, target: Path, *, overwrite: bool = False, into_folder: bool = False
) -> BackupResult:
    """Copy ``source`` to ``target`` (a file, or a folder to put a dated file in).

    Args:
        into_folder: ``target`` is a folder even if it does not exist yet (created).

    Raises:
        ConfigError: no database at ``source``, or ``target`` exists and ``overwrite`` is off.
        StoreError: the copy failed or did not pass the integrity check.
    """
    return await asyncio.to_thread(_backup, source, target, overwrite, into_folder)


def _backup(source: Path, target: Path, overwrite: bool, into_folder: bool) -> BackupResult:
    started = time.monotonic()
    if not source.is_file():
        raise ConfigError(
            f"no database at {source}: check TURNSTILE_DATABASE (and the folder you run from)",
            setting="TURNSTILE_DATABASE",
        )
    if into_folder:
        target.mkdir(parents=True, exist_ok=True)
    if target.is_dir():
        target = target / time.strftime("turnstile-%Y%m%d-%H%M%S.db")
    if target.exists() and not overwrite:
        raise ConfigError(f"{target} exists: pass --force to overwrite it")
    if target.absolute() == source.absolute():
        raise ConfigError("the backup would overwrite the database itself")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        version = _copy(source, tmp)
        _fsync(tmp)
        tmp.replace(target)
        _fsync_dir(target.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return BackupResult(
        source=source,
        target=target,
        schema_version=version,
        size=target.stat().st_size,
        seconds=time.monotonic() - started,
    )


def _copy(source: Path, tmp: Path) -> int:
    try:
        src = sqlite3.connect(f"{source.absolute().as_uri()}?mode=ro", uri=True, timeout=30.0)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open {source}: {exc}") from exc
    try:
        dst = sqlite3.connect(tmp)
        try:
            # pages=-1: the whole database in one step, i.e. one read snapshot. Stepping
            # would restart the copy each time the bot commits in between.
            src.backup(dst, pages=-1)
            dst.execute("PRAGMA journal_mode = DELETE")
            problems = [row[0] for row in dst.execute("PRAGMA integrity_check").fetchall()]
            if problems != ["ok"]:
                raise StoreError(f"the copy failed its integrity check: {problems[:5]}")
            version = int(dst.execute("PRAGMA user_version").fetchone()[0])
        finally:
            dst.close()
    except sqlite3.Error as exc:
        raise StoreError(f"backup of {source} failed: {exc}") from exc
    finally:
        src.close()
    return version


def _fsync(path: Path) -> None:
    with path.open("rb+") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""``turnstile backup PATH``: a consistent copy of the database, safe while the bot runs.

Uses SQLite's online backup in one step inside a read transaction: in WAL mode that is a
snapshot that never blocks the bot's writers. The source is opened read-only, so a backup
never creates or migrates the database it copies. The copy is written beside its target,
checked with ``PRAGMA integrity_check``, turned into a single self-contained file
(``journal_mode=DELETE``), flushed to disk and only then renamed into place.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ConfigError, StoreError
from engine.settings import Settings

__all__ = ["BackupResult", "backup_database", "register"]


@dataclass(frozen=True, slots=True)
class BackupResult:
    """What was copied where."""

    source: Path
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
            "turnstile-YYYYMMDD-HHMMSS.db. Restore by stopping the bot "
            "and copying the file back over the database (remove its -wal and -shm files)."
        ),
    )
    parser.add_argument("path", metavar="PATH", help="file or folder to write to")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    parser.set_defaults(handler=run_backup)


async def run_backup(args: argparse.Namespace, settings: Settings) -> int:
    result = await backup_database(
        settings.sqlite_database,
        Path(args.path),
        overwrite=args.force,
        into_folder=args.path.endswith(("/", os.sep)),
    )
    print(
        f"backed up {result.source} (schema version {result.schema_version}, "
        f"{result.size / 1_048_576:.1f} MB) to {result.target} in {result.seconds:.2f} s; "
        "integrity check ok"
    )
    return 0


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

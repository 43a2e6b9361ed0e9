"""A throwaway PostgreSQL cluster for the tests, started by the suite itself.

``initdb`` + ``pg_ctl`` into a temporary folder, a free port on 127.0.0.1, ``fsync=off``.
The server refuses to run as root: as root it runs as the ``postgres`` user (``runuser``),
its folder chowned to it. One cluster per test session, started the first time a test asks
for it; each test gets its own database, copied (``CREATE DATABASE … TEMPLATE``) from one
migrated once.

pytest-postgresql was considered: it runs ``pg_ctl`` as the current user (root here, which
``initdb`` refuses), has no way to run it through ``runuser``, and its janitor hands out
synchronous connections; the forty lines below do what is needed.

Binaries: ``/usr/lib/postgresql/*/bin`` (Debian's ``postgresql``) or ``pg_config --bindir``.
Without them the PostgreSQL tests skip and say why; under CI (``CI`` set) they fail, since
``.ci/run`` installs the package.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from engine.store.backend import open_database
from engine.store.location import PostgresURL

__all__ = [
    "PASSWORD_ROLE",
    "PgCluster",
    "bot_backend",
    "database",
    "db_target",
    "find_bindir",
    "pg_cluster",
    "pg_url",
]

TEMPLATE = "turnstile_template"
#: A role that must log in with a password (the others are trusted on loopback).
PASSWORD_ROLE = "turnstile_pw"
PASSWORD = "correct-horse-battery"


def find_bindir() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``, or None when the server is not installed."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if found:
        return found[-1].parent
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        candidate = Path(out.stdout.strip())
        if (candidate / "initdb").exists() and (candidate / "pg_ctl").exists():
            return candidate
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class PgCluster:
    """One running server: URLs to its databases, and a way to make new ones."""

    bindir: Path
    folder: Path
    port: int = 0
    _counter: Iterator[int] = field(default_factory=itertools.count)

    @property
    def _as_server(self) -> list[str]:
        return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def _run(self, *argv: str) -> None:
        result = subprocess.run(
            [*self._as_server, *argv], capture_output=True, text=True, check=False, timeout=120
        )
        if result.returncode != 0:
            log = self.folder / "log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{argv[0]} failed: {result.stderr or result.stdout}\n{tail}")

    def start(self) -> None:
        data = self.folder / "data"
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
        self._run(str(self.bindir / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres")
        # Loopback: trusted, except one role that must give its password.
        (data / "pg_hba.conf").write_text(
            "local all all trust\n"
            f"host all {PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256\n"
            "host all all 127.0.0.1/32 trust\n"
        )
        self.port = _free_port()
        self.start_again()
        self.admin(f"CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD '{PASSWORD}'")

    def start_again(self) -> None:
        """Start the server (after :meth:`stop`) on its data folder and port."""
        data = self.folder / "data"
        options = (
            f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(data),
            "-w",
            "-l",
            str(self.folder / "log"),
            "-o",
            options,
            "start",
        )

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._run(
                str(self.bindir / "pg_ctl"), "-D", str(self.folder / "data"), "-m", "fast", "stop"
            )

    def url(
        self, database: str = "postgres", *, user: str = "postgres", password: str | None = None
    ) -> str:
        secret = f":{password}" if password is not None else ""
        return f"postgresql://{user}{secret}@127.0.0.1:{self.port}/{database}"

    def admin(self, statement: str) -> None:
        """One statement as the superuser on the ``postgres`` database (autocommit)."""
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(statement.encode())

    def new_database(self, *, template: str = TEMPLATE) -> str:
        """A fresh database copied from ``template`` (the migrated one, or ``template0``)."""
        name = f"t_{os.getpid()}_{next(self._counter)}"
        self.admin(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        """Drop a test's database again (its connections are ended first), so that the
        cluster stays small: hundreds of copies would make its removal at the end of the
        session slow enough to hit the last test's timeout."""
        name = url.rsplit("/", 1)[-1]
        with contextlib.suppress(psycopg.Error):
            self.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """The session's PostgreSQL server, with a migrated template database."""
    bindir = find_bindir()
    if bindir is None:
        reason = (
            "PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin, pg_config): "
            "`apt-get install postgresql` (.ci/run installs it)"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    folder = Path(tempfile.mkdtemp(prefix="turnstile-pg-"))
    cluster = PgCluster(bindir, folder)
    try:
        cluster.start()
        cluster.admin(f'CREATE DATABASE "{TEMPLATE}"')

        async def migrate() -> None:
            async with open_database(cluster.url(TEMPLATE)):
                pass

        # In a thread of its own: the first test to ask may be running an event loop.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, migrate()).result()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def pg_url(pg_cluster: PgCluster) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database of this test's own (dropped afterwards)."""
    url = pg_cluster.new_database()
    yield url
    pg_cluster.drop_database(url)


@pytest.fixture(params=["sqlite", "postgresql"])
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """An open, migrated database: a SQLite file in tmp_path, or a fresh PostgreSQL one."""
    cluster: PgCluster | None = None
    if request.param == "sqlite":
        target: Path | PostgresURL = tmp_path / "t.db"
    else:
        cluster = request.getfixturevalue("pg_cluster")
        target = PostgresURL(cluster.new_database())
    async with open_database(target) as db:
        assert db.dialect == request.param
        yield db
    if cluster is not None:
        cluster.drop_database(target.database)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path | PostgresURL]:
    """Where a test's database lives, not yet opened: a SQLite file in tmp_path, or a fresh
    PostgreSQL database (dropped afterwards) — for tests that hand it to Settings."""
    if request.param == "sqlite":
        yield tmp_path / "t.db"
        return
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    url = cluster.new_database()
    yield PostgresURL(url)
    cluster.drop_database(url)


@pytest.fixture(params=["sqlite", "postgresql"])
def bot_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The bot of this test (tests/fakes/bot_harness.py) on each database in turn."""
    if request.param != "postgresql":
        yield str(request.param)
        return
    from tests.fakes import bot_harness

    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    url = cluster.new_database()
    monkeypatch.setattr(bot_harness, "DATABASE", url)
    yield str(request.param)
    cluster.drop_database(url)


@pytest.fixture(params=["sqlite", "postgresql"])
def empty(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path | PostgresURL]:
    """Where a database that does not exist yet goes, on each database in turn."""
    if request.param == "sqlite":
        yield tmp_path / "old.db"
        return
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    url = cluster.new_database(template="template0")
    yield PostgresURL(url)
    cluster.drop_database(url)

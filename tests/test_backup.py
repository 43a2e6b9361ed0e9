"""``turnstile backup`` copies a database consistently while another process writes to it."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from pathlib import Path

import pytest

from engine.commands.backup import backup_database
from engine.errors import ConfigError
from engine.store import Database
from tests.support import clean_env

ROOT = Path(__file__).resolve().parent.parent

# Writes two tables in one transaction per commit, as fast as it can, until told to stop.
# A torn copy would show the two tables with different row counts.
WRITER = r"""
import os, sqlite3, sys
db, stop = sys.argv[1], sys.argv[2]
conn = sqlite3.connect(db, isolation_level=None, timeout=30)
conn.execute("PRAGMA journal_mode = WAL")
conn.execute("PRAGMA busy_timeout = 30000")
conn.execute("CREATE TABLE IF NOT EXISTS ledger (id INTEGER PRIMARY KEY, payload BLOB)")
conn.execute("CREATE TABLE IF NOT EXISTS mirror (id INTEGER PRIMARY KEY, payload BLOB)")
n = 0
while not os.path.exists(stop):
    conn.execute("BEGIN IMMEDIATE")
    payload = os.urandom(4096)
    conn.execute("INSERT INTO ledger (id, payload) VALUES (?, ?)", (n, payload))
    conn.execute("INSERT INTO mirror (id, payload) VALUES (?, ?)", (n, payload))
    conn.execute("COMMIT")
    n += 1
    if n == 300:
        print("ready", flush=True)
print(n, flush=True)
"""


def _env(database: Path) -> dict[str, str]:
    env = clean_env()
    env.update(TURNSTILE_DATABASE=str(database), PYTHONPATH=str(ROOT))
    return env


async def _turnstile(cwd: Path, env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "engine.cli",
        *args,
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _inspect(path: Path) -> dict[str, object]:
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    try:
        return {
            "integrity": [r[0] for r in conn.execute("PRAGMA integrity_check")],
            "ledger": conn.execute("SELECT count(*) FROM ledger").fetchone()[0],
            "mirror": conn.execute("SELECT count(*) FROM mirror").fetchone()[0],
            "mismatched": conn.execute(
                "SELECT count(*) FROM ledger JOIN mirror USING (id) "
                "WHERE ledger.payload != mirror.payload"
            ).fetchone()[0],
            "version": conn.execute("PRAGMA user_version").fetchone()[0],
            "journal": conn.execute("PRAGMA journal_mode").fetchone()[0],
            "runs": conn.execute("SELECT count(*) FROM runs").fetchone()[0],
        }
    finally:
        conn.close()


@pytest.mark.timeout(120)
async def test_backup_while_another_process_writes(tmp_path: Path) -> None:
    database = tmp_path / "live" / "turnstile.db"
    async with Database(database) as db:
        latest = db.latest_version
    stop = tmp_path / "stop"
    writer = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        WRITER,
        str(database),
        str(stop),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert writer.stdout is not None
    try:
        assert (await writer.stdout.readline()).strip() == b"ready"
        copies = [tmp_path / "backups" / "first.db", tmp_path / "backups" / "second.db"]
        for copy in copies:
            code, out, err = await _turnstile(tmp_path, _env(database), "backup", str(copy))
            assert code == 0, out + err
            assert f"to {copy}" in out
            assert "integrity check ok" in out
    finally:
        stop.touch()
        out, err = await writer.communicate()
    assert writer.returncode == 0, err.decode()
    total = int(out.strip())

    seen = []
    for copy in copies:
        facts = _inspect(copy)
        assert facts["integrity"] == ["ok"]
        assert facts["ledger"] == facts["mirror"]  # one snapshot, never half a transaction
        assert facts["mismatched"] == 0
        assert facts["version"] == latest
        assert facts["journal"] == "delete"  # a self-contained file
        assert facts["runs"] == 0
        assert not copy.with_name(copy.name + "-wal").exists()
        seen.append(facts["ledger"])
    assert 300 <= seen[0] <= seen[1] <= total
    assert sorted(p.name for p in copies[0].parent.iterdir()) == ["first.db", "second.db"]


async def test_backup_into_a_folder_and_refusing_to_overwrite(tmp_path: Path) -> None:
    database = tmp_path / "turnstile.db"
    async with Database(database):
        pass
    folder = tmp_path / "backups"
    code, _, err = await _turnstile(tmp_path, _env(database), "backup", f"{folder}/")
    assert code == 0, err
    (made,) = folder.iterdir()
    made.unlink()
    result = await backup_database(database, folder)
    assert result.target.parent == folder
    assert result.target.name.startswith("turnstile-")
    assert result.target.suffix == ".db"

    code, _, err = await _turnstile(tmp_path, _env(database), "backup", str(result.target))
    assert code == 2
    assert "pass --force" in err
    code, _, err = await _turnstile(
        tmp_path, _env(database), "backup", "--force", str(result.target)
    )
    assert code == 0, err
    assert [p.name for p in folder.iterdir()] == [result.target.name]


async def test_missing_database_is_an_error_and_is_not_created(tmp_path: Path) -> None:
    database = tmp_path / "nowhere.db"
    code, _, err = await _turnstile(tmp_path, _env(database), "backup", str(tmp_path / "b.db"))
    assert code == 2
    assert "no database at" in err
    assert "TURNSTILE_DATABASE" in err
    assert not database.exists()
    assert not (tmp_path / "b.db").exists()


async def test_refuses_to_overwrite_the_database_itself(tmp_path: Path) -> None:
    database = tmp_path / "turnstile.db"
    async with Database(database):
        pass
    with pytest.raises(ConfigError, match="database itself"):
        await backup_database(database, database, overwrite=True)

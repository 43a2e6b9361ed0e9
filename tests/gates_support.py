"""Helpers for the gates tests: settings, a store on a real database, fake-agent scripts.

A test module that uses :func:`gate_backend` (``pytestmark = pytest.mark.usefixtures(
"gate_backend")``, the fixture imported into the module) runs each test twice: on a SQLite
file in ``tmp_path`` and on a fresh PostgreSQL database (tests/pg_support.py).
:func:`make_settings` then points ``database`` at the backend under test.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from engine.gates import Gates
from engine.settings import Settings
from engine.sink import GateRequest, StatusUpdate
from engine.store.backend import open_database
from engine.store.location import PostgresURL
from tests import support
from tests.pg_support import PgCluster
from tests.support import clean_env

REPO = Path(__file__).resolve().parent.parent
FAKE_AGENT = REPO / "tests" / "fake_agent.py"
AGENT_CMD = f"{sys.executable} {FAKE_AGENT} --session {{session_id}} --prompt {{prompt}}"
APPROVER = 42

DECOMPOSITION_EMPTY = "# Decomposition\n\nNo split.\n\n```subtasks\n```\n"


# While gate_backend says "postgresql": the cluster, and the database of each folder the
# running test made settings for (one folder, one database, as with SQLite files).
_PG_CLUSTER: PgCluster | None = None
_PG_URLS: dict[Path, str] = {}


@pytest.fixture(params=["sqlite", "postgresql"])
def gate_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """The database the gates test runs on: ``sqlite`` or ``postgresql``."""
    global _PG_CLUSTER
    if request.param == "postgresql":
        _PG_CLUSTER = request.getfixturevalue("pg_cluster")
    try:
        yield str(request.param)
    finally:
        if _PG_CLUSTER is not None:
            for url in _PG_URLS.values():
                _PG_CLUSTER.drop_database(url)
        _PG_CLUSTER = None
        _PG_URLS.clear()


def _database_for(tmp_path: Path) -> Path | str:
    if _PG_CLUSTER is None:
        return tmp_path / "gates.db"
    if tmp_path not in _PG_URLS:
        _PG_URLS[tmp_path] = _PG_CLUSTER.new_database()
    return _PG_URLS[tmp_path]


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database": _database_for(tmp_path),
        "approvers": (APPROVER, 43, 44),
        "agent_command": AGENT_CMD,
        "default_agent": "command",
        "wave_concurrency": 3,
    }
    values.update(overrides)
    return support.make_settings(tmp_path, **values)


@asynccontextmanager
async def open_gates(settings: Settings, **kwargs: Any) -> AsyncIterator[Gates]:
    async with open_database(settings) as db:
        gates = Gates(db, settings, **kwargs)
        try:
            yield gates
        finally:
            await gates.stop_all()


def phase_rules(decomposition: str = DECOMPOSITION_EMPTY) -> list[dict[str, Any]]:
    """Fake-agent rules writing each phase's artifact when its prompt arrives."""
    artifacts = {
        "research": "research.md",
        "decomposition": "decomposition.md",
        "design": "design.md",
        "test_design": "test_plan.md",
        "implement": "implementation.md",
        "bug_find": "bugs.md",
        "adversarial_bug_find": "adversarial_bugs.md",
        "doc_review": "doc_review.md",
        "referee": "referee.md",
    }
    rules = []
    for phase, artifact in artifacts.items():
        content = decomposition if phase == "decomposition" else f"# {phase}\n\nturn {{turn}}\n"
        rules.append(
            {
                "match": f"Phase: {phase} (",
                "files": {artifact: content},
                "text": f"wrote {artifact}",
            }
        )
    return rules


def write_script(tmp_path: Path, script: dict[str, Any], name: str = "script.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(script))
    return path


def agent_env(tmp_path: Path, script: Path) -> dict[str, str]:
    return {
        "FAKE_AGENT_SCRIPT": str(script),
        "FAKE_AGENT_STATE": str(tmp_path / "fake-state"),
        "FAKE_AGENT_LOG": str(tmp_path / "agent.log"),
    }


def read_log(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "agent.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def database_setting(settings: Settings) -> str:
    """``TURNSTILE_DATABASE`` for a child process (a URL with its password, if any)."""
    where = settings.database
    return where.conninfo() if isinstance(where, PostgresURL) else str(where)


def cli_env(settings: Settings, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = clean_env()
    env.update(
        {
            "TURNSTILE_DATABASE": database_setting(settings),
            "TURNSTILE_TASKS_ROOT": str(settings.tasks_root),
            "TURNSTILE_APPROVERS": ",".join(str(i) for i in settings.approvers),
            "TURNSTILE_APPROVAL_QUORUM": str(settings.approval_quorum),
            "TURNSTILE_WAVE_CONCURRENCY": str(settings.wave_concurrency),
            "TURNSTILE_AGENT_COMMAND": settings.agent_command or "",
            "TURNSTILE_LOG_LEVEL": "WARNING",
        }
    )
    env.update(extra or {})
    return env


async def run_cli(*args: str, env: dict[str, str], cwd: Path | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "engine.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=cwd or REPO,
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


class EventSink:
    """A :class:`engine.sink.RunSink` that records everything and signals gate requests."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.statuses: list[StatusUpdate] = []
        self.gates: list[GateRequest] = []
        self.gate_opened = asyncio.Event()
        self.queue: asyncio.Queue[GateRequest] = asyncio.Queue()

    async def publish_text(self, run_id: str, text: str) -> None:
        self.texts.append(text)

    async def update_status(self, update: StatusUpdate) -> None:
        self.statuses.append(update)

    async def request_gate(self, request: GateRequest) -> None:
        self.gates.append(request)
        self.gate_opened.set()
        self.queue.put_nowait(request)


async def _race(db_path: str, root: str, name: str, target: str, ready: str, go: str) -> int:
    """Read the task, say ready, wait for go, then compare-and-set a transition."""
    from engine.gates import GateRefused, SqlGateStore, TaskStore, load_workflow

    async with open_database(db_path) as db:
        store = TaskStore(SqlGateStore(db), load_workflow(), tasks_root=Path(root), track_git=False)
        task = await store.get(name)
        Path(ready + ".tmp").write_text(str(task.version))
        os.replace(ready + ".tmp", ready)  # the test must never see an empty file
        await support.wait_until(lambda: Path(go).exists(), interval=0.005)
        try:
            await store.transition(name, target, expected_version=task.version)
        except GateRefused as exc:
            print(exc.reason.value)
            return exc.reason.exit_code
        print("won")
        return 0


if __name__ == "__main__":
    if sys.argv[1] == "race":
        sys.exit(asyncio.run(_race(*sys.argv[2:8])))
    raise SystemExit(f"unknown helper {sys.argv[1]!r}")

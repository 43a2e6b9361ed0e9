"""The workers harness: a throwaway PostgreSQL database, a bare project repo, the fake agent
and real ``turnstile worker`` subprocesses, shared by the worker suites.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from engine.store.postgres import PostgresDatabase
from engine.workers.store import Placement, WorkerStore
from tests.automode_support import (
    AGENT_CMD,
    cli_env,
    happy_rules,
    report_head,
    turnstile,
    write_script,
)
from tests.test_workspace_git import git_test_env, make_remote

HEARTBEAT = "0.3"
# A worker silent this long is lost. Short, so that kill -9 tests are quick; not shorter:
# on a loaded machine (the suite runs two at a time) a live worker can stall for 2 s.
TIMEOUT = "4"


def wait_for(what: str, check: Callable[[], Any], *, within: float = 60.0) -> Any:
    """Poll ``check`` until it returns something true; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


@dataclass
class WorkerProc:
    name: str
    proc: subprocess.Popen[str]
    root: Path
    lines: list[str] = field(default_factory=list)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def start_reader(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def output(self) -> str:
        return "".join(self.lines)


@dataclass
class Cluster:
    """The shared environment: PostgreSQL URL, project, fake agent, and the workers."""

    tmp: Path
    url: str
    env: dict[str, str]
    remote: Path
    workers: dict[str, WorkerProc] = field(default_factory=dict)

    def worker_env(self, name: str) -> dict[str, str]:
        root = self.tmp / name
        return {
            **self.env,
            "TURNSTILE_WORKSPACES": str(root / "ws"),
            "TURNSTILE_RUNS_DIR": str(root / "runs"),
        }

    def start_worker(
        self, name: str, *, concurrency: int = 2, env: dict[str, str] | None = None
    ) -> WorkerProc:
        root = self.tmp / name
        root.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            turnstile(
                "--log-level", "INFO", "worker", "--name", name, "--concurrency", str(concurrency)
            ),
            cwd=root,
            env={**self.worker_env(name), **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        worker = WorkerProc(name, proc, root)
        worker.start_reader()
        self.workers[name] = worker
        wait_for(
            f"worker {name} ready", lambda: "ready" in worker.output or proc.poll() is not None
        )
        assert proc.poll() is None, worker.output
        return worker

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            turnstile(*args),
            cwd=self.tmp,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def auto(self, *extra: str, objective: str = "make result.txt", detach: bool = True) -> str:
        """An auto run of the fake agent on the project; its id. ``detach=False``: run here,
        in this command, to its end."""
        done = self.cli(
            "auto",
            *(["--detach"] if detach else []),
            "--checkout-repo",
            "demo",
            "--tool",
            "command",
            "--agent-cmd",
            AGENT_CMD,
            "--max-turns",
            "6",
            "-p",
            objective,
            *extra,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip() if detach else report_head(done.stdout)[0]

    def runs(self) -> dict[str, dict[str, Any]]:
        done = self.cli("runs", "--json", "--limit", "0")
        assert done.returncode == 0, done.stderr
        return {r["id"]: r for r in map(json.loads, done.stdout.splitlines())}

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            return list(conn.execute(sql, params).fetchall())

    def status(self, run_id: str) -> str | None:
        rows = self.query("SELECT status FROM runs WHERE id = %s", run_id)
        return rows[0][0] if rows else None

    def placement(self, run_id: str) -> Placement | None:
        """The run's placement as the store reads it (how it stands, from its run's row)."""

        async def read() -> Placement | None:
            async with PostgresDatabase(self.url, pooled=False) as db:
                return await WorkerStore(db).placement(run_id)

        # (In a thread of its own: an async test calls it from its running loop too.)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, read()).result()

    def stop_all(self) -> None:
        for worker in self.workers.values():
            if worker.proc.poll() is None:
                worker.proc.send_signal(signal.SIGTERM)
        for worker in self.workers.values():
            try:
                worker.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait(timeout=10)
            if worker.proc.stdout is not None:
                with contextlib.suppress(OSError, ValueError):
                    worker.proc.stdout.close()


@pytest.fixture
def cluster(tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    found = make_cluster(tmp_path, pg_url, monkeypatch)
    try:
        yield found
    finally:
        found.stop_all()


def make_cluster(tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    env_git = git_test_env(tmp_path / "home")
    for key, value in env_git.items():
        monkeypatch.setenv(key, value)
    remote = make_remote(tmp_path)
    script = write_script(tmp_path / "fake", rules=happy_rules())
    env = cli_env(
        tmp_path,
        script,
        log=tmp_path / "agent.log",
        extra={
            **env_git,
            "TURNSTILE_DATABASE": pg_url,
            "TURNSTILE_EXECUTION": "workers",
            "TURNSTILE_PROJECTS": f"demo={remote}#main",
            "TURNSTILE_WORKER_HEARTBEAT": HEARTBEAT,
            "TURNSTILE_WORKER_TIMEOUT": TIMEOUT,
            "TURNSTILE_WORKSPACES": str(tmp_path / "control-ws"),
        },
    )
    return Cluster(tmp_path, pg_url, env, remote)

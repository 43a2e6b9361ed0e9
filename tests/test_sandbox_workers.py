"""The agent's walls on a worker: a hostile chat turn run by ``turnstile worker`` on
PostgreSQL reaches nothing of the control plane either.

The database's role logs in with a password (trust on loopback would let anything in over
TCP: that is the network's wall, see docs/security.md); the worker's URL, with that
password, is in its environment and its ``.env`` — neither is inside the sandbox.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.approvals import Decision, SqliteApprovalStore
from engine.store.location import PostgresURL
from tests.conftest import REPO
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import APPROVER, CHAT, OPERATOR, bot_settings, running_bot
from tests.pg_support import PASSWORD, PASSWORD_ROLE, PgCluster
from tests.test_sandbox import ATTACKS, HOSTILE
from tests.workers_support import HEARTBEAT, TIMEOUT, make_cluster

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("isolated_env")]


async def test_a_hostile_chat_turn_on_a_worker_reaches_nothing(
    tmp_path: Path, pg_cluster: PgCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"sbxw_{os.getpid()}"
    pg_cluster.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    pg_cluster.admin(f'CREATE DATABASE "{name}" OWNER "{PASSWORD_ROLE}" TEMPLATE template0')
    url = pg_cluster.url(name, user=PASSWORD_ROLE, password=PASSWORD)
    cluster = make_cluster(tmp_path, url, monkeypatch)
    hostile = f"{sys.executable} {HOSTILE} {{prompt}}"
    worker_root = tmp_path / "w1"
    worker_root.mkdir()
    (worker_root / ".env").write_text(f"TURNSTILE_DATABASE={url}\n")
    sibling = worker_root / "ws" / "worktrees" / "demo" / "another-run" / "notes.txt"
    sibling.parent.mkdir(parents=True)
    sibling.write_text("another run's work\n")
    # Beside the test (the host's /tmp: the sandbox has its own) and in the real home
    # (read-only inside), the write must reach neither.
    outside = [tmp_path / "outside.txt", Path.home() / f".hostile-was-here-{os.getpid()}"]
    try:
        async with FakeBotApi() as api:
            settings = bot_settings(
                api,
                tmp_path / "bot",
                database=url,
                execution="workers",
                projects=cluster.env["TURNSTILE_PROJECTS"],
                worker_heartbeat=float(HEARTBEAT),
                worker_timeout=float(TIMEOUT),
                agent_command=hostile,
            )
            async with running_bot(api, settings) as rt:
                request = await SqliteApprovalStore(rt.db).open_request(
                    "someone-else", "Bash", {"command": "rm -rf /srv"}
                )
                targets = {
                    "database": PostgresURL(url).without_password(),
                    "env_file": str(worker_root / ".env"),
                    "token": PASSWORD,
                    "sibling": str(sibling),
                    "outside": [str(p) for p in outside],
                    "bot_pid": os.getpid(),
                    "pg_socket": str(Path(pg_cluster.folder) / f".s.PGSQL.{pg_cluster.port}"),
                    "task": "g1",
                    "tasks_root": str(tmp_path / "tasks"),
                    "approver": APPROVER,
                    "request_id": request.id,
                    "repo": str(REPO),
                }
                env = {
                    "TURNSTILE_SANDBOX": "on",
                    "TURNSTILE_AGENT_ENV": "FAKE_*",
                    "FAKE_HOSTILE": json.dumps(targets),
                }
                await asyncio.to_thread(cluster.start_worker, "w1", env=env)
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat command demo")
                await api.wait_for_message(lambda m: "bound" in m.text)
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text="go")
                reply = await api.wait_for_message(lambda m: m.text.startswith("attempts:"), 120)
                assert reply.text == (
                    f"attempts: {len(ATTACKS)}; held: {len(ATTACKS)}; work committed"
                )
                still = await SqliteApprovalStore(rt.db).get(request.id)
                assert still.state is Decision.PENDING
    finally:
        cluster.stop_all()
    [report_file] = list((worker_root / "ws").rglob("hostile-report.json"))
    report = json.loads(report_file.read_text())
    assert set(report) == ATTACKS
    assert {n: r for n, r in report.items() if r["got_in"] and n != "write_outside"} == {}
    assert "No such file" in report["pg_socket"]["detail"]
    assert "password" in report["decide_tool"]["detail"]
    assert "No such file" in report["read_sibling"]["detail"]
    assert "token read" not in report["read_env_file"]["detail"]
    assert "No such process" in report["signal_bot"]["detail"]
    assert not any(p.exists() for p in outside)
    workdir = report_file.parent
    log = subprocess.run(
        ["git", "log", "-1", "--format=%s", "--", "work.txt"],
        cwd=workdir,
        capture_output=True,
        text=True,
        check=True,
    )
    assert log.stdout.strip() == "hostile agent's work"
    pg_cluster.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

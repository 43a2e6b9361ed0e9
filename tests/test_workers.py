"""Turns on ``turnstile worker`` processes: real PostgreSQL, real workers, the fake agent.

Each worker is a ``turnstile worker`` subprocess with a workspace root and runs folder of
its own; the control plane is ``turnstile auto`` / ``stop`` / ``runs`` / ``workers`` run
as further subprocesses, all sharing one throwaway PostgreSQL database and one bare repo.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from engine.store.location import PostgresURL
from tests.automode_support import (
    AGENT_CMD,
    CLARIFY,
    EVALUATE,
    EXECUTE,
    PLAN,
    agent_log,
    cli_env,
    commit_step,
    evaluation,
    turnstile,
    write_script,
)
from tests.test_workspace_git import git
from tests.workers_support import (
    HEARTBEAT,
    TIMEOUT,
    Cluster,
    make_cluster,
    wait_for,
)
from tests.workers_support import cluster as cluster  # the fixture

pytestmark = pytest.mark.timeout(180)


def _finished(cluster: Cluster, run_ids: list[str]) -> bool:
    return all(cluster.status(r) not in (None, "running") for r in run_ids)


def test_concurrent_auto_runs_spread_over_workers_and_complete(cluster: Cluster) -> None:
    for name in ("w1", "w2", "w3"):
        cluster.start_worker(name)
    run_ids = [cluster.auto(objective=f"objective {i}") for i in range(6)]
    wait_for("six runs to end", lambda: _finished(cluster, run_ids), within=120)

    runs = cluster.runs()
    assert {runs[r]["status"] for r in run_ids} == {"completed"}
    used = {runs[r]["worker"] for r in run_ids}
    assert len(used) >= 2, used  # spread over workers
    assert used <= {"w1", "w2", "w3"}
    # Every turn of a run ran on the worker holding its worktree, once.
    log = agent_log(cluster.tmp / "agent.log")
    for run_id in run_ids:
        rows = cluster.query("SELECT seq, attempt, state FROM turns WHERE run_id = %s", run_id)
        assert all(state == "finished" and attempt == 1 for _, attempt, state in rows), rows
        worker = runs[run_id]["worker"]
        workdir = runs[run_id]["workdir"]
        assert workdir.startswith(str(cluster.tmp / worker / "ws")), (worker, workdir)
        # The run branch reached the project's remote, with the agent's commit.
        assert "add result.txt" in git(
            "log", "--format=%s", f"turnstile/{run_id}", cwd=cluster.remote
        )
    assert len(log) == sum(
        len(cluster.query("SELECT 1 FROM turns WHERE run_id = %s", r)) for r in run_ids
    )
    # One turn per session at a time, across the workers: a run's turns never overlap.
    by_session: dict[str, list[tuple[float, float]]] = {}
    for entry in log:
        by_session.setdefault(entry["session"], []).append((entry["started"], entry["finished"]))
    assert len(by_session) == len(run_ids)
    for spans in by_session.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
    workers = cluster.cli("workers", "--json")
    listed = {w["name"]: w for w in map(json.loads, workers.stdout.splitlines())}
    assert set(listed) == {"w1", "w2", "w3"}
    assert all(w["status"] == "alive" and w["capacity"] == 2 for w in listed.values())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent has not reaped it yet).
    with contextlib.suppress(OSError):
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    return False


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is in process group ``pgid``."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _pids(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [int(p) for line in path.read_text().split("\n") for p in line.split()]


def _slow_execute(tmp: Path, *, wait_file: Path | None = None) -> dict[str, Any]:
    """An Execute turn that records the worker it ran on, then hangs (or waits for a file)."""
    step: dict[str, Any] = {
        "progress": "working",
        "grandchild": True,
        "text": "committed",
        "files": {"result.txt": "done\n"},
        "run": [
            ["sh", "-c", 'printf %s "$AGENT_WORKER_NAME" > worker.txt'],
            ["git", "add", "result.txt", "worker.txt"],
            ["git", "commit", "-q", "-m", "add result.txt"],
        ],
    }
    if wait_file is None:
        step["sleep"] = 120
    else:
        step["wait_file"] = str(wait_file)
    return step


def _script(cluster: Cluster, execute: dict[str, Any]) -> None:
    write_script(
        cluster.tmp / "fake",
        rules=[
            {"match": CLARIFY, "text": "Goal: result.txt exists and is committed."},
            {"match": PLAN, "text": "1. write result.txt\n2. commit it"},
            {"match": EXECUTE, **execute},
            {"match": EVALUATE, **evaluation("COMPLETE")},
        ],
    )
    cluster.env["FAKE_AGENT_PIDS"] = str(cluster.tmp / "pids")


def _execute_started(cluster: Cluster, run_id: str) -> Any:
    rows = cluster.query(
        "SELECT proc_pgid FROM turns WHERE run_id = %s AND phase = 'execute' AND state = 'started'"
        " AND proc_pgid IS NOT NULL",
        run_id,
    )
    return rows[0][0] if rows and _pids(cluster.tmp / "pids") else None


def test_stop_from_another_process_stops_the_turn_on_its_worker(cluster: Cluster) -> None:
    _script(cluster, _slow_execute(cluster.tmp))
    cluster.start_worker("w1")
    run_id = cluster.auto()
    pgid = wait_for("the execute turn to run", lambda: _execute_started(cluster, run_id))
    agent_pids = _pids(cluster.tmp / "pids")

    began = time.monotonic()
    done = cluster.cli("stop", run_id, "--wait", "30")
    took = time.monotonic() - began
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"run {run_id} stopped" in done.stdout
    assert took < 20, took  # the grace is 1 s; generous for a loaded machine
    assert cluster.status(run_id) == "stopped"
    wait_for(
        "the agent's process group to be gone", lambda: not any(map(_alive, agent_pids)), within=10
    )
    assert not _group_alive(pgid), "the agent's process group is still there"
    rows = cluster.query("SELECT state FROM turns WHERE run_id = %s AND phase = 'execute'", run_id)
    assert rows == [("interrupted",)]
    assert cluster.runs()[run_id]["status"] == "stopped"
    # The worker carries on: a new run completes on it.
    _script(cluster, commit_step("result.txt"))
    second = cluster.auto()
    wait_for("the next run to end", lambda: _finished(cluster, [second]), within=60)
    assert cluster.status(second) == "completed"


def test_a_killed_workers_run_continues_on_another_worker(cluster: Cluster) -> None:
    gate = cluster.tmp / "go-on"
    _script(cluster, _slow_execute(cluster.tmp, wait_file=gate))
    first = cluster.start_worker("w1", concurrency=1)
    run_id = cluster.auto()
    pgid = wait_for("the execute turn to run on w1", lambda: _execute_started(cluster, run_id))
    cut_off = _pids(cluster.tmp / "pids")
    assert cluster.runs()[run_id]["worker"] == "w1"
    second = cluster.start_worker("w2", concurrency=1)

    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=10)
    gate.write_text("")  # the re-run turn may finish at once
    wait_for("the run to end on w2", lambda: _finished(cluster, [run_id]), within=90)

    run = cluster.runs()[run_id]
    assert run["status"] == "completed", run
    assert run["worker"] == "w2"
    assert run["workdir"].startswith(str(cluster.tmp / "w2" / "ws"))
    turns = cluster.query(
        "SELECT seq, attempt, phase, state, prompt FROM turns WHERE run_id = %s ORDER BY id", run_id
    )
    execute = [
        (seq, attempt, state) for seq, attempt, phase, state, _ in turns if phase == "execute"
    ]
    assert execute[0][1:] == (1, "interrupted"), turns
    assert execute[1] == (execute[0][0], 2, "finished"), turns
    # No finished turn ran twice: Clarify and Plan ran once, on w1.
    phases = [phase for _, _, phase, state, _ in turns if state == "finished"]
    assert phases.count("clarify") == 1, phases
    assert phases.count("plan") == 1, phases
    clarify_calls = [e for e in agent_log(cluster.tmp / "agent.log") if CLARIFY in e["prompt"]]
    assert len(clarify_calls) == 1
    # The new session was told, in plain words, where the run stands (what the agent got).
    executes = [e for e in agent_log(cluster.tmp / "agent.log") if EXECUTE in e["prompt"]]
    assert len(executes) == 1  # the cut-off one never finished, so it logged nothing
    told = executes[0]["prompt"]
    assert told.startswith("Note before this turn: this run moved to another machine"), told
    assert "The plan so far:\n1. write result.txt" in told
    assert executes[0]["session"] != agent_log(cluster.tmp / "agent.log")[0]["session"]
    # The cut-off agent is gone; the worker that ran the turn is on the pushed branch.
    wait_for("the cut-off agent to be gone", lambda: not any(map(_alive, cut_off)), within=10)
    assert not _group_alive(pgid), "the cut-off agent's process group is still there"
    branch = f"turnstile/{run_id}"
    assert git("show", f"{branch}:worker.txt", cwd=cluster.remote) == "w2"
    workers = {
        w["name"]: w for w in map(json.loads, cluster.cli("workers", "--json").stdout.splitlines())
    }
    assert workers["w1"]["status"] == "lost"
    assert workers["w2"]["status"] == "alive"
    # w2 prepared the run once (it had moved), then kept it for its next turn.
    assert second.output.count(f"Resuming auto run {run_id}") == 1, second.output


def test_with_no_worker_alive_a_run_waits_visibly_then_runs(cluster: Cluster) -> None:
    follow = subprocess.Popen(
        turnstile(
            "auto",
            "--checkout-repo",
            "demo",
            "--tool",
            "command",
            "--agent-cmd",
            AGENT_CMD,
            "-p",
            "make result.txt",
        ),
        cwd=cluster.tmp,
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert follow.stdout is not None
        lines.extend(follow.stdout)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for("the waiting notice", lambda: any("waiting for a worker" in x for x in lines))
        run_id = lines[0].split()[2]
        listed = cluster.cli("runs")
        assert "waiting for a worker" in listed.stdout, listed.stdout
        assert cluster.runs()[run_id]["status"] == "waiting for a worker"
        assert follow.poll() is None  # nothing timed out

        worker = cluster.start_worker("w1")
        code = follow.wait(timeout=90)
        reader.join(timeout=10)
        out = "".join(lines)
        assert code == 0, out + (follow.stderr.read() if follow.stderr else "")
        assert f"Auto run {run_id}: completed" in out
        assert "clarify: finished" in out
        assert "evaluate: finished" in out
        assert cluster.runs()[run_id]["worker"] == "w1"
        # Prepared once, on its first turn, and kept in memory for the next turns.
        assert f"Resuming auto run {run_id}" not in worker.output, worker.output
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait(timeout=10)
        for stream in (follow.stdout, follow.stderr):
            if stream is not None:
                stream.close()


def test_workers_are_refused_on_sqlite(tmp_path: Path) -> None:
    env = cli_env(
        tmp_path,
        None,
        extra={"TURNSTILE_EXECUTION": "workers", "TURNSTILE_PROJECTS": "demo=/nowhere"},
    )
    for args in (
        ("auto", "--checkout-repo", "demo", "-p", "x"),
        ("worker",),
        ("workers",),
    ):
        done = subprocess.run(
            turnstile(*args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert "TURNSTILE_EXECUTION=workers needs a PostgreSQL database" in lines[0]
    detach = subprocess.run(
        turnstile("auto", "--detach", "-p", "x"),
        cwd=tmp_path,
        env={**env, "TURNSTILE_EXECUTION": "local"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert detach.returncode == 2
    assert "--detach needs TURNSTILE_EXECUTION=workers" in detach.stderr


def test_stop_reaches_a_run_driven_by_turnstile_auto_without_workers(tmp_path: Path) -> None:
    import sqlite3

    from tests.automode_support import git_workspace

    workdir = git_workspace(tmp_path / "work")
    script = write_script(
        tmp_path / "fake",
        rules=[
            {"match": CLARIFY, "text": "Goal: result.txt exists."},
            {"match": PLAN, "text": "1. write result.txt"},
            {"match": EXECUTE, "progress": "working", "grandchild": True, "sleep": 120},
            {"match": EVALUATE, **evaluation("COMPLETE")},
        ],
    )
    env = cli_env(tmp_path, script, extra={"FAKE_AGENT_PIDS": str(tmp_path / "pids")})
    auto = subprocess.Popen(
        turnstile(
            "auto",
            "--tool",
            "command",
            "--agent-cmd",
            AGENT_CMD,
            "--workdir",
            str(workdir),
            "-p",
            "x",
        ),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def started() -> tuple[str, int] | None:
            if not (tmp_path / "turnstile.db").exists() or not _pids(tmp_path / "pids"):
                return None
            with contextlib.closing(sqlite3.connect(tmp_path / "turnstile.db")) as conn:
                row = conn.execute(
                    "SELECT run_id, proc_pgid FROM turns WHERE phase = 'execute'"
                    " AND state = 'started' AND proc_pgid IS NOT NULL"
                ).fetchone()
            return (row[0], row[1]) if row else None

        run_id, pgid = wait_for("the execute turn to run", started)
        done = subprocess.run(
            turnstile("stop", run_id, "--wait", "30"),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"run {run_id} stopped" in done.stdout
        assert auto.wait(timeout=30) == 130
        assert not _group_alive(pgid)
        with contextlib.closing(sqlite3.connect(tmp_path / "turnstile.db")) as conn:
            assert conn.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone() == (
                "stopped",
            )
        again = subprocess.run(
            turnstile("stop", run_id), cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert again.returncode == 2
        assert "has ended" in again.stderr
    finally:
        if auto.poll() is None:
            auto.kill()
            auto.wait(timeout=10)


def test_sigterm_lets_the_running_turn_finish_then_the_run_moves_on(cluster: Cluster) -> None:
    gate = cluster.tmp / "go-on"
    _script(cluster, _slow_execute(cluster.tmp, wait_file=gate))
    first = cluster.start_worker("w1", concurrency=1)
    run_id = cluster.auto()
    wait_for("the execute turn to run on w1", lambda: _execute_started(cluster, run_id))
    cluster.start_worker("w2", concurrency=1)

    first.proc.send_signal(signal.SIGTERM)
    wait_for("w1 to say it stops", lambda: "the running turns finish first" in first.output)
    assert first.proc.poll() is None  # still finishing its turn
    gate.write_text("")
    assert first.proc.wait(timeout=60) == 0, first.output
    wait_for("the run to end", lambda: _finished(cluster, [run_id]), within=90)

    run = cluster.runs()[run_id]
    assert run["status"] == "completed", run
    turns = cluster.query(
        "SELECT phase, attempt, state FROM turns WHERE run_id = %s ORDER BY id", run_id
    )
    # The Execute turn finished on w1 (nothing cut off); Evaluate ran on w2.
    assert ("execute", 1, "finished") in turns, turns
    assert all(attempt == 1 for _, attempt, _ in turns), turns
    assert run["worker"] == "w2"
    assert git("show", f"turnstile/{run_id}:worker.txt", cwd=cluster.remote) == "w1"
    workers = {
        w["name"]: w for w in map(json.loads, cluster.cli("workers", "--json").stdout.splitlines())
    }
    assert workers["w1"]["status"] == "stopped"


def test_a_run_waits_for_a_worker_with_its_agent_and_goes_to_one(cluster: Cluster) -> None:
    # w1 has no codex CLI; w2 has one (a stand-in that says where it ran, then fails).
    mark = cluster.tmp / "codex-ran-on"
    fake = cluster.tmp / "bin" / "codex"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nprintf %s "$AGENT_WORKER_NAME" > {mark}\nexit 3\n')
    fake.chmod(0o755)
    lacking = cluster.start_worker("w1", env={"TURNSTILE_CODEX_BIN": str(cluster.tmp / "none")})
    done = cluster.cli(
        "auto", "--detach", "--checkout-repo", "demo", "--tool", "codex", "-p", "make result.txt"
    )
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.strip()

    def says_why() -> bool:
        return "waiting for a worker with codex installed" in cluster.cli("runs").stdout

    wait_for("turnstile runs to say why the run waits", says_why)
    # w1 listens on its agents' queues only: it never took the run (and is still up).
    workers = {
        w["name"]: w for w in map(json.loads, cluster.cli("workers", "--json").stdout.splitlines())
    }
    assert workers["w1"]["status"] == "alive"
    assert "codex" not in workers["w1"]["agents"]
    assert "command" in workers["w1"]["agents"]
    assert cluster.query("SELECT 1 FROM turns WHERE run_id = %s", run_id) == []
    assert cluster.query("SELECT worker FROM worker_runs WHERE run_id = %s", run_id) == [(None,)]
    assert cluster.runs()[run_id]["status"] == "waiting for a worker with codex installed"

    cluster.start_worker("w2", env={"TURNSTILE_CODEX_BIN": str(fake)})
    wait_for("the run to end on w2", lambda: _finished(cluster, [run_id]), within=60)
    assert mark.read_text() == "w2"
    assert cluster.runs()[run_id]["worker"] == "w2"
    assert lacking.proc.poll() is None, lacking.output
    assert run_id not in lacking.output


def test_a_job_on_the_shared_queue_is_handed_to_a_worker_with_the_agent(cluster: Cluster) -> None:
    """A turn queued on the shared queue (before the agent queues) reaches the right worker."""
    import asyncio

    from engine.workers import queue as queue_mod
    from engine.workers.store import QueuedRun

    lacking = cluster.start_worker("w1", env={"TURNSTILE_CODEX_BIN": str(cluster.tmp / "none")})
    run_id = "auto-shared-queue-1"
    spec = QueuedRun(run_id=run_id, objective="x", tool="codex", project="demo")
    cluster.query(
        "INSERT INTO worker_runs (run_id, spec_json, worker, job, note, moves, created_at,"
        " updated_at) VALUES (%s, %s, NULL, 'queued', NULL, 0, 0, 0) RETURNING run_id",
        run_id,
        # (A placement as written before placing wrote the run's row: its JSON names all.)
        json.dumps(
            {**json.loads(spec.to_json()), "run_id": run_id, "objective": "x", "tool": "codex"}
        ),
    )

    async def defer() -> None:
        app = queue_mod.make_app(PostgresURL(cluster.url))
        async with app.open_async():
            await queue_mod.defer_turn(app, run_id, queue=queue_mod.SHARED_QUEUE)

    asyncio.run(defer())

    def handed_on() -> bool:
        rows = cluster.query(
            "SELECT queue_name, status FROM procrastinate_jobs WHERE lock = %s", run_id
        )
        return ("turnstile.agent.codex", "todo") in rows

    wait_for("w1 to hand the job to the codex queue", handed_on)
    assert cluster.query("SELECT worker FROM worker_runs WHERE run_id = %s", run_id) == [(None,)]
    assert lacking.proc.poll() is None, lacking.output


@pytest.mark.usefixtures("isolated_env")
async def test_auto_and_stop_from_the_bot_reach_a_run_on_a_worker(cluster: Cluster) -> None:
    import asyncio
    import re

    from tests.fakes.bot_api import FakeBotApi
    from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot

    _script(cluster, _slow_execute(cluster.tmp))
    # The chat's project is "default": the bot and the worker know it by that name.
    projects = f"default={cluster.remote}#main"
    cluster.env["TURNSTILE_PROJECTS"] = projects
    worker = await asyncio.to_thread(cluster.start_worker, "w1")
    bot_root = cluster.tmp / "bot"
    bot_root.mkdir()
    async with FakeBotApi() as api:
        settings = bot_settings(
            api,
            bot_root,
            database=cluster.url,
            execution="workers",
            projects=projects,
            worker_heartbeat=float(HEARTBEAT),
            worker_timeout=float(TIMEOUT),
        )
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto make result.txt")
            # The run's live status message: its first text (it is edited as turns run).
            queued = await api.wait_for_message(
                lambda m: "is queued on the workers" in (m.history or [m.text])[0]
            )
            found = re.search(r"Auto run (\S+) is queued", (queued.history or [queued.text])[0])
            assert found is not None
            run_id = found.group(1)
            try:
                pgid = await asyncio.to_thread(
                    wait_for, "the execute turn to run", lambda: _execute_started(cluster, run_id)
                )
            except BaseException:
                print(worker.output)
                raise
            agent_pids = _pids(cluster.tmp / "pids")

            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            await api.wait_for_message(
                lambda m: f"🤖 auto {run_id} · running on worker w1" in m.text
            )
            began = time.monotonic()
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/stop {run_id}")
            await asyncio.to_thread(
                wait_for, "the run to stop", lambda: cluster.status(run_id) == "stopped", within=30
            )
            took = time.monotonic() - began
            assert took < 20, took  # the grace is 1 s; generous for a loaded machine
            await asyncio.to_thread(
                wait_for,
                "the agent's process group to be gone",
                lambda: not any(map(_alive, agent_pids)),
                within=10,
            )
            assert not _group_alive(pgid)
            rows = cluster.query(
                "SELECT state FROM turns WHERE run_id = %s AND phase = 'execute'", run_id
            )
            assert rows == [("interrupted",)]
            assert cluster.runs()[run_id]["worker"] == "w1"
            # The stop went through the store (who asked is recorded until the run ends).
            assert not any(m.text.startswith(f"No run {run_id} here.") for m in api.sent)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            await api.wait_for_message(lambda m: m.text.startswith("No runs in this chat. /help"))


def test_a_worker_that_loses_the_database_carries_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's own PostgreSQL server goes away for 10 s while it idles; it then takes
    and completes a new run, in the same process."""
    import asyncio

    from engine.store.backend import open_database
    from tests.pg_support import PgCluster, find_bindir

    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries not found")
    # Its own folder outside tmp_path: the server runs as postgres when we are root.
    server = PgCluster(bindir, Path(tempfile.mkdtemp(prefix="turnstile-pg-")))
    server.start()
    try:
        server.admin('CREATE DATABASE "t"')
        url = server.url("t")

        async def migrate() -> None:
            async with open_database(PostgresURL(url)):
                pass

        asyncio.run(migrate())
        found = make_cluster(tmp_path, url, monkeypatch)
        try:
            worker = found.start_worker("w1")
            first = found.auto(objective="before the outage")
            wait_for("the first run to end", lambda: _finished(found, [first]), within=60)
            assert found.status(first) == "completed"

            began = time.monotonic()
            server.stop()
            wait_for(
                "the worker to notice the database is gone",
                lambda: "heartbeat failed" in worker.output,
                within=30,
            )
            time.sleep(max(0.0, 10 - (time.monotonic() - began)))  # the outage itself
            server.start_again()
            assert worker.proc.poll() is None, worker.output

            second = found.auto(objective="after the outage")
            wait_for("the run after the outage to end", lambda: _finished(found, [second]))
            assert found.status(second) == "completed", worker.output
            assert found.runs()[second]["worker"] == "w1"
            assert worker.proc.poll() is None, worker.output
            listed = {
                w["name"]: w
                for w in map(json.loads, found.cli("workers", "--json").stdout.splitlines())
            }
            assert listed["w1"]["status"] == "alive"
        finally:
            found.stop_all()
    finally:
        server.stop()
        shutil.rmtree(server.folder, ignore_errors=True)

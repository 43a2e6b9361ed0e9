"""A dead worker's agent processes die with it (issue 17): real PostgreSQL, real
``turnstile worker`` subprocesses, the fake agent with a grandchild in its process group
and an escapee in a session of its own (out of the group, found by the turn's marker).

- kill -9 of a worker mid-turn: the worker's watchdog kills the whole turn at once;
- kill -9 of a worker whose watchdog was killed first: the turn's processes outlive it,
  and a worker restarted under the same name kills them before anything else, records the
  cut-off turn interrupted and re-runs it as a new attempt.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.automode_support import CLARIFY, EVALUATE, EXECUTE, PLAN, evaluation, write_script
from tests.workers_support import Cluster, WorkerProc, wait_for
from tests.workers_support import cluster as cluster  # the fixture

pytestmark = pytest.mark.timeout(180)

# How soon a dead worker's turn must be gone: the watchdog notices at once; generous for
# a loaded machine.
_GONE_WITHIN = 10.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie is gone for our purposes
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    return False


def _group_alive(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _children(pid: int) -> list[tuple[int, str]]:
    """The children of ``pid``: (pid, command line)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                child = int(stat.parent.name)
                cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append((child, cmdline))
    return found


def _agent_pids(cluster: Cluster) -> list[int]:
    path = cluster.tmp / "pids"
    if not path.exists():
        return []
    return [int(p) for p in path.read_text().split()]


def _script(cluster: Cluster, gate: Path) -> None:
    """An Execute turn that leaves a grandchild and an escapee, then waits for ``gate``."""
    write_script(
        cluster.tmp / "fake",
        rules=[
            {"match": CLARIFY, "text": "Goal: result.txt exists and is committed."},
            {"match": PLAN, "text": "1. write result.txt\n2. commit it"},
            {
                "match": EXECUTE,
                "progress": "working",
                "grandchild": True,
                "escapee": True,
                "wait_file": str(gate),
                "text": "committed",
                "files": {"result.txt": "done\n"},
                "run": [
                    ["git", "add", "result.txt"],
                    ["git", "commit", "-q", "-m", "add result.txt"],
                ],
            },
            {"match": EVALUATE, **evaluation("COMPLETE")},
        ],
    )
    cluster.env["FAKE_AGENT_PIDS"] = str(cluster.tmp / "pids")


def _in_execute(cluster: Cluster, run_id: str) -> Any:
    """The Execute turn's process group once it runs with all its processes; else None."""
    rows = cluster.query(
        "SELECT proc_pgid FROM turns WHERE run_id = %s AND phase = 'execute' AND state = 'started'"
        " AND proc_pgid IS NOT NULL",
        run_id,
    )
    return rows[0][0] if rows and len(_agent_pids(cluster)) == 3 else None


def _kill(worker: WorkerProc) -> None:
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait(timeout=10)


def test_a_killed_workers_turn_dies_with_it(cluster: Cluster) -> None:
    _script(cluster, cluster.tmp / "never")
    worker = cluster.start_worker("w1", concurrency=1)
    run_id = cluster.auto()
    pgid = wait_for("the execute turn to run", lambda: _in_execute(cluster, run_id))
    agent = _agent_pids(cluster)  # leader, grandchild (its group), escapee (its own session)
    assert all(map(_alive, agent))
    assert os.getpgid(agent[2]) != pgid  # the escapee is out of the group

    _kill(worker)
    began = time.monotonic()
    wait_for(
        "the dead worker's agent processes to be gone",
        lambda: not any(map(_alive, agent)),
        within=_GONE_WITHIN,
    )
    took = time.monotonic() - began
    assert not _group_alive(pgid), "the agent's process group is still there"
    assert took < _GONE_WITHIN, took


def test_a_worker_restarted_under_its_name_reaps_what_its_last_life_left(
    cluster: Cluster,
) -> None:
    gate = cluster.tmp / "go-on"
    _script(cluster, gate)
    worker = cluster.start_worker("w1", concurrency=1)
    run_id = cluster.auto()
    pgid = wait_for("the execute turn to run", lambda: _in_execute(cluster, run_id))
    agent = _agent_pids(cluster)
    watchdogs = [pid for pid, cmd in _children(worker.proc.pid) if "--watch" in cmd]
    assert len(watchdogs) == 1, _children(worker.proc.pid)

    # The watchdog goes first (as if the whole machine had stalled), then the worker: the
    # turn's processes are left behind, the turn recorded as started.
    os.kill(watchdogs[0], signal.SIGKILL)
    _kill(worker)
    assert all(map(_alive, agent)), "something other than the reaper killed the turn"

    cluster.workers["w1 (earlier)"] = worker  # its pipe closed at the end with the others
    restarted = cluster.start_worker("w1", concurrency=1)
    wait_for(
        "the earlier life's agent processes to be gone",
        lambda: not any(map(_alive, agent)),
        within=_GONE_WITHIN,
    )
    assert not _group_alive(pgid)
    assert "died without stopping; taking over" in restarted.output, restarted.output

    gate.write_text("")  # the re-run turn may finish now
    wait_for(
        "the run to end",
        lambda: cluster.status(run_id) not in (None, "running"),
        within=90,
    )
    run = cluster.runs()[run_id]
    assert run["status"] == "completed", (run, restarted.output)
    assert run["worker"] == "w1"
    execute = cluster.query(
        "SELECT attempt, state FROM turns WHERE run_id = %s AND phase = 'execute' ORDER BY id",
        run_id,
    )
    assert execute == [(1, "interrupted"), (2, "finished")], execute


def test_a_worker_declared_lost_while_alive_cuts_its_running_turn_off(cluster: Cluster) -> None:
    """The others declared w1 lost (it froze, or its link was slower than the timeout) and
    run its turn again: w1's copy of the turn is gone (on one machine the taker's reaper
    kills it at once; on another, w1 cuts it off itself at its next beat, hearing it was
    declared lost), the run completes once on w2 and w1 carries on."""
    gate = cluster.tmp / "go-on"
    _script(cluster, gate)
    cluster.start_worker("w1", concurrency=1)
    run_id = cluster.auto()
    wait_for("the execute turn to run on w1", lambda: _in_execute(cluster, run_id))
    first = _agent_pids(cluster)
    (cluster.tmp / "pids").unlink()
    cluster.start_worker("w2", concurrency=1)

    # w1 freezes (its agent goes on working): the others hear nothing from it, declare it
    # lost and run its turn again.
    w1 = cluster.workers["w1"]
    w1.proc.send_signal(signal.SIGSTOP)
    try:
        wait_for("the turn to run again on w2", lambda: _in_execute(cluster, run_id), within=60)
    finally:
        w1.proc.send_signal(signal.SIGCONT)
    wait_for(
        "w1 to cut its copy of the turn off",
        lambda: not any(map(_alive, first)),
        within=30,
    )
    gate.write_text("")
    wait_for("the run to end", lambda: cluster.status(run_id) not in (None, "running"), within=90)
    run = cluster.runs()[run_id]
    assert run["status"] == "completed", run
    assert run["worker"] == "w2"
    execute = cluster.query(
        "SELECT attempt, state FROM turns WHERE run_id = %s AND phase = 'execute' ORDER BY id",
        run_id,
    )
    assert execute == [(1, "interrupted"), (2, "finished")], execute
    assert "declared lost" in w1.output, w1.output
    assert w1.proc.poll() is None, w1.output

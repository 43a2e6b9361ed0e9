"""The same scripted run, in this process and on the workers: the same event log.

Where a run executes is a choice of settings; what happens in it is not. Each test runs
one scripted run both ways on one PostgreSQL database (a real ``turnstile worker``
process for the workers) and compares the events ``turnstile runs RUN --events --json``
prints, less what differs by nature (ids, times, the worker's folders)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests import test_workers_autopilot as pilot
from tests.automode_support import turnstile
from tests.workers_support import Cluster, wait_for
from tests.workers_support import cluster as cluster  # the fixture

pytestmark = pytest.mark.timeout(180)

APPROVER = pilot.APPROVER
_TWO = "# Decomposition\n\n```subtasks\nwave 1: a1 - one\nwave 1: a2 - two\n```\n"

# What says where or when, not what: left out of the comparison.
_PLACE = {"id", "run_id", "at", "turn_id"}


def _events(cluster: Cluster, run_id: str) -> list[dict[str, Any]]:
    done = cluster.cli("runs", run_id, "--events", "--json")
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def _what(events: list[dict[str, Any]], run_id: str) -> list[dict[str, Any]]:
    said = []
    for event in events:
        kept = {k: v for k, v in event.items() if k not in _PLACE}
        if kept.get("kind") == "note":
            kept["text"] = kept["text"].replace(run_id, "RUN").splitlines()[0]
        said.append(kept)
    return said


def test_an_auto_run_s_events_are_the_same_here_and_on_a_worker(cluster: Cluster) -> None:
    cluster.start_worker("w1")
    on_worker = cluster.auto(objective="make result.txt")
    wait_for(
        "the run on the worker to end",
        lambda: cluster.runs()[on_worker]["status"] not in ("running", "waiting for a worker"),
        within=120,
    )
    cluster.env["TURNSTILE_EXECUTION"] = "local"
    local = cluster.auto(objective="make result.txt", detach=False)
    worker_events = _events(cluster, on_worker)
    local_events = _events(cluster, local)
    assert worker_events[-1]["kind"] in ("run_ended", "note")
    assert [e["kind"] for e in worker_events if e["kind"] == "run_ended"] == ["run_ended"]
    assert _what(worker_events, on_worker) == _what(local_events, local)


def _gate_round(cluster: Cluster, task: str) -> tuple[str, int]:
    rows = cluster.query(
        "SELECT phase, sub_state, gate_round FROM gate_tasks WHERE name = %s", task
    )
    if not rows:
        return "", 0
    phase, sub, round_ = rows[0]
    return (f"{phase}:{sub}" if sub else phase), int(round_)


def _through_the_gates(cluster: Cluster, task: str) -> None:
    """Reject research once, then approve it and the decomposition."""
    for gate, round_, decide in (
        ("research", 1, ["--reject", "--reason", "say more"]),
        ("research", 2, ["--approve"]),
        ("decomposition", 3, ["--approve"]),
    ):
        wait_for(
            f"{task} at the {gate} gate (round {round_})",
            lambda gate=gate, round_=round_: (
                _gate_round(cluster, task) == (f"{gate}:awaiting_approval", round_)
            ),
            within=90,
        )
        done = cluster.cli("status", "--task", task, *decide, "--by", APPROVER)
        assert done.returncode == 0, done.stdout + done.stderr


def _drives(cluster: Cluster, task: str) -> tuple[str, list[str]]:
    """The drive of ``task`` and the drives of its sub-tasks (by task name)."""
    rows = cluster.query(
        "SELECT id, task, parent_id FROM runs WHERE mode = 'autopilot' AND (task = %s OR"
        " task LIKE %s) ORDER BY task",
        task,
        f"{task}.%",
    )
    (drive,) = [r[0] for r in rows if r[2] is None]
    return drive, [r[0] for r in rows if r[2] == drive]


def _autopilot_events(cluster: Cluster, run_id: str, task: str) -> list[dict[str, Any]]:
    said = []
    for event in _events(cluster, run_id):
        kept = {
            k: v.replace(task, "TASK") if isinstance(v, str) else v
            for k, v in event.items()
            if k not in {*_PLACE, "sha256", "text", "size", "parent"}
        }
        said.append(kept)
    return said


def test_an_autopilot_drive_s_events_are_the_same_here_and_on_workers(cluster: Cluster) -> None:
    """A rejection round, two approvals and a wave of two sub-tasks, driven in a terminal and
    on the workers: the same events for the drive and for each sub-task."""
    agent_cmd = pilot.setup_pilot(cluster, decomposition=_TWO)
    cluster.start_worker("w1")
    cluster.start_worker("w2")
    start = ["--checkout-repo", "demo", "--summary", "build the thing", "--tool", "command"]
    done = cluster.cli(
        "autopilot", "--task", "wdrive", "--init", *start, "--agent-cmd", agent_cmd, "--detach"
    )
    assert done.returncode == 0, done.stderr
    on_workers = done.stdout.strip()
    _through_the_gates(cluster, "wdrive")
    wait_for(
        "the drive on the workers to end",
        lambda: pilot.placement(cluster, on_workers)[0] == "finished",
        within=120,
    )
    here = subprocess.Popen(
        turnstile("autopilot", "--task", "hdrive", "--init", *start, "--agent-cmd", agent_cmd),
        cwd=cluster.tmp,
        env={**cluster.env, "TURNSTILE_EXECUTION": "local"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _through_the_gates(cluster, "hdrive")
        out, _ = here.communicate(timeout=120)
    finally:
        if here.poll() is None:
            here.kill()
            here.wait()
    assert here.returncode == 0, out
    assert pilot.label(cluster, "hdrive") == pilot.label(cluster, "wdrive") == "complete"
    drive_w, subs_w = _drives(cluster, "wdrive")
    drive_h, subs_h = _drives(cluster, "hdrive")
    assert drive_w == on_workers
    assert len(subs_w) == len(subs_h) == 2
    worker_log = _autopilot_events(cluster, drive_w, "wdrive")
    local_log = _autopilot_events(cluster, drive_h, "hdrive")
    kinds = [e["kind"] for e in local_log]
    assert kinds.count("gate_opened") == 3
    assert [e["decision"] for e in local_log if e["kind"] == "gate_decided"] == [
        "rejected",
        "approved",
        "approved",
    ]
    assert kinds[-1] in ("run_ended", "note")
    # Where it runs shows in one place only: on the workers a drive waiting at a gate
    # gives its worker back (parked, then resumed by the next step); in a terminal it
    # waits in its process.
    assert [e["kind"] for e in worker_log].count("parked") == 3
    assert [e["kind"] for e in worker_log].count("run_resumed") == 3
    worker_log = [e for e in worker_log if e["kind"] not in ("parked", "run_resumed")]
    assert worker_log == local_log
    for sub_w, sub_h in zip(subs_w, subs_h, strict=True):
        assert _autopilot_events(cluster, sub_w, "wdrive") == _autopilot_events(
            cluster, sub_h, "hdrive"
        )

"""The same scripted run, in this process and on the workers: the same event log.

Where a run executes is a choice of settings; what happens in it is not. Each test runs
one scripted run both ways on one PostgreSQL database (a real ``turnstile worker``
process for the workers) and compares the events ``turnstile runs RUN --events --json``
prints, less what differs by nature (ids, times, the worker's folders)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.automode_support import AGENT_CMD
from tests.workers_support import Cluster, wait_for
from tests.workers_support import cluster as cluster  # the fixture

pytestmark = pytest.mark.timeout(180)

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
    here = cluster.cli(
        "auto",
        "--checkout-repo",
        "demo",
        "--tool",
        "command",
        "--agent-cmd",
        AGENT_CMD,
        "--max-turns",
        "6",
        "-p",
        "make result.txt",
    )
    assert here.returncode == 0, here.stderr
    local = here.stdout.split()[2].rstrip(":")
    worker_events = _events(cluster, on_worker)
    local_events = _events(cluster, local)
    assert worker_events[-1]["kind"] in ("run_ended", "note")
    assert [e["kind"] for e in worker_events if e["kind"] == "run_ended"] == ["run_ended"]
    assert _what(worker_events, on_worker) == _what(local_events, local)

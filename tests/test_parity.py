"""The same scripted run, in this process and on the workers: the same event log.

Where a run executes is a choice of settings; what happens in it is not. Each test runs
one scripted run both ways (a real ``turnstile worker`` process for the workers) and
compares the events ``turnstile runs RUN --events --json`` prints, less what differs by
nature (ids, times, the worker's folders); a chat session also compares the messages the
chat got (the bot against the fake Bot API, its own SQLite file when local)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from typing import Any

import pytest

from tests import test_workers_autopilot as pilot
from tests.automode_support import turnstile, write_script
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot
from tests.workers_support import HEARTBEAT, TIMEOUT, Cluster, wait_for
from tests.workers_support import cluster as cluster  # the fixture

pytestmark = pytest.mark.timeout(180)

APPROVER = pilot.APPROVER
_TWO = "# Decomposition\n\n```subtasks\nwave 1: a1 - one\nwave 1: a2 - two\n```\n"

# What says where or when, not what: left out of the comparison.
_PLACE = {"id", "run_id", "at", "turn_id"}


_ELAPSED = re.compile(r"(· )\d+(?:h\d+m|m\d+s|s)\b")


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
            if k not in {*_PLACE, "sha256", "text", "body", "size", "parent"}
        }
        said.append(kept)
    return said


_COMMIT = re.compile(r"^  [0-9a-f]{7,} (.*)$")
_FOLDER_COMMIT = re.compile(r"^turnstile: TASK(\.\S+)? at ")


def _work(cluster: Cluster, run_id: str, task: str, branch: str) -> dict[str, Any]:
    """What the drive's completion says it changed, less what differs by nature: its
    branch's name (the run's on the workers, the task's here) and, on the workers, the
    task's folder, committed on the branch after every step (its commits and files)."""
    [body] = [e["body"] for e in _events(cluster, run_id) if e.get("note") == "final"]
    lines = body.replace(branch, "BRANCH").replace(task, "TASK").splitlines()
    commits = [m.group(1) for m in map(_COMMIT.match, lines) if m is not None]
    return {
        "heads": [line.split(":")[0] for line in lines if not line.startswith(" ")],
        "commits": sorted(c for c in commits if not _FOLDER_COMMIT.match(c)),
        "files": sorted(
            line.split(" | ")[0].strip()
            for line in lines
            if " | " in line and not line.strip().startswith(".turnstile/")
        ),
        "branch": [line for line in lines if line.startswith("Branch: ")],
    }


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
    # What it changed, as its completion says it: the same commits, files and push.
    work = _work(cluster, drive_h, "hdrive", "turnstile/hdrive")
    assert work["heads"] == ["Commits since start", "Changed since the start", "Branch"]
    assert work["files"] == ["src/TASK.a1.txt", "src/TASK.a2.txt", "src/TASK.txt"]
    assert _work(cluster, drive_w, "wdrive", f"turnstile/{drive_w}") == work
    for sub_w, sub_h in zip(subs_w, subs_h, strict=True):
        assert _autopilot_events(cluster, sub_w, "wdrive") == _autopilot_events(
            cluster, sub_h, "hdrive"
        )


# -- a chat session ------------------------------------------------------------------


async def _chat(
    cluster: Cluster, database: str, execution: str, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str, str | None, bytes | None, int | None]]:
    """Three messages to a chat session run ``execution``'s way: what the chat was sent."""
    root = cluster.tmp / f"bot-{execution}"
    root.mkdir(exist_ok=True)
    monkeypatch.setenv("FAKE_AGENT_SCRIPT", cluster.env["FAKE_AGENT_SCRIPT"])
    monkeypatch.setenv("FAKE_AGENT_STATE", str(root / "agent-state"))
    async with FakeBotApi() as api:
        settings = bot_settings(
            api,
            root,
            database=database,
            execution=execution,
            projects=cluster.env["TURNSTILE_PROJECTS"],
            worker_heartbeat=float(HEARTBEAT),
            worker_timeout=float(TIMEOUT),
        )
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            bound = await api.wait_for_message(lambda m: "bound to a new" in m.text)
            for text in ("hello one", "hello two"):
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text=text)
                await api.wait_for_message(lambda m, t=text: m.text == f"echo: {t}", timeout=60)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="send the notes")
            await api.wait_for_message(lambda m: m.filename == "notes.md", timeout=60)
            await api.wait_until(lambda: sum("✅ done" in m.text for m in api.sent) == 3)
        after = [m for m in api.sent if m.message_id > bound.message_id]
        asked = sorted({m.reply_to for m in after if m.reply_to is not None})
        # What each message says, which file it carries and which of the person's
        # messages it answers (its place among them: ids differ by what else was sent).
        # How long a turn took ("✅ done · 1s") is the machine's, not the run's.
        return [
            (
                _ELAPSED.sub(r"\1…", m.text),
                m.filename,
                m.document,
                asked.index(m.reply_to) if m.reply_to else None,
            )
            for m in after
        ]


async def test_a_chat_session_s_events_and_messages_are_the_same_here_and_on_a_worker(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every message echoed; one asks for a file the agent writes and hands over.
    write_script(
        cluster.tmp / "fake",
        rules=[
            {
                "match": "send the notes",
                "files": {"notes.md": "# Notes\n\nall well\n"},
                "text": "here they are\nTURNSTILE-SEND: notes.md",
            }
        ],
    )
    cluster.env["TURNSTILE_PROJECTS"] = f"default={cluster.remote}#main"
    await asyncio.to_thread(cluster.start_worker, "w1")
    on_worker = await _chat(cluster, cluster.url, "workers", monkeypatch)
    [worker_run] = [r for r in cluster.runs().values() if r["mode"] == "chat"]
    turns = cluster.query("SELECT DISTINCT run_id, worker FROM worker_chat_turns")
    assert turns == [(worker_run["id"], "w1")]
    worker_events = _events(cluster, worker_run["id"])
    # Here: the bot's own SQLite file, the default.
    sqlite = str(cluster.tmp / "bot-local" / "turnstile.db")
    here = await _chat(cluster, sqlite, "local", monkeypatch)
    cluster.env["TURNSTILE_DATABASE"] = sqlite
    [local_run] = [r for r in cluster.runs().values() if r["mode"] == "chat"]
    local_events = _events(cluster, local_run["id"])
    assert [e["kind"] for e in local_events].count("turn_ended") == 3
    assert _what(worker_events, worker_run["id"]) == _what(local_events, local_run["id"])
    assert on_worker == here
    # The file the agent handed over came out of the worker's folder, as here.
    assert ("notes.md", b"# Notes\n\nall well\n") in [(f, d) for _, f, d, _ in here]

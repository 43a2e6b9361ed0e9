"""The same scripted autopilot drive from the chat, in the bot's process and on the workers:
the same messages in the chat and the same event log.

A rejection round (Reject pressed, the reason given in reply to the bot's question, the
phase revised, then approved), the decomposition approved, a wave of two sub-tasks (the
short workflow starts them at implement: no gates of their own), merged, complete. Driven
once by the bot on its own SQLite file (``execution`` local), once by the bot on
PostgreSQL with two ``turnstile worker`` processes. Compared: the final text of every
message the bot sent after its answer to /autopilot, in order, with the documents' names
and bytes; and ``turnstile runs RUN --events --json`` of the drive and of each sub-task.
Only what differs by nature is normalized, each item below with its reason.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import APPROVER, CHAT, OPERATOR, running_bot
from tests.test_bot_workers_autopilot import _bot_on_workers, _local_bot, _on_workers, _setup
from tests.test_parity import _TWO, _autopilot_events
from tests.workers_support import Cluster, wait_for
from tests.workers_support import cluster as cluster  # the fixture

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(150)]

TASK = "T1"
REASON = "say more about the risks"

# What differs by nature between the two runs, normalized in the messages' texts (each
# with its reason); nothing else is.
_NORMALIZE: list[tuple[re.Pattern[str], str, str]] = [
    # How long a drive took is the machine's, not the drive's ("4 turns in 2s.").
    (re.compile(r"(· |in )\d+(?:h\d+m|m\d+s|s)\b"), r"\1ELAPSED", "elapsed times"),
    # A run id carries the time it was made and random bits (the run's branch names it).
    (re.compile(r"\bautopilot-\d{8}-\d{6}-[0-9a-f]+\b"), "RUN", "run ids"),
    # A commit's hash depends on its time and parents (the summary's list of commits).
    (re.compile(r"^  [0-9a-f]{7,40} ", re.M), "  COMMIT ", "commit hashes"),
    # The runs remote the branch was pushed to is the test's folder.
    (re.compile(r"pushed to \S+"), "pushed to REMOTE", "the branch line's remote"),
]
# On the workers the drive works in a worktree of the chat's project, and its summary says
# what it changed there (its commits, files, branch); the bot's own drive works in its task
# folder, which is no checkout: its summary has no such lines.
_WORK = re.compile(r"\nCommits since start: .*?\nBranch: [^\n]*", re.S)


def _normal(text: str) -> str:
    for pattern, replacement, _why in _NORMALIZE:
        text = pattern.sub(replacement, text)
    return text


def _is_gate(m: SentMessage, phase: str) -> bool:
    return m.text.startswith(f"🛂 Gate: task {TASK} · phase {phase}\n")


async def _press(api: FakeBotApi, message: SentMessage, label: str) -> None:
    await api.wait_until(lambda: any(b["text"].endswith(label) for b in message.buttons), 60)
    data = next(b["callback_data"] for b in message.buttons if b["text"].endswith(label))
    api.push_callback(chat_id=CHAT, user_id=APPROVER, data=data, message_id=message.message_id)


async def _gate(api: FakeBotApi, phase: str, nth: int) -> SentMessage:
    await api.wait_until(lambda: sum(_is_gate(m, phase) for m in api.sent) >= nth, 90)
    return [m for m in api.sent if _is_gate(m, phase)][nth - 1]


async def _drive(api: FakeBotApi, started: str) -> SentMessage:
    """/autopilot T1; research rejected (with a reason), revised, approved; the
    decomposition approved; until the task is complete. The bot's answer to /autopilot."""
    api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/autopilot {TASK} build it")
    answer = await api.wait_for_message(lambda m: started in m.text, timeout=30)
    research = await _gate(api, "research", 1)
    await _press(api, research, "Reject")
    asked = await api.wait_for_message(lambda m: f"why reject {TASK} · research" in m.text, 30)
    api.push_message(chat_id=CHAT, user_id=APPROVER, text=REASON, reply_to=asked.message_id)
    await api.wait_for_message(lambda m: m.text.startswith(f"↩️ Rejected {TASK} · research"), 30)
    await api.wait_until(lambda: "↩️ Rejected by" in research.text, 30)
    for phase, nth in (("research", 2), ("decomposition", 1)):
        gate = await _gate(api, phase, nth)
        await _press(api, gate, "Approve")
        await api.wait_until(lambda g=gate: "✅ Approved by" in g.text, 60)
    await api.wait_for_message(lambda m: f"🏁 Task {TASK} is complete" in m.text, 120)
    # Durable outcomes (edits are throttled: a display may skip a state, so wait for the
    # last one): the wave's message says both sub-tasks are complete, the parent's
    # implement phase (after the wave merged) says it is done.
    await api.wait_until(
        lambda: any(
            m.text.startswith(f"🛂 {TASK} · wave 1") and m.text.count("✅ complete") == 2
            for m in api.sent
        ),
        60,
    )
    await api.wait_until(
        lambda: any(m.text.startswith(f"🛂 {TASK} · implement\n✅") for m in api.sent), 60
    )
    return answer


def _said(api: FakeBotApi, answer: SentMessage) -> list[Any]:
    """What the chat shows after the answer to /autopilot, in order of sending: each
    message's final text, its document (name and bytes), whether it answers someone."""
    return [
        (
            _normal(m.text),
            m.filename,
            m.document,
            m.reply_to is not None,
        )
        for m in api.sent
        if m.message_id > answer.message_id and m.chat_id == CHAT
    ]


def _events_of(cluster: Cluster, database: str, run_id: str) -> list[dict[str, Any]]:
    env = {**cluster.env, "TURNSTILE_DATABASE": database}
    saved, cluster.env = cluster.env, env
    try:
        return _autopilot_events(cluster, run_id, TASK)
    finally:
        cluster.env = saved


def _drives(cluster: Cluster, database: str) -> tuple[str, list[str]]:
    """The drive of T1 and its sub-tasks' drives, by task name."""
    env = {**cluster.env, "TURNSTILE_DATABASE": database}
    saved, cluster.env = cluster.env, env
    try:
        runs = [r for r in cluster.runs().values() if r["mode"] == "autopilot"]
    finally:
        cluster.env = saved
    (drive,) = [r["id"] for r in runs if r["task"] == TASK]
    subs = sorted((r["task"], r["id"]) for r in runs if r["task"] != TASK)
    return drive, [run_id for _, run_id in subs]


async def test_a_drive_from_the_chat_says_the_same_here_and_on_workers(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In the bot's process: its own SQLite file, its own disk.
    local_root = tmp_path / "local"
    command, conf = _setup(local_root, decomposition=_TWO)
    monkeypatch.setenv("FAKE_PILOT_AGENT_CONF", str(conf))
    async with FakeBotApi() as api:
        async with running_bot(api, _local_bot(api, local_root, command)):
            answer = await _drive(api, f"Autopilot for task {TASK} started")
        here = _said(api, answer)

    # On the workers: PostgreSQL, two worker processes, the project's worktree.
    command, projects = _on_workers(cluster, decomposition=_TWO)
    await asyncio.to_thread(cluster.start_worker, "w1", concurrency=1)
    await asyncio.to_thread(cluster.start_worker, "w2", concurrency=1)
    async with FakeBotApi() as api:
        async with running_bot(api, _bot_on_workers(api, cluster, command, projects)):
            answer = await _drive(api, "is queued on the workers")
        there = _said(api, answer)
    drive_w, subs_w = _drives(cluster, cluster.url)
    await asyncio.to_thread(
        wait_for,
        "the drive's placement finished",
        lambda: cluster.placement(drive_w).status.value == "finished",  # type: ignore[union-attr]
        within=30,
    )

    # The chat: the same messages in the same order, less the summary's work lines, which
    # only a drive in a worktree has (asserted here, then left out).
    [summary] = [i for i, m in enumerate(there) if m[0].startswith(f"🏁 Task {TASK} is complete")]
    work = _WORK.search(there[summary][0])
    assert work is not None, there[summary][0]
    lines = work.group(0).strip("\n").splitlines()
    assert lines[0].startswith("Commits since start: 10; files changed: 8"), lines
    assert "  COMMIT turnstile: merge sub-task a1 into turnstile/RUN" in lines
    assert "  COMMIT turnstile: merge sub-task a2 into turnstile/RUN" in lines
    assert lines[-1] == "Branch: turnstile/RUN, pushed to REMOTE", lines
    assert _WORK.search(here[summary][0]) is None
    there[summary] = (_WORK.sub("", there[summary][0]), *there[summary][1:])
    shown = "\n---\n".join(f"{a!r}\n{b!r}" for a, b in zip(here, there, strict=False))
    assert there == here, f"{shown}\n({len(here)} messages here, {len(there)} there)"
    # What the chat was told, for the reader of this test: the rejection round, the wave.
    assert [t for t, *_ in here if t.startswith(f"🛂 {TASK} · wave 1")] == [
        f"🛂 {TASK} · wave 1: 2 sub-tasks\n{TASK}.a1 · ✅ complete\n{TASK}.a2 · ✅ complete"
    ]
    assert [f for _, f, _, _ in here if f] == ["research.md"] * 2 + ["decomposition.md"]

    # The event logs: the drive's and each sub-task's, as tests/test_parity.py compares
    # them. Where it runs shows in one place: on the workers a drive at its gate (and one
    # waiting for its wave) gives its worker back, parked, and is resumed by its next step.
    sqlite = str(local_root / "turnstile.db")
    drive_h, subs_h = _drives(cluster, sqlite)
    local_log = _events_of(cluster, sqlite, drive_h)
    worker_log = _events_of(cluster, cluster.url, drive_w)
    kinds = [e["kind"] for e in local_log]
    assert [e["decision"] for e in local_log if e["kind"] == "gate_decided"] == [
        "rejected",
        "approved",
        "approved",
    ]
    assert "parked" not in kinds
    assert [e["kind"] for e in worker_log].count("parked") == 3
    assert [e["kind"] for e in worker_log].count("run_resumed") == 3
    worker_log = [e for e in worker_log if e["kind"] not in ("parked", "run_resumed")]
    assert worker_log == local_log
    assert len(subs_w) == len(subs_h) == 2
    for sub_w, sub_h in zip(subs_w, subs_h, strict=True):
        assert _events_of(cluster, cluster.url, sub_w) == _events_of(cluster, sqlite, sub_h)

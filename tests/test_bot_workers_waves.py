"""A wave whose sub-tasks have gates of their own, driven from the chat on the workers:
each sub-task's gate is a message of its own, posted once; its row in the wave's message
says it waits for approval; its Approve button lets it go on; and a bot restarted in the
middle of the wave goes on following the drive without posting anything twice.

Checked on durable outcomes only: a message's final text (or a text it keeps while the
drive is held where it is), rows in the database. A throttled live message may skip a
state that lasts a moment; a state held until the test moves on is shown in the end.
"""

from __future__ import annotations

import asyncio
import re
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import APPROVER, CHAT, OPERATOR, running_bot
from tests.test_bot_workers_autopilot import _bot_on_workers, _local_bot, _on_workers, _setup
from tests.test_parity import _TWO
from tests.test_parity_bot_autopilot import _WORK, _normal
from tests.workers_support import Cluster
from tests.workers_support import cluster as cluster  # the fixture

pytestmark = [pytest.mark.usefixtures("isolated_env")]

TASK = "T1"
SUBS = ("T1.a1", "T1.a2")

# The parent's decomposition gate, then its sub-tasks start at design, which has a gate of
# its own (the parent's design follows its wave, gated too), then implement, automatic.
WORKFLOW = textwrap.dedent(
    '''
    [workflow]
    name = "gated sub-tasks"
    decomposition = "decomposition"
    subtask_start = "design"

    [phases.decomposition]
    persona = "Architect"
    approval = true
    artifact = "decomposition.md"
    forbidden = ["design.md", "implementation.md"]
    code_edits = false
    allowed = ["Split the task into sub-tasks in {artifact_path}."]
    forbidden_actions = ["Editing code."]
    prompt = """
    Split task {task}.
    """

    [phases.design]
    persona = "Designer"
    approval = true
    artifact = "design.md"
    forbidden = ["implementation.md"]
    code_edits = false
    allowed = ["Write the design to {artifact_path}."]
    forbidden_actions = ["Editing code."]
    prompt = """
    Design task {task}.
    """

    [phases.implement]
    persona = "Implementer"
    approval = false
    artifact = "implementation.md"
    forbidden = []
    code_edits = true
    allowed = ["Edit code; summarise in {artifact_path}."]
    forbidden_actions = ["Writing review artifacts."]
    prompt = """
    Implement task {task}.
    """
    '''
)

WAVE = f"🛂 {TASK} · wave 1"
# What the wave's message says while both sub-tasks wait at their gates, and at the end.
WAITING = f"{WAVE}: 2 sub-tasks\n" + "\n".join(
    f"{sub} · design · 🛂 waiting for approval" for sub in SUBS
)
DONE = f"{WAVE}: 2 sub-tasks\n" + "\n".join(f"{sub} · ✅ complete" for sub in SUBS)


def _gate_head(task: str, phase: str) -> str:
    return f"🛂 Gate: task {task} · phase {phase}\n"


def _gates_of(api: FakeBotApi, task: str, phase: str) -> list[SentMessage]:
    return [m for m in api.sent if m.text.startswith(_gate_head(task, phase))]


async def _gate(api: FakeBotApi, task: str, phase: str) -> SentMessage:
    """The gate message of ``task`` at ``phase``, once posted with its buttons."""
    await api.wait_until(lambda: bool(_gates_of(api, task, phase)), 90)
    gate = _gates_of(api, task, phase)[0]
    await api.wait_until(lambda: bool(gate.buttons), 30)
    return gate


async def _approve(api: FakeBotApi, gate: SentMessage) -> None:
    """Press its Approve button; until the gate message says it is approved."""
    data = next(b["callback_data"] for b in gate.buttons if b["text"].endswith("Approve"))
    api.push_callback(chat_id=CHAT, user_id=APPROVER, data=data, message_id=gate.message_id)
    await api.wait_until(lambda: "✅ Approved by" in gate.text, 60)


def _wave(api: FakeBotApi) -> SentMessage | None:
    return next((m for m in api.sent if m.text.startswith(WAVE)), None)


async def _wave_says(api: FakeBotApi, text: str, within: float = 60) -> None:
    def says() -> bool:
        wave = _wave(api)
        return wave is not None and wave.text == text

    try:
        await api.wait_until(says, within)
    except TimeoutError:
        waves = [m.text for m in api.sent if m.text.startswith(WAVE)]
        pytest.fail(f"the wave's messages say {waves!r}, not {text!r}")


async def _to_the_end(api: FakeBotApi) -> None:
    """The parent's design gate approved, until the task is complete and the last edits
    (the wave's rows, the parent's implement phase) are shown."""
    await _approve(api, await _gate(api, TASK, "design"))
    await api.wait_for_message(lambda m: f"🏁 Task {TASK} is complete" in m.text, 120)
    await _wave_says(api, DONE)
    await api.wait_until(
        lambda: any(m.text.startswith(f"🛂 {TASK} · implement\n✅") for m in api.sent), 60
    )


async def _drive(api: FakeBotApi, started: str) -> tuple[SentMessage, str]:
    """/autopilot T1; its decomposition approved; both sub-tasks at their design gates
    (the wave's message says so), each approved by its button; to the end. The bot's
    answer to /autopilot, and what the wave's message said while both waited."""
    api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/autopilot {TASK} build it")
    answer = await api.wait_for_message(lambda m: started in m.text, timeout=30)
    await _approve(api, await _gate(api, TASK, "decomposition"))
    gates = [await _gate(api, sub, "design") for sub in SUBS]
    # Held there until a button is pressed: the wave's message shows it in the end.
    await _wave_says(api, WAITING)
    wave = _wave(api)
    assert wave is not None
    waiting = wave.text
    for gate in gates:
        await _approve(api, gate)
    await _to_the_end(api)
    return answer, waiting


def _said(api: FakeBotApi, answer: SentMessage) -> Counter[tuple[Any, ...]]:
    """What the chat shows after the answer to /autopilot, as a multiset (the sub-tasks'
    gates and their documents come in either order): each message's final text, its
    document (name and bytes)."""
    return Counter(
        (_normal(m.text), m.filename, bytes(m.document) if m.document is not None else None)
        for m in api.sent
        if m.message_id > answer.message_id and m.chat_id == CHAT
    )


def _decided(cluster: Cluster) -> list[tuple[Any, ...]]:
    """Each task's phase now, and the approvals of its gates (the rows in the database)."""
    phases = cluster.query("SELECT name, phase FROM gate_tasks ORDER BY name")
    approvals = cluster.query("SELECT task, phase FROM gate_approvals ORDER BY task, phase")
    return [*phases, *approvals]


@pytest.mark.timeout(120)
async def test_sub_tasks_wait_at_their_own_gates_on_the_workers_as_here(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In the bot's process: its own SQLite file, its own disk.
    local_root = tmp_path / "local"
    command, conf = _setup(local_root, workflow=WORKFLOW, decomposition=_TWO)
    monkeypatch.setenv("FAKE_PILOT_AGENT_CONF", str(conf))
    async with FakeBotApi() as api:
        async with running_bot(api, _local_bot(api, local_root, command)):
            answer, local_waiting = await _drive(api, f"Autopilot for task {TASK} started")
        here = _said(api, answer)

    # On the workers: PostgreSQL, two worker processes (a sub-task each at once).
    command, projects = _on_workers(cluster, workflow=WORKFLOW, decomposition=_TWO)
    await asyncio.to_thread(cluster.start_worker, "w1", concurrency=1)
    await asyncio.to_thread(cluster.start_worker, "w2", concurrency=1)
    async with FakeBotApi() as api:
        async with running_bot(api, _bot_on_workers(api, cluster, command, projects)):
            answer, waiting = await _drive(api, "is queued on the workers")
        there = _said(api, answer)
        sent = list(api.sent)

    # Each sub-task's gate was posted once, with its artifact, and approved by its button;
    # the wave's message said both waited for approval, and ends with both complete.
    assert waiting == local_waiting == WAITING
    for sub in SUBS:
        [gate] = [m for m in sent if m.text.startswith(_gate_head(sub, "design"))]
        assert "✅ Approved by" in gate.text, gate.text
        assert not gate.buttons
        docs = [m for m in sent if m.filename == "design.md" and m.text.startswith(f"{sub} · ")]
        assert len(docs) == 1, [m.text for m in sent]
    [wave] = [m for m in sent if m.text.startswith(WAVE)]
    assert wave.text == DONE
    assert not wave.buttons
    # In the database: every task complete, each gate approved once.
    assert _decided(cluster) == [
        (TASK, "complete"),
        *((sub, "complete") for sub in SUBS),
        (TASK, "decomposition"),
        (TASK, "design"),
        *((sub, "design") for sub in SUBS),
    ]

    # The chat was told the same both ways, less the summary's work lines (only a drive in
    # a worktree has them, see tests/test_parity_bot_autopilot.py) and its elapsed time.
    def same(said: Counter[tuple[Any, ...]]) -> Counter[tuple[Any, ...]]:
        return Counter(
            {(_WORK.sub("", text), name, body): n for (text, name, body), n in said.items()}
        )

    assert same(there) == same(here), (same(there) - same(here), same(here) - same(there))


@pytest.mark.timeout(120)
async def test_a_bot_restarted_mid_wave_goes_on_following_it_without_posting_twice(
    cluster: Cluster,
) -> None:
    # T1.a1's design turn waits for a file: the wave is held there while the bot restarts,
    # with T1.a2 waiting at its gate.
    release = cluster.tmp / "release-a1"
    command, projects = _on_workers(
        cluster, workflow=WORKFLOW, decomposition=_TWO, hold={"T1.a1:design": str(release)}
    )
    await asyncio.to_thread(cluster.start_worker, "w1", concurrency=1)
    await asyncio.to_thread(cluster.start_worker, "w2", concurrency=1)
    held = (
        f"{WAVE}: 2 sub-tasks\n"
        "T1.a1 · design · ⏳ running…\n"
        "T1.a2 · design · 🛂 waiting for approval"
    )
    async with FakeBotApi() as api:
        settings = _bot_on_workers(api, cluster, command, projects)
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/autopilot {TASK} build it")
            await _approve(api, await _gate(api, TASK, "decomposition"))
            second = await _gate(api, "T1.a2", "design")
            await api.wait_until(
                lambda: any(m.text.startswith("T1.a2 · design · ") for m in api.sent), 30
            )
            await _wave_says(api, held)
        last = max(m.message_id for m in api.sent)
        wave = _wave(api)
        assert wave is not None
        edits = wave.edits
        # A new bot process, the wave still held on the workers.
        async with running_bot(api, settings):
            await _approve(api, second)
            release.touch()
            await _approve(api, await _gate(api, "T1.a1", "design"))
            await _to_the_end(api)
        sent = list(api.sent)

    shown = "\n\n".join(repr((m.text, m.history)) for m in sent)
    # The wave's message was edited in place after the restart, not posted again.
    assert [m for m in sent if m.text.startswith(WAVE)] == [wave], shown
    assert wave.text == DONE
    assert wave.edits > edits
    # Each gate message exists once, approved; the summary once; nothing said twice.
    for task in (TASK, *SUBS):
        [gate] = [m for m in sent if m.text.startswith(_gate_head(task, "design"))]
        assert "✅ Approved by" in gate.text, gate.text
    assert len(_gates_of(api, TASK, "decomposition")) == 1
    assert sum(m.text.startswith(f"🏁 Task {TASK} is complete") for m in sent) == 1
    twice = {k: n for k, n in Counter((m.text, m.filename) for m in sent).items() if n > 1}
    assert not twice, shown
    # Posted after the restart: only what the drive did since, each once.
    after = [m.text.split("\n", 1)[0] for m in sent if m.message_id > last]
    assert [re.sub(r"sha256 \w+|\. .*", "", t) for t in after] == [
        "🛂 Gate: task T1.a1 · phase design",
        "T1.a1 · design · ",
        "[T1] wave 1 merged into the task's branch",
        "🛂 Gate: task T1 · phase design",
        "T1 · design · ",
        "🛂 T1 · implement",
        "🏁 Task T1 is complete",
    ], after
    assert _decided(cluster)[:3] == [(TASK, "complete"), *((sub, "complete") for sub in SUBS)]

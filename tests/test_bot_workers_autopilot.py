"""/autopilot on the workers shows in the chat what a drive in the bot's process shows:
one message per phase (a gated phase's becomes its gate), the artifacts, the completion
summary; counted side by side with a local drive of the same agent and workflow."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bot.autopilot import AutopilotExtension
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import APPROVER, CHAT, OPERATOR, bot_settings, running_bot
from tests.test_workers_autopilot import NO_SPLIT, WORKFLOW
from tests.workers_support import Cluster
from tests.workers_support import cluster as cluster

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(240)]

# Writes its phase's artifact (the decomposition from its configuration) and says so.
AGENT = textwrap.dedent(
    """
    import json, os, re, sys, time
    from pathlib import Path

    prompt = sys.argv[sys.argv.index("--prompt") + 1]
    conf = json.loads(Path(os.environ["FAKE_PILOT_AGENT_CONF"]).read_text())
    if "The engine found these problems" in prompt:  # a revision turn (it names no phase)
        time.sleep(float(conf.get("revision_sleep", 0)))
    phase = re.search(r"^Phase: (\\w+) \\(", prompt, re.M).group(1)
    task = re.search(r"^You are the .* for task (\\S+)\\.$", prompt, re.M).group(1)
    artifact = Path(re.search(r"^Write the artifact to: (.+)$", prompt, re.M).group(1))
    held = conf.get("hold", {}).get(f"{task}:{phase}")  # (its turn waits for this file)
    while held and not os.path.exists(held):
        time.sleep(0.05)
    if phase not in conf.get("skip", []):  # (a phase it skips fails its checks)
        artifact.parent.mkdir(parents=True, exist_ok=True)
        artifact.write_text(conf["decomposition"] if phase == "decomposition" else f"# {phase}\\n")
    with open(conf["log"], "a") as fh:
        fh.write(phase + "\\n")
    print(f"## {phase}\\n\\nwrote {artifact.name}")
    """
)


def _setup(root: Path, *, workflow: str = WORKFLOW, **more: Any) -> tuple[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "workflow.toml").write_text(workflow)
    (root / "agent.py").write_text(AGENT)
    conf = {"log": str(root / "phases.log"), "decomposition": NO_SPLIT, **more}
    (root / "agent.json").write_text(json.dumps(conf))
    command = f"{sys.executable} {root / 'agent.py'} --session {{session_id}} --prompt {{prompt}}"
    return command, root / "agent.json"


def _kind(m: SentMessage) -> str:
    if m.filename is not None:
        return f"document {m.filename}"
    if m.text.startswith("🛂 Gate: task T1"):
        phase = re.search(r"phase (\w+)", m.text)
        return f"gate {phase.group(1) if phase else '?'}"
    if m.text.startswith("🛂 T1 · "):
        return "phase " + m.text.splitlines()[0].removeprefix("🛂 T1 · ")
    if m.text.startswith("🏁 Task T1 is complete"):
        return "summary"
    return "other"


async def _drive(api: FakeBotApi, started: str) -> tuple[Counter[str], SentMessage]:
    """/autopilot T1, both gates approved by their buttons, until the summary: the kinds of
    message posted after the bot's answer to /autopilot, and the summary."""
    api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T1 build it")
    answer = await api.wait_for_message(lambda m: started in m.text, timeout=30)
    for phase in ("research", "decomposition"):

        def gate(m: SentMessage, phase: str = phase) -> bool:
            return m.text.startswith("🛂 Gate: task T1") and f"phase {phase}" in m.text

        # The gate message is the phase's message (edited from "running", unless the
        # throttled edits went straight to the gate: a display may skip a state).
        message = await api.wait_for_message(gate, timeout=90)
        await api.wait_until(lambda m=message: bool(m.buttons), timeout=30)
        approve = next(b["callback_data"] for b in message.buttons if b["text"].endswith("Approve"))
        api.push_callback(
            chat_id=CHAT, user_id=APPROVER, data=approve, message_id=message.message_id
        )
        await api.wait_until(lambda m=message: "✅ Approved by" in m.text, timeout=60)
    summary = await api.wait_for_message(lambda m: "Task T1 is complete" in m.text, timeout=90)
    # (a beat for the last edits: the implement phase's message says it is done)
    await api.wait_until(
        lambda: any(m.text.startswith("🛂 T1 · implement\n✅") for m in api.sent), timeout=30
    )
    after = [m for m in api.sent if m.message_id > answer.message_id and m.chat_id == CHAT]
    return Counter(_kind(m) for m in after), summary


def _on_workers(cluster: Cluster, *, workflow: str = WORKFLOW, **conf: Any) -> tuple[str, str]:
    """Configure the cluster for drives (before its worker starts): the agent command and
    the projects."""
    command, path = _setup(cluster.tmp / "pilot", workflow=workflow, **conf)
    projects = f"default={cluster.remote}#main"
    cluster.env.update(
        {
            "TURNSTILE_PROJECTS": projects,
            "TURNSTILE_WORKFLOW_FILE": str(cluster.tmp / "pilot" / "workflow.toml"),
            "TURNSTILE_APPROVERS": str(APPROVER),
            "TURNSTILE_TASKS_ROOT": str(cluster.tmp / "tasks"),
            "FAKE_PILOT_AGENT_CONF": str(path),
        }
    )
    return command, projects


def _local_bot(api: FakeBotApi, root: Path, command: str) -> Any:
    """The bot running drives in its own process (SQLite, its own disk), set up by _setup."""
    return bot_settings(api, root, agent_command=command, workflow_file=root / "workflow.toml")


def _bot_on_workers(api: FakeBotApi, cluster: Cluster, command: str, projects: str) -> Any:
    return bot_settings(
        api,
        cluster.tmp / "bot",
        database=cluster.url,
        execution="workers",
        projects=projects,
        agent_command=command,
        workflow_file=cluster.tmp / "pilot" / "workflow.toml",
        worker_heartbeat=0.3,
        worker_timeout=2.0,
    )


async def test_a_drive_on_the_workers_shows_what_a_local_drive_shows(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The drive in the bot's own process (SQLite, the bot's disk).
    command, conf = _setup(tmp_path / "local")
    monkeypatch.setenv("FAKE_PILOT_AGENT_CONF", str(conf))
    async with (
        FakeBotApi() as api,
        running_bot(api, _local_bot(api, tmp_path / "local", command)),
    ):
        local, local_summary = await _drive(api, "Autopilot for task T1 started")

    # The same on the workers (PostgreSQL, a worker subprocess, the project's worktree).
    command, projects = _on_workers(cluster)
    await asyncio.to_thread(cluster.start_worker, "w1", concurrency=1)
    async with FakeBotApi() as api:
        settings = _bot_on_workers(api, cluster, command, projects)
        async with running_bot(api, settings):
            remote, remote_summary = await _drive(api, "is queued on the workers")

    expected: dict[str, Any] = {
        "gate research": 1,
        "document research.md": 1,
        "gate decomposition": 1,
        "document decomposition.md": 1,
        "phase implement": 1,
        "summary": 1,
    }
    assert dict(local) == expected, local
    assert dict(remote) == dict(local), (remote, local)
    for summary in (local_summary, remote_summary):
        assert "research approved by" in summary.text
        assert "decomposition approved by" in summary.text
        assert re.search(r"\n3 turns in \d+(m\d+)?s\.", summary.text), summary.text
    # On the workers the drive worked in the project's worktree: its summary says what it
    # changed there and where its branch went (the local drive here has no worktree).
    assert "\nCommits since start: " in remote_summary.text, remote_summary.text
    assert re.search(
        r"\nBranch: turnstile/autopilot-\S+, pushed to \S+remote", remote_summary.text
    ), remote_summary.text
    assert "Commits since start" not in local_summary.text, local_summary.text


async def test_a_restarted_bot_goes_on_following_a_drive_without_posting_twice(
    cluster: Cluster,
) -> None:
    # The decomposition phase never writes its artifact: the drive is sent to a person.
    command, projects = _on_workers(cluster, skip=["decomposition"])
    await asyncio.to_thread(cluster.start_worker, "w1", concurrency=1)

    def gate(m: SentMessage) -> bool:
        return m.text.startswith("🛂 Gate: task T1") and "phase research" in m.text

    def person(m: SentMessage) -> bool:
        return m.text.startswith("[T1] needs a person")

    async with FakeBotApi() as api:
        settings = _bot_on_workers(api, cluster, command, projects)
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T1 build it")
            message = await api.wait_for_message(gate, timeout=90)
            await api.wait_until(lambda: bool(message.buttons), timeout=30)
            await api.wait_until(
                lambda: any(m.filename == "research.md" for m in api.sent), timeout=30
            )
        before = Counter(_kind(m) for m in api.sent)
        # A new bot process: the drive still parks at its gate on the worker.
        async with running_bot(api, settings):
            approve = next(
                b["callback_data"] for b in message.buttons if b["text"].endswith("Approve")
            )
            api.push_callback(
                chat_id=CHAT, user_id=APPROVER, data=approve, message_id=message.message_id
            )
            await api.wait_until(lambda: "✅ Approved by" in message.text, timeout=60)
            said = await api.wait_for_message(person, timeout=90)
            assert "decomposition" in said.text, said.text
            await api.wait_until(
                lambda: any(
                    m.text.startswith("🛂 T1 · decomposition\n✋ waiting for a person")
                    for m in api.sent
                ),
                timeout=30,
            )
        after_person = len(api.sent)
        # And once more: the drive ended while no bot ran; its end was said already.
        async with running_bot(api, settings) as rt:
            assert rt.features is not None
            pilot = next(f for f in rt.features.extensions if isinstance(f, AutopilotExtension))
            assert not pilot.executor.followed  # (started: recovery is over)
    kinds = Counter(_kind(m) for m in api.sent)
    # Nothing before the restart was posted again; after it only the decomposition phase,
    # its problems (before its revision turn, as a local drive says them) and the message
    # saying the drive needs a person.
    shown = "\n\n".join(repr((m.text, m.history)) for m in api.sent)
    assert kinds - before == Counter({"phase decomposition": 1, "other": 2}), shown
    assert sum("[T1 · decomposition] problems:" in m.text for m in api.sent) == 1
    assert sum(person(m) for m in api.sent) == 1
    assert len(api.sent) == after_person


async def test_a_drive_stopped_from_the_chat_says_so_once(cluster: Cluster) -> None:
    command, projects = _on_workers(cluster)
    await asyncio.to_thread(cluster.start_worker, "w1", concurrency=1)

    def stopped(m: SentMessage) -> bool:
        return m.text.startswith("⏹ Autopilot for T1 stopped on the workers")

    async with FakeBotApi() as api:
        settings = _bot_on_workers(api, cluster, command, projects)
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T1 build it")
            queued = await api.wait_for_message(lambda m: "is queued on the workers" in m.text)
            found = re.search(r"\(run (\S+)\)", queued.text)
            assert found is not None
            await api.wait_for_message(lambda m: m.text.startswith("🛂 Gate: task T1"), timeout=90)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/stop {found.group(1)}")
            said = await api.wait_for_message(stopped, timeout=60)
            assert "/autopilot T1 resumes it" in said.text
        async with running_bot(api, settings) as rt:
            assert rt.features is not None
            pilot = next(f for f in rt.features.extensions if isinstance(f, AutopilotExtension))
            assert not pilot.executor.followed  # its end was said: not followed again
    assert sum(stopped(m) for m in api.sent) == 1


async def test_a_phase_s_problems_reach_the_chat_from_the_workers_as_from_a_local_drive(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent never writes research.md: the drive says the phase's problems, gives it one
    revision turn, then needs a person. The problems come to the chat from the workers'
    drive too (from the event log), once, and a person is asked once; the phase's message
    says its revision turn runs, as a local drive's does."""

    def problems(m: SentMessage) -> bool:
        return "[T1 · research] problems:" in m.text and "research.md was not written" in m.text

    def person(m: SentMessage) -> bool:
        return "needs a person" in m.text

    def revising(m: SentMessage) -> bool:
        return any("⏳ running: revision turn…" in t for t in (m.text, *m.history))

    # (The revision turn lasts long enough for its phase's message to show it.)
    command, conf = _setup(tmp_path / "local", skip=["research"], revision_sleep=2)
    monkeypatch.setenv("FAKE_PILOT_AGENT_CONF", str(conf))
    async with FakeBotApi() as api:
        async with running_bot(api, _local_bot(api, tmp_path / "local", command)):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T1 build it")
            await api.wait_for_message(problems, timeout=90)
            await api.wait_for_message(person, timeout=90)
        local = api.sent

    command, projects = _on_workers(cluster, skip=["research"], revision_sleep=2)
    await asyncio.to_thread(cluster.start_worker, "w1", concurrency=1)
    async with FakeBotApi() as api:
        settings = _bot_on_workers(api, cluster, command, projects)
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T1 build it")
            queued = await api.wait_for_message(lambda m: "is queued on the workers" in m.text)
            await api.wait_for_message(problems, timeout=90)
            await api.wait_for_message(person, timeout=90)
        # A restart posts nothing again.
        async with running_bot(api, settings):
            await asyncio.sleep(2)
        remote = api.sent
    for sent in (local, remote):
        assert sum(problems(m) for m in sent) == 1
        assert sum(person(m) for m in sent) == 1
        assert sum(revising(m) for m in sent) == 1, [(m.text, m.history) for m in sent]
    # The workers' drive recorded which of the phase's turns each was.
    found = re.search(r"\(run (\S+)\)", queued.text)
    assert found is not None
    done = cluster.cli("runs", found.group(1), "--events", "--json")
    assert done.returncode == 0, done.stderr
    started = [json.loads(line) for line in done.stdout.splitlines()]
    kinds = [e.get("turn_kind") for e in started if e["kind"] == "turn_started"]
    assert kinds == ["phase", "revision"], done.stdout
